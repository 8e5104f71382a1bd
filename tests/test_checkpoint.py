"""Config and checkpoint round trips, and every way a checkpoint directory can be broken."""

from __future__ import annotations

import json

import pytest
import torch

from toolkit.reference.errors import CheckpointError, ConfigError
from runtime.tokenizer import CharTokenizer
from toolkit.reference.checkpoint import load_checkpoint, save_checkpoint
from toolkit.reference.config import PRESETS, ModelConfig, preset
from toolkit.reference.model import Transformer
from toolkit.reference.outdir import OutputError


@pytest.fixture
def tiny():
    return Transformer(preset("tiny", vocab_size=40), seed=3)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_round_trips_through_config_json(tmp_path, name):
    config = preset(name, norm="pre", activation="gelu", tie_embeddings=False)
    config.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == config
    assert json.loads((tmp_path / "config.json").read_text()) == config.to_dict()


def test_checkpoint_round_trips_exactly(tmp_path, tiny):
    tok = CharTokenizer("abcdefghij")
    save_checkpoint(tmp_path / "ckpt", tiny, tok, training={"steps": 1})
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == tiny.config
    assert loaded.tokenizer.chars == tok.chars
    original, restored = tiny.state_dict(), loaded.model.state_dict()
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    assert not loaded.model.training
    src = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(src)
    tgt = torch.tensor([[1, 9, 10]])
    tiny.eval()
    assert torch.equal(tiny(src, mask, tgt), loaded.model(src, mask, tgt))


def test_save_refuses_to_overwrite_without_force(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    with pytest.raises(OutputError, match="already exists.*--force"):
        save_checkpoint(tmp_path / "ckpt", tiny)
    save_checkpoint(tmp_path / "ckpt", tiny, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]      # no temporary directory left behind


def test_loading_rejects_a_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_loading_rejects_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "file")


def test_loading_rejects_a_missing_config(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    (tmp_path / "ckpt" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_checkpoint(tmp_path / "ckpt")


def test_loading_rejects_malformed_json(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    (tmp_path / "ckpt" / "config.json").write_text('{"d_model": 32,')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path / "ckpt")


def test_loading_rejects_heads_that_do_not_divide_d_model(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    data = {**tiny.config.to_dict(), "n_heads": 5}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="not divisible by n_heads"):
        load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="not divisible"):
        preset("tiny", n_heads=5)


def test_loading_rejects_unknown_fields(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    data = {**tiny.config.to_dict(), "n_layers": 6}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="unknown config field.*n_layers"):
        load_checkpoint(tmp_path / "ckpt")


def test_loading_rejects_weights_of_another_model(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    bigger = {**tiny.config.to_dict(), "d_ff": 128}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(bigger))
    with pytest.raises(CheckpointError, match="has shape"):
        load_checkpoint(tmp_path / "ckpt")
    deeper = {**tiny.config.to_dict(), "n_encoder_layers": 3}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(deeper))
    with pytest.raises(CheckpointError, match="do not match config.json"):
        load_checkpoint(tmp_path / "ckpt")


