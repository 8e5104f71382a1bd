"""Per-graph parity: each ONNX graph's outputs against PyTorch, judged by the tolerance table.

The encoder runs once on a padded batch with varied source lengths. The decoder then runs a first
step with an empty past (past_len 0, new_len >= 1) and `steps` cached one-token steps, ONNX Runtime
fed with its OWN encoder outputs and presents, PyTorch with its own, so errors that accumulate
through the cache show up. Both sides receive the same seeded random tokens, so every step sees new
input (greedy decoding of a trained model repeats EOS once done, and its logits stop varying).

Padding: the model masks keys only, so hidden states and cross K/V at padded source positions are
well defined (every padded query still attends to the real keys) and deterministic. They are
compared like any other element; nothing is excluded.

Errors: max abs error per output (worst over all steps), and max rel = max abs error divided by the
largest reference magnitude of that output (a scale-relative error; element-wise ratios blow up
near zero). Max abs is judged against Tolerance.limit (tolerances.py: logits by the table's number,
hidden states and caches by it times their magnitude above 1). The reference must vary (std above a
floor) or the report fails: a constant model would otherwise pass vacuously.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from runtime.errors import BundleError, InputError, ParityError
from runtime.generate import pad_batch
from runtime.manifest import read_manifest
from runtime.session import choose_provider, make_session
from runtime.spec import cache_name, graph_specs, source_pad_id
from runtime.static_cache import dynamic_view
from toolkit.model import Transformer
from toolkit.parity.tolerances import MIN_REFERENCE_STD, Tolerance, tolerance



@dataclass
class OutputCheck:
    """The worst disagreement of one graph output over all steps."""

    graph: str
    output: str
    steps: int = 0                  # how many times it was compared
    max_abs: float = 0.0
    max_rel: float = 0.0            # max_abs / max |reference|
    step: int | None = None         # decoder step of the worst element (0 = first step, past_len 0)
    index: tuple = ()               # index of the worst element
    expected: float = 0.0           # PyTorch's value there
    got: float = 0.0                # ONNX Runtime's value there
    scale: float = 0.0              # largest reference magnitude seen
    limit: float | None = None      # max abs error allowed (None = report only)
    ok: bool = True

    def where(self) -> str:
        step = "" if self.step is None else f" step {self.step}"
        allowed = "" if self.limit is None else f", allowed {self.limit:.3g}"
        return (f"{self.graph} output {self.output}{step} at index {list(self.index)}: "
                f"onnxruntime {self.got:.6g} vs pytorch {self.expected:.6g} (abs error {self.max_abs:.3g}{allowed})")

    def to_dict(self) -> dict:
        return {"graph": self.graph, "output": self.output, "steps": self.steps, "max_abs": self.max_abs,
                "max_rel": self.max_rel, "step": self.step, "index": list(self.index),
                "expected": self.expected, "got": self.got, "scale": self.scale, "limit": self.limit, "ok": self.ok}


@dataclass
class ParityReport:
    """Per-output errors of both graphs on one provider and precision, and whether they are within tolerance."""

    provider: str
    precision: str
    tolerance: Tolerance
    batch: int
    src_lens: list[int]
    steps: int
    checks: list[OutputCheck] = field(default_factory=list)
    reference_std: dict[str, float] = field(default_factory=dict)

    @property
    def vacuous(self) -> list[str]:
        return [name for name, std in self.reference_std.items() if not std > MIN_REFERENCE_STD]

    @property
    def failures(self) -> list[OutputCheck]:
        return [c for c in self.checks if not c.ok]

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.failures and not self.vacuous

    def summary(self) -> str:
        """One line: verdict, and the worst output (or why it failed)."""
        if self.vacuous:
            return (f"parity NOT verified: reference outputs {', '.join(self.vacuous)} do not vary "
                    f"(std <= {MIN_REFERENCE_STD:g}), so a comparison would pass vacuously; check the model weights")
        worst = max(self.checks, key=lambda c: c.max_abs)
        tol = "report only" if self.tolerance.atol is None else f"logits tolerance {self.tolerance.atol:g}"
        if self.failures:
            first = max(self.failures, key=lambda c: c.max_abs)
            return (f"parity FAILED on {self.provider} {self.precision} ({tol}): {len(self.failures)} output(s) out of "
                    f"tolerance; worst: {first.where()}")
        return f"parity ok on {self.provider} {self.precision} ({tol}): max abs error {worst.max_abs:.2e} ({worst.where()})"

    def table(self) -> str:
        """The per-output table; cache outputs are grouped over layers (worst layer shown)."""
        return record_table(self.to_dict())

    def __str__(self) -> str:
        lines = [self.table(), self.summary()]
        lines += [f"  out of tolerance: {c.where()}" for c in self.failures[:10]]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        per_graph = {}
        for graph in ("encoder", "decoder"):
            checks = [c for c in self.checks if c.graph == graph]
            if checks:
                worst = max(checks, key=lambda c: c.max_abs)
                per_graph[graph] = {"max_abs": worst.max_abs, "max_rel": max(c.max_rel for c in checks),
                                    "worst_output": worst.output, "ok": all(c.ok for c in checks)}
        return {"verified": self.ok, "provider": self.provider, "precision": self.precision,
                "tolerance": self.tolerance.atol, "token_match": self.tolerance.token_match,
                "batch": self.batch, "src_lens": list(self.src_lens), "steps": self.steps,
                "max_abs": max((c.max_abs for c in self.checks), default=None), "summary": self.summary(),
                **per_graph, "reference_std": dict(self.reference_std),
                "outputs": [c.to_dict() for c in self.checks]}


def record_table(record: dict) -> str:
    """A parity record (ParityReport.to_dict(), as kept in manifest.json) as a table, cache layers grouped."""
    groups: dict[tuple[str, str], dict] = {}
    for o in record.get("outputs", []):
        key = (o["graph"], re.sub(r"\.\d+\.", ".*.", o["output"]))
        current = groups.get(key)
        if current is None or (not o["ok"], o["max_abs"]) > (not current["ok"], current["max_abs"]):
            groups[key] = o
    lines = [f"{'graph':<8} {'output':<28} {'steps':>5} {'max abs':>9} {'max rel':>9} {'allowed':>9}  ok", "-" * 78]
    for (graph, name), o in groups.items():
        limit = "report" if o.get("limit") is None else f"{o['limit']:.2e}"
        lines.append(f"{graph:<8} {name:<28} {o['steps']:>5} {o['max_abs']:>9.2e} {o['max_rel']:>9.2e} {limit:>9}  "
                     f"{'yes' if o['ok'] else 'NO'}")
    stds = ", ".join(f"{k} {v:.3g}" for k, v in record.get("reference_std", {}).items())
    lines.append(f"batch {record.get('batch')}, source lengths {record.get('src_lens')}, decoder steps "
                 f"1 + {record.get('steps')}; reference std: {stds}")
    return "\n".join(lines)


def session(path: str | Path, provider: str = "cpu") -> ort.InferenceSession:
    """An ONNX Runtime session with default (full) graph optimizations, as the runtime makes it."""
    return make_session(path, choose_provider(provider))


def graph_paths(model: Transformer, bundle: str | Path | dict, precision: str | None = None) -> tuple[dict, str]:
    """(encoder/decoder paths, precision) from a bundle directory (checking it holds this model) or a {name: path} dict."""
    if isinstance(bundle, dict):
        return {name: Path(bundle[name]) for name in ("encoder", "decoder")}, precision or "fp32"
    manifest = read_manifest(bundle)
    if precision is not None and precision != manifest["precision"]:
        raise BundleError(f"bundle {bundle} is {manifest['precision']}, not {precision}; "
                          f"judge it with precision {manifest['precision']}")
    mine, theirs = model.config.to_dict(), manifest["model"]
    differ = sorted(k for k in mine if k != "dropout" and mine[k] != theirs.get(k))
    if differ:
        raise BundleError(f"bundle {bundle} was exported from another model (config differs in {', '.join(differ)}); "
                          f"compare it with the checkpoint it was exported from")
    return ({name: Path(bundle) / manifest["graphs"][name]["file"] for name in ("encoder", "decoder")},
            manifest["precision"])


def sample_inputs(config, src_lens, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded random source ids [B, S] and mask [B, S] (1 = token), ids drawn from the non-special range."""
    rng = np.random.default_rng(seed)
    vocab = config.source_vocab_size
    low = min(3, vocab - 1)
    return pad_batch([rng.integers(low, vocab, n).tolist() for n in src_lens], source_pad_id(config.to_dict()))


