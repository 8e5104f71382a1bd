"""BART, mBART, M2M100 (NLLB) and Pegasus converted to the reference model, against transformers.

Each family's tiny model is built OFFLINE from its Config class with random weights whose greedy outputs vary
with the input (toolkit/testing/tiny_families.py), saved with save_pretrained and read back by the importer's
real loading code. Proofs: teacher-forced logits within 1e-5 on batched, right-padded inputs (float64 where float32
rounding alone exceeds it), and greedy ids identical to `generate` with the same settings, including a forced
first token (forced_bos_token_id, the target language of mBART-50 and NLLB) after decoder_start_token_id.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from runtime.generate import generate_ids, pad_batch  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from toolkit.reference.importers import ImportRefused  # noqa: E402
from toolkit.reference.importers.bart import BART, convert_state, fairseq_table, load_family, model_config  # noqa: E402
from toolkit.reference.importers.m2m100 import M2M100  # noqa: E402
from toolkit.reference.torch_engine import TorchEngine  # noqa: E402
from toolkit.testing.tiny_families import FAMILIES, SIZES, ForcedFirst, tiny_original  # noqa: E402

FIRST = 3          # first ordinary id: 0..2 are specials in every family here
FORCED = 7         # the "target language" token forced first


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, our converted Transformer, source id lists)."""
    directory = tmp_path_factory.mktemp(request.param)
    original = tiny_original(request.param, directory, seed=sorted(FAMILIES).index(request.param))
    rng = np.random.default_rng(0)
    eos = original.config.eos_token_id
    seqs = [rng.integers(FIRST, SIZES["vocab_size"], size=int(n)).tolist() + [eos]
            for n in rng.integers(1, 14, size=24)]
    return request.param, original, load_family(directory), seqs


def test_config_is_the_familys(family):
    name, original, ours, _ = family
    c, hf = ours.config, original.config
    assert (c.norm, c.positions, c.layernorm_embedding, c.logits_bias) == {
        "bart": ("post", "table", True, True), "mbart": ("pre", "table", True, True),
        "m2m100": ("pre", "table", False, False), "pegasus": ("pre", "halves", False, True)}[name]
    assert (c.bos_id, c.eos_id, c.pad_id, c.scale_embeddings) == \
        (hf.decoder_start_token_id, hf.eos_token_id, hf.pad_token_id, hf.scale_embedding)
    assert c.suppress_pad == (name == "pegasus")                 # decoding from pad never generates it


def test_logits_equal_the_originals_on_padded_batches(family):
    name, original, ours, seqs = family
    hf = original.config
    ids, mask = (torch.from_numpy(a) for a in pad_batch(seqs, hf.pad_token_id))
    assert len({len(s) for s in seqs}) > 5 and int((mask == 0).sum()) > 0
    tgt = torch.from_numpy(np.random.default_rng(1).integers(FIRST, SIZES["vocab_size"], size=(len(seqs), 9)))
    tgt[:, 0] = hf.decoder_start_token_id

    def both(a, b):
        with torch.no_grad():
            return a(input_ids=ids, attention_mask=mask, decoder_input_ids=tgt).logits, b(ids, mask, tgt)

    want, got = both(original, ours)
    assert float(want.std()) > 0.5                                # logits that vary
    err = float((want - got).abs().max())
    if err > 1e-5:                                                # float32 rounding of two implementations
        want, got = both(copy.deepcopy(original).double(), copy.deepcopy(ours).double())
        err = float((want - got).abs().max())
    assert err <= 1e-5, f"{name}: max abs logits error {err:.2e}"


