"""T5 variants exported to fp32 bundles, against transformers, end to end (slow: an export per variant).

Each variant of toolkit/testing/tiny_t5.py, trained briefly (outputs that vary: >= 32 distinct of 64 held-out
sentences, asserted), is imported and exported by the command line; export's own parity gate passes. The bundle
carries each stack's relative position bias as one table over every offset k - q up to max_len (folded at export
from the bucket embedding; the decoder gathers it once per step, not once per layer), and: its greedy and beam-4
ids equal `generate`'s, `onnxformer generate BUNDLE TEXTS` prints what the transformers tokenizer + generate +
batch_decode print, and `onnxformer parity DIR BUNDLE` is ok (tokenizer, logits <= 1e-5, greedy, beam 4).
`onnxformer optimize --precision int8` passes its gate (greedy tokens >= 98% equal to the fp32 bundle's) on
held-out texts chosen so that every greedy step of the original has a clear best token (top-2 logit margin >=
MIN_MARGIN, toolkit/parity/confident.py): a toy model's near-ties, which move with the CPU's float kernels,
cannot decide the check; the int8 graph's logit error can.
"""

from __future__ import annotations

import json
import warnings

import onnx
import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from runtime.bundle import load_bundle  # noqa: E402
from runtime.generate import generate_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from toolkit.apps.cli import main  # noqa: E402
from toolkit.parity.original import hf_generate  # noqa: E402
from toolkit.testing.tiny_families import held_out  # noqa: E402
from toolkit.parity.confident import confident_inputs  # noqa: E402
from toolkit.testing.tiny_t5 import VARIANTS, trained_t5  # noqa: E402

pytestmark = pytest.mark.slow
TEXTS = held_out(64)
MAX_NEW = 12
STEPS = 600           # training steps: the 64 most confident of 1,024 held-out texts have margins of 0.98-1.96
MIN_MARGIN = 0.5      # ... the int8 graphs' logits differ from fp32 by 0.30-0.44 at most on the gate's graph check


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request, tmp_path_factory):
    """(name, original directory, transformers model, its tokenizer, fp32 bundle)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"t5-export-{name}")
    model, tok = trained_t5(name, root / name, steps=STEPS)
    for args in (["import", str(root / name), "--out", str(root / "ckpt")],
                 ["export", str(root / "ckpt"), "--out", str(root / "bundle")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    return name, root / name, model, tok, root / "bundle"


def test_the_bundle_carries_one_offset_table_per_stack(exported):
    name, _, model, _, bundle = exported
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["parity"]["verdict"] == "ok" and manifest["parity"]["ok"]                 # the export gate
    rows, heads = 2 * manifest["model"]["max_len"] - 1, model.config.num_heads
    for graph in ("encoder", "decoder"):
        proto = onnx.load(str(bundle / f"{graph}.onnx"), load_external_data=False)
        tables = [i for i in proto.graph.initializer if list(i.dims) == [rows, heads]]
        buckets = [i for i in proto.graph.initializer if "relative_bias" in i.name]
        gathers = [n for n in proto.graph.node if n.op_type in ("Gather", "GatherND") and n.input[0] == tables[0].name]
        assert len(tables) == 1 and not buckets and len(gathers) == 1, (name, graph)   # once per step, all layers


@pytest.mark.parametrize("beam", [1, 4])
def test_bundle_ids_equal_generate(exported, beam):
    name, _, model, tok, bundle = exported
    seqs = [tok(t)["input_ids"] for t in TEXTS]
    want = hf_generate(model, seqs, beam, MAX_NEW)
    assert len({tuple(w) for w in want}) >= 32, want                              # outputs that vary
    engine = load_bundle(bundle, "cpu").engine
    got = [h[0].tokens for h in generate_ids(engine, seqs, SearchOptions(max_new_tokens=MAX_NEW, beam=beam))]
    assert got == want, name


@pytest.mark.parametrize("beam", [1, 4])
def test_text_in_text_out_equals_transformers(exported, beam):
    name, _, model, tok, bundle = exported
    texts = TEXTS[:16]
    result = CliRunner().invoke(main, ["generate", str(bundle), *texts, "--beam", str(beam),
                                       "--max-new-tokens", str(MAX_NEW)])
    assert result.exit_code == 0, result.output
    batch = tok(texts, return_tensors="pt", padding=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = model.generate(**batch, num_beams=beam, max_new_tokens=MAX_NEW, early_stopping="never")
    want = tok.batch_decode(gen, skip_special_tokens=True)
    assert len(set(want)) >= 12
    assert [line for line in result.stdout.splitlines() if not line.startswith("generated with")] == want, name


def test_parity_command_against_each_variants_directory(exported, tmp_path):
    name, directory, _, _, bundle = exported
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    result = CliRunner().invoke(main, ["parity", str(directory), str(bundle), "--input", str(tmp_path / "texts.txt"),
                                       "--samples", "64", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    checks = {c["what"]: c for c in report["checks"]}
    assert report["verdict"] == "ok" and report["family"] == "t5"
    assert set(checks) == {"tokenizer", "logits", "greedy", "beam 4"} and checks["logits"]["value"] <= 1e-5
    for search in ("greedy", "beam 4"):
        assert checks[search]["value"] == 1.0 and checks[search]["distinct_outputs"] >= 32


def test_int8_passes_its_gate_on_confident_held_out_texts(exported, tmp_path):
    name, _, model, tok, bundle = exported
    texts, margins = confident_inputs(model, tok, held_out(1024), 64, 32)
    outputs = {tuple(o) for o in hf_generate(model, [tok(t)["input_ids"] for t in texts], 1, 32)}
    assert min(margins) >= MIN_MARGIN and len(outputs) >= 32, (       # the precondition, built by the choice
        f"{name}: needed 64 held-out texts whose greedy steps all have a top-2 margin >= {MIN_MARGIN} and >= 32 "
        f"distinct outputs; got a smallest margin of {min(margins):.3f} and {len(outputs)} distinct: train longer")
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    result = CliRunner().invoke(main, ["optimize", str(bundle), "--out", str(tmp_path / "int8"), "--precision", "int8",
                                       "--input", str(tmp_path / "texts.txt"), "--samples", "64"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "int8" / "manifest.json").read_text())
    generation = manifest["parity"]["generation"]
    assert manifest["parity"]["verdict"] == "ok" and generation["basis"] == "tokens", name
    assert generation["tokens_equal"] >= 0.98 and generation["distinct_outputs"] >= 32, (name, generation)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "int8" / "decoder.onnx"), load_external_data=False).graph.node}
    assert {"MultiHeadAttention", "MatMulInteger", "SkipSimplifiedLayerNormalization"} <= ops, (name, sorted(ops))