def default_src_lens(batch: int, longest: int = 11) -> list[int]:
    """Varied lengths, longest first: batch 3 -> [11, 7, 4]; batch 1 -> [11]."""
    return [max(1, round(longest * (batch - i) / batch)) for i in range(batch)]


def _compare(check: OutputCheck, ref: np.ndarray, got: np.ndarray, tol: Tolerance, step: int | None) -> None:
    """Fold one comparison into the running worst of an output."""
    if ref.shape != got.shape:
        raise ParityError(f"{check.graph} output {check.output} step {step}: onnxruntime shape {got.shape}, "
                             f"pytorch shape {ref.shape}")
    check.steps += 1
    if ref.size == 0:
        return
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    diff = np.where(np.isnan(diff), np.inf, diff)   # NaN never passes
    flat = int(np.argmax(diff))
    worst = float(diff.flat[flat])
    scale = float(np.abs(ref).max())
    check.scale = max(check.scale, scale)
    check.max_rel = max(check.max_rel, worst / max(scale, 1e-12))
    if worst >= check.max_abs and (worst > check.max_abs or check.steps == 1):
        index = np.unravel_index(flat, diff.shape)
        check.max_abs, check.step, check.index = worst, step, tuple(int(i) for i in index)
        check.expected, check.got = float(ref[index]), float(got[index])
    check.limit = tol.limit(check.output, check.scale)
    check.ok = check.limit is None or check.max_abs <= check.limit


