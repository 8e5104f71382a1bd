"""Whisper exported to bundles and optimized, against transformers, end to end (slow: export and optimize).

The tiny random Whisper of toolkit/testing/tiny_whisper.py (outputs that vary: >= 8 distinct of 16, asserted) is
imported, exported and optimized by the command line; each gate passes. The encoder graph takes input_features
[batch, 80, 3000] float32 and no mask (its interface recorded in the manifest), the decoder keeps the contract;
the fp32 bundle's greedy and beam-4 ids, and the optimized bundle's greedy ids, equal
`WhisperForConditionalGeneration.generate`'s with the prompt forced; optimize fuses the encoder's self-attention
(no mask) and the decoder's self- and cross-attention into MultiHeadAttention (cross K/V from the encoder, once).
"""

from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from runtime.bundle import load_bundle  # noqa: E402
from runtime.generate import generate_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from runtime.speech import prompt_ids  # noqa: E402
from toolkit.apps.cli import main  # noqa: E402
from toolkit.testing.tiny_whisper import SIZES, random_whisper  # noqa: E402

pytestmark = pytest.mark.slow
INPUTS = 16
MAX_NEW = 10


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """(transformers model, features [16, 80, 3000], {"fp32": bundle, "fused": optimized fp32 bundle})."""
    root = tmp_path_factory.mktemp("whisper-export")
    model, features = random_whisper(root / "tiny", inputs=INPUTS)
    for args in (["import", str(root / "tiny"), "--out", str(root / "ckpt")],
                 ["export", str(root / "ckpt"), "--out", str(root / "fp32")],
                 ["optimize", str(root / "fp32"), "--out", str(root / "fused")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    return model, features, {"fp32": root / "fp32", "fused": root / "fused"}


def hf_generate(model, features, beams=1):
    with torch.no_grad():
        out = model.generate(features, language="en", task="transcribe", max_new_tokens=MAX_NEW,
                             num_beams=beams).tolist()
    eos = model.generation_config.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


def bundle_ids(path, features, beams=1):
    bundle = load_bundle(path, provider="cpu")
    prefix = tuple(prompt_ids(bundle.tokenizer, "en", "transcribe"))
    opts = SearchOptions(max_new_tokens=MAX_NEW, beam=beams, prefix_ids=(prefix,) * len(features))
    return [h[0].tokens[len(prefix):] for h in generate_ids(bundle.engine, list(features.numpy()), opts)]


def test_the_encoder_takes_features_and_the_gates_passed(bundles):
    _, _, paths = bundles
    for name, path in paths.items():
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["graphs"]["encoder"]["inputs"] == [
            {"name": "input_features", "dtype": "float32", "shape": ["batch", 80, 3000]}]
        assert manifest["graphs"]["encoder"]["outputs"][1]["shape"] == ["batch", 4, 1500, 16]
        assert manifest["parity"]["verified"] is True, (name, manifest["parity"].get("summary"))
        assert manifest["model"]["encoder_input"] == "features"


@pytest.mark.parametrize("name,beams", [("fp32", 1), ("fp32", 4), ("fused", 1)])
def test_bundle_ids_equal_generates(bundles, name, beams):
    model, features, paths = bundles
    count = INPUTS if beams == 1 else 8
    ref = hf_generate(model, features[:count], beams)
    assert len({tuple(r) for r in ref}) >= count // 2, ref                # outputs that vary by input
    assert bundle_ids(paths[name], features[:count], beams) == ref


def test_text_equals_batch_decode(bundles):
    model, features, paths = bundles
    ref = hf_generate(model, features)
    tok = load_bundle(paths["fp32"], provider="cpu").tokenizer
    hf_tok = transformers.AutoTokenizer.from_pretrained(paths["fp32"].parent / "tiny")
    assert [tok.decode(r) for r in ref] == hf_tok.batch_decode(ref, skip_special_tokens=True)


def test_optimize_fuses_every_attention(bundles):
    _, _, paths = bundles
    manifest = json.loads((paths["fused"] / "manifest.json").read_text())
    layers = SIZES["encoder_layers"], SIZES["decoder_layers"]
    fusions = manifest["fusions"]
    assert fusions["attention_self_unmasked"] == layers[0]                   # the encoder's, over every frame
    assert fusions["attention_past"] == fusions["attention_cross"] == layers[1]
    ops = {g: Counter(n.op_type for n in onnx.load(str(paths["fused"] / f"{g}.onnx"),
                                                   load_external_data=False).graph.node)
           for g in ("encoder", "decoder")}
    assert ops["encoder"]["MultiHeadAttention"] == layers[0] and "Softmax" not in ops["encoder"]
    # query, key, value and nothing else: no mask, no bias, no past, so ORT's CPU kernel takes its flash path (no
    # [B, H, 1500, 1500] score matrix: 72 MiB a layer at base)
    encoder = onnx.load(str(paths["fused"] / "encoder.onnx"), load_external_data=False).graph.node
    assert [[i for i in n.input if i] for n in encoder if n.op_type == "MultiHeadAttention"] == \
        [list(n.input[:3]) for n in encoder if n.op_type == "MultiHeadAttention"]
    assert "Softmax" not in ops["decoder"]
    assert ops["decoder"]["MultiHeadAttention"] + ops["decoder"]["GroupQueryAttention"] == 2 * layers[1]


def test_onnxformer_parity_of_the_bundle_against_the_original(bundles):
    _, _, paths = bundles
    result = CliRunner().invoke(main, ["parity", str(paths["fp32"].parent / "tiny"), str(paths["fused"]),
                                       "--samples", "16"])
    assert result.exit_code == 0, result.output
    assert "greedy 100.00% tokens identical" in result.output and "beam 4 100.00% tokens identical" in result.output


def test_the_audio_encoder_s_session_keeps_the_arena_the_decoder_s_none(bundles):
    """The encoder's input has one shape (30 s of features): ORT's arena holds one run's buffers and reuses them
    (runtime.session.SessionConfig.for_graph); the decoder's session allocates without it."""
    engine = load_bundle(bundles[2]["fused"], provider="cpu").engine
    assert engine.encoder.get_session_options().enable_cpu_mem_arena
    assert not engine.decoder.get_session_options().enable_cpu_mem_arena


@pytest.mark.parametrize("field, change, named", [
    ("source_positions", lambda v: v // 2, "source_positions"), ("n_mels", lambda v: v * 2, "n_mels"),
    ("d_model", lambda v: v + 8, "d_model")])
def test_an_edited_audio_config_is_refused_at_load_naming_the_field(bundles, tmp_path, field, change, named):
    """An audio bundle's fixed dims (frames, mel bins, the cross caches' source axis) name the config field
    that gives them, as the text families' do."""
    import shutil

    from runtime.bundle import BundleError
    path = shutil.copytree(bundles[2]["fp32"], tmp_path / "bundle")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["model"][field] = change(manifest["model"][field])
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=rf"model config .*{named}.*copy the bundle again or re-export") as err:
        load_bundle(path, provider="cpu")
    assert "\n" not in str(err.value)
