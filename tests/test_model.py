"""The reference model: cached step-by-step decoding equals recomputing the prefix; padding changes nothing. Each
for post-norm and pre-norm stacks and for T5's variants (relative position bias, RMSNorm, gated GELU, no biases,
unscaled scores, d_kv apart from d_model / heads, rescaled tied head), whose bias must follow the KV cache."""

from __future__ import annotations

import pytest
import torch

from runtime.generate import generate_ids, pad_batch
from runtime.search import SearchOptions
from toolkit.testing.toy import toy_inputs
from toolkit.reference.torch_engine import TorchEngine

ATOL = 1e-5  # fp32: cached and uncached paths do the same arithmetic in a different order
T5 = dict(norm="pre", positions="none", relative_buckets=8, relative_max_distance=12, normalization="rms",
          attention_scale=False, linear_bias=False, gated_ffn=True, activation="gelu_tanh", d_kv=6, head_rescale=True,
          scale_embeddings=False)   # distances up to 12: the inputs here reach the logarithmic buckets
VARIANTS = {"post": dict(norm="post"), "pre": dict(norm="pre"), "t5": T5}


def padded_batch(config, lengths=(3, 9, 6, 1), seed=5):
    """Sources of different lengths, right-padded: [B, S] ids and mask."""
    seqs = [s[:n] for s, n in zip(toy_inputs(config, len(lengths), min_len=12, max_len=12, seed=seed), lengths)]
    ids, mask = pad_batch(seqs, config.pad_id)
    return seqs, torch.from_numpy(ids), torch.from_numpy(mask)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_cached_decoding_equals_recomputing_the_prefix(toy_model_factory, variant):
    model = toy_model_factory(**VARIANTS[variant])
    config = model.config
    _, src, mask = padded_batch(config)
    _, cross = model.encode(src, mask)
    gen = torch.Generator().manual_seed(0)
    tgt = torch.cat([torch.full((src.shape[0], 1), config.bos_id),
                     torch.randint(3, config.vocab_size, (src.shape[0], 9), generator=gen)], dim=1)  # [B, 10]

    full, _ = model.decode_step(tgt, mask, model.empty_cache(src.shape[0]), cross)          # [B, 10, V]
    past, steps = model.empty_cache(src.shape[0]), []
    for t in range(tgt.shape[1]):                                                            # one token at a time
        logits, past = model.decode_step(tgt[:, t:t + 1], mask, past, cross)
        steps.append(logits)
    cached = torch.cat(steps, dim=1)
    assert past[0][0].shape == (src.shape[0], config.n_heads, tgt.shape[1], config.head_dim)
    assert (cached - full).abs().max().item() <= ATOL

    past = model.empty_cache(src.shape[0])                                                   # a chunk, then steps
    first, past = model.decode_step(tgt[:, :4], mask, past, cross)
    rest, _ = model.decode_step(tgt[:, 4:], mask, past, cross)
    assert (torch.cat([first, rest], dim=1) - full).abs().max().item() <= ATOL


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_and_uncached_engines_generate_the_same(toy_model_factory, variant):
    model = toy_model_factory(**VARIANTS[variant])
    seqs = toy_inputs(model.config, 12, seed=7)
    for opts in (SearchOptions(max_new_tokens=16), SearchOptions(max_new_tokens=16, beam=3, num_return=3)):
        cached = generate_ids(TorchEngine(model, use_cache=True), seqs, opts)
        uncached = generate_ids(TorchEngine(model, use_cache=False), seqs, opts)
        assert [[h.tokens for h in hs] for hs in cached] == [[h.tokens for h in hs] for hs in uncached]
        for hs_c, hs_u in zip(cached, uncached):
            for a, b in zip(hs_c, hs_u):
                assert a.score == pytest.approx(b.score, abs=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_encoder_output_does_not_depend_on_padding(toy_model_factory, variant):
    model = toy_model_factory(**VARIANTS[variant])
    seqs, src, mask = padded_batch(model.config)
    memory, cross = model.encode(src, mask)
    for row, seq in enumerate(seqs):
        alone, alone_cross = model.encode(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
        n = len(seq)
        assert (memory[row, :n] - alone[0]).abs().max().item() <= ATOL
        assert (cross[0][0][row, :, :n] - alone_cross[0][0][0]).abs().max().item() <= ATOL


@torch.no_grad()
def test_t5_rows_at_their_own_positions_equal_the_rows_alone(toy_model_factory):
    """In-flight rows: row 1 joined 3 slots late (its first 3 cached slots masked out, its positions 3 lower); its
    relative position bias counts only its real keys, so its logits equal the row decoded alone."""
    model = toy_model_factory(**T5)
    _, src, mask = padded_batch(model.config, lengths=(5, 8))
    _, cross = model.encode(src, mask)
    prefix = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    _, past = model.decode_step(prefix, mask, model.empty_cache(2), cross)
    new = torch.tensor([[7, 8], [9, 10]])
    positions, key_mask = torch.tensor([[6, 7], [3, 4]]), torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    logits, _ = model.decode_step(new, mask, past, cross, positions, key_mask)
    alone, _ = model.decode_step(new[1:], mask[1:], [(k[1:, :, 3:], v[1:, :, 3:]) for k, v in past],
                                 [(k[1:], v[1:]) for k, v in cross])
    assert (logits[1:] - alone).abs().max().item() <= ATOL
    full, _ = model.decode_step(new, mask, past, cross)                      # every slot real: row 0 is the same
    assert (logits[0] - full[0]).abs().max().item() <= ATOL
    assert (logits[1] - full[1]).abs().max().item() > 1e-3                    # the mask and positions matter


@pytest.mark.parametrize("beam", [1, 3])
def test_generated_tokens_do_not_depend_on_batching(toy_model, beam):
    engine = TorchEngine(toy_model)
    seqs = toy_inputs(toy_model.config, 8, min_len=1, max_len=12, seed=11)
    opts = SearchOptions(max_new_tokens=16, beam=beam)
    batched = generate_ids(engine, seqs, opts)
    alone = [generate_ids(engine, [s], opts)[0] for s in seqs]
    assert [h[0].tokens for h in batched] == [h[0].tokens for h in alone]
    assert [h[0].score for h in batched] == pytest.approx([h[0].score for h in alone], abs=1e-4)
    assert len({tuple(h[0].tokens) for h in batched}) > 1, "a trained model's outputs should vary with the input"


def test_dropout_acts_in_train_mode_and_is_off_in_eval_mode():
    """With dropout 0.3, train() gives a different output each call; eval() gives one output, the same as the
    same weights with dropout 0."""
    from toolkit.reference.config import preset
    from toolkit.reference.model import Transformer

    torch.manual_seed(0)
    model = Transformer(preset("tiny", dropout=0.3))
    plain = Transformer(preset("tiny", dropout=0.0))
    plain.load_state_dict(model.state_dict())
    plain.eval()
    src, tgt = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 8, 9]])
    mask = torch.ones_like(src)
    with torch.no_grad():
        model.train()
        first, second = model(src, mask, tgt), model(src, mask, tgt)
        assert not torch.allclose(first, second), "dropout 0.3 in train mode changed nothing"
        model.eval()
        assert torch.equal(model(src, mask, tgt), model(src, mask, tgt))
        assert torch.allclose(model(src, mask, tgt), plain(src, mask, tgt), atol=1e-6)
        assert not torch.allclose(first, plain(src, mask, tgt), atol=1e-3)
