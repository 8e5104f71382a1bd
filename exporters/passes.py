"""Graph passes on onnx_ir.passes: each pass is an `ir.passes.InPlacePass` (it mutates and returns its model)
or an `ir.passes.FunctionalPass` (it returns a new one), and `ir.passes.PassManager` chains them, repeating
the chain until no pass changes the model.

What onnx_ir's PassResult does not carry is the report optimize writes: which passes changed the model and
how often each rewrite rule fired. Our passes (`Reporting`) keep that on themselves over every round the
manager runs them, and `run_passes` gathers it:

    passes = [RewritePass("fuse_attention", attention_rules("ort")), CleanupPass()]
    run = run_passes(passes, model)      # run.model, run.modified, run.counts {"attention_self": 6, ...}, run.applied
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import onnx_ir as ir
from onnx_ir.passes.common import (CommonSubexpressionEliminationPass, RemoveUnusedNodesPass,
                                   TopologicalSortPass)
from onnxscript.rewriter import pattern


class Reporting:
    """Mixin for our passes: a name (listed in the manifest's `passes`), how often each of its rules fired, and
    whether it ever changed a model. Put it before the onnx_ir base class: class P(Reporting, ir.passes.InPlacePass)."""

    name = "pass"

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.changed = False

    def __call__(self, model_or_result):
        result = super().__call__(model_or_result)
        self.changed |= bool(result.modified)
        return result


class RewritePass(Reporting, ir.passes.InPlacePass):
    """Applies rewrite rules one at a time (in the given order), counting each rule's rewrites by its name."""

    def __init__(self, name: str, rules: Sequence[pattern.RewriteRule]):
        super().__init__()
        self.name, self.rules = name, list(rules)
        self.counts.update({rule.name: 0 for rule in self.rules})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        fired = 0
        for rule in self.rules:
            n = pattern.RewriteRuleSet([rule]).apply_to_model(model)
            self.counts[rule.name] += n
            fired += n
        return ir.passes.PassResult(model, fired > 0)


class CleanupPass(Reporting, ir.passes.InPlacePass):
    """Common-subexpression elimination (this is what leaves one attention bias per graph), dead nodes, order."""

    name = "cleanup"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = bool(CommonSubexpressionEliminationPass()(model).modified)
        modified |= bool(RemoveUnusedNodesPass()(model).modified)
        TopologicalSortPass()(model)    # reorders only; not a change worth another round
        return ir.passes.PassResult(model, modified)


class OpsetPass(Reporting, ir.passes.InPlacePass):
    """Raise the default-domain opset (e.g. to 23 for the ONNX Attention op); never lowers it."""

    def __init__(self, version: int):
        super().__init__()
        self.version, self.name = version, f"opset_{version}"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        current = model.opset_imports.get("", model.graph.opset_imports.get("", 1))
        if current >= self.version:
            return ir.passes.PassResult(model, False)
        from onnxscript import version_converter
        version_converter.convert_version(model, self.version)
        return ir.passes.PassResult(model, True)


class ConvertPass(Reporting, ir.passes.FunctionalPass):
    """A conversion that makes a new model from its input (the precision passes work on protobufs and files)."""

    def __init__(self, name: str, fn: Callable[[ir.Model], ir.Model]):
        super().__init__()
        self.name, self.fn = name, fn

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(self.fn(model), True)


class ConvertInPlacePass(Reporting, ir.passes.InPlacePass):
    """A conversion that rewrites its input model (int8: exporters/int8_weights, a weight at a time)."""

    def __init__(self, name: str, fn: Callable[[ir.Model], ir.Model]):
        super().__init__()
        self.name, self.fn = name, fn

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = self.fn(model)
        assert result is model, "an in-place conversion returns its input model"
        return ir.passes.PassResult(model, True)


@dataclass
class PassRun:
    """What a run of passes did: the model, whether it changed, rewrites by rule, the passes that changed it."""

    model: ir.Model
    modified: bool
    counts: dict[str, int] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)


def run_passes(passes: Sequence[Reporting], model: ir.Model, steps: int = 4) -> PassRun:
    """Run `passes` under onnx_ir's PassManager, repeated until nothing changes (at most `steps` rounds)."""
    for p in passes:                                  # a fresh report, should a pass object be run again
        p.counts, p.changed = Counter({name: 0 for name in p.counts}), False
    result = ir.passes.PassManager(list(passes), steps=steps, early_stop=True)(model)
    counts: Counter = Counter()
    for p in passes:
        counts.update(p.counts)
    return PassRun(result.model, bool(result.modified), dict(counts), [p.name for p in passes if p.changed])


def explain_misses(model: ir.Model, rules: Sequence[pattern.RewriteRule]) -> dict[str, str]:
    """For each rule that did not fire, why its best partial match failed (onnxscript's MatchingTracer).

    The model is not changed: with a tracer, the rewriter only records matches.
    """
    tracer = pattern.MatchingTracer()
    for rule in rules:
        pattern.RewriteRuleSet([rule]).apply_to_model(model, tracer=tracer)
    reasons = {}
    for rule, matches in tracer.best_matches_map.items():
        if matches and matches[0].status != pattern.MatchStatus.SUCCESS:
            best = matches[0]
            reason = best.match_result.reason or "the pattern did not match"
            reasons[rule.name] = f"{best.status.name.lower()}: {reason} (best partial match: " \
                                 f"{len(best.match_result.nodes)} nodes, at {best.root_node.op_type} " \
                                 f"{best.root_node.name})"
    return reasons


__all__ = ["Reporting", "RewritePass", "CleanupPass", "OpsetPass", "ConvertPass", "ConvertInPlacePass", "PassRun", "run_passes",
           "explain_misses"]
