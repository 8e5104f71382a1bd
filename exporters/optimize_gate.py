"""optimize's gate step: the new graphs' parity record against the source bundle's (toolkit.parity.gate), or,
for a CUDA target on a machine without CUDA, a record that says they were not run there (with a CPU look that is
never a verdict)."""

from __future__ import annotations

import time
from pathlib import Path

import onnxruntime as ort

from runtime.manifest import GRAPHS, decoder_layout
from toolkit.parity.gate import bundle_gate
from toolkit.parity.graphs import bundle_parity


def optimize_parity(job, paths: dict[str, Path]) -> dict:
    """The gate's parity record of the new graphs (paths) against the source bundle's (job: optimize's _Job)."""
    src_paths, precision, config = {g: job.source(g) for g in GRAPHS}, job.precision, job.manifest["model"]
    layouts = (job.report.decoder_layout, decoder_layout(job.manifest))             # (candidate, source)
    provider = "cuda" if job.target == "cuda" else "cpu"
    if provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        record = {"verified": False, "judged": False, "verdict": "not run", "provider": "cuda", "precision": precision,
                  "reason": f"CUDA not available: this onnxruntime has no CUDAExecutionProvider, so the {precision} "
                            f"graphs were not run on their target; check them on a GPU machine with "
                            f"`onnxformer parity CHECKPOINT BUNDLE --provider cuda`"}
        try:                                       # an informative look on the CPU, never a verdict
            cpu = bundle_parity(src_paths, paths, config, "cpu", None, precision, layouts=layouts).to_dict()
            record["cpu_check"] = {k: cpu[k] for k in ("summary", "max_abs", "teacher_forced_tokens_equal")}
        except Exception as exc:                   # e.g. an op without a CPU kernel for this type
            record["cpu_check"] = {"summary": f"does not run on the CPU ({str(exc).splitlines()[0][:200]})"}
        job.progress(f"parity not verified: {record['reason']}")
        return record
    t0 = time.perf_counter()
    record = bundle_gate(src_paths, paths, job.manifest, job.bundle_dir, provider, precision, job.samples,
                         job.texts, layouts[0], job.inputs)
    job.progress(f"parity against the source bundle on {provider} in {time.perf_counter() - t0:.1f} s: "
                 f"{record['summary']}")
    return record


__all__ = ["optimize_parity"]
