"""T5 (t5, T5 v1.1 / Flan-T5, mT5, ByT5) imported by `onnxformer import`, against transformers.

Each variant's tiny model is built OFFLINE (toolkit/testing/tiny_t5.py: T5Config / MT5Config, its tokenizer from
tokenizer.json, spiece.model alone or ByT5's bytes) and trained briefly, so that its greedy outputs vary with the
input (>= 32 distinct of 64 held-out sentences is asserted before anything is compared), then saved with
save_pretrained and imported by the command line. Proofs: the config holds the variant; our tokenizer's ids and
text equal transformers'; teacher-forced logits within 1e-5 on batched, right-padded inputs (float64 where float32
rounding alone exceeds it); greedy and beam-4 ids equal to `generate`'s. What cannot be represented is refused
by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from runtime.generate import generate_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from toolkit.apps.cli import main  # noqa: E402
from toolkit.parity.original import hf_generate, logits_check  # noqa: E402
from toolkit.reference.checkpoint import load_checkpoint  # noqa: E402
from toolkit.reference.importers import ImportRefused  # noqa: E402
from toolkit.reference.importers.t5 import convert_state  # noqa: E402
from toolkit.reference.torch_engine import TorchEngine  # noqa: E402
from toolkit.testing.tiny_families import held_out  # noqa: E402
from toolkit.testing.tiny_t5 import VARIANTS, trained_t5  # noqa: E402

TEXTS = held_out(64)
STEPS = 200           # seconds a variant; its outputs already vary (>= 48 distinct of 64, asserted >= 32)
MAX_NEW = 12
EXPECTED = {          # variant: (activation, gated, tied, head rescaled, d_kv, buckets, max distance)
    "t5": ("relu", False, True, True, None, 32, 128),
    "v1.1": ("gelu_tanh", True, False, False, None, 8, 20),
    "mt5": ("gelu_tanh", True, False, False, 6, 16, 32),
    "byt5": ("gelu_tanh", True, False, False, None, 16, 64),
}
TOKENIZER = {"t5": "FastTokenizer", "v1.1": "FastTokenizer", "mt5": "FastTokenizer", "byt5": "ByteTokenizer"}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, transformers model, its tokenizer, the checkpoint `onnxformer import` wrote, the source ids)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"t5-{name}")
    model, tok = trained_t5(name, root / name, steps=STEPS)
    result = CliRunner().invoke(main, ["import", str(root / name), "--out", str(root / "ckpt")])
    assert result.exit_code == 0, result.output
    return name, model, tok, load_checkpoint(root / "ckpt"), [tok(t)["input_ids"] for t in TEXTS]


def test_the_config_is_the_variants(variant):
    name, model, _, ckpt, _ = variant
    c = ckpt.config
    assert (c.activation, c.gated_ffn, c.tie_embeddings, c.head_rescale, c.d_kv, c.relative_buckets,
            c.relative_max_distance) == EXPECTED[name]
    assert (c.norm, c.normalization, c.positions, c.attention_scale, c.linear_bias, c.scale_embeddings) == \
        ("pre", "rms", "none", False, False, False)
    assert (c.bos_id, c.pad_id, c.eos_id, c.suppress_pad) == (0, 0, 1, False)     # decoding from pad, not banned
    assert (c.head_dim, c.layer_norm_eps) == (model.config.d_kv, model.config.layer_norm_epsilon)
    assert json.loads((ckpt.path / "import.json").read_text())["format"] == "t5"
    assert type(ckpt.tokenizer).__name__ == TOKENIZER[name]


def test_tokenizer_ids_and_text_equal_transformers(variant):
    name, _, tok, ckpt, seqs = variant
    texts = TEXTS + (["héllo </s> wörld<extra_id_1>x <pad>", "a</s>  "] if name == "byt5" else [])
    assert [ckpt.tokenizer.encode(t) for t in texts] == [tok(t)["input_ids"] for t in texts]
    assert len({len(s) for s in seqs}) > 4                                           # padded batches follow
    for ids in seqs + [[0, 5, 1, 7, 2]]:
        assert ckpt.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_logits_equal_the_originals_on_padded_batches(variant):
    name, model, _, ckpt, seqs = variant
    check = logits_check(model, ckpt.model, seqs)
    assert check.ok and check.value <= 1e-5, f"{name}: {check.detail}"


@pytest.mark.parametrize("beam", [1, 4])
def test_greedy_and_beam_ids_equal_generate(variant, beam):
    name, model, _, ckpt, seqs = variant
    want = hf_generate(model, seqs, beam, MAX_NEW)
    assert len({tuple(w) for w in want}) >= 32, want                               # outputs that vary
    got = [h[0].tokens for h in generate_ids(TorchEngine(ckpt.model), seqs,
                                             SearchOptions(max_new_tokens=MAX_NEW, beam=beam))]
    assert got == want, name


@pytest.fixture(scope="module")
def t5_parts(tmp_path_factory):
    from toolkit.testing.tiny_t5 import random_t5

    directory = tmp_path_factory.mktemp("t5-parts")
    model, _ = random_t5("v1.1", directory)
    return json.loads((directory / "config.json").read_text()), model.state_dict()


@pytest.mark.parametrize("change,message", [
    (dict(feed_forward_proj="gated-tanh", dense_act_fn="tanh"), "activation 'tanh' cannot be represented"),
    (dict(feed_forward_proj="double-gated-gelu"), "is not 'ACT' or 'gated-ACT'"),
    (dict(feed_forward_proj="relu"), "disagree with feed_forward_proj 'relu'"),     # config.json keeps both
    (dict(is_gated_act=False), "disagree with feed_forward_proj"),
    (dict(dense_act_fn="relu"), "disagree with feed_forward_proj"),
    (dict(model_type="umt5"), "not one of t5, mt5"),
    (dict(d_kv=...), "lacks d_kv"),
    (dict(eos_token_id=[1, 2]), "several EOS ids"),
])
def test_config_features_are_refused_by_name(t5_parts, change, message):
    hf, state = t5_parts
    hf = {k: v for k, v in {**hf, **change}.items() if v is not ...}          # ...: the key is removed
    with pytest.raises(ImportRefused, match=message):
        convert_state(hf, state)


@pytest.mark.parametrize("edit,message", [
    ({"encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight": torch.ones(8, 4)},
     "a relative position bias in a later layer"),
    ({"encoder.block.0.layer.0.SelfAttention.q.bias": torch.ones(32)}, "cannot be represented"),
    ({"encoder.embed_tokens.weight": "other"}, "differs from shared.weight"),
    ({"decoder.final_layer_norm.weight": None}, "lack decoder.final_layer_norm.weight"),
    ({"decoder.block.1.layer.2.DenseReluDense.wi_1.weight": None}, "lack decoder.block.1.layer.2"),
])
def test_weights_that_cannot_be_represented_are_refused(t5_parts, edit, message):
    hf, state = t5_parts
    state = dict(state)
    for key, value in edit.items():
        if value is None:
            del state[key]
        else:
            state[key] = state["shared.weight"] * 2 if isinstance(value, str) else value
    with pytest.raises(ImportRefused, match=message):
        convert_state(hf, state)


def test_umt5_and_longt5_stay_refused_by_name(tmp_path):
    for model_type, lacks in (("umt5", "per-layer relative position buckets"), ("longt5", "transient-global")):
        src = tmp_path / model_type
        src.mkdir()
        (src / "config.json").write_text(json.dumps({"model_type": model_type}))
        result = CliRunner().invoke(main, ["import", str(src), "--out", str(tmp_path / "out")])
        assert result.exit_code == 2 and lacks in result.output, result.output


def test_rows_past_the_tokenizer_decode_to_nothing_as_transformers_does(tmp_path):
    """A model with more rows than tokens (vocab_size 32128, 32100 tokens in t5-small): generation stays
    transformers' (its generate picks those ids too), and the text of ids with no token is transformers' (none)."""
    from toolkit.testing.tiny_t5 import random_t5

    model, tok = random_t5("v1.1", tmp_path / "src", extra_rows=40)
    assert model.config.vocab_size == len(tok) + 40
    result = CliRunner().invoke(main, ["import", str(tmp_path / "src"), "--out", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.config.vocab_size == len(tok) + 40 and ckpt.tokenizer.vocab_size == len(tok)
    seqs = [tok(t)["input_ids"] for t in TEXTS[:16]]
    want = hf_generate(model, seqs, 1, MAX_NEW)
    assert any(i >= len(tok) for w in want for i in w), want                   # the unused rows are picked
    got = [h[0].tokens for h in generate_ids(TorchEngine(ckpt.model), seqs, SearchOptions(max_new_tokens=MAX_NEW))]
    assert got == want
    assert [ckpt.tokenizer.decode(g) for g in got] == tok.batch_decode(want, skip_special_tokens=True)
    result = CliRunner().invoke(main, ["generate", str(tmp_path / "ckpt"), TEXTS[0], "--max-new-tokens",
                                       str(MAX_NEW)])
    assert result.exit_code == 0 and tok.decode(want[0], skip_special_tokens=True) in result.output, result.output


@pytest.fixture(scope="module")
def t5_bundle(t5_exported):
    """The fp32 bundle of a random tiny v1.1 (conftest's t5_exported: imported and exported by the command line)."""
    return t5_exported[1]


def test_optimize_fuses_t5_attention_and_rms_norm(t5_bundle, tmp_path):
    """The default `onnxformer optimize` of a T5 bundle: every attention block fused, scale 1 (the encoder's and
    the cross-attention into MultiHeadAttention, the relative bias and mask as attention_bias; the decoder's
    self-attention into GroupQueryAttention, the per-row static cache, its relative bias as attention_bias:
    tests/test_static_cache_t5.py), RMSNorm into (Skip)SimplifiedLayerNormalization, the fp32 gate passed."""
    import onnx

    result = CliRunner().invoke(main, ["optimize", str(t5_bundle), "--out", str(tmp_path / "fused")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "fused" / "manifest.json").read_text())
    layers = manifest["model"]["n_encoder_layers"], manifest["model"]["n_decoder_layers"]
    assert manifest["parity"]["verified"] and manifest["decoder_layout"] == "static-per-row"
    for graph, attention, norms in (("encoder", layers[0], 2 * layers[0] + 1), ("decoder", 2 * layers[1],
                                                                                  3 * layers[1] + 1)):
        nodes = onnx.load(str(tmp_path / "fused" / f"{graph}.onnx"), load_external_data=False).graph.node
        ops = [n.op_type for n in nodes]
        fused = [n for n in nodes if n.op_type in ("MultiHeadAttention", "GroupQueryAttention")]
        assert len(fused) == attention and "Softmax" not in ops and "Pow" not in ops, (graph, ops)
        assert all(n.input[5 if n.op_type == "MultiHeadAttention" else 10] and
                   [a.f for a in n.attribute if a.name == "scale"] == [1.0] for n in fused)
        skip = ops.count("SkipSimplifiedLayerNormalization")
        assert skip == norms - 1 and ops.count("SimplifiedLayerNormalization") == 1, (graph, ops)


def test_fp16_keeps_t5s_ffn_output_projections_in_float32(t5_bundle, tmp_path):
    """--precision fp16 (CUDA; converted here on the CPU, the gate not run): the feed-forward output MatMuls (T5's
    `wo`, whose activations overflow float16) take float32 inputs and weights; the other MatMuls are float16."""
    import onnx

    from exporters.optimize import optimize_bundle

    optimize_bundle(t5_bundle, tmp_path / "fp16", target="cuda", precision="fp16", allow_unverified=True)
    layers = json.loads((t5_bundle / "manifest.json").read_text())["model"]
    for graph, n in (("encoder", layers["n_encoder_layers"]), ("decoder", layers["n_decoder_layers"])):
        g = onnx.load(str(tmp_path / "fp16" / f"{graph}.onnx")).graph
        types = {i.name: i.data_type for i in g.initializer}
        types.update({o: next(a.i for a in n.attribute if a.name == "to") for n in g.node if n.op_type == "Cast"
                      for o in n.output})                                  # a Cast's output: its type
        matmuls = {n.name: n for n in g.node if n.op_type == "MatMul" and n.input[1] in types}
        wo = [k for k, n in matmuls.items() if any(a.key == "pkg.torch.onnx.name_scopes" and ".ffn.w_2'" in a.value
                                                   for a in n.metadata_props)]
        dtypes = {k: {types.get(i) for i in n.input} for k, n in matmuls.items()}
        assert len(wo) == n and all(dtypes[k] == {onnx.TensorProto.FLOAT} for k in wo), (graph, dtypes)
        assert all(onnx.TensorProto.FLOAT16 in t for k, t in dtypes.items() if k not in wo), (graph, dtypes)
