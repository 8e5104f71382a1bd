"""The T5 benchmark shapes (toolkit.testing.tiny_t5.random_shape, raced by benchmarks/race_peers.py --model t5-small
and flan-t5-base): the directory is built offline with the checkpoints' vocabulary (32,128 rows, a 32,100-token
tokenizer), each variant's head (t5: tied and rescaled; v1.1: its own, drawn apart from the embedding), and
`onnxformer import` reads it as that variant. The shapes are shrunk here (d_model 32, 1+1 layers) to keep it cheap;
the vocabulary stays the real one, as the converters see it.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from toolkit.apps.cli import main  # noqa: E402
from toolkit.reference.checkpoint import load_checkpoint  # noqa: E402
from toolkit.testing import tiny_t5  # noqa: E402

SMALL = dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4)
EXPECTED = {   # shape: (variant, activation, gated, tied, head rescaled)
    "t5-small": ("t5", "relu", False, True, True),
    "flan-t5-base": ("v1.1", "gelu_tanh", True, False, False),
}


@pytest.mark.parametrize("shape", sorted(EXPECTED))
def test_a_shape_builds_offline_and_imports_as_its_variant(shape, tmp_path, monkeypatch):
    variant, activation, gated, tied, rescaled = EXPECTED[shape]
    assert tiny_t5.SHAPES[shape][0] == variant
    monkeypatch.setitem(tiny_t5.SHAPES, shape, (variant, SMALL))
    hf = tiny_t5.random_shape(shape, tmp_path / "hf")

    config = json.loads((hf / "config.json").read_text())
    assert {k: config[k] for k in SMALL} == SMALL
    assert config["vocab_size"] == tiny_t5.SHAPE_ROWS == 32128
    assert config.get("tie_word_embeddings", True) is tied
    tokenizer = json.loads((hf / "tokenizer.json").read_text())
    tokens = len(tokenizer["model"]["vocab"]) + sum(t["id"] >= len(tokenizer["model"]["vocab"])
                                                    for t in tokenizer["added_tokens"])
    assert tokens == tiny_t5.SHAPE_PIECES + tiny_t5.SHAPE_EXTRA_IDS == 32100

    result = CliRunner().invoke(main, ["import", str(hf), "--out", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    ckpt = load_checkpoint(tmp_path / "ckpt")
    c = ckpt.config
    assert (c.activation, c.gated_ffn, c.tie_embeddings, c.head_rescale, c.vocab_size, c.d_model) == \
        (activation, gated, tied, rescaled, 32128, 32)
    if not tied:   # the untied head is its own draw, not a copy of the embedding
        state = ckpt.model.state_dict()
        assert not state["generator.proj.weight"].equal(state["embed.lut.weight"])
    else:
        assert "generator.proj.weight" not in ckpt.model.state_dict()