@torch.no_grad()
def graph_parity(model: Transformer, bundle: str | Path | dict, provider: str = "cpu", precision: str | None = None,
                 steps: int = 16, seed: int = 0, batch: int = 3, src_lens=None, first_len: int = 2) -> ParityReport:
    """Compare encoder and decoder graphs with PyTorch: encoder once, then a first and `steps` cached decoder steps.

    bundle: a bundle directory or {"encoder": path, "decoder": path}; precision defaults to the bundle's
    (fp32 for bare paths) and picks the tolerance with the provider.
    """
    c = model.config
    paths, precision = graph_paths(model, bundle, precision)
    tol = tolerance(precision, provider)
    src_lens = list(src_lens) if src_lens is not None else default_src_lens(batch)
    if len(src_lens) != batch or min(src_lens) < 1:
        raise InputError(f"src_lens {src_lens} must give one length >= 1 per batch row ({batch})")
    if first_len < 1 or steps < 0:
        raise InputError(f"first_len ({first_len}) must be >= 1 and steps ({steps}) >= 0")
    if max(src_lens) > c.max_len or first_len + steps > c.max_len:
        raise InputError(f"source length {max(src_lens)} or target length {first_len + steps} exceeds the model's "
                         f"max_len {c.max_len}; use fewer steps or shorter sources")
    specs = graph_specs(c.to_dict())
    enc_sess, dec_sess = session(paths["encoder"], provider), dynamic_view(session(paths["decoder"], provider))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    report = ParityReport(provider, precision, tol, batch, src_lens, steps)
    checks: dict[tuple[str, str], OutputCheck] = {}

    def check(graph: str, name: str, ref: torch.Tensor, got: np.ndarray, step: int | None) -> None:
        key = (graph, name)
        if key not in checks:
            checks[key] = OutputCheck(graph, name)
            report.checks.append(checks[key])
        _compare(checks[key], ref.float().cpu().numpy(), got, tol, step)

    try:
        # encoder: once, on the padded batch
        ids, mask = sample_inputs(c, src_lens, seed)
        t_ids, t_mask = torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)
        memory, cross = model.encode(t_ids, t_mask)
        enc_names = specs["encoder"].output_names
        enc_out = dict(zip(enc_names, enc_sess.run(enc_names, {"input_ids": ids, "attention_mask": mask})))
        check("encoder", "encoder_hidden_states", memory, enc_out["encoder_hidden_states"], None)
        for i, layer in enumerate(cross):
            for kv, ref in zip(("key", "value"), layer):
                name = cache_name("present", i, "encoder", kv)
                check("encoder", name, ref, enc_out[name], None)
        report.reference_std["encoder_hidden_states"] = float(memory.float().std())

        # decoder: first step (empty past, first_len tokens), then one-token cached steps
        rng = np.random.default_rng(seed + 1)
        low = min(3, c.vocab_size - 1)
        tokens = np.concatenate([np.full((batch, 1), c.bos_id, dtype=np.int64),
                                 rng.integers(low, c.vocab_size, (batch, first_len - 1))], axis=1)
        t_past = model.empty_cache(batch, device)
        o_past = {}                                                     # onnxruntime's caches, by input name
        empty = np.zeros((batch, c.n_heads, 0, c.head_dim), dtype=np.float32)
        for i in range(c.n_decoder_layers):
            for kv in ("key", "value"):
                o_past[cache_name("past_key_values", i, "decoder", kv)] = empty
                o_past[cache_name("past_key_values", i, "encoder", kv)] = enc_out[cache_name("present", i, "encoder", kv)]
        dec_names = specs["decoder"].output_names
        ref_logits = []
        for step in range(steps + 1):
            logits, t_past = model.decode_step(torch.from_numpy(tokens).to(device), t_mask, t_past, cross)
            out = dict(zip(dec_names, dec_sess.run(dec_names, {"input_ids": tokens, "encoder_attention_mask": mask,
                                                               **o_past})))
            check("decoder", "logits", logits, out["logits"], step)
            for i, layer in enumerate(t_past):
                for kv, ref in zip(("key", "value"), layer):
                    name = cache_name("present", i, "decoder", kv)
                    check("decoder", name, ref, out[name], step)
                    o_past[cache_name("past_key_values", i, "decoder", kv)] = out[name]   # fed its own cache
            ref_logits.append(logits.float().cpu().numpy().reshape(-1, c.vocab_size))
            tokens = rng.integers(low, c.vocab_size, (batch, 1))            # the same next token for both
        # per-vocabulary-entry std over all rows and positions, averaged: zero if logits ignore the input
        report.reference_std["logits"] = float(np.concatenate(ref_logits).std(axis=0).mean())
    finally:
        model.train(was_training)
    return report
