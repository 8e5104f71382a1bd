"""End-to-end generation parity: the same inputs through PyTorch and ONNX Runtime engines, token by token.

Both engines feed the same numpy search (runtime.search), so tokens can differ only where the numbers
differ enough to change a choice. For each search (greedy, beam) it reports the fraction of inputs
whose best hypothesis is identical and the fraction of identical tokens (position-wise, over the longer
of the two outputs), judged against the tolerance table's token_match for the precision and provider.

Verdicts: "ok", "failed" or "inconclusive". Equal tokens prove something only when the reference outputs vary:
with fewer distinct reference outputs than max(4, a quarter of the inputs) (a random-weight model repeats one
token for every input) agreement is no verdict. Parity then compares teacher-forced logits along the reference's
tokens instead (`teacher_forced`): both engines are fed the reference's outputs and their logits at every
position are judged by the tolerance table's atol; where the table has none (int8: report only) the verdict
stays "inconclusive", and a gate refuses it like a failure. Disagreeing tokens fail whatever the variety.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field

import numpy as np

from runtime.generate import encoder_inputs, generate_ids
from runtime.search import SearchOptions
from runtime.session import return_freed_memory
from toolkit.parity.inputs import input_kind, not_representative, parity_inputs  # parity_inputs: where callers found it
from toolkit.parity.report import Report, combine, mismatch_window, needed_distinct, shout, token_verdict
from toolkit.parity.tolerances import MIN_REFERENCE_STD, Tolerance

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
    distinct_outputs: int           # distinct reference outputs (too few: the tokens prove nothing)
    first_mismatch: dict | None = None  # {"index", "position", "input", "pytorch", "onnxruntime"}
    teacher_forced: dict | None = None  # the logits check run when the outputs vary too little (see `teacher_forced`)

    @property
    def varied(self) -> bool:
        return self.distinct_outputs >= needed_distinct(self.samples)

    @property
    def verdict(self) -> str:
        return token_verdict(self.tokens_equal, self.token_match, self.distinct_outputs, self.samples,
                             self.teacher_forced and self.teacher_forced["verdict"])

    @property
    def basis(self) -> str:
        """What the verdict rests on."""
        return "tokens" if self.varied or self.tokens_equal < self.token_match else "teacher-forced logits"

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "verdict": self.verdict, "basis": self.basis,
                "needed_distinct": needed_distinct(self.samples)}


@dataclass
class GenerationReport(Report):
    """Generation parity of one engine against the reference, for each search."""

    provider: str
    precision: str
    tolerance: Tolerance
    source: str                     # where the inputs came from ("dates held-out examples" | "random ids")
    checks: list[GenerationCheck] = field(default_factory=list)
    representative: bool = True     # False: random ids for a text model (toolkit.parity.inputs)

    @property
    def verdict(self) -> str:
        return combine(c.verdict for c in self.checks)

    def summary(self) -> str:
        parts = [f"{c.search} {c.tokens_equal:.2%} tokens, {c.sequences_equal:.2%} sequences" for c in self.checks]
        line = (f"generation parity {shout(self.verdict)} on {self.provider} {self.precision} (tokens equal >= "
                f"{self.tolerance.token_match:.0%}): " + "; ".join(parts))
        bad = [c for c in self.checks if c.verdict == "failed"]
        if bad and bad[0].first_mismatch:
            line += f"; first mismatch ({bad[0].search}): " + mismatch_window(bad[0].first_mismatch, "onnxruntime",
                                                                              "pytorch")
        for c in self.checks:
            if c.basis != "tokens":
                line += (f"; {c.search}: only {c.distinct_outputs} distinct reference outputs of {c.samples} inputs "
                         f"(a token verdict needs {needed_distinct(c.samples):g}), so " + _fallback(c.teacher_forced))
        return line if self.representative else f"{line}; {not_representative(self.source)}"

    def table(self) -> str:
        lines = [f"{'search':<8} {'inputs':>6} {'max new':>7} {'sequences equal':>16} {'tokens equal':>13} "
                 f"{'needed':>7} {'distinct':>8}  verdict", "-" * 84]
        for c in self.checks:
            lines.append(f"{c.search:<8} {c.samples:>6} {c.max_new_tokens:>7} {c.sequences_equal:>16.2%} "
                         f"{c.tokens_equal:>13.2%} {c.token_match:>7.0%} {c.distinct_outputs:>8}  "
                         f"{c.verdict}{'' if c.basis == 'tokens' else ' (teacher-forced logits)'}")
        lines.append(f"inputs: {self.source}" + ("" if self.representative else f" (NOT representative: this model "
                                                                                  f"reads {input_kind(self.source)})"))
        return "\n".join(lines)

    def fields(self) -> dict:
        return {"provider": self.provider, "precision": self.precision, "token_match": self.tolerance.token_match,
                "source": self.source, "representative": self.representative,
                "checks": [c.to_dict() for c in self.checks]}


def _fallback(record: dict | None) -> str:
    if record is None:
        return "the tokens are no verdict (inconclusive)"
    limit = "report only" if record["limit"] is None else f"allowed {record['limit']:g}"
    return (f"teacher-forced logits along the reference tokens were compared instead: {record['verdict']} "
            f"(max abs error {record['max_abs']:.3g}, {limit}; {record['positions']} positions, argmax equal "
            f"{record['argmax_equal']:.2%})")


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


def _with_engine(engine, work):
    """work(engine) for an Engine, or for the engine a zero-argument callable makes, which is dropped as soon as
    work returns (work keeps no reference to it) and its memory given back to the system."""
    if hasattr(engine, "start"):
        return work(engine)
    try:
        return work(engine())
    finally:
        return_freed_memory()


def generation_parity(reference, candidate, seqs: list[list[int]], tolerance: Tolerance, provider: str,
                      precision: str, beams=(1, 4), max_new_tokens: int = 32,
                      source: str = "given inputs", representative: bool = True) -> GenerationReport:
    """Compare the best hypothesis of `candidate` with `reference` (both runtime.generate Engines) per search.
    source, representative: where the inputs came from (toolkit.parity.inputs.ParityInputs).

    reference and candidate may also be zero-argument callables that make the engine (optimize's gate): each is
    made when its turn comes, runs all its searches, and is dropped before the other is made, so two large models'
    sessions are never in memory at once."""
    report = GenerationReport(provider, precision, tolerance, source, representative=representative)

    def searches(engine) -> tuple[dict, int]:
        limit = min(max_new_tokens, engine.max_len)
        return {beam: _best_tokens(engine, seqs, SearchOptions(max_new_tokens=limit, beam=beam))
                for beam in beams}, limit

    (refs, max_new_tokens), (gots, _) = _with_engine(reference, searches), _with_engine(candidate, searches)
    for beam in beams:
        ref, got = refs[beam], gots[beam]
        seq_eq, tok_eq, first = compare_tokens(ref, got)
        if first is not None:
            first["input"] = list(seqs[first["index"]])
        check = GenerationCheck("greedy" if beam == 1 else f"beam {beam}", beam, len(seqs), max_new_tokens, seq_eq,
                                tok_eq, tolerance.token_match, len({tuple(t) for t in ref}), first)
        if check.basis != "tokens":
            check.teacher_forced = teacher_forced(reference, candidate, seqs, ref, tolerance)
        report.checks.append(check)
    return report


def _forced_logits(engine, seqs: list[list[int]], tokens: list[list[int]], visit) -> None:
    """Feed `engine` the output tokens after the start token, and call visit(offset, logits) with the logits of
    every position an output has, in a fixed order (chunk, position, row): offset counts the rows visited before."""
    offset = 0
    for start in range(0, len(seqs), BATCH):
        chunk, outs = seqs[start:start + BATCH], tokens[start:start + BATCH]
        length = max(1, max(len(t) for t in outs))
        ids, mask = encoder_inputs(engine, chunk)               # padded ids, or an audio encoder's features
        state = engine.start(ids, mask, 1, length)
        feed = np.full(len(chunk), engine.bos_id, dtype=np.int64)
        for pos in range(length):
            logits = state.step(feed, None)
            rows = np.asarray([pos < len(t) for t in outs])          # positions this output has
            if rows.any():
                visit(offset, logits[rows])
                offset += int(rows.sum())
            feed = np.asarray([t[pos] if pos < len(t) else engine.eos_id for t in outs], dtype=np.int64)


def forced_owners(tokens: list[list[int]]) -> list[int]:
    """The input each row visited by _forced_logits belongs to, in its order (chunk, position, row)."""
    owners = []
    for start in range(0, len(tokens), BATCH):
        chunk = range(start, min(start + BATCH, len(tokens)))
        for pos in range(max(1, max(len(tokens[i]) for i in chunk))):
            owners += [i for i in chunk if pos < len(tokens[i])]
    return owners


def teacher_forced(reference, candidate, seqs: list[list[int]], tokens: list[list[int]], tol: Tolerance) -> dict:
    """Both engines fed the reference's output tokens (after the start token): their logits at every position
    of every output, judged by tol.atol (None: report only, verdict "inconclusive"). The reference logits must
    vary across inputs (std above MIN_REFERENCE_STD) or the verdict is "inconclusive" too.

    The reference runs first and its logits wait in a temporary file (positions x vocabulary float32: 3.3 GB for
    100 inputs of 32 tokens over NLLB's 256,206 entries, more than memory should hold), then the candidate runs;
    engines may be given as callables that make them (generation_parity)."""
    positions = sum(len(t) for t in tokens)
    worst, total, same = 0.0, 0.0, 0
    if positions == 0:
        std = 0.0
    else:
        with tempfile.TemporaryFile(prefix="onnxformer-teacher-forced-") as spill:
            stored = None
            sums = None

            def keep(offset: int, logits: np.ndarray) -> None:
                nonlocal stored, sums
                if stored is None:
                    stored = np.memmap(spill, dtype=np.float32, mode="w+", shape=(positions, logits.shape[-1]))
                    sums = np.zeros((2, logits.shape[-1]))
                stored[offset:offset + len(logits)] = logits
                wide = logits.astype(np.float64)
                sums += (wide.sum(axis=0), np.square(wide).sum(axis=0))

            def judge(offset: int, logits: np.ndarray) -> None:
                nonlocal worst, total, same
                ref = np.asarray(stored[offset:offset + len(logits)])
                diff = np.abs(logits.astype(np.float64) - ref.astype(np.float64))
                per_position = np.nan_to_num(diff, nan=np.inf).max(axis=-1)
                worst, total = max(worst, float(per_position.max())), total + float(per_position.sum())
                same += int((logits.argmax(-1) == ref.argmax(-1)).sum())

            _with_engine(reference, lambda engine: _forced_logits(engine, seqs, tokens, keep))
            _with_engine(candidate, lambda engine: _forced_logits(engine, seqs, tokens, judge))
            mean = sums[0] / positions               # per-vocabulary-entry std over all positions, averaged
            std = float(np.sqrt(np.maximum(sums[1] / positions - np.square(mean), 0.0)).mean())
            del stored
    limit = tol.limit("logits", 0.0)
    if limit is None or not std > MIN_REFERENCE_STD:
        verdict = "inconclusive"
    else:
        verdict = "ok" if worst <= limit else "failed"
    return {"verdict": verdict, "max_abs": worst, "mean_max_abs": total / max(positions, 1), "limit": limit,
            "positions": positions,
            "argmax_equal": same / max(positions, 1), "reference_std": std}


__all__ = ["GenerationCheck", "GenerationReport", "generation_parity", "teacher_forced", "compare_tokens",
           "forced_owners", "parity_inputs", "combine", "needed_distinct"]