def test_loading_rejects_missing_and_corrupt_weights(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    weights = tmp_path / "ckpt" / "weights.safetensors"
    whole = weights.read_bytes()
    header = 8 + int.from_bytes(whole[:8], "little")
    for cut in (100, header + 10, len(whole) - 1):             # in the header, in the first tensor, the last byte
        weights.write_bytes(whole[:cut])
        with pytest.raises(CheckpointError, match=rf"is truncated \({cut} of (at least )?\d+ bytes\).*save it again"):
            load_checkpoint(tmp_path / "ckpt")
    weights.write_bytes(whole[:8] + b"[" + whole[9:])            # complete, but its header is not JSON
    with pytest.raises(CheckpointError, match="unreadable.*re-save the checkpoint"):
        load_checkpoint(tmp_path / "ckpt")
    weights.unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_checkpoint(tmp_path / "ckpt")
    torch.save(tiny.state_dict(), tmp_path / "ckpt" / "weights.pt")
    pt = (tmp_path / "ckpt" / "weights.pt").read_bytes()
    (tmp_path / "ckpt" / "weights.pt").write_bytes(pt[: len(pt) // 2])
    with pytest.raises(CheckpointError, match="weights.pt is truncated .*zip archive's directory is missing"):
        load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_loading_refuses_weights_holding_nan_or_inf(tmp_path, tiny, value):
    """A diverged model is refused at load, naming the tensor, so export and generate never run on it."""
    from click.testing import CliRunner

    from toolkit.apps.cli import main

    broken = Transformer(tiny.config, seed=3)
    with torch.no_grad():
        broken.state_dict()["decoder.layers.1.ffn.w_2.weight"][3, :2] = value
        broken.state_dict()["decoder.layers.1.sublayers.2.norm.bias"][0] = value
    save_checkpoint(tmp_path / "ckpt", broken)
    kind = "2 NaN and 0 infinite" if value != value else "0 NaN and 2 infinite"
    with pytest.raises(CheckpointError, match=rf"weight decoder.layers.1.ffn.w_2.weight holds {kind} values of "
                                              rf"\d+ \(and 1 more tensors\); the model is broken"):
        load_checkpoint(tmp_path / "ckpt")
    for args in (["generate", str(tmp_path / "ckpt"), "--ids", "5 6 7"],
                 ["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "bundle")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "decoder.layers.1.ffn.w_2.weight holds" in result.stderr, result.output
        assert result.stderr.count("\n") == 1 and not (tmp_path / "bundle").exists()


def test_a_plain_state_dict_in_weights_pt_loads(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    (tmp_path / "ckpt" / "weights.safetensors").unlink()
    torch.save(tiny.state_dict(), tmp_path / "ckpt" / "weights.pt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    for name, tensor in tiny.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name])


class Payload:
    """Unpickling this object would create a file: proof that pickled code ran."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loading_never_unpickles_code(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny)
    (tmp_path / "ckpt" / "weights.safetensors").unlink()
    marker = tmp_path / "pwned"
    Payload.marker = str(marker)
    state = dict(tiny.state_dict())
    state["evil"] = Payload()
    torch.save(state, tmp_path / "ckpt" / "weights.pt")
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists(), "loading executed pickled code"


def test_loading_rejects_a_bundle_and_a_bad_tokenizer(tmp_path, tiny):
    save_checkpoint(tmp_path / "ckpt", tiny, CharTokenizer("abc"))
    (tmp_path / "ckpt" / "tokenizer.json").write_text('{"type": "bpe"}')
    with pytest.raises(CheckpointError, match="not a character tokenizer"):
        load_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="bundle"):
        load_checkpoint(tmp_path / "ckpt")


def test_a_loaded_checkpoint_holds_the_file_weights_once_without_drawing_random_ones(tmp_path, tiny, monkeypatch):
    """load_checkpoint and the importers build the model from the state itself (Transformer.from_state): no random
    weights drawn first and copied over (for NLLB-600M that was 16 s and a second 2.3 GiB), the state's tensors
    are the model's (safetensors' mapped file pages), and the derived sinusoid table is the model's own."""
    from toolkit.reference.model import PositionalEncoding, sinusoid_table

    save_checkpoint(tmp_path / "ckpt", tiny)
    monkeypatch.setattr(Transformer, "init_weights", lambda self, seed: pytest.fail("random weights drawn"))
    loaded = load_checkpoint(tmp_path / "ckpt").model
    for name, value in tiny.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert not loaded.training
    tables = [m.pe for m in loaded.modules() if isinstance(m, PositionalEncoding)]
    assert tables and all(torch.equal(t, sinusoid_table(tiny.config)) for t in tables)
    state = {k: v.clone() for k, v in tiny.state_dict().items()}
    model = Transformer.from_state(tiny.config, state)
    assert all(model.state_dict()[k].data_ptr() == v.data_ptr() for k, v in state.items())    # held, not copied
    ids = torch.tensor([[5, 6, 7, 2]])
    mask = torch.ones_like(ids)
    assert torch.equal(model.encode(ids, mask)[0], tiny.eval().encode(ids, mask)[0])
    half = {k: v.half() for k, v in state.items()}                 # a half-precision source is made float32
    assert all(p.dtype == torch.float32 for p in Transformer.from_state(tiny.config, half).parameters())
    with pytest.raises(RuntimeError, match="Missing key"):
        Transformer.from_state(tiny.config, {k: v for k, v in state.items() if "decoder.layers.0" not in k})


def test_the_finite_check_reads_a_slice_at_a_time_and_finds_the_last_value():
    """nonfinite checks a tensor in slices (isfinite on NLLB's whole embedding made 1.5 GB of temporaries); a NaN
    in the last element of the last slice is still found."""
    import numpy as np

    from exporters.validate import finite as finite_array
    from toolkit.reference.checkpoint import finite

    t = torch.zeros(10, 7)
    assert finite(t, chunk=4) and finite_array(t.numpy(), chunk=4)
    t[9, 6] = float("nan")
    assert not finite(t, chunk=4) and not finite_array(t.numpy(), chunk=4)
    assert not finite(torch.full((3,), float("inf")), chunk=2) and finite(torch.zeros(0))
    assert finite_array(np.zeros(0, np.float32))
