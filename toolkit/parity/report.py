"""What every parity report is, and how verdicts combine: the one place a verdict is composed.

    Report           a verdict ("ok" | "failed" | "inconclusive"; a graph report may be "not judged"), `ok`,
                     summary() (one line), table(), to_dict() (its JSON) and str() (table, then summary)
    ├─ graphs.ParityReport        each graph output against the reference, judged by atol
    ├─ generation.GenerationReport    generated tokens against the reference's, per search
    ├─ original.OriginalReport    an imported model against its original framework
    └─ Combined      several of them judged as one (`onnxformer parity`): failed if any failed, ...

combine() is also the optimize gate's rule for its checks (toolkit.parity.gate), so a command never composes a
verdict: it prints a report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VERDICTS = ("ok", "failed", "inconclusive")
NOT_JUDGED = "not judged"           # numbers reported only (a report-only row): no verdict either way


def combine(verdicts) -> str:
    """One verdict of several checks: failed if any failed, else inconclusive if any is (or none was judged), else
    ok. "not judged" counts for nothing."""
    verdicts = set(verdicts) - {NOT_JUDGED}
    if "failed" in verdicts:
        return "failed"
    return "inconclusive" if "inconclusive" in verdicts or not verdicts else "ok"


def shout(verdict: str) -> str:
    """A verdict as summaries write it: capitals unless ok, so a failure stands out in a log."""
    return verdict if verdict in ("ok", NOT_JUDGED) else verdict.upper()


def token_verdict(tokens_equal: float, token_match: float, distinct: int, samples: int,
                  fallback: str | None = None) -> str:
    """The token rule, one for every comparison of generated tokens: tokens below the table's token_match fail
    whatever the variety; equal tokens are a verdict only when the reference outputs vary (needed_distinct),
    else the fallback's verdict (teacher-forced logits), else inconclusive."""
    if tokens_equal < token_match:
        return "failed"
    if distinct >= needed_distinct(samples):
        return "ok"
    return fallback or "inconclusive"


def needed_distinct(samples: int) -> float:
    """Distinct reference outputs a token verdict needs: max(4, a quarter of the inputs)."""
    return max(4.0, samples / 4)


def mismatch_window(first: dict, candidate: str, reference: str, before: int = 4, after: int = 8) -> str:
    """The first differing generated token in context: both outputs from `before` tokens ahead of it to `after`
    past it, the differing one in >< ("end" where an output stopped sooner).

        input 3 at position 5 (tokens 1..13): onnxruntime ... 9 4 >17< 6 2 vs pytorch ... 9 4 >12< 6 2"""
    pos = first["position"]
    lo, hi = max(0, pos - before), pos + after + 1

    def span(ids: list[int]) -> str:
        shown = [str(t) if i != pos else f">{t}<" for i, t in enumerate(ids[lo:hi], start=lo)]
        if pos >= len(ids):
            shown.append(">end<")
        return ("... " if lo else "") + " ".join(shown) + (" ..." if len(ids) > hi else "")

    return (f"input {first['index']} at position {pos} (tokens {lo}..{hi - 1}): {candidate} "
            f"{span(first[candidate])} vs {reference} {span(first[reference])}")


class Report:
    """A parity report. Subclasses give `verdict`, summary(), table() and fields() (their JSON besides the verdict)."""

    verdict: str

    @property
    def ok(self) -> bool:
        return self.verdict in ("ok", NOT_JUDGED)

    def summary(self) -> str:
        raise NotImplementedError

    def table(self) -> str:
        raise NotImplementedError

    def fields(self) -> dict:
        raise NotImplementedError

    def problems(self) -> str:
        """What is not ok, in one line: the message a failed run exits with."""
        return self.summary()

    def to_dict(self) -> dict:
        return {"ok": self.ok, "verdict": self.verdict, **self.fields(), "summary": self.summary()}

    def __str__(self) -> str:
        return f"{self.table()}\n{self.summary()}"


@dataclass
class Combined(Report):
    """Reports judged as one: `onnxformer parity` (graphs, then generated tokens). meta: what was compared."""

    parts: dict[str, Report]
    meta: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return combine(p.verdict for p in self.parts.values())

    def summary(self) -> str:
        return f"verdict: {self.verdict} (" + ", ".join(f"{k} {p.verdict}" for k, p in self.parts.items()) + ")"

    def problems(self) -> str:
        return "; ".join(p.problems() for p in self.parts.values() if not p.ok) or self.summary()

    def table(self) -> str:
        return "\n\n".join(str(p) for p in self.parts.values())

    def fields(self) -> dict:
        return {**self.meta, **{name: p.to_dict() for name, p in self.parts.items()}}


__all__ = ["Report", "Combined", "combine", "shout", "token_verdict", "needed_distinct", "mismatch_window",
           "VERDICTS", "NOT_JUDGED"]