def original_greedy(original, seqs, max_new_tokens: int, forced: int | None, beam: int = 1,
                    forced_eos: int | None = None) -> list[list[int]]:
    hf = original.config
    ids, mask = (torch.from_numpy(a) for a in pad_batch(seqs, hf.pad_token_id))
    settings = transformers.GenerationConfig(
        num_beams=beam, do_sample=False, max_new_tokens=max_new_tokens, decoder_start_token_id=hf.decoder_start_token_id,
        eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id, forced_bos_token_id=forced,
        forced_eos_token_id=forced_eos, early_stopping="never",
        bad_words_ids=[[hf.pad_token_id]] if hf.decoder_start_token_id == hf.pad_token_id else None)
    own, original.generation_config.forced_eos_token_id = original.generation_config.forced_eos_token_id, forced_eos
    try:                                               # generate takes an unset (None) field from the model's own
        with torch.no_grad():
            out = original.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
    finally:
        original.generation_config.forced_eos_token_id = own
    eos = hf.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in out[:, 1:].tolist()]


@pytest.mark.parametrize("forced", [None, FORCED])
def test_greedy_ids_equal_generate(family, forced):
    name, original, ours, seqs = family
    if forced is not None and name not in ("mbart", "m2m100"):
        pytest.skip("only mBART-50 and NLLB force a first token")
    want = original_greedy(original, seqs, 12, forced)
    assert len({tuple(w) for w in want}) >= len(seqs) // 2, want  # outputs that vary with the input
    engine = TorchEngine(ours) if forced is None else ForcedFirst(TorchEngine(ours), forced)
    got = [h[0].tokens for h in generate_ids(engine, seqs, SearchOptions(max_new_tokens=12))]
    assert got == want


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_forced_eos_is_imported_and_searched_as_generate_does(name, tmp_path):
    """A config that forces EOS at the length limit (forced_eos_token_id: BART's, mBART's and Pegasus' own configs
    do) imports as forced_eos, which the search then applies by default: greedy and beam-4 ids equal generate's
    with it, at a limit the outputs reach (these random models end no output themselves: the trained Marian's
    test, tests/test_decoding_marian.py, mixes outputs that end before it)."""
    original = tiny_original(name, tmp_path, seed=sorted(FAMILIES).index(name), forced_eos=True)
    ours = load_family(tmp_path)
    assert ours.config.forced_eos and original.generation_config.forced_eos_token_id == original.config.eos_token_id
    eos, rng = original.config.eos_token_id, np.random.default_rng(0)
    seqs = [rng.integers(FIRST, SIZES["vocab_size"], size=int(n)).tolist() + [eos]
            for n in rng.integers(1, 14, size=24)]
    limit = 6
    engine = TorchEngine(ours)
    for beam in (1, 4):
        want = original_greedy(original, seqs, limit, None, beam, forced_eos=eos)
        assert len({tuple(w) for w in want}) >= len(seqs) // 2, want
        unforced = original_greedy(original, seqs, limit, None, beam)
        assert sum(w != u for w, u in zip(want, unforced)) >= 4, (name, beam)      # the limit was reached
        got = generate_ids(engine, seqs, SearchOptions(max_new_tokens=limit, beam=beam))
        assert [h[0].tokens for h in got] == want, (name, beam)
        plain = generate_ids(engine, seqs, SearchOptions(max_new_tokens=limit, beam=beam, forced_eos=False))
        assert [h[0].tokens for h in plain] == unforced, (name, beam)            # a request turns it off


def test_fairseq_table_is_m2m100s():
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding as Theirs

    for d, pad in ((32, 1), (33, 0)):
        hf = {**SIZES, "model_type": "m2m_100", "d_model": d, "activation_function": "relu", "scale_embedding": True,
              "pad_token_id": pad, "eos_token_id": 2, "decoder_start_token_id": 2, "encoder_attention_heads": 1,
              "decoder_attention_heads": 1}
        config = model_config(M2M100, hf, "config.json")
        theirs = Theirs.get_embedding(config.max_len + pad + 1, d, pad)[pad + 1:]
        assert torch.equal(fairseq_table(config), theirs)


