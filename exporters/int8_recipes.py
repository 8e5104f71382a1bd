"""int8 recipes: the ways optimize can quantize a bundle to int8, cheapest first, and how one is chosen.

    optimize --precision int8                 tries RECIPES in order through the gate, keeps the first that passes
    optimize --precision int8 --recipe NAME   that recipe only (still gated); EXPLICIT ones only this way

A recipe fixes three choices: weight scales (per tensor, or per output channel; packed weights always get per
channel, exporters/precision), activation ranges (per MatMul input tensor, or per token row:
exporters/row_activations) and whether the output projection (the MatMul that makes the logits, tied to the 8-bit
embedding or not) stays float32. The "blocks" recipe instead gives the decoder's MatMuls 8-bit weights in blocks
of 128 along K (com.microsoft.MatMulNBits, exporters/precision.to_blocks: a scale per block, activations quantized
per row inside the kernel) and the encoder the default recipe's; auto never tries it (EXPLICIT): faster at batch 1
on one shape and slower on another, slower at batch 8, no more accurate than default where that was measured
(benchmarks/RESULTS.md). The "fp32-cross-kv" recipe (by name only too) is the default with the encoder's
cross-attention K/V projections (the MatMuls behind every present.N.encoder.key/value output, run once a request)
kept float32: on the speech-trained tiny Whisper they made most of int8's logit error on speech (RESULTS.md).
--per-channel/--per-tensor and --activation-scales narrow the list to the recipes
that agree with them; with --recipe they must agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import onnx_ir as ir

from exporters.fusions import quantization_prepasses
from exporters.optimize_options import OptimizeError
from exporters.passes import ConvertPass, run_passes
from exporters.precision import INT8_BLOCK, precision_pass, to_blocks

LOGITS = "logits"
PROJECTION = "output_projection"
CROSS_KV = "cross_kv_projection"
AUTO = "auto"


@dataclass(frozen=True)
class Recipe:
    name: str
    per_channel: bool                 # weight scales per output channel (else one per tensor)
    activation_scales: str            # "per-tensor" | "per-row"
    float_projection: bool            # the output projection stays float32 (the 8-bit lookup table stays)
    step_cost: str                    # its decode-step cost against "default", where it was measured
    blocks: bool = False              # the decoder's MatMuls: 8-bit weight blocks (MatMulNBits), not per tensor
    weight_bits: int = 8              # 7: |w| <= 64, exact on CPUs whose int8 kernel saturates (resolve_weight_bits)
    float_cross_kv: bool = False      # the encoder's cross-attention K/V MatMuls stay float32

    def options(self) -> dict:
        return {"recipe": self.name, "per_channel": self.per_channel, "activation_scales": self.activation_scales,
                "float_projection": self.float_projection, "blocks": self.blocks, "weight_bits": self.weight_bits,
                **({"float_cross_kv": True} if self.float_cross_kv else {})}   # other recipes' manifests as before


# Cheapest first, by decode-step cost (benchmarks/RESULTS.md, "int8 activation scales"): per-channel weight scales
# cost a few percent of CPU time per token; per-row activations add about ten nodes per quantized MatMul, which costs
# more; a float32 projection multiplies the bytes of the largest matrix (vocab x d_model) read every step by four
# and grows the bundle by three times that matrix, so it comes last.
RECIPES = (
    Recipe("default", False, "per-tensor", False, "the baseline"),
    Recipe("per-channel", True, "per-tensor", False,
           "+5% CPU time per token at batch 1 (benchmarks/RESULTS.md, \"int8 activation scales\")"),
    Recipe("per-row", False, "per-row", False,
           "+14% CPU time per token at batch 1 (benchmarks/RESULTS.md, \"int8 activation scales\")"),
    Recipe("per-channel-per-row", True, "per-row", False,
           "+19% CPU time per token at batch 1 (benchmarks/RESULTS.md, \"int8 activation scales\")"),
    Recipe("fp32-projection", False, "per-tensor", True,
           "not measured: the logits MatMul reads float32 weights (4x the bytes of the 8-bit one) every step"),
)
EXPLICIT = (             # chosen by name only: --recipe blocks
    Recipe("blocks", False, "per-tensor", False,
           "batch 1 1.12x faster, batch 8 1.15x slower than default at the BART-base shape, batch 1 1.16x "
           "slower at the NLLB-600M shape (benchmarks/RESULTS.md, "
           "\"The NLLB-600M and BART-base shapes: the race\")", blocks=True),
    Recipe("fp32-cross-kv", False, "per-tensor", False,
           "decode steps as default's; the encoder's cross K/V MatMuls, run once a request, in float32",
           float_cross_kv=True),
)
NAMES = tuple(r.name for r in RECIPES)
ALL_NAMES = NAMES + tuple(r.name for r in EXPLICIT)


def recipes_for(recipe: str, per_channel: bool | None, activation_scales: str | None,
                weight_bits: int = 8) -> list[Recipe]:
    """The recipes to try, in order: one for a name, the ones agreeing with the flags for "auto", each with
    `weight_bits` (resolve_weight_bits). A flag that contradicts --recipe, or flags no recipe has: OptimizeError
    naming both."""
    return [replace(r, weight_bits=weight_bits) for r in _recipes(recipe, per_channel, activation_scales)]


WEIGHT_BITS = ("auto", "8", "7")


def resolve_weight_bits(weight_bits: str | int, saturates) -> int:
    """--weight-bits: 8 or 7 as given; "auto": 7 where this CPU's int8 kernel saturates 8-bit products (x86 without
    VNNI: `saturates()`, runtime.session.int8_saturates), else 8.

    Why 7: such kernels add pairs of uint8 x int8 products in int16, and full-range weights overflow it (255 x 127 x
    2 > 32,767): results off by up to a quarter of their magnitude, up to 22% of the greedy tokens lost
    (benchmarks/RESULTS.md, "int8 on CPUs without VNNI"). Weights within +-64 never overflow, so a 7-bit bundle
    gives the same results on every CPU; elsewhere 8 bits are one bit more precise."""
    if str(weight_bits) not in WEIGHT_BITS:
        raise OptimizeError(f"--weight-bits {weight_bits} is not one of {', '.join(WEIGHT_BITS)}")
    if str(weight_bits) == "auto":
        return 7 if saturates() else 8
    return int(weight_bits)


def _recipes(recipe: str, per_channel: bool | None, activation_scales: str | None) -> list[Recipe]:
    flags = {"per_channel": (per_channel, "--per-channel" if per_channel else "--per-tensor"),
             "activation_scales": (activation_scales, f"--activation-scales {activation_scales}")}
    given = {k: v for k, v in flags.items() if v[0] is not None}
    if recipe == AUTO:
        chosen = [r for r in RECIPES if all(getattr(r, k) == v for k, (v, _) in given.items())]
        if not chosen:
            raise OptimizeError(f"no int8 recipe has {' with '.join(f for _, f in given.values())}; choose one of: "
                                f"{', '.join(NAMES)}")
        return chosen
    if recipe not in ALL_NAMES:
        raise OptimizeError(f"unknown int8 recipe {recipe!r}; choose auto or one of: {', '.join(ALL_NAMES)}")
    chosen = (RECIPES + EXPLICIT)[ALL_NAMES.index(recipe)]
    for key, (value, flag) in given.items():
        if getattr(chosen, key) != value:
            raise OptimizeError(f"--recipe {recipe} conflicts with {flag} (the recipe uses "
                                f"{key.replace('_', ' ')} {getattr(chosen, key)}); pass one of them")
    return [chosen]


def _matmuls_behind(model: ir.Model, wanted, through: tuple[str, ...], data: tuple[str, ...] = ()) -> list[ir.Node]:
    """The MatMuls that make the graph outputs whose names `wanted` accepts, walked back through `through` ops
    with one moving (non-constant) input each, and `data` ops by their first input (a Reshape's shape may be
    computed); each once, in graph output order."""
    found = []
    for out in model.graph.outputs:
        node = out.producer() if wanted(out.name) else None
        while node is not None and node.op_type in through + data:
            moving = [v for v in node.inputs if v is not None and v.producer() is not None
                      and ir.convenience.get_const_tensor(v) is None]
            moving = node.inputs[:1] if node.op_type in data else moving
            node = moving[0].producer() if len(moving) == 1 and moving[0] is not None else None
        if node is not None and node.op_type == "MatMul" and node not in found:
            found.append(node)
    return found


def output_projections(model: ir.Model) -> list[ir.Node]:
    """The MatMuls that make the logits output: walked back from it through its bias Add (and reshapes, casts)."""
    return _matmuls_behind(model, lambda name: name == LOGITS, ("Add", "Mul", "Reshape", "Cast", "Identity"))


def cross_kv_projections(model: ir.Model) -> list[ir.Node]:
    """The encoder graph's MatMuls behind its present.N.encoder.key/value outputs (packed: one per decoder layer),
    walked back through the heads' reshapes and transposes, the bias Add and the packed split."""
    return _matmuls_behind(model, lambda name: name.startswith("present.") and ".encoder." in name, ("Add",),
                           ("Reshape", "Transpose", "Split", "Cast", "Identity"))


