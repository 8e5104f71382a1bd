"""Optimize a bundle: fuse (attention, LayerNorm, GELU), convert precision, prove parity, write a new bundle.

    out, report = optimize_bundle("out/bundle", "out/fused", target="cpu", precision="int8")
    print(report.format())

Three steps: transform (fusions as rewrite passes, exporters/fusions, under onnx_ir's PassManager until nothing
changes; the static KV cache; int8 pre-passes), convert (precision, judged by parity against the source bundle),
write (manifest, tokenizer, ORT-format graphs). Options are checked first (exporters/optimize_options). The new
bundle is staged and renamed into place (exporters/bundle), so a failure (bad input, parity out of tolerance)
leaves nothing behind.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
import onnx_ir as ir

from exporters.bundle import build_manifest, copy_tokenizer, graph_entry, op_counts, stage_bundle, write_manifest
from exporters.debug_records import drop_export_debug
from exporters.fusions import attention_rules, fusion_passes, quantization_prepasses
from exporters.int8_recipes import (AUTO, Recipe, account, figures, pick, prepare, recipes_for,
                                    resolve_weight_bits)
from exporters.logs import quiet_loggers
from exporters.optimize_gate import optimize_parity
from exporters.optimize_options import (ATTENTION_OPS, CPU_TARGETS, STATIC_ATTENTION_OPS, TARGETS,
                                        OptimizeError, check_options, given_gate_inputs, resolve_kv_cache,
                                        source_manifest)
from exporters.ort_format import add_ort_format, check_convertible
from exporters.passes import explain_misses, run_passes
from exporters.precision import fp16_keep_float, precision_pass
from exporters.row_activations import RowActivationsPass
from exporters.tied_table import TiedTablePass
from exporters.shared_weights import graph_data, inline_external, save_graph, share_weights, shared_bytes
from exporters.static_cache import StaticCachePass, StaticCacheError, per_row_for
from exporters.validate import check_finite, ir_weights
from runtime.manifest import GRAPHS, PRECISIONS, decoder_layout
from runtime.session import int8_saturates, return_freed_memory
from runtime.spec import DYNAMIC
from toolkit.parity import ParityError
from toolkit.parity.graphs import record_table
from toolkit.parity.inputs import DEFAULT_SAMPLES, ParityInputs

@dataclass
class OptimizeReport:
    """What optimize did: rewrites per rule and graph, node/op counts and sizes before and after, parity."""

    source: str
    out: str
    target: str
    precision: str
    attention: str | None
    kv_cache: str = "dynamic"
    decoder_layout: str = DYNAMIC                                         # what the manifest declares
    fusions: dict[str, dict[str, int]] = field(default_factory=dict)      # graph -> rule -> count
    passes: list[str] = field(default_factory=list)
    before: dict[str, dict] = field(default_factory=dict)                # graph -> {nodes, op_counts, bytes}
    after: dict[str, dict] = field(default_factory=dict)
    parity: dict = field(default_factory=dict)
    recipe: dict | None = None                                            # int8: the recipe kept, those tried
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def totals(self) -> dict[str, int]:
        rules: dict[str, int] = {}
        for counts in self.fusions.values():
            for rule, n in counts.items():
                rules[rule] = rules.get(rule, 0) + n
        return rules

    def to_dict(self) -> dict:
        return {"source": self.source, "out": self.out, "target": self.target, "precision": self.precision,
                "attention": self.attention, "kv_cache": self.kv_cache,
                "decoder_layout": self.decoder_layout, "fusions": self.fusions, "fusion_totals": self.totals,
                "passes": self.passes, "before": self.before, "after": self.after, "parity": self.parity,
                "recipe": self.recipe, "notes": self.notes, "seconds": self.seconds}

    def format(self) -> str:
        """The command's report: rewrites, node and op counts, file sizes, parity."""
        lines = [f"optimized {self.source} -> {self.out}  (target {self.target}, precision {self.precision}, "
                 f"attention {self.attention or 'not fused'}, KV cache {self.kv_cache} (decoder layout "
                 f"{self.decoder_layout}), {self.seconds:.1f} s)"]
        totals = self.totals
        if totals:
            fired = {rule: n for rule, n in totals.items() if n}
            if fired:
                lines.append(f"\n{'rewrite':<30} {'encoder':>8} {'decoder':>8} {'total':>6}")
                for rule, n in fired.items():
                    enc, dec = (self.fusions.get(g, {}).get(rule, 0) for g in GRAPHS)
                    lines.append(f"{rule:<30} {enc:>8} {dec:>8} {n:>6}")
            else:
                lines.append("\nno fusion fired: nothing left to fuse"
                             + (" (a no-op)" if self.precision == "fp32" else ""))
            idle = [rule for rule, n in totals.items() if not n]
            if idle and fired:
                lines.append("did not fire: " + ", ".join(idle))
        lines.append("passes: " + (", ".join(self.passes) if self.passes else "none"))
        for g in GRAPHS:
            b, a = self.before[g], self.after[g]
            lines.append(f"\n{g}: {b['nodes']} -> {a['nodes']} nodes, {len(b['op_counts'])} -> {len(a['op_counts'])} "
                         f"op types, {_mb(b['bytes'])} -> {_mb(a['bytes'])}")
            ops = sorted(set(b["op_counts"]) | set(a["op_counts"]))
            changed = [(op, b["op_counts"].get(op, 0), a["op_counts"].get(op, 0)) for op in ops]
            changed = [c for c in changed if c[1] != c[2]]
            for op, x, y in sorted(changed, key=lambda c: -abs(c[2] - c[1])):
                lines.append(f"  {op:<36} {x:>5} -> {y:<5}")
        p = self.parity
        if p.get("outputs"):
            lines.append("\n" + record_table(p))
        verdict = "verified" if p.get("verified") else "NOT verified"
        lines.append(("" if p.get("outputs") else "\n") + f"parity: {verdict} on {p.get('provider')} "
                     f"{p.get('precision')}: {p.get('summary', p.get('reason', ''))}")
        if p.get("cpu_check"):
            check = p["cpu_check"]
            tokens = check.get("teacher_forced_tokens_equal")
            lines.append(f"  looked at on the CPU instead (not a verdict): {check['summary']}"
                         + ("" if tokens is None else f", teacher-forced greedy tokens equal {tokens:.2%}"))
        gen = p.get("generation")
        if gen:
            lines.append(f"  greedy tokens equal to the source bundle: {gen['tokens_equal']:.2%} over {gen['samples']} "
                         f"inputs with {gen['distinct_outputs']} distinct reference outputs (needed "
                         f"{gen['token_match']:.0%} and {gen['needed_distinct']:g} distinct; {gen['source']}): "
                         f"{gen['verdict']}" + ("" if gen["basis"] == "tokens" else " (teacher-forced logits)"))
        if p.get("accuracy"):
            a = p["accuracy"]
            lines.append(f"  {a['what']}: {a['candidate']:.2%} vs {a['source']:.2%} for the source bundle: {a['verdict']}")
        if p.get("allowed_unverified"):
            lines.append(f"  written UNVERIFIED (--allow-unverified): the gate's verdict was {p.get('verdict')}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


@dataclass
class _Job:
    """One optimize call: the source, the options (resolved), the report being filled, and the staging folder."""

    bundle_dir: Path
    out_dir: Path
    manifest: dict
    target: str
    precision: str
    fuse: bool
    attention: str
    kv_cache: str
    recipes: list[Recipe]
    samples: int
    ort_format: bool
    report: OptimizeReport
    progress: Callable[[str], None]
    allow_unverified: bool = False
    texts: list[str] | None = None
    inputs: ParityInputs | None = None        # the gate's, given as audio clips (optimize_options.given_gate_inputs)

    def source(self, graph: str) -> Path:
        return self.bundle_dir / self.manifest["graphs"][graph]["file"]


def optimize_bundle(bundle_dir: str | Path, out_dir: str | Path, target: str = "cpu", precision: str = "fp32",
                    fuse: bool = True, attention: str = "ort", force: bool = False, per_channel: bool | None = None,
                    samples: int = DEFAULT_SAMPLES, progress: Callable[[str], None] | None = None,
                    ort_format: bool = False, kv_cache: str = "auto",
                    allow_unverified: bool = False, activation_scales: str | None = None,
                    texts: list[str] | None = None, recipe: str = AUTO,
                    weight_bits: str | int = "auto", gate_audio: list | None = None) -> tuple[Path, OptimizeReport]:
    """Fuse and/or convert a bundle into out_dir; returns (out_dir, report). Bad input: OptimizeError/BundleError.

    Three steps, inside a staging folder renamed into place only when all succeed: transform (fusions, static
    KV cache, int8 pre-passes), convert (precision, judged by parity against the source bundle), write (manifest,
    tokenizer, ORT-format graphs).

    kv_cache: "static" rewrites the decoder for a preallocated cache updated in place (exporters/static_cache);
    "auto" chooses it for CPU targets with fused attention (the static attention ops have no float16 CPU kernel,
    and CUDA keeps the dynamic cache: no GPU run has compared the two yet). On CPU the cache is per row
    (GroupQueryAttention: each row at its own length, as in-flight batching needs); --target cuda --kv-cache static
    gets the shared-slot layout (DecoderMaskedMultiHeadAttention).

    recipe (int8): "auto" tries the int8 recipes cheapest first (exporters/int8_recipes: weight scales per tensor
    or per channel, activation ranges per tensor or per token row, the output projection kept float32) and keeps
    the first the gate passes; a name uses that recipe only. per_channel and activation_scales (None: not given)
    narrow "auto" to the recipes that agree; with a named recipe they must agree with it (else OptimizeError).
    weight_bits (int8): 8, 7, or "auto": 7 where this CPU's int8 kernel saturates 8-bit products (x86 without VNNI),
    8 elsewhere (exporters/int8_recipes.resolve_weight_bits).

    The gate (toolkit.parity.gate, the tolerance table's row for the precision): a verdict other than "ok"
    (failed, or inconclusive because the outputs do not vary) raises ParityError and writes nothing, unless
    allow_unverified, which writes the bundle with the verdict and "verified": false in its manifest. Its token
    check runs on `samples` inputs chosen as `onnxformer parity` chooses them (toolkit.parity.inputs): the texts
    given (through the bundle's tokenizer), or an audio bundle's clips given (gate_audio: files or directories),
    else the held-out inputs of the model's task, else random ids (which a text model, e.g. an imported Marian, never
    sees: give it texts; nor does a Whisper bundle hear random log-mel features: give it clips).
    """
    start = time.perf_counter()
    bundle_dir, out_dir = Path(bundle_dir), Path(out_dir)
    check_options(target, precision, attention, fuse, activation_scales, recipe, weight_bits)
    if ort_format:                                        # .ort graphs are for the CPU provider's minimal builds
        check_convertible({"precision": precision, "target": target})
    manifest = source_manifest(bundle_dir, out_dir, precision, fuse, attention)
    kv_cache = resolve_kv_cache(kv_cache, target, fuse, attention, manifest, precision)
    report = OptimizeReport(str(bundle_dir), str(out_dir), target, precision, attention if fuse else None, kv_cache)
    inputs = given_gate_inputs(manifest, bundle_dir, texts, gate_audio, samples)
    recipes = _int8_recipes(target, recipe, per_channel, activation_scales, weight_bits, report) \
        if precision == "int8" else []
    job = _Job(bundle_dir, out_dir, manifest, target, precision, fuse, attention, kv_cache, recipes, samples,
               ort_format, report, progress or (lambda msg: None), allow_unverified, texts, inputs)
    job.progress(f"optimizing {bundle_dir} -> {out_dir}")
    if manifest.get("ort_graphs"):
        report.notes.append("the source's ORT-format (.ort) graphs are not carried over; convert the new graphs again")
    with stage_bundle(out_dir, force) as tmp:
        models = transform(job)
        kept = convert(job, models, tmp)
        write(job, tmp, kept)
    report.seconds = time.perf_counter() - start
    return out_dir, report


def _int8_recipes(target: str, recipe: str, per_channel: bool | None, activation_scales: str | None,
                  weight_bits: str | int, report: OptimizeReport) -> list[Recipe]:
    """The int8 recipes to try, their weights in the bits --weight-bits resolves to on this target."""
    bits = resolve_weight_bits(weight_bits, int8_saturates if target in CPU_TARGETS else lambda: False)
    if str(weight_bits) == "auto" and bits == 7:
        report.notes.append("int8 weights in 7 bits: this CPU's int8 kernel saturates products of 8-bit weights "
                            "(x86 without VNNI), and 7-bit ones are exact on every CPU")
    return recipes_for(recipe, per_channel, activation_scales, bits)


def transform(job: _Job) -> dict[str, ir.Model]:
    """Load each graph and run its rewrite passes (fusions until nothing changes, the static cache, int8 pre-passes);
    the report gets the decoder layout the new manifest declares."""
    report, models = job.report, {}
    static = StaticCachePass(per_row_for(job.target)) if job.kv_cache == "static" else None
    for g in GRAPHS:
        entry = job.manifest["graphs"][g]
        report.before[g] = _counts(entry, job.source(g))
        t0 = time.perf_counter()
        models[g], report.fusions[g], applied = _fuse_graph(
            job.source(g), job.fuse, job.attention, job.precision, entry.get("opset") or job.manifest.get("opset"),
            static if g == "decoder" else None, report.notes)
        report.passes = sorted(set(report.passes) | set(applied), key=_pass_rank)
        _check_fused(g, models[g], job.manifest["model"], job.fuse, job.attention, report)
        job.progress(f"{g}: {sum(report.fusions[g].values())} rewrites in {time.perf_counter() - t0:.1f} s")
    report.decoder_layout = static.layout if static is not None and static.changed else decoder_layout(job.manifest)
    return models


def convert(job: _Job, models: dict[str, ir.Model], tmp: Path) -> Recipe | None:
    """Convert to the precision and save into tmp, judged by parity; int8 tries its recipes in order
    (exporters/int8_recipes) and keeps the first that passes. Returns the int8 recipe kept. Out of tolerance:
    ParityError, listing each recipe's figure."""
    report, files = job.report, {g: job.manifest["graphs"][g]["file"] for g in GRAPHS}
    candidates = job.recipes if job.precision == "int8" else [None]
    tried = []
    for recipe in candidates:
        folder = tmp if len(candidates) == 1 else tmp / f".recipe_{recipe.name}"
        folder.mkdir(exist_ok=True)
        last = recipe is candidates[-1]             # the last recipe rewrites the fused graphs themselves
        applied, counts = _convert_graphs(job, models, recipe, folder, files, clone=not last)
        parity = optimize_parity(job, {g: folder / files[g] for g in GRAPHS})
        tried.append((recipe, folder, parity, applied, counts))
        if parity.get("verified") or parity.get("verdict") in ("inconclusive", "not run"):
            break                                   # outputs that do not vary: no recipe can be judged
    kept = pick([(t[0], t[2]) for t in tried]) if job.precision == "int8" else 0
    recipe, folder, report.parity, applied, counts = tried[kept]
    report.passes = sorted(set(report.passes) | set(applied), key=_pass_rank)
    for g in GRAPHS:
        for rule, n in counts.get(g, {}).items():
            report.fusions[g][rule] = report.fusions[g].get(rule, 0) + n
    if recipe is not None:
        sizes = [sum((t[1] / files[g]).stat().st_size for g in GRAPHS) for t in tried]
        report.recipe, notes = account([(t[0], t[2], size) for t, size in zip(tried, sizes)], kept)
        report.notes += notes
    if folder != tmp:
        for g in GRAPHS:
            for path in (folder / files[g], graph_data(folder / files[g])):
                path.replace(tmp / path.name)
        for other in tried:
            shutil.rmtree(other[1], ignore_errors=True)
    if not report.parity["verified"] and report.parity.get("verdict") != "not run":
        if not job.allow_unverified:
            tries = f" (int8 recipes tried: {figures([(t[0], t[2]) for t in tried])})" if len(tried) > 1 else ""
            raise ParityError(f"the {job.precision} graphs did not pass the gate: {report.parity['summary']}{tries}; "
                              f"nothing was written to {job.out_dir} (pass --allow-unverified to write it marked "
                              f"unverified)", report.parity)
        report.parity["allowed_unverified"] = True
    return recipe


def _convert_graphs(job: _Job, models: dict[str, ir.Model], recipe: Recipe | None, folder: Path, files: dict,
                    clone: bool) -> tuple[list[str], dict[str, dict[str, int]]]:
    """Convert each graph (an int8 recipe: its pre-passes first, on a copy when other recipes follow) into folder;
    returns (the passes applied, the pre-passes' rewrites by graph). Without clone the graphs are converted in
    place and released once saved (int8 frees each float weight the fusions made as it quantizes it)."""
    applied, counts = [], {}
    for g in GRAPHS:
        keep = fp16_keep_float(job.manifest["model"], models[g]) if job.precision == "fp16" else ()
        model, step = models[g], precision_pass(job.precision, keep_float=keep)
        if recipe is not None:
            model, step, counts[g], prepasses = prepare(model.clone() if clone else model, recipe, g)
            applied += prepasses
        with quiet_loggers("root", "onnxruntime", "onnxruntime.quantization"):
            converted = step(model).model if step is not None else model
        # int8/int4 not for wasm: onnxruntime-web ran the sliced QGemms 2.4x slower than a DynamicQuantizeMatMul
        if job.target in CPU_TARGETS and (job.precision == "fp32" or job.target == "cpu"):
            table = TiedTablePass(floats=job.precision == "fp32")   # the tied table read by rows, held once
            table(converted)
            if table.changed and table.name not in applied:
                applied.append(table.name)
        drop_export_debug(converted)
        check_finite(ir_weights(converted), f"the {job.precision} {files[g]}")
        save_graph(converted, folder / files[g])
        if step is not None and step.name not in applied:
            applied.append(step.name)
        if not clone:                                     # the gate that follows loads the saved graphs
            for value in converted.graph.initializers.values():
                value.const_value = None                  # the arrays go now (the graph itself is cyclic garbage)
            models[g] = model = converted = None
            return_freed_memory()
    if recipe is not None and recipe.activation_scales == "per-row":
        applied.append(RowActivationsPass.name)
    return applied, counts


def write(job: _Job, tmp: Path, recipe: Recipe | None) -> None:
    """The new bundle's manifest (graph entries, fusions, passes, parity, where it came from), its tokenizer and,
    when asked, its ORT-format graphs."""
    report, manifest = job.report, job.manifest
    paths = {g: tmp / manifest["graphs"][g]["file"] for g in GRAPHS}
    shared = share_weights(paths)        # weights.data: one copy of what both graphs hold (same bytes: parity holds)
    if shared is not None:
        report.notes.append(f"weights in {shared['file']} ({shared['bytes'] / 1e6:.2f} MB), "
                            f"{shared_bytes(shared) / 1e6:.2f} MB of them stored once for both graphs "
                            f"({', '.join(t['name'] for t in shared['tensors'])})")
    entries = {g: graph_entry(paths[g]) for g in GRAPHS}
    for g in GRAPHS:
        report.after[g] = _counts(entries[g], paths[g])
    fusions = dict(manifest.get("fusions") or {})
    for rule, n in report.totals.items():
        if n:
            fusions[rule] = fusions.get(rule, 0) + n
    source = {"bundle": str(job.bundle_dir.absolute()), "precision": manifest["precision"],
              "target": manifest.get("target", "any"), "passes": manifest.get("passes") or [],
              "graphs": {g: {"sha256": manifest["graphs"][g]["sha256"], **report.before[g]} for g in GRAPHS},
              "options": {"target": job.target, "precision": job.precision, "fuse": job.fuse,
                          "attention": job.attention, "kv_cache": job.kv_cache,
                          **(recipe.options() if recipe is not None else
                             {"recipe": None, "per_channel": None, "activation_scales": None})},
              "fusions_by_graph": report.fusions}
    new = build_manifest(manifest["model"], entries, precision=job.precision, target=job.target,
                         fusions=fusions, passes=(manifest.get("passes") or []) + report.passes,
                         parity=report.parity, tokenizer=_tokenizer(job.bundle_dir, manifest, tmp), source=source,
                         decoder_layout=report.decoder_layout)
    if shared is not None:
        new["shared_weights"] = shared
    if job.ort_format:
        add_ort_format(tmp, new, progress=job.progress)   # adds encoder.ort, decoder.ort, required_operators.config
    write_manifest(tmp, new)


def _counts(entry: dict, path: Path) -> dict:
    """{nodes, op_counts, bytes} of a graph, from its manifest entry (or the file when the entry lacks them)."""
    if entry.get("nodes") is None or "op_counts" not in entry:
        counts = op_counts(onnx.load(str(path), load_external_data=False).graph)
        return {"nodes": sum(counts.values()), "op_counts": dict(counts), "bytes": path.stat().st_size}
    return {"nodes": entry["nodes"], "op_counts": entry["op_counts"], "bytes": entry.get("bytes", path.stat().st_size)}


def _fuse_graph(path: Path, fuse: bool, attention: str, precision: str, opset: int | None,
                static: StaticCachePass | None = None,
                notes: list[str] | None = None) -> tuple[ir.Model, dict[str, int], list[str]]:
    """Load one graph and run the fusion passes until nothing changes (then `static`, the static cache pass, and the
    int8 passes)."""
    model = ir.load(path)
    inline_external(model)                      # a source with weights.data: its graphs are written anew
    counts, applied = Counter(), []
    if fuse:
        run = run_passes(fusion_passes(attention, opset or 20), model)
        model, applied = run.model, run.applied
        counts.update(run.counts)
    if static is not None:                            # called directly: the manager would wrap its error
        try:
            static(model)
        except StaticCacheError as exc:
            raise OptimizeError(str(exc)) from None
        counts.update(static.counts)
        applied += [static.name] if static.changed else []
        if static.note and notes is not None:
            notes.append(static.note)
    if precision == "int4":                         # int8: each recipe runs its own (exporters/int8_recipes)
        run = run_passes(quantization_prepasses(), model, steps=2)
        model = run.model
        counts.update(run.counts)
        applied += [p for p in run.applied if p not in applied]
    return model, dict(counts), applied


PIPELINE = ("opset_23", "fuse_attention", "fuse_layer_norm", "fuse_rms_norm", "fuse_erf_gelu", "fuse_skip_layer_norm", "fuse_bias_gelu",
            "fuse_silu", "pack_matmuls", "cleanup", "static_kv_cache", "fold_transposed_weights", "int8_embedding",
            "float16", "quantize_int8", "quantize_int8_blocks", "per_row_activations", "quantize_int4",
            "tied_table_rows")


def _pass_rank(name: str) -> tuple[int, str]:
    """Passes listed in pipeline order (they come from two graphs, each applying a subset)."""
    return (PIPELINE.index(name) if name in PIPELINE else len(PIPELINE), name)


def _check_fused(graph: str, model: ir.Model, config: dict, fuse: bool, attention: str,
                 report: OptimizeReport) -> None:
    """Note when a graph does not hold one fused attention per attention block, with the tracer's reasons."""
    if not fuse:
        return
    expected = config["n_encoder_layers"] if graph == "encoder" else 2 * config["n_decoder_layers"]
    op_types = {ATTENTION_OPS[attention].rsplit(".", 1)[-1], *STATIC_ATTENTION_OPS}
    found = sum(1 for n in model.graph if n.op_type in op_types)
    left = sum(1 for n in model.graph if n.op_type == "Softmax")
    if found != expected or left:
        reasons = explain_misses(model, attention_rules(attention)) if left else {}
        why = "; ".join(f"{k}: {v}" for k, v in reasons.items()) or "no candidate matched"
        report.notes.append(f"{graph}: {found} of {expected} attention blocks fused, {left} Softmax left ({why})")


def _tokenizer(bundle_dir: Path, manifest: dict, tmp: Path) -> str | None:
    name = manifest.get("tokenizer")
    return copy_tokenizer(bundle_dir / name, tmp) if name else None


__all__ = ["optimize_bundle", "OptimizeReport", "OptimizeError", "check_options", "resolve_kv_cache", "PRECISIONS",
           "TARGETS"]
