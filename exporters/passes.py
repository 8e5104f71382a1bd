"""Graph passes as objects, in the spirit of onnx_ir.passes: each declares whether it works in place and
reports whether it changed the model (and, for rewrites, how often each rule fired). A manager chains
passes and repeats the chain until nothing changes.

    manager = PassManager([RewritePass("fuse_attention", attention_rules("ort")), CleanupPass()])
    result = manager(model)           # result.model, result.modified, result.counts {"attention_self": 6, ...}
"""

from __future__ import annotations

import abc
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import onnx_ir as ir
from onnx_ir.passes.common import (CommonSubexpressionEliminationPass, RemoveUnusedNodesPass,
                                   TopologicalSortPass)
from onnxscript.rewriter import pattern


@dataclass
class PassResult:
    """What a pass (or a manager) returns: the model, whether it changed, and rewrite counts by rule name."""

    model: ir.Model
    modified: bool
    counts: dict[str, int] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)   # names of the passes that changed the model, in order
    iterations: int = 1


class Pass(abc.ABC):
    """A model transformation. in_place passes mutate and return the same model; others return a new one."""

    name: str = "pass"
    in_place: bool = True

    def __call__(self, model: ir.Model) -> PassResult:
        result = self.call(model)
        if self.in_place and result.model is not model:
            raise RuntimeError(f"pass {self.name} declares in_place but returned a new model")
        if not self.in_place and result.model is model:
            raise RuntimeError(f"pass {self.name} declares it returns a new model but returned its input")
        if result.modified and self.name not in result.applied:
            result.applied = [self.name, *result.applied]
        return result

    @abc.abstractmethod
    def call(self, model: ir.Model) -> PassResult:
        """Do the work."""


class RewritePass(Pass):
    """Applies rewrite rules one at a time (in the given order), counting each rule's rewrites by its name."""

    def __init__(self, name: str, rules: Sequence[pattern.RewriteRule]):
        self.name, self.rules = name, list(rules)

    def call(self, model: ir.Model) -> PassResult:
        counts: Counter = Counter({rule.name: 0 for rule in self.rules})
        for rule in self.rules:
            counts[rule.name] += pattern.RewriteRuleSet([rule]).apply_to_model(model)
        return PassResult(model, any(counts.values()), dict(counts))


class CleanupPass(Pass):
    """Common-subexpression elimination (this is what leaves one attention bias per graph), dead nodes, order."""

    name = "cleanup"

    def call(self, model: ir.Model) -> PassResult:
        modified = bool(CommonSubexpressionEliminationPass()(model).modified)
        modified |= bool(RemoveUnusedNodesPass()(model).modified)
        TopologicalSortPass()(model)    # reorders only; not a change worth another round
        return PassResult(model, modified)


class OpsetPass(Pass):
    """Raise the default-domain opset (e.g. to 23 for the ONNX Attention op); never lowers it."""

    def __init__(self, version: int):
        self.version, self.name = version, f"opset_{version}"

    def call(self, model: ir.Model) -> PassResult:
        current = model.opset_imports.get("", model.graph.opset_imports.get("", 1))
        if current >= self.version:
            return PassResult(model, False)
        from onnxscript import version_converter
        version_converter.convert_version(model, self.version)
        return PassResult(model, True)


class FunctionalPass(Pass):
    """A pass that makes a new model from its input (precision conversions work on protobufs and files)."""

    in_place = False

    def __init__(self, name: str, fn: Callable[[ir.Model], ir.Model]):
        self.name, self.fn = name, fn

    def call(self, model: ir.Model) -> PassResult:
        return PassResult(self.fn(model), True)


class PassManager:
    """Runs its passes in order, repeating the chain until no pass changes the model (at most `steps` rounds)."""

    def __init__(self, passes: Sequence[Pass], steps: int = 4):
        self.passes, self.steps = list(passes), steps

    def __call__(self, model: ir.Model) -> PassResult:
        counts: Counter = Counter()
        applied: list[str] = []
        rounds = 0
        for rounds in range(1, self.steps + 1):
            changed = False
            for p in self.passes:
                result = p(model)
                model = result.model
                for name, n in result.counts.items():
                    counts[name] += n
                changed |= result.modified
                applied += [name for name in result.applied if name not in applied]
            if not changed:
                break
        return PassResult(model, bool(applied), dict(counts), applied, rounds)


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