def prepare(model: ir.Model, recipe: Recipe,
            graph: str = "decoder") -> tuple[ir.Model, ConvertPass, dict[str, int], list[str]]:
    """Run the int8 pre-passes on `model` (in place) for a recipe; returns (model, its quantization pass, rewrites
    by rule, the pre-passes that changed it). `graph`: which graph (the blocks recipe puts the decoder only in
    blocks: the encoder's many rows a request run faster through DynamicQuantizeMatMul)."""
    run = run_passes(quantization_prepasses(tied_projection=not recipe.float_projection,
                                            weight_bits=recipe.weight_bits), model, steps=2)
    keep = []
    floats = {PROJECTION: output_projections(run.model) if recipe.float_projection else [],
              CROSS_KV: cross_kv_projections(run.model) if recipe.float_cross_kv and graph == "encoder" else []}
    for prefix, nodes in floats.items():
        for i, node in enumerate(nodes):
            node.name = node.name or f"{prefix}_{i}"
            keep.append(node.name)
    step = precision_pass("int8", recipe.per_channel, recipe.activation_scales, keep_float=tuple(keep),
                          reduce_range=recipe.weight_bits == 7)
    if recipe.blocks and graph == "decoder":
        step = ConvertPass("quantize_int8_blocks", lambda m: to_blocks(m, 8, INT8_BLOCK))
    return run.model, step, dict(run.counts), list(run.applied)


