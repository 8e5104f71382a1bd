"""Parity of an optimized bundle with the bundle it was made from, on ONNX Runtime as users run it.

Both sides run in sessions with ORT's graph optimizations on (runtime.session defaults). The encoder runs
once on a padded batch; the decoder runs a first step (empty past, two tokens) and `steps` cached one-token
steps, each side fed with its own encoder outputs and presents, both with the same tokens (the reference's
greedy choice). A static-cache decoder is run through runtime.static_cache.DynamicView, so both sides are fed
and compared in the dynamic contract. Errors are judged with the tolerance table (toolkit.parity.tolerances), output by output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.session import SessionConfig, make_session
from runtime.spec import first_step_cache, graph_specs, past_of
from runtime.static_cache import dynamic_view
from toolkit.config import ModelConfig
from toolkit.parity.graphs import default_src_lens, sample_inputs
from toolkit.parity.tolerances import MIN_REFERENCE_STD, Tolerance


@dataclass
class Worst:
    """The largest disagreement seen on one output."""

    graph: str
    output: str
    max_abs: float = 0.0
    scale: float = 0.0              # largest reference magnitude seen
    step: int | None = None         # decoder step of the worst element (None: the encoder)
    steps: int = 0                  # how many times it was compared
    limit: float | None = None
    ok: bool = True

    def fold(self, ref: np.ndarray, got: np.ndarray, step: int | None, tol: Tolerance | None) -> None:
        if ref.shape != got.shape:
            raise AssertionError(f"{self.graph} {self.output}: shapes {got.shape} vs reference {ref.shape}")
        self.steps += 1
        if ref.size:
            diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
            worst = float(np.nan_to_num(diff, nan=np.inf).max())
            self.scale = max(self.scale, float(np.abs(ref).max()))
            if worst > self.max_abs or self.step is None:
                self.max_abs, self.step = worst, step
        self.limit = None if tol is None else tol.limit(self.output, self.scale)
        self.ok = self.limit is None or self.max_abs <= self.limit

    def to_dict(self) -> dict:
        return {"graph": self.graph, "output": self.output, "max_abs": self.max_abs,
                "max_rel": self.max_abs / max(self.scale, 1e-12), "step": self.step, "steps": self.steps,
                "limit": self.limit, "ok": self.ok}


def compare_graphs(reference: dict[str, Path], candidate: dict[str, Path], config: dict, provider: str = "cpu",
                   tol: Tolerance | None = None, steps: int = 8, batch: int = 3, seed: int = 0) -> dict:
    """Per-output max abs errors of candidate graphs against reference graphs; tol None = report only."""
    c = ModelConfig.from_dict(config)
    specs = graph_specs(config)
    options = SessionConfig()                    # ORT_ENABLE_ALL, as the runtime runs bundles
    ref = {g: dynamic_view(make_session(p, provider, options)) for g, p in reference.items()}
    new = {g: dynamic_view(make_session(p, provider, options)) for g, p in candidate.items()}
    checks: dict[tuple[str, str], Worst] = {}
    agree = total = 0

    def fold(graph, name, r, g, step):
        checks.setdefault((graph, name), Worst(graph, name)).fold(r, g, step, tol)

    src_lens = default_src_lens(batch)
    ids, mask = sample_inputs(c, src_lens, seed)
    names = specs["encoder"].output_names
    enc = [dict(zip(names, s.run(names, {"input_ids": ids, "attention_mask": mask}))) for s in (ref["encoder"],
                                                                                               new["encoder"])]
    for name in names:
        fold("encoder", name, enc[0][name], enc[1][name], None)
    std = {"encoder_hidden_states": float(enc[0]["encoder_hidden_states"].std())}

    rng = np.random.default_rng(seed + 1)
    tokens = np.stack([np.full(batch, c.bos_id), rng.integers(min(3, c.vocab_size - 1), c.vocab_size, batch)], 1)
    past = [first_step_cache(config, side, batch) for side in enc]
    names = specs["decoder"].output_names
    logits_seen = []
    for step in range(steps + 1):
        outs = []
        for sess, feeds in zip((ref["decoder"], new["decoder"]), past):
            out = dict(zip(names, sess.run(names, {"input_ids": tokens.astype(np.int64),
                                                   "encoder_attention_mask": mask, **feeds})))
            for name in names[1:]:                                   # each side keeps its own cache
                feeds[past_of(name)] = out[name]
            outs.append(out)
        for name in names:
            fold("decoder", name, outs[0][name], outs[1][name], step)
        chosen = [o["logits"][:, -1].argmax(-1) for o in outs]
        agree += int((chosen[0] == chosen[1]).sum())
        total += batch
        logits_seen.append(outs[0]["logits"][:, -1])
        tokens = chosen[0][:, None]                                   # the reference's greedy token, for both
    std["logits"] = float(np.concatenate(logits_seen).std(axis=0).mean())

    results = list(checks.values())
    vacuous = [k for k, v in std.items() if not v > MIN_REFERENCE_STD]
    worst = max(results, key=lambda w: w.max_abs)
    failed = [w for w in results if not w.ok]
    per_graph = {}
    for graph in ("encoder", "decoder"):
        mine = [w for w in results if w.graph == graph]
        top = max(mine, key=lambda w: w.max_abs)
        per_graph[graph] = {"max_abs": top.max_abs, "max_rel": max(w.max_abs / max(w.scale, 1e-12) for w in mine),
                            "worst_output": top.output, "ok": all(w.ok for w in mine)}
    judged = tol is not None and tol.judged
    ok = judged and not failed and not vacuous
    if vacuous:
        summary = f"not verified: reference outputs {', '.join(vacuous)} do not vary"
    elif not judged:
        summary = f"report only: max abs error {worst.max_abs:.2e} ({worst.graph} {worst.output})"
    elif failed:
        bad = max(failed, key=lambda w: w.max_abs)
        summary = (f"FAILED: {len(failed)} output(s) out of tolerance; worst {bad.graph} {bad.output} "
                   f"step {bad.step}: max abs {bad.max_abs:.3g} > {bad.limit:.3g}")
    else:
        summary = f"ok: max abs error {worst.max_abs:.2e} ({worst.graph} {worst.output}) within tolerance"
    return {"verified": ok, "judged": judged, "provider": provider, "reference": "source bundle",
            "graph_optimization": options.graph_optimization,
            "tolerance": None if tol is None else tol.atol, "batch": batch, "src_lens": src_lens, "steps": steps,
            "max_abs": worst.max_abs, "summary": summary, **per_graph,
            "teacher_forced_tokens_equal": agree / max(total, 1), "reference_std": std,
            "outputs": [w.to_dict() for w in results]}
