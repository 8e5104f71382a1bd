"""Per-graph parity: each ONNX graph's outputs against a reference, judged by the tolerance table. The one comparator.

    graph_parity(model, bundle)                 PyTorch is the reference: the export gate, `onnxformer parity`
    bundle_parity(source, candidate, config)    another bundle's graphs on ONNX Runtime are: optimize, ORT format

Both sides run the same script (compare): the encoder once on a padded batch with varied source lengths, then
the decoder's first step with an empty past (past_len 0, new_len >= 1) and `steps` cached one-token steps, each
side fed with its OWN encoder outputs and presents, so errors that accumulate through the cache show up. The
tokens fed are the same for both: seeded random ones against PyTorch (greedy decoding of a trained model
repeats EOS once done, and its logits stop varying), the reference's greedy choice against another bundle (its
agreement is reported as teacher_forced_tokens_equal). A static-cache decoder (its layout given by the caller: the
manifest's decoder_layout) is run by runtime.feed in the dynamic contract, so both sides are compared in it.

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
import torch

from runtime.errors import BundleError, InputError
from runtime.feed import Feed
from runtime.generate import pad_batch
from runtime.manifest import decoder_layout, read_manifest, verify_hashes
from runtime.session import SessionConfig, choose_provider, make_session, return_freed_memory
from runtime.spec import CROSS, DYNAMIC, KV, PRESENT, SELF, cache_name, empty_past, graph_specs, source_pad_id
from toolkit.reference.config import ModelConfig
from toolkit.reference.model import Transformer
from toolkit.parity import ParityError
from toolkit.parity.report import NOT_JUDGED, Report
from toolkit.parity.tolerances import MIN_REFERENCE_STD, Tolerance, tolerance

GRAPH_OPTIMIZATION = SessionConfig().graph_optimization   # ONNX Runtime sessions as the runtime makes them


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
    expected: float = 0.0           # the reference's value there
    got: float = 0.0                # the candidate's value there
    scale: float = 0.0              # largest reference magnitude seen
    limit: float | None = None      # max abs error allowed (None = report only)
    ok: bool = True
    sides: tuple = ("onnxruntime", "pytorch")   # (candidate, reference), for messages

    def fold(self, ref: np.ndarray, got: np.ndarray, tol: Tolerance | None, step: int | None) -> None:
        """Fold one comparison into the running worst of this output."""
        if ref.shape != got.shape:
            raise ParityError(f"{self.graph} output {self.output} step {step}: {self.sides[0]} shape {got.shape}, "
                              f"{self.sides[1]} shape {ref.shape}")
        self.steps += 1
        if ref.size:
            diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
            diff = np.where(np.isnan(diff), np.inf, diff)   # NaN never passes
            flat = int(np.argmax(diff))
            worst = float(diff.flat[flat])
            self.scale = max(self.scale, float(np.abs(ref).max()))
            self.max_rel = max(self.max_rel, worst / max(self.scale, 1e-12))
            if worst >= self.max_abs and (worst > self.max_abs or self.steps == 1):
                index = np.unravel_index(flat, diff.shape)
                self.max_abs, self.step, self.index = worst, step, tuple(int(i) for i in index)
                self.expected, self.got = float(ref[index]), float(got[index])
        self.limit = None if tol is None else tol.limit(self.output, self.scale)
        self.ok = self.limit is None or self.max_abs <= self.limit

    def where(self) -> str:
        step = "" if self.step is None else f" step {self.step}"
        allowed = "" if self.limit is None else f", allowed {self.limit:.3g}"
        return (f"{self.graph} output {self.output}{step} at index {list(self.index)}: {self.sides[0]} "
                f"{self.got:.6g} vs {self.sides[1]} {self.expected:.6g} (abs error {self.max_abs:.3g}{allowed})")

    def to_dict(self) -> dict:
        return {"graph": self.graph, "output": self.output, "steps": self.steps, "max_abs": self.max_abs,
                "max_rel": self.max_rel, "step": self.step, "index": list(self.index),
                "expected": self.expected, "got": self.got, "scale": self.scale, "limit": self.limit, "ok": self.ok}


@dataclass
class ParityReport(Report):
    """Per-output errors of both graphs on one provider and precision, and whether they are within tolerance."""

    provider: str
    precision: str
    tolerance: Tolerance | None     # None: numbers reported, not judged (as a tolerance whose atol is None)
    batch: int
    src_lens: list[int]
    steps: int
    reference: str = "pytorch"      # "pytorch" | "source bundle" | ...
    checks: list[OutputCheck] = field(default_factory=list)
    reference_std: dict[str, float] = field(default_factory=dict)
    teacher_forced_tokens_equal: float | None = None   # fed the reference's greedy tokens: how often both chose them

    @property
    def judged(self) -> bool:
        return self.tolerance is not None and self.tolerance.judged

    @property
    def vacuous(self) -> list[str]:
        return [name for name, std in self.reference_std.items() if not std > MIN_REFERENCE_STD]

    @property
    def failures(self) -> list[OutputCheck]:
        return [c for c in self.checks if not c.ok]

    @property
    def verdict(self) -> str:
        """ok | failed | inconclusive (reference outputs that do not vary) | not judged (report only)."""
        if self.vacuous or not self.checks:
            return "inconclusive"
        if not self.judged:
            return NOT_JUDGED
        return "failed" if self.failures else "ok"

    def summary(self) -> str:
        """One line: verdict, and the worst output (or why it failed)."""
        if self.vacuous:
            return (f"parity INCONCLUSIVE (not verified): reference outputs {', '.join(self.vacuous)} do not vary "
                    f"(std <= {MIN_REFERENCE_STD:g}), so a comparison would pass vacuously; check the model weights")
        worst = max(self.checks, key=lambda c: c.max_abs)
        against = "" if self.reference == "pytorch" else f" against the {self.reference}"
        if not self.judged:
            return (f"parity reported{against} on {self.provider} {self.precision} (report only, not judged): "
                    f"max abs error {worst.max_abs:.2e} ({worst.where()})")
        tol = f"logits tolerance {self.tolerance.atol:g}"
        if self.failures:
            first = max(self.failures, key=lambda c: c.max_abs)
            return (f"parity FAILED{against} on {self.provider} {self.precision} ({tol}): {len(self.failures)} "
                    f"output(s) out of tolerance; worst: {first.where()}")
        return (f"parity ok{against} on {self.provider} {self.precision} ({tol}): max abs error "
                f"{worst.max_abs:.2e} ({worst.where()})")

    def table(self) -> str:
        """The per-output table; cache outputs are grouped over layers (worst layer shown)."""
        return record_table(self.to_dict())

    def __str__(self) -> str:
        return "\n".join([super().__str__()] + [f"  out of tolerance: {c.where()}" for c in self.failures[:10]])

    def fields(self) -> dict:
        per_graph = {}
        for graph in ("encoder", "decoder"):
            checks = [c for c in self.checks if c.graph == graph]
            if checks:
                worst = max(checks, key=lambda c: c.max_abs)
                per_graph[graph] = {"max_abs": worst.max_abs, "max_rel": max(c.max_rel for c in checks),
                                    "worst_output": worst.output, "ok": all(c.ok for c in checks)}
        tol = self.tolerance
        record = {"verified": self.ok, "judged": self.judged, "provider": self.provider,
                  "precision": self.precision,
                  "reference": self.reference, "graph_optimization": GRAPH_OPTIMIZATION,
                  "tolerance": None if tol is None else tol.atol, "token_match": None if tol is None else tol.token_match,
                  "batch": self.batch, "src_lens": list(self.src_lens), "steps": self.steps,
                  "max_abs": max((c.max_abs for c in self.checks), default=None),
                  **per_graph, "reference_std": dict(self.reference_std),
                  "outputs": [c.to_dict() for c in self.checks]}
        if self.teacher_forced_tokens_equal is not None:
            record["teacher_forced_tokens_equal"] = self.teacher_forced_tokens_equal
        return record


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


class TorchSide:
    """The reference model's encode and cached decode_step, outputs named as the graph specs name them."""

    label = "pytorch"

    def __init__(self, model: Transformer):
        self.model, self.device = model, next(model.parameters()).device

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        self.mask = torch.from_numpy(mask).to(self.device)
        memory, self.cross = self.model.encode(torch.from_numpy(ids).to(self.device), self.mask)
        self.past = self.model.empty_cache(len(ids), self.device)
        return {"encoder_hidden_states": _numpy(memory), **_named(self.cross, CROSS)}

    def step(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        logits, self.past = self.model.decode_step(torch.from_numpy(tokens).to(self.device), self.mask, self.past,
                                                   self.cross)
        return {"logits": _numpy(logits), **_named(self.past, SELF)}

    def close(self) -> None:
        """Its state goes; the model is the caller's."""
        self.mask = self.cross = self.past = None


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.float().cpu().numpy()


def _named(layers, attn: str) -> dict[str, np.ndarray]:
    return {cache_name(PRESENT, i, attn, kv): _numpy(t) for i, layer in enumerate(layers) for kv, t in zip(KV, layer)}


class OrtSide:
    """A bundle's encoder and decoder graphs on ONNX Runtime, the decoder fed back its own presents (runtime.feed,
    by the decoder's layout: a static graph is run in the dynamic contract). Its sessions are made when needed, the
    encoder's at its (single) encode, then the decoder's in place of it, and dropped by close(): compare() holds one
    graph's weights at a time."""

    def __init__(self, paths: dict[str, Path], config: dict, provider: str, label: str = "onnxruntime",
                 layout: str = DYNAMIC):
        self.label, self.paths, self.config, self.layout = label, paths, config, layout
        self.provider = choose_provider(provider)
        self.feed = None
        self.encoder_names = graph_specs(config)["encoder"].output_names

    def open(self) -> Feed:
        """The feed with its encoder session (the decoder's is made by encode, once the encoder is done)."""
        if self.feed is None:
            self.feed = Feed(make_session(self.paths["encoder"], self.provider), None, self.config, self.layout,
                             self.provider)
        return self.feed

    def close(self) -> None:
        self.feed = self.mask = self.cross = self.past = None
        return_freed_memory()

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        self.open()
        out = dict(zip(self.encoder_names, self.feed.encode(ids, mask, self.encoder_names)))
        # one session at a time: compare() encodes once, then steps; the encoder's weights (the embedding
        # included) go before the decoder's are loaded
        self.feed.encoder = None
        return_freed_memory()                 # glibc keeps a dropped session's heap unless asked (malloc_trim)
        self.feed.decoder = make_session(self.paths["decoder"], self.provider)
        self.mask, self.cross = mask, [out[name] for name in self.feed.cross_names]
        self.past = [empty_past(len(ids), self.feed.n_heads, self.feed.head_dim)] * len(self.feed.past_names)
        return out

    def step(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        logits, self.past = self.feed.decode(tokens, self.mask, self.past, self.cross)   # fed its own cache
        return dict(zip(self.feed.decoder_out_names, [logits, *self.past]))


def compare(reference, candidate, config: ModelConfig, tol: Tolerance | None, provider: str, precision: str,
            steps: int, seed: int, src_lens: list[int], first_len: int = 2, greedy: bool = False,
            reference_name: str = "pytorch") -> ParityReport:
    """Run both sides (TorchSide / OrtSide) on the same inputs and fold every output into a report.

    greedy: later tokens are the reference's greedy choice (else seeded random ids, the same for both).
    The sides run one after the other, not in step: the reference's outputs (a few MB: a small batch and a few
    steps) are kept and the reference closed before the candidate starts, so two large models are never in
    memory at once."""
    c, batch = config, len(src_lens)
    specs = graph_specs(c.to_dict())
    report = ParityReport(provider, precision, tol, batch, list(src_lens), steps, reference_name)
    ids, mask = sample_inputs(c, src_lens, seed)
    rng = np.random.default_rng(seed + 1)
    low = min(3, c.vocab_size - 1)
    first = np.concatenate([np.full((batch, 1), c.bos_id, dtype=np.int64),
                            rng.integers(low, c.vocab_size, (batch, first_len - 1))], axis=1)

    # the reference: encoder once on the padded batch, a first step (empty past, first_len tokens), then one-token
    # cached steps; every output copied (a static-cache side writes its presents in place)
    kept, fed = [], [first]
    try:
        kept.append(_copied(reference.encode(ids, mask)))
        for step in range(steps + 1):
            outs = _copied(reference.step(fed[-1]))
            kept.append(outs)
            if greedy:
                fed.append(outs["logits"][:, -1].argmax(-1)[:, None].astype(np.int64))   # its choice, for both
            else:
                fed.append(rng.integers(low, c.vocab_size, (batch, 1)))                 # the same for both
    finally:
        reference.close()
    report.reference_std["encoder_hidden_states"] = float(kept[0]["encoder_hidden_states"].std())
    # per-vocabulary-entry std over all rows and positions, averaged: zero if logits ignore the input
    report.reference_std["logits"] = float(np.concatenate([o["logits"].reshape(-1, c.vocab_size)
                                                           for o in kept[1:]]).std(axis=0).mean())

    checks: dict[tuple[str, str], OutputCheck] = {}

    def check(graph: str, ref: dict, got: dict, step: int | None) -> None:
        for name in specs[graph].output_names:
            if (graph, name) not in checks:
                checks[graph, name] = OutputCheck(graph, name, sides=(candidate.label, reference.label))
                report.checks.append(checks[graph, name])
            checks[graph, name].fold(ref[name], got[name], tol, step)

    # the candidate, fed the same tokens, each output folded as it comes
    agree = 0
    try:
        check("encoder", kept[0], candidate.encode(ids, mask), None)
        for step in range(steps + 1):
            got = candidate.step(fed[step])
            check("decoder", kept[step + 1], got, step)
            if greedy:
                agree += int((got["logits"][:, -1].argmax(-1) == fed[step + 1][:, 0]).sum())
    finally:
        candidate.close()
    if greedy:
        report.teacher_forced_tokens_equal = agree / (batch * (steps + 1))
    return report


def _copied(outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.array(value, copy=True) for name, value in outs.items()}


def graph_paths(model: Transformer, bundle: str | Path | dict, precision: str | None = None,
                layout: str = DYNAMIC) -> tuple[dict, str, str]:
    """(encoder/decoder paths, precision, decoder layout) from a bundle directory (checking it holds this model) or a
    {name: path} dict (its decoder of the given layout)."""
    if isinstance(bundle, dict):
        return {name: Path(bundle[name]) for name in ("encoder", "decoder")}, precision or "fp32", layout
    manifest = read_manifest(bundle)
    verify_hashes(bundle, manifest)                    # parity of a changed file would prove nothing
    if precision is not None and precision != manifest["precision"]:
        raise BundleError(f"bundle {bundle} is {manifest['precision']}, not {precision}; "
                          f"judge it with precision {manifest['precision']}")
    mine, theirs = model.config.to_dict(), manifest["model"]
    differ = sorted(k for k in mine if k != "dropout" and mine[k] != theirs.get(k))
    if differ:
        raise BundleError(f"bundle {bundle} was exported from another model (config differs in {', '.join(differ)}); "
                          f"compare it with the checkpoint it was exported from")
    return ({name: Path(bundle) / manifest["graphs"][name]["file"] for name in ("encoder", "decoder")},
            manifest["precision"], decoder_layout(manifest))


def sample_inputs(config, src_lens, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded random source ids [B, S] and mask [B, S] (1 = token), ids drawn from the non-special range. An
    audio encoder's (config.features): standard normal features [B, n_mels, 2 * source_positions] (one row per
    length of src_lens) and the decoder's source mask, ones [B, source_positions]."""
    rng = np.random.default_rng(seed)
    if config.features:
        shape = (len(src_lens), config.n_mels, 2 * config.source_positions)
        return rng.standard_normal(shape, dtype=np.float32), np.ones((len(src_lens), config.source_positions),
                                                                     dtype=np.int64)
    vocab = config.source_vocab_size
    low = min(3, vocab - 1)
    return pad_batch([rng.integers(low, vocab, n).tolist() for n in src_lens], source_pad_id(config.to_dict()))


def default_src_lens(batch: int, longest: int = 11) -> list[int]:
    """Varied lengths, longest first: batch 3 -> [11, 7, 4]; batch 1 -> [11]."""
    return [max(1, round(longest * (batch - i) / batch)) for i in range(batch)]


@torch.no_grad()
def graph_parity(model: Transformer, bundle: str | Path | dict, provider: str = "cpu", precision: str | None = None,
                 steps: int = 16, seed: int = 0, batch: int = 3, src_lens=None, first_len: int = 2,
                 layout: str = DYNAMIC) -> ParityReport:
    """Compare encoder and decoder graphs with PyTorch: encoder once, then a first and `steps` cached decoder steps.

    bundle: a bundle directory or {"encoder": path, "decoder": path}; precision defaults to the bundle's
    (fp32 for bare paths) and picks the tolerance with the provider; layout: bare paths' decoder layout (a bundle
    declares its own).
    """
    c = model.config
    paths, precision, layout = graph_paths(model, bundle, precision, layout)
    tol = tolerance(precision, provider)
    src_lens = list(src_lens) if src_lens is not None else source_lengths(c.to_dict(), batch)
    if c.features:                                     # an audio encoder's length is fixed
        src_lens = [c.source_positions] * batch
    if len(src_lens) != batch or min(src_lens) < 1:
        raise InputError(f"src_lens {src_lens} must give one length >= 1 per batch row ({batch})")
    if first_len < 1 or steps < 0:
        raise InputError(f"first_len ({first_len}) must be >= 1 and steps ({steps}) >= 0")
    if (max(src_lens) > c.max_len and not c.features) or first_len + steps > c.max_len:
        raise InputError(f"source length {max(src_lens)} or target length {first_len + steps} exceeds the model's "
                         f"max_len {c.max_len}; use fewer steps or shorter sources")
    candidate = OrtSide(paths, c.to_dict(), provider, layout=layout)
    was_training = model.training
    model.eval()
    try:
        return compare(TorchSide(model), candidate, c, tol, provider, precision, steps, seed, src_lens, first_len)
    finally:
        model.train(was_training)


def bundle_parity(reference: dict[str, Path], candidate: dict[str, Path], config: dict, provider: str = "cpu",
                  tol: Tolerance | None = None, precision: str = "fp32", steps: int = 8, batch: int = 3,
                  seed: int = 0, labels: tuple[str, str] = ("optimized", "source bundle"),
                  layouts: tuple[str, str] = (DYNAMIC, DYNAMIC)) -> ParityReport:
    """Candidate graphs against reference graphs, both on ONNX Runtime, fed the reference's greedy tokens;
    tol None = report only. labels and layouts (their decoders'): (candidate, reference)."""
    return compare(OrtSide(reference, config, provider, labels[1], layouts[1]),
                   OrtSide(candidate, config, provider, labels[0], layouts[0]), ModelConfig.from_dict(config), tol,
                   provider, precision, steps, seed, source_lengths(config, batch), greedy=True,
                   reference_name=labels[1])


def source_lengths(config: dict, batch: int) -> list[int]:
    """The source lengths a parity batch has: varied (default_src_lens), or an audio encoder's fixed length."""
    if config.get("encoder_input") == "features":
        return [config["source_positions"]] * batch
    return default_src_lens(batch)


__all__ = ["OutputCheck", "ParityReport", "TorchSide", "OrtSide", "compare", "graph_parity", "bundle_parity",
           "record_table", "sample_inputs", "default_src_lens", "graph_paths"]
