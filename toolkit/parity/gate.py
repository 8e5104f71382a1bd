"""The gate a converted bundle passes before it is written (optimize, for every precision): one function, driven
by the tolerance table's row for the precision and provider, so a new precision (int4) is gated by adding a row.

    record = bundle_gate(source_paths, candidate_paths, manifest, source_dir, "cpu", "int8", samples=100)
    record["verdict"]      # "ok" | "failed" | "inconclusive"; record["verified"] = verdict == "ok"
    record["verdicts"]     # per check: {"graphs": ..., "tokens": ..., "accuracy": ...}

What the row asks is judged, against the source bundle's graphs on the same provider:
- atol (not None): every graph output over a first and 8 cached decoder steps (toolkit.parity.graphs);
- token_match: greedy tokens over `samples` inputs, chosen as `onnxformer parity` chooses them
  (toolkit.parity.inputs: texts or audio clips given, else the task's held-out inputs, else random ids); the reference
  outputs must vary (toolkit.parity.generation), else teacher-forced logits decide, judged by atol, and without
  an atol (int8) the tokens are no verdict: "inconclusive", which a gate refuses like "failed";
- accuracy_drop (not None): the task metric of the model's task (toolkit.reference.tasks.task_accuracy), the candidate at
  most that many points below the source, where the task has one.
"""

from __future__ import annotations

from pathlib import Path

from runtime.bundle import one_at_a_time
from runtime.manifest import GRAPHS, decoder_layout
from runtime.ort_engine import OrtEngine
from runtime.session import SessionConfig, choose_provider, make_session
from runtime.spec import feature_shape, graph_specs
from runtime.tokenizer import load_tokenizer
from toolkit.reference.config import ModelConfig
from toolkit.parity.generation import generation_parity
from toolkit.parity.graphs import bundle_parity
from toolkit.parity.inputs import DEFAULT_SAMPLES, ParityInputs, choose_inputs, not_representative
from toolkit.parity.report import combine, shout
from toolkit.parity.tolerances import tolerance
from toolkit.reference.tasks import task_accuracy

ACCURACY_SAMPLES = 1000             # held-out examples for the task metric: 1 point = 10 examples


def engine(paths: dict[str, Path], config: dict, provider: str, layout: str) -> OrtEngine:
    """A runtime engine over a pair of graph files whose decoder has `layout` (sessions made as the runtime makes
    them). On CPU its sessions hold one graph at a time (runtime.bundle.one_at_a_time, as `onnxformer generate`):
    the gate's searches encode a batch of at most 64 inputs, then decode it, so each graph's session is made once a
    batch, and a model's encoder weights are gone before its decoder's load (NLLB-3.3B shape: 5 GiB less at the
    gate's peak; benchmarks/RESULTS.md)."""
    options = SessionConfig()
    fixed = feature_shape(config) is not None                  # an audio encoder: one input shape (for_graph)
    makers = {g: (lambda g=g: make_session(paths[g], provider, options.for_graph(g, fixed))) for g in GRAPHS}
    if choose_provider(provider) == "cpu":
        sessions = one_at_a_time(makers, graph_specs(config, layout=layout))
        return OrtEngine(sessions["encoder"], sessions["decoder"], config, provider, io_binding=False, layout=layout)
    return OrtEngine(makers["encoder"](), makers["decoder"](), config, provider, layout=layout)


