"""The report: one row per engine and batch size (throughput, latency, memory, roofline), the step profile, tables."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from toolkit.apps.bench.settings import FIRST_TOKEN, PROFILE_WINDOW, BenchSettings, ModelInfo, profile_plan

if TYPE_CHECKING:
    from toolkit.apps.bench.runner import EngineRun


def step_flops(config: dict, batch: int, past: float, src_len: int) -> float:
    """FLOPs of one decode step: projections, FFN, output layer, and attention over past + 1 and src_len keys."""
    d, f, layers, vocab = config["d_model"], config["d_ff"], config["n_decoder_layers"], config["vocab_size"]
    macs = layers * (4 * d * d + 2 * d * d + 2 * d * f) + vocab * d   # self q,k,v,o; cross q,o; FFN; output
    macs += layers * (2 * d * (past + 1) + 2 * d * src_len)           # scores and weighted sums
    return 2.0 * batch * macs


def step_cache_bytes(config: dict, batch: int, past: float, src_len: int) -> float:
    """Bytes of float32 self- and cross-attention keys and values one decode step reads."""
    return config["n_decoder_layers"] * 2 * batch * config["d_model"] * (past + src_len) * 4.0


def roofline(config: dict, weight_bytes: int, batch: int, past: float, src_len: int, step_s: float,
             machine: dict) -> dict:
    """The larger of the memory and compute bounds of a step, and the measured step's fraction of it."""
    mem_s = (weight_bytes + step_cache_bytes(config, batch, past, src_len)) / (machine["bandwidth_gbs"] * 1e9)
    cmp_s = step_flops(config, batch, past, src_len) / (machine["gemm_gflops"] * 1e9)
    bound, bound_s = ("memory", mem_s) if mem_s >= cmp_s else ("compute", cmp_s)
    return {"roofline_bound": bound, "bound_ms": round(bound_s * 1e3, 4),
            "roofline_fraction": round(bound_s / step_s, 4) if step_s > 0 else None}


def build_report(s: BenchSettings, machine: dict, infos: list[ModelInfo], runs: list[EngineRun],
                 profiled: list[EngineRun]) -> dict:
    """The JSON report: exact settings, machine probe, one row per engine and batch size, step profile."""
    rows = []
    for batch in s.batch_sizes:
        for run in runs:
            rows.append(engine_row(s, machine, run, batch))
    for batch in s.batch_sizes:
        first = next(r for r in rows if r["batch_size"] == batch)
        for row in rows:
            if row["batch_size"] == batch:
                row["ratio_to_first"] = round(row["tokens_per_s"] / first["tokens_per_s"], 3)
    versions = {}
    for run in runs:
        versions.update(run.loaded.get("versions", {}))
    report = {"settings": {**asdict(s), "batch_sizes": list(s.batch_sizes), "first_token_id": FIRST_TOKEN,
                           "search": "greedy, EOS suppressed (ignore_eos)", "order": "interleaved rounds"},
              "machine": machine, "versions": versions,
              "models": [{k: v for k, v in asdict(i).items() if k != "config"} | {"config": i.config} for i in infos],
              "rows": rows}
    if profiled:
        report["step_profile"] = [profile_row(run) for run in profiled]
    return report


def engine_row(s: BenchSettings, machine: dict, run: EngineRun, batch: int) -> dict:
    """Statistics of one engine at one batch size."""
    calls = run.calls[batch]
    lat = np.array([c["latency"] for c in calls])
    enc = np.array([c["encode"] for c in calls])
    step = np.array([c["step_sum"] / c["steps"] for c in calls])
    loop = (lat - enc) / s.new_tokens - step                    # search's own work per step (argmax, bookkeeping)
    tokens = [t for c in calls for t in c["tokens"]]
    p50 = float(np.median(lat))
    past = (s.new_tokens - 1) / 2                               # average past length over the call
    info = run.info
    row = {"model": info.path, "label": Path(info.path).name, "kind": info.kind, "engine": run.name,
           "provider": run.loaded.get("provider"), "precision": info.precision, "fused": info.fused,
           "kv_cache": kv_cache(run), "batch_size": batch, "src_len": s.src_len, "new_tokens": s.new_tokens,
           "tokens_generated": min(tokens), "tokens_generated_max": max(tokens),
           "tokens_per_s": round(batch * s.new_tokens / p50, 2),
           "latency_ms_p50": round(p50 * 1e3, 3), "latency_ms_p90": round(float(np.percentile(lat, 90)) * 1e3, 3),
           "encoder_ms": round(float(np.median(enc)) * 1e3, 3), "step_ms": round(float(np.median(step)) * 1e3, 4),
           "search_ms_per_step": round(float(np.median(loop)) * 1e3, 4),
           "peak_rss_mb": round(run.peaks[batch] / 2**20, 1),
           "rss_growth_mb": round((run.peaks[batch] - run.loaded["rss_before_load"]) / 2**20, 1),
           "model_mb": round(info.model_bytes / 2**20, 2), "weight_mb_per_step": round(run.weight_bytes / 2**20, 2),
           "weight_source": info.weight_source or run.loaded.get("weight_source", ""),
           "torch_loaded": run.loaded.get("torch_loaded"), "rounds": len(calls)}
    row.update(roofline(info.config, run.weight_bytes, batch, past, s.src_len, float(np.median(step)), machine))
    return row