def tokens(parity: dict) -> float | None:
    gen = parity.get("generation")
    return None if not gen else gen["tokens_equal"]


def figures(tried: list[tuple[Recipe, dict]]) -> str:
    """'default 96.90% tokens (failed), per-row 98.96% (ok)': each recipe tried and its gate figure."""
    parts = []
    for recipe, parity in tried:
        t = tokens(parity)
        parts.append(f"{recipe.name} {'no token figure' if t is None else f'{t:.2%} tokens'} "
                     f"({parity.get('verdict', 'not run')})")
    return ", ".join(parts)


def pick(tried: list[tuple[Recipe, dict]]) -> int:
    """The index of the recipe to keep: the first verified, else the one with the most equal tokens."""
    for i, (_, parity) in enumerate(tried):
        if parity.get("verified"):
            return i
    return max(range(len(tried)), key=lambda i: tokens(tried[i][1]) or 0.0)


def account(tried: list[tuple[Recipe, dict, int]], kept: int) -> tuple[dict, list[str]]:
    """The report's record of the int8 recipe kept (its options, size, cost, the figures of those tried) and its
    notes, from (recipe, parity record, graph bytes) of each recipe tried."""
    recipe, _, size = tried[kept]
    default = next((b for r, _, b in tried if r.name == "default"), None)
    record = {**recipe.options(), "graph_bytes": size, "default_graph_bytes": default, "step_cost": recipe.step_cost,
              "tried": [{"recipe": r.name, "tokens_equal": tokens(p), "verdict": p.get("verdict")}
                        for r, p, _ in tried]}
    notes = [f"int8 recipe: {recipe.name} ({figures([(r, p) for r, p, _ in tried])})"] if len(tried) > 1 else []
    if recipe.name != "default":
        compared = ("size not compared (the default was not built)" if default is None else
                    f"graphs {size / 1e6:.2f} MB vs {default / 1e6:.2f} MB for the default "
                    f"({(size - default) / default:+.1%})")
        notes.append(f"int8 recipe {recipe.name} against the default: {compared}; step time {recipe.step_cost}")
    return record, notes


__all__ = ["Recipe", "RECIPES", "NAMES", "ALL_NAMES", "WEIGHT_BITS", "resolve_weight_bits", "AUTO", "recipes_for",
           "output_projections", "cross_kv_projections", "prepare", "figures", "pick", "account"]
