"""End-to-end generation parity: the same inputs through PyTorch and ONNX Runtime engines, token by token.

Both engines feed the same numpy search (runtime.search), so tokens can differ only where the numbers
differ enough to change a choice. For each search (greedy, beam) it reports the fraction of inputs
whose best hypothesis is identical and the fraction of identical tokens (position-wise, over the longer
of the two outputs), judged against the tolerance table's token_match for the precision and provider.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from runtime.errors import InputError
from runtime.generate import generate_ids
from runtime.search import SearchOptions
from toolkit.parity.tolerances import Tolerance
from toolkit.tasks import task_parity_inputs

BATCH = 64                          # inputs per generate call (both engines see the same padded batches)


@dataclass
class GenerationCheck:
    """Token agreement of one search (greedy or one beam width) over all inputs."""

    search: str                     # "greedy" | "beam 4"
    beam: int
    samples: int
    max_new_tokens: int
    sequences_equal: float          # fraction of inputs whose best hypothesis is identical
    tokens_equal: float             # identical tokens / tokens compared (position-wise, longer output counts)
    token_match: float              # the threshold tokens_equal must reach
    distinct_outputs: int           # distinct reference outputs (1 would make the comparison weak)
    first_mismatch: dict | None = None  # {"index", "position", "input", "pytorch", "onnxruntime"}

    @property
    def ok(self) -> bool:
        return self.tokens_equal >= self.token_match

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


@dataclass
class GenerationReport:
    """Generation parity of one engine against the reference, for each search."""

    provider: str
    precision: str
    tolerance: Tolerance
    source: str                     # where the inputs came from ("dates held-out examples" | "random ids")
    checks: list[GenerationCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def summary(self) -> str:
        bad = [c for c in self.checks if not c.ok]
        verdict = "ok" if not bad else "FAILED"
        parts = [f"{c.search} {c.tokens_equal:.2%} tokens, {c.sequences_equal:.2%} sequences" for c in self.checks]
        line = (f"generation parity {verdict} on {self.provider} {self.precision} (tokens equal >= "
                f"{self.tolerance.token_match:.0%}): " + "; ".join(parts))
        if bad and bad[0].first_mismatch:
            m = bad[0].first_mismatch
            line += (f"; first mismatch ({bad[0].search}): input {m['index']} at position {m['position']}: "
                     f"onnxruntime {m['onnxruntime'][:12]} vs pytorch {m['pytorch'][:12]}")
        return line

    def table(self) -> str:
        lines = [f"{'search':<8} {'inputs':>6} {'max new':>7} {'sequences equal':>16} {'tokens equal':>13} "
                 f"{'needed':>7} {'distinct':>8}  ok", "-" * 78]
        for c in self.checks:
            lines.append(f"{c.search:<8} {c.samples:>6} {c.max_new_tokens:>7} {c.sequences_equal:>16.2%} "
                         f"{c.tokens_equal:>13.2%} {c.token_match:>7.0%} {c.distinct_outputs:>8}  "
                         f"{'yes' if c.ok else 'NO'}")
        lines.append(f"inputs: {self.source}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "provider": self.provider, "precision": self.precision,
                "token_match": self.tolerance.token_match, "source": self.source, "summary": self.summary(),
                "checks": [c.to_dict() for c in self.checks]}


def parity_inputs(config, tokenizer=None, samples: int = 100, seed: int = 0) -> tuple[list[list[int]], str]:
    """Token id inputs and their description: the held-out examples of the model's task (toolkit.tasks), else
    random ids."""
    if samples < 1:
        raise InputError(f"--samples must be at least 1, got {samples}")
    held_out = task_parity_inputs(tokenizer, config.max_len, samples)
    if held_out is not None:
        return held_out
    rng = np.random.default_rng(seed)
    vocab = config.source_vocab_size
    low, longest = min(3, vocab - 1), min(config.max_len, 24)
    lens = rng.integers(1, longest + 1, size=samples)
    return [rng.integers(low, vocab, size=int(n)).tolist() for n in lens], \
        f"{samples} random id sequences, lengths 1..{longest}"


def compare_tokens(reference: list[list[int]], candidate: list[list[int]]) -> tuple[float, float, dict | None]:
    """(fraction of identical sequences, fraction of identical tokens position-wise, first mismatch)."""
    same_seq, same_tok, total, first = 0, 0, 0, None
    for i, (r, c) in enumerate(zip(reference, candidate)):
        width = max(len(r), len(c))
        equal = [a == b for a, b in zip(r, c)] + [False] * (width - min(len(r), len(c)))
        same_seq += r == c
        same_tok += sum(equal)
        total += width
        if first is None and r != c:
            first = {"index": i, "position": equal.index(False), "pytorch": list(r), "onnxruntime": list(c)}
    n = max(len(reference), 1)
    return same_seq / n, (same_tok / total if total else float(same_seq == len(reference))), first


def _best_tokens(engine, seqs: list[list[int]], opts: SearchOptions) -> list[list[int]]:
    out = []
    for start in range(0, len(seqs), BATCH):
        out += [hyps[0].tokens for hyps in generate_ids(engine, seqs[start:start + BATCH], opts)]
    return out


def generation_parity(reference, candidate, seqs: list[list[int]], tolerance: Tolerance, provider: str,
                      precision: str, beams=(1, 4), max_new_tokens: int = 32,
                      source: str = "given inputs") -> GenerationReport:
    """Compare the best hypothesis of `candidate` with `reference` (both runtime.generate Engines) per search."""
    max_new_tokens = min(max_new_tokens, reference.max_len)
    report = GenerationReport(provider, precision, tolerance, source)
    for beam in beams:
        opts = SearchOptions(max_new_tokens=max_new_tokens, beam=beam)
        ref, got = _best_tokens(reference, seqs, opts), _best_tokens(candidate, seqs, opts)
        seq_eq, tok_eq, first = compare_tokens(ref, got)
        if first is not None:
            first["input"] = list(seqs[first["index"]])
        report.checks.append(GenerationCheck(
            "greedy" if beam == 1 else f"beam {beam}", beam, len(seqs), max_new_tokens, seq_eq, tok_eq,
            tolerance.token_match, len({tuple(t) for t in ref}), first))
    return report