@pytest.fixture(scope="module")
def bart_parts(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bart-parts")
    original = tiny_original("bart", directory)
    return json.loads((directory / "config.json").read_text()), original.state_dict()


@pytest.mark.parametrize("change,message", [
    (dict(activation_function="gelu_new"), "activation 'gelu_new' cannot be represented"),
    (dict(decoder_ffn_dim=128), "different feed-forward sizes"),
    (dict(model_type="mbart"), "model_type 'mbart', not 'bart'"),
    (dict(decoder_start_token_id=None), "has no decoder_start_token_id"),
    (dict(eos_token_id=[2, 3]), "several EOS ids"),
    (dict(scale_embedding=...), "lacks scale_embedding"),
])
def test_config_features_are_refused_by_name(bart_parts, change, message):
    hf, state = bart_parts
    hf = {k: v for k, v in {**hf, **change}.items() if v is not ...}          # ...: the key is removed

    with pytest.raises(ImportRefused, match=message):
        convert_state(BART, hf, state)


@pytest.mark.parametrize("drop,add,message", [
    ("model.encoder.layernorm_embedding.weight", None, "lacks encoder.layernorm_embedding.weight"),
    (None, "model.decoder.layer_norm.weight", "has decoder.layer_norm.weight, but BartForConditionalGeneration lacks"),
    ("model.decoder.embed_positions.weight", None, "decoder.embed_positions.weight is missing"),
    (None, "model.encoder.extra_proj.weight", "cannot be represented"),
])
def test_weights_the_family_lacks_or_needs_are_refused(bart_parts, drop, add, message):
    hf, state = bart_parts
    state = dict(state)
    if drop:
        del state[drop]
    if add:
        state[add] = torch.ones(SIZES["d_model"])
    with pytest.raises(ImportRefused, match=message):
        convert_state(BART, hf, state)


TOKENIZER_OF = {"bart": "bart", "mbart": "mbart50", "m2m100": "nllb", "pegasus": "pegasus"}


def cli_import(directory, out):
    from click.testing import CliRunner

    from toolkit.apps.cli import main

    return CliRunner().invoke(main, ["import", str(directory), "--out", str(out)])


TEXTS = ["the quick fox jumps", "a lazy dog", "seven wizards hex the box", "over the jolly fox", "quietly",
         "the box", "brown dog jumps", "wizards"]


def imported(name, tmp_path):
    """(transformers model, its tokenizer) of a family's tiny directory at tmp_path/name, imported by
    `onnxformer import` into tmp_path/ckpt."""
    from toolkit.testing.tiny_families import tiny_tokenizer

    theirs = tiny_tokenizer(TOKENIZER_OF[name])
    original = tiny_original(name, tmp_path / name, seed=2, vocab_size=max(SIZES["vocab_size"], len(theirs)))
    theirs.save_pretrained(tmp_path / name)
    result = cli_import(tmp_path / name, tmp_path / "ckpt")
    assert result.exit_code == 0, result.output
    return original, theirs


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_onnxformer_import_detects_each_family(name, tmp_path):
    """`onnxformer import DIR` detects the family from config.json, converts it and keeps its tokenizer: the
    checkpoint tokenizes as transformers does and its greedy ids equal transformers' generate."""
    from runtime.tokenizer import FastTokenizer
    from toolkit.reference.checkpoint import load_checkpoint

    original, theirs = imported(name, tmp_path)
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "import.json").read_text())["format"] == name
    assert isinstance(ckpt.tokenizer, FastTokenizer)
    texts = TEXTS[:5]
    seqs = [ckpt.tokenizer.encode(t) for t in texts]
    assert seqs == [theirs(t)["input_ids"] for t in texts]
    want = original_greedy(original, seqs, 10, None)
    assert len({tuple(w) for w in want}) >= 4, want                # outputs that vary with the input
    pad = original.config.pad_token_id                             # M2M100 positions a generated pad differently
    assert name != "m2m100" or not any(pad in w for w in want)     # (m2m100.py): these outputs have none
    got = [h[0].tokens for h in generate_ids(TorchEngine(ckpt.model), seqs, SearchOptions(max_new_tokens=10))]
    assert got == want


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parity_against_each_familys_original(name, tmp_path):
    """`onnxformer parity ORIGINAL_DIR CHECKPOINT` loads the family's transformers model (its load_original) and
    finds tokenizer, logits, greedy and beam outputs equal to the imported checkpoint's."""
    from click.testing import CliRunner

    from toolkit.apps.cli import main

    imported(name, tmp_path)
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    result = CliRunner().invoke(main, ["parity", str(tmp_path / name), str(tmp_path / "ckpt"), "--input",
                                       str(tmp_path / "texts.txt"), "--json"])
    assert result.exit_code == 0, result.output
    assert "Loading weights" not in result.output            # transformers' progress bar stays out of the report
    report = json.loads(result.output[result.output.index("{"):])
    checks = {c["what"]: c for c in report["checks"]}
    assert report["verdict"] == "ok" and set(checks) == {"tokenizer", "logits", "greedy", "beam 4"}
    assert checks["logits"]["value"] <= 1e-5
    assert all(checks[s]["value"] == 1.0 and checks[s]["distinct_outputs"] >= 6 for s in ("greedy", "beam 4"))