def bundle_gate(src_paths: dict[str, Path], paths: dict[str, Path], manifest: dict, bundle_dir: Path,
                provider: str, precision: str, samples: int = DEFAULT_SAMPLES,
                texts: list[str] | None = None, layout: str | None = None, inputs: ParityInputs | None = None) -> dict:
    """The parity record of candidate graphs against the source bundle's, with the gate's verdict. texts: source
    texts (through the bundle's tokenizer, at most `samples`) as the token check's inputs instead of the task's
    held-out inputs or random ids; layout: the candidate's decoder layout (default: the source's, `manifest`'s);
    inputs: the token check's inputs chosen already (an audio bundle's given clips: inputs.audio_inputs)."""
    config, source_layout = manifest["model"], decoder_layout(manifest)
    layout = layout or source_layout
    tol = tolerance(precision, provider)
    record = bundle_parity(src_paths, paths, config, provider, tol, precision,
                           layouts=(layout, source_layout)).to_dict()
    verdicts = {"graphs": record["verdict"]} if record["judged"] or record["verdict"] == "inconclusive" else {}
    tokenizer = load_tokenizer(bundle_dir / manifest["tokenizer"]) if manifest.get("tokenizer") else None
    inputs = inputs or choose_inputs(ModelConfig.from_dict(config), tokenizer, samples, texts)
    # the engines as makers: each made in its turn and dropped before the other (one model in memory at a time)
    reference = lambda: engine(src_paths, config, provider, source_layout)           # noqa: E731
    candidate = lambda: engine(paths, config, provider, layout)                      # noqa: E731
    gen = generation_parity(reference, candidate, inputs.seqs, tol, provider, precision, beams=(1,),
                            max_new_tokens=min(32, config["max_len"]), source=inputs.source,
                            representative=inputs.representative)
    check = gen.checks[0].to_dict()
    record["generation"] = {**{k: check[k] for k in ("tokens_equal", "sequences_equal", "samples", "token_match",
                                                      "distinct_outputs", "needed_distinct", "verdict", "basis",
                                                      "teacher_forced")},
                            "source": inputs.source, "representative": inputs.representative, "summary": gen.summary()}
    verdicts["tokens"] = check["verdict"]
    record["tokenizer"] = tokenizer is not None
    if tol.accuracy_drop is not None:
        found = task_accuracy(tokenizer, (reference, candidate), ACCURACY_SAMPLES)
        if found is not None:
            (before, after), what = found
            drop = (before - after) * 100
            verdicts["accuracy"] = "ok" if drop <= tol.accuracy_drop else "failed"
            record["accuracy"] = {"source": before, "candidate": after, "drop_points": drop,
                                  "allowed_drop_points": tol.accuracy_drop, "what": what,
                                  "verdict": verdicts["accuracy"]}
    record["verdicts"] = verdicts
    record["verdict"] = combine(verdicts.values())
    record["verified"] = record["ok"] = record["verdict"] == "ok"       # the gate's, not the graphs' alone
    record["summary"] = gate_summary(record)
    return record


def gate_summary(record: dict) -> str:
    """One line: the verdict, each check's, and the numbers behind them."""
    gen, parts = record["generation"], []
    for name, verdict in record["verdicts"].items():
        if name == "graphs":
            parts.append(f"graphs {verdict} (max abs error {record['max_abs']:.3g}, tolerance {record['tolerance']})")
        elif name == "tokens":
            why = (f"{gen['distinct_outputs']} distinct reference outputs of {gen['samples']}, a token verdict needs "
                   f"{gen['needed_distinct']:g}" + ("" if gen["teacher_forced"] is None else
                                                      f"; teacher-forced logits {gen['teacher_forced']['verdict']}")
                   if gen["basis"] != "tokens" else f"needed {gen['token_match']:.0%}")
            parts.append(f"greedy tokens {verdict}: {gen['tokens_equal']:.2%} equal ({why})")
        else:
            a = record["accuracy"]
            parts.append(f"{a['what']} {verdict}: {a['candidate']:.2%} vs {a['source']:.2%} "
                         f"({a['drop_points']:+.2f} points lost, at most {a['allowed_drop_points']:g} allowed)")
    line = (f"verdict {shout(record['verdict'])} against the source bundle on {record['provider']} "
            f"{record['precision']}: " + "; ".join(parts))
    return line if gen["representative"] else f"{line}; {not_representative(gen.get('source', ''))}"


__all__ = ["bundle_gate", "gate_summary", "engine", "ACCURACY_SAMPLES"]
