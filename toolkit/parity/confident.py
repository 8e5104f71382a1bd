"""Inputs on which a trained toy model's greedy decisions are clear: the precondition of a quantized gate's token
check, built rather than hoped for.

A briefly trained toy model has near-ties: steps where its best and second-best logits differ by less than an
int8 kernel's rounding. Which steps those are depends on the CPU's float kernels (the trained weights differ by
instruction set), so a count of int8 tokens equal to fp32 tokens over arbitrary inputs holds on one machine and
not on the next. A quantized graph whose logits stay within margin / 2 of the fp32 graph's cannot change a greedy
decision whose top-2 margin is `margin`; choosing the inputs whose every greedy step has such a margin makes the
gate's token check a statement about the quantization error, on every CPU.

    texts, margins = confident_inputs(model, tok, pool, n=64, max_new_tokens=32)
    tokens, margins = engine_margins(engine, inputs, max_new_tokens=32)   # a bundle's engine: ids or features
"""

from __future__ import annotations


def greedy_margins(model, tok, texts: list[str], max_new_tokens: int, batch: int = 64) -> list[float]:
    """Per text: the smallest top-1 minus top-2 logit over the steps of the original's greedy output (EOS
    included), teacher-forced on that output."""
    import torch

    from runtime.generate import pad_batch
    from toolkit.parity.original import hf_generate, hf_pad, suppresses_pad

    seqs = [tok(t)["input_ids"] for t in texts]
    outs = hf_generate(model, seqs, 1, max_new_tokens)
    start = model.config.decoder_start_token_id
    margins = []
    for first in range(0, len(seqs), batch):
        ids, mask = pad_batch(seqs[first:first + batch], hf_pad(model))
        rows = outs[first:first + batch]
        width = max(len(r) for r in rows)
        dec = torch.full((len(rows), width), start, dtype=torch.long)
        for i, r in enumerate(rows):
            dec[i, 1:len(r)] = torch.tensor(r[:-1], dtype=torch.long)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                           decoder_input_ids=dec).logits.double()
        if suppresses_pad(model.config):                      # generate never picks pad there: not a rival
            logits[..., model.config.pad_token_id] = float("-inf")
        top2 = logits.topk(2, dim=-1).values
        gaps = top2[..., 0] - top2[..., 1]
        margins += [float(gaps[i, :len(r)].min()) for i, r in enumerate(rows)]
    return margins


def confident_inputs(model, tok, pool: list[str], n: int, max_new_tokens: int) -> tuple[list[str], list[float]]:
    """The n texts of pool whose greedy outputs have the largest smallest margin (greedy_margins), in pool order,
    with their margins."""
    margins = greedy_margins(model, tok, pool, max_new_tokens)
    chosen = sorted(sorted(range(len(pool)), key=lambda i: -margins[i])[:n])
    return [pool[i] for i in chosen], [margins[i] for i in chosen]


def engine_margins(engine, seqs: list, max_new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """(greedy tokens, per input the smallest top-1 minus top-2 logit over their steps) of a runtime Engine (a
    bundle's: inputs token ids or an audio encoder's features), as optimize's gate decodes them (its suppressed ids
    are no rival), teacher-forced on those tokens."""
    import numpy as np

    from runtime.search import SearchOptions
    from toolkit.parity.generation import _best_tokens, _forced_logits, forced_owners

    tokens = _best_tokens(engine, seqs, SearchOptions(max_new_tokens=max_new_tokens, beam=1))
    owners, low = forced_owners(tokens), np.full(len(seqs), np.inf)

    def visit(offset: int, logits: np.ndarray) -> None:
        logits = np.array(logits, dtype=np.float64)
        logits[:, list(engine.suppress_ids)] = -np.inf
        top2 = np.sort(logits, axis=-1)[:, -2:]
        np.minimum.at(low, owners[offset:offset + len(logits)], top2[:, 1] - top2[:, 0])

    _forced_logits(engine, seqs, tokens, visit)
    return tokens, low.tolist()


__all__ = ["confident_inputs", "greedy_margins", "engine_margins"]