def test_an_imported_bart_exports_a_bundle_with_its_tokenizer(tmp_path):
    from click.testing import CliRunner

    from exporters.export import export_checkpoint
    from runtime.bundle import load_bundle
    from runtime.tokenizer import FastTokenizer
    from toolkit.apps.cli import main
    from toolkit.reference.checkpoint import load_checkpoint
    from toolkit.testing.tiny_families import CONDITIONED, tiny_tokenizer

    original = tiny_original("bart", tmp_path / "bart", matrix=CONDITIONED, forced_eos=True)   # as bart-base's
    theirs = tiny_tokenizer("bart")
    theirs.save_pretrained(tmp_path / "bart")
    assert cli_import(tmp_path / "bart", tmp_path / "ckpt").exit_code == 0
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert isinstance(ckpt.tokenizer, FastTokenizer) and ckpt.config.positions == "table"
    text = "the quick fox jumps"
    ids = ckpt.tokenizer.encode(text)
    assert ids == theirs(text)["input_ids"]
    bundle = load_bundle(export_checkpoint(tmp_path / "ckpt", tmp_path / "bundle"), "cpu")
    assert isinstance(bundle.tokenizer, FastTokenizer) and bundle.tokenizer.encode(text) == ids
    opts = SearchOptions(max_new_tokens=8)
    want = original_greedy(original, [ids], 8, None, forced_eos=original.config.eos_token_id)
    assert [h[0].tokens for h in generate_ids(bundle.engine, [ids], opts)] == want and want[0][-1] == 2
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "bundle")])
    assert "EOS forced at the length limit" in shown.output, shown.output
    off = generate_ids(bundle.engine, [ids], SearchOptions(max_new_tokens=8, forced_eos=False))[0][0]
    assert off.tokens == original_greedy(original, [ids], 8, None)[0] and not off.finished    # a request decides


def test_a_refused_family_import_writes_nothing(tmp_path):
    from toolkit.testing.tiny_families import tiny_tokenizer

    tiny_original("bart", tmp_path / "bart")
    tiny_tokenizer("pegasus").save_pretrained(tmp_path / "bart")    # eos and pad ids that are not BART's
    result = cli_import(tmp_path / "bart", tmp_path / "ckpt")
    assert result.exit_code == 2 and "differ from config.json's" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "ckpt").exists()      # nothing half-written


def test_m2m100_checkpoints_that_saved_their_sinusoids_import(tmp_path):
    """Older M2M100 / NLLB files carry the computed table (embed_positions.weights): it is checked, not mapped."""
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding as Theirs

    original = tiny_original("m2m100", tmp_path / "m2m", seed=1)
    hf = json.loads((tmp_path / "m2m" / "config.json").read_text())
    table = Theirs.get_embedding(SIZES["max_position_embeddings"] + 2, SIZES["d_model"], 1)
    state = {**original.state_dict(), "model.encoder.embed_positions.weights": table,
             "model.decoder.embed_positions.weights": table}
    ours = convert_state(M2M100, hf, state)
    assert torch.equal(ours.pos.pe, fairseq_table(ours.config))
    state["model.decoder.embed_positions.weights"] = table * 2
    with pytest.raises(ImportRefused, match="decoder.embed_positions.weights is not M2M100"):
        convert_state(M2M100, hf, state)
