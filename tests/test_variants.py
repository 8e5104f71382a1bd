"""ModelConfig variants of real checkpoints: each one builds, exports, fuses (attention, SkipLayerNorm and its
activation) and passes the fp32 parity gate; the defaults stay the paper's.

    marian      sin|cos position halves, silu (QuickGelu), logits bias, decoding from pad (pad never generated)
    tutorial    torch.nn.Transformer as PyTorch's translation tutorial builds it: separate vocabularies and
                embeddings, untied generator with a bias, the final encoder/decoder LayerNorm
    plain-gelu  embeddings not scaled, exact GELU (BiasGelu)
    bart        a stored position table per side, embedding LayerNorm, GELU, logits bias, decoding from eos
    mbart       bart's variants in pre-norm stacks (final LayerNorms)
    m2m100      pre-norm, a stored position table per side (fairseq's sinusoids when imported), decoding from eos
    pegasus     pre-norm, sin|cos halves, logits bias, decoding from pad (pad never generated)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exporters.export import export_model
from exporters.optimize import optimize_bundle
from runtime.bundle import load_bundle
from toolkit.reference.errors import ConfigError
from runtime.generate import generate_ids
from runtime.manifest import read_manifest
from runtime.search import SearchOptions
from toolkit.reference.config import ModelConfig, preset
from toolkit.reference.model import Transformer, sinusoid_table
from toolkit.parity.graphs import graph_parity
from toolkit.reference.torch_engine import TorchEngine

VARIANTS = {
    "marian": dict(positions="halves", activation="silu", logits_bias=True, suppress_pad=True, pad_id=0, bos_id=0,
                   eos_id=2),
    "tutorial": dict(src_vocab_size=50, share_embeddings=False, tie_embeddings=False, logits_bias=True,
                     final_norm=True, pad_id=1, bos_id=2, eos_id=3),
    "plain-gelu": dict(scale_embeddings=False, activation="gelu"),
    "bart": dict(positions="table", layernorm_embedding=True, activation="gelu", logits_bias=True,
                 scale_embeddings=False, pad_id=1, bos_id=2, eos_id=2),
    "mbart": dict(norm="pre", positions="table", layernorm_embedding=True, activation="gelu", logits_bias=True,
                  pad_id=1, bos_id=2, eos_id=2),
    "m2m100": dict(norm="pre", positions="table", pad_id=1, bos_id=2, eos_id=2),
    "pegasus": dict(norm="pre", positions="halves", logits_bias=True, pad_id=0, bos_id=0, eos_id=1,
                    suppress_pad=True),
}
ACTIVATION_OP = {"silu": "com.microsoft.QuickGelu", "gelu": "com.microsoft.BiasGelu", "relu": "Relu"}


def variant_model(name: str, seed: int = 3) -> Transformer:
    model = Transformer(preset("tiny", dropout=0.0, **VARIANTS[name]), seed=seed).eval()
    with torch.no_grad():
        if model.generator.bias is not None:      # a bias that matters (a zero bias would prove nothing)
            model.generator.bias.copy_(torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(1)))
    return model


def test_defaults_are_the_papers():
    c = ModelConfig()
    assert (c.positions, c.scale_embeddings, c.activation, c.logits_bias, c.src_vocab_size, c.share_embeddings,
            c.tie_embeddings, c.final_norm, c.suppress_pad, c.norm, c.layernorm_embedding) == \
        ("interleaved", True, "relu", False, None, True, True, False, False, "post", False)
    assert (c.d_kv, c.attention_scale, c.linear_bias, c.normalization, c.gated_ffn, c.relative_buckets,
            c.relative_max_distance, c.head_rescale, c.head_dim) == (None, True, True, "layernorm", False, 0, 128,
                                                                      False, 64)
    assert preset("tiny", d_model=30, n_heads=4, d_kv=6).inner_dim == 24     # T5's d_kv: heads need not fill d
    assert not any(name.startswith("src_pos.") for name in Transformer(preset("tiny")).state_dict())
    pe = sinusoid_table(c)
    assert torch.allclose(pe[5, 0::2], torch.sin(5 / 10000 ** (torch.arange(0, 512, 2) / 512)), atol=1e-5)


def test_halves_table_is_marians():
    pe = sinusoid_table(preset("tiny", positions="halves"))
    pos, d = 7, 32
    angle = pos / np.power(10000, 2 * (np.arange(d) // 2) / d)
    np.testing.assert_allclose(pe[pos].numpy(), np.r_[np.sin(angle[0::2]), np.cos(angle[1::2])], atol=1e-7)


@pytest.mark.parametrize("fields,message", [
    (dict(positions="learned"), "positions must be one of"),
    (dict(layernorm_embedding=1), "must be true or false"),
    (dict(eos_id=0), "eos_id must differ from pad_id"),
    (dict(activation="gelu_new"), "activation must be one of"),
    (dict(src_vocab_size=50), "shared source/target embeddings need one vocabulary size"),
    (dict(positions="none"), "needs a relative position bias"),
    (dict(relative_buckets=1), "relative_buckets must be 0"),
    (dict(relative_buckets=8, relative_max_distance=1), "relative_max_distance must be at least 2"),
    (dict(normalization="batch"), "normalization must be one of"),
    (dict(d_kv=0), "d_kv must be a positive integer"),
    (dict(gated_ffn="yes"), "must be true or false"),
    (dict(d_model=30), "not divisible by n_heads"),
    (dict(final_norm=True, norm="pre"), "final_norm is for post-norm"),
    (dict(logits_bias="yes"), "must be true or false"),
])
def test_bad_variants_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        preset("tiny", **fields)


def test_decoding_from_pad_may_generate_it():
    """T5 decodes from pad and its generate may emit pad: a config that does not suppress it is valid."""
    c = preset("tiny", pad_id=0, bos_id=0, eos_id=1)
    assert c.bos_id == c.pad_id and not c.suppress_pad


def test_position_tables_are_stored_per_side(tmp_path):
    from toolkit.reference.checkpoint import load_checkpoint, save_checkpoint

    model = variant_model("bart")
    state = model.state_dict()
    assert {"pos.pe", "src_pos.pe", "pos.norm.weight", "src_pos.norm.weight"} <= set(state)
    assert not torch.equal(state["pos.pe"], state["src_pos.pe"])       # the encoder reads its own table
    loaded = load_checkpoint(save_checkpoint(tmp_path / "ckpt", model, None)).model
    src, mask, tgt = torch.tensor([[5, 6, 7, 2]]), torch.ones(1, 4, dtype=torch.long), torch.tensor([[2, 9, 10]])
    with torch.no_grad():
        assert torch.equal(loaded(src, mask, tgt), model(src, mask, tgt))


def test_marian_never_generates_pad():
    model = variant_model("marian")
    with torch.no_grad():
        model.generator.bias[model.config.pad_id] = 50.0          # pad would win every step
    seqs = [[5, 6, 7], [9, 10, 11, 12]]
    for beam in (1, 3):
        hyps = generate_ids(TorchEngine(model), seqs, SearchOptions(max_new_tokens=6, beam=beam))
        assert all(model.config.pad_id not in h[0].tokens and h[0].tokens for h in hyps)


def layer_norms(*modules: torch.nn.Module) -> int:
    return sum(isinstance(m, torch.nn.LayerNorm) for module in modules for m in module.modules())


# tutorial and bart in the fast suite (bart: a stored position table, the embedding LayerNorm, decoding from EOS);
# the other families' variants combine the same parts with pre-norm (fused and gated in tests/test_optimize.py's
# pre-norm variant), and Marian's is exported and fused by its fast import tests (tests/test_import_marian.py), so
# they run with the slow tests (each family's import and token parity stays fast: tests/test_families.py)
@pytest.mark.parametrize("name", ["tutorial", "bart", *(pytest.param(name, marks=pytest.mark.slow)
                                                        for name in ("marian", "mbart", "m2m100", "pegasus"))])
def test_variant_exports_fuses_and_passes_the_fp32_gate(name, tmp_path):
    model = variant_model(name)
    c = model.config
    bundle = export_model(model, tmp_path / "bundle")
    fused, report = optimize_bundle(bundle, tmp_path / "fused")
    manifest = read_manifest(fused)
    enc, dec = manifest["graphs"]["encoder"]["op_counts"], manifest["graphs"]["decoder"]["op_counts"]
    assert enc["com.microsoft.MultiHeadAttention"] == c.n_encoder_layers and "Softmax" not in dec
    assert enc["com.microsoft.SkipLayerNormalization"] == 2 * c.n_encoder_layers
    assert enc[ACTIVATION_OP[c.activation]] == c.n_encoder_layers and dec[ACTIVATION_OP[c.activation]] == \
        c.n_decoder_layers
    assert dec["com.microsoft.SkipLayerNormalization"] >= 3 * c.n_decoder_layers
    for counts, modules in ((enc, (model.encoder, model.source_pos)), (dec, (model.decoder, model.pos))):
        fused_norms = counts["com.microsoft.SkipLayerNormalization"] + counts.get("LayerNormalization", 0)
        assert fused_norms == layer_norms(*modules)               # every LayerNorm there, none lost or doubled
    assert manifest["model"] == c.to_dict()
    record = graph_parity(model, fused, provider="cpu", precision="fp32")
    assert record.ok, record.summary()
    seqs = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40, 41]]
    for beam in (1, 4):
        opts = SearchOptions(max_new_tokens=10, beam=beam)
        want = [h[0].tokens for h in generate_ids(TorchEngine(model), seqs, opts)]
        assert [h[0].tokens for h in generate_ids(load_bundle(fused, "cpu").engine, seqs, opts)] == want


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_int8(name, tmp_path):
    model = variant_model(name)
    bundle = export_model(model, tmp_path / "bundle")
    fused, _ = optimize_bundle(bundle, tmp_path / "fused")
    if name == "plain-gelu":
        record = graph_parity(model, fused, provider="cpu", precision="fp32")
        assert record.ok, record.summary()
    out, report = optimize_bundle(fused, tmp_path / "int8", precision="int8", recipe="default",
                                  allow_unverified=True)
    assert report.parity["generation"]["samples"] > 0