def kv_cache(run: EngineRun) -> str:
    """How the engine keeps its self-attention cache: static (in place), dynamic (grown each step), none."""
    return run.info.kv_cache if run.use_cache else "none"


def profile_row(run: EngineRun) -> dict:
    """Median engine step time at each profiled past length (batch 1), and the longest over the shortest."""
    new_tokens, pasts = profile_plan(run.info.config)
    at = {}
    for past in pasts:
        lo, hi = max(1, past - PROFILE_WINDOW), min(new_tokens - 1, past + PROFILE_WINDOW)
        at[str(past)] = round(float(np.median([t for c in run.profile for t in c["steps"][lo:hi + 1]])) * 1e3, 4)
    first, last = at[str(pasts[0])], at[str(pasts[-1])]
    return {"model": run.info.path, "label": Path(run.info.path).name, "engine": run.name,
            "precision": run.info.precision, "fused": run.info.fused, "kv_cache": kv_cache(run), "batch_size": 1,
            "new_tokens": new_tokens, "step_ms_at_past": at, "window": PROFILE_WINDOW,
            "ratio": round(last / first, 3), "target_ratio": 1.15, "rounds": len(run.profile)}


TABLE_COLUMNS = ("model", "engine", "prec", "fused", "cache", "batch", "tok/s", "p50 ms", "p90 ms", "enc ms", "step ms",
                 "roofline", "peak MB", "size MB", "ratio")


def table_rows(report: dict) -> list[tuple[str, ...]]:
    """The report's rows as strings, in TABLE_COLUMNS order."""
    out = []
    for r in report["rows"]:
        frac = r["roofline_fraction"]
        roof = f"{frac * 100:.0f}% {r['roofline_bound'][:3]}" if frac is not None else "-"
        out.append((r["label"], r["engine"], r["precision"], "yes" if r["fused"] else "no", r.get("kv_cache", "-"),
                    str(r["batch_size"]),
                    f"{r['tokens_per_s']:.1f}", f"{r['latency_ms_p50']:.1f}", f"{r['latency_ms_p90']:.1f}",
                    f"{r['encoder_ms']:.2f}", f"{r['step_ms']:.2f}", roof, f"{r['peak_rss_mb']:.0f}",
                    f"{r['model_mb']:.1f}", f"{r['ratio_to_first']:.2f}x"))
    return out


PROFILE_COLUMNS = ("model", "engine", "prec", "fused", "cache", "step ms by past length", "ratio", "target")


def profile_table_rows(report: dict) -> list[tuple[str, ...]]:
    out = []
    for p in report.get("step_profile", []):
        at = ", ".join(f"{k}: {v:.2f}" for k, v in p["step_ms_at_past"].items())
        out.append((p["label"], p["engine"], p["precision"], "yes" if p["fused"] else "no", p.get("kv_cache", "-"), at,
                    f"{p['ratio']:.2f}x", f"<= {p['target_ratio']:.2f}x"))
    return out


def machine_line(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    return (f"machine: {m['cpu_count']} CPUs, read bandwidth {m['bandwidth_gbs']:.1f} GB/s, float32 GEMM "
            f"{m['gemm_gflops']:.1f} GFLOP/s ({m['probe_threads']} threads); {s['threads']} threads, "
            f"src_len {s['src_len']}, new_tokens {s['new_tokens']}, {s['repeat']} rounds after {s['warmup']} warm-up")


def print_tables(report: dict) -> None:
    """The benchmark table (and the step profile), with rich when installed."""
    tables = [(TABLE_COLUMNS, table_rows(report), "onnxformer bench")]
    if report.get("step_profile"):
        tables.append((PROFILE_COLUMNS, profile_table_rows(report), "decode step time vs past length (batch 1)"))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for columns, rows, title in tables:
            widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
            print(title)
            for line in (columns, *rows):
                print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        print(machine_line(report))
        return
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)
    for columns, rows, title in tables:
        table = Table(title=title, title_justify="left")
        for i, name in enumerate(columns):
            table.add_column(name, justify="left" if i < 2 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print(machine_line(report) + "; roofline: share of the memory (mem) or compute (com) bound",
                  highlight=False)
