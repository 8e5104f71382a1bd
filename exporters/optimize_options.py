"""What optimize accepts, refused before any work: targets, precisions, attention ops, the KV cache, the source."""

from __future__ import annotations

from pathlib import Path

from exporters.fusions import ATTENTION_TARGETS
from exporters.row_activations import ACTIVATION_SCALES
from runtime.errors import OnnxformerError
from runtime.manifest import GRAPHS, PRECISIONS, read_manifest, verify_hashes
from runtime.spec import KV_CACHES
from toolkit.parity.inputs import ParityInputs, choose_inputs
from toolkit.reference.config import ModelConfig

TARGETS = ("cpu", "cuda", "wasm")                # bundle targets optimize writes (the manifest also knows "any")
CPU_TARGETS = ("cpu", "wasm")   # wasm: onnxruntime-web, the CPU engine compiled to WebAssembly (`onnxformer web`)
ATTENTION_OPS = {"ort": "com.microsoft.MultiHeadAttention", "onnx": "Attention"}
STATIC_ATTENTION_OPS = ("GroupQueryAttention", "DecoderMaskedMultiHeadAttention")  # the static cache's self-attention
                                                           # (per row on CPU, shared slot on CUDA: exporters/static_cache)


class OptimizeError(OnnxformerError):
    """Options or a source bundle that optimize cannot work with (exit 2, nothing written)."""


def check_options(target: str, precision: str, attention: str, fuse: bool,
                  activation_scales: str | None = None, recipe: str = "auto", weight_bits: str | int = "auto") -> None:
    """Refuse option combinations that cannot work, before touching anything (the int8 recipe's own checks:
    exporters/int8_recipes.recipes_for)."""
    if activation_scales is not None and activation_scales not in ACTIVATION_SCALES:
        raise OptimizeError(f"unknown activation scales {activation_scales!r}; choose one of: "
                            f"{', '.join(ACTIVATION_SCALES)}")
    if activation_scales not in (None, "per-tensor") and precision != "int8":
        raise OptimizeError(f"--activation-scales {activation_scales} is for --precision int8 (dynamically quantized "
                            f"activations); {precision} has none to scale" + (
                                " (int4's kernel already quantizes each row on its own)" if precision == "int4" else ""))
    if str(weight_bits) != "auto" and precision != "int8":
        raise OptimizeError(f"--weight-bits {weight_bits} is for --precision int8; drop it for {precision}")
    if recipe != "auto" and precision != "int8":
        raise OptimizeError(f"--recipe {recipe} is for --precision int8 (the int8 recipes); drop it for {precision}")
    if target not in TARGETS:
        raise OptimizeError(f"unknown target {target!r}; choose one of: {', '.join(TARGETS)}")
    if precision not in PRECISIONS:
        raise OptimizeError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if attention not in ATTENTION_TARGETS:
        raise OptimizeError(f"unknown attention target {attention!r}; choose ort (onnxruntime's "
                            f"MultiHeadAttention) or onnx (the standard Attention op, opset 23)")
    if precision == "fp16" and target != "cuda":
        raise OptimizeError("fp16 is for the CUDA provider: pass --target cuda (for CPU use --precision fp32 or int8)")
    if precision in ("int8", "int4") and target not in CPU_TARGETS:
        raise OptimizeError(f"{precision} quantization is made for the CPU provider: pass --target cpu "
                            f"(for CUDA use --precision fp16)")
    if not fuse and precision == "fp32":
        raise OptimizeError("nothing to do: --no-fuse with --precision fp32 leaves the graphs unchanged; "
                            "drop --no-fuse or choose --precision int8/fp16")


def resolve_kv_cache(kv_cache: str, target: str, fuse: bool, attention: str, manifest: dict,
                     precision: str = "fp32") -> str:
    """'auto' -> static on CPU when the attention is (or will be) fused for onnxruntime, else the source's cache."""
    source = manifest.get("kv_cache", "dynamic")
    fused_ort = (fuse and attention == "ort") or attention_state(manifest) == "ort"
    if kv_cache == "auto":
        return "static" if source == "static" or (target in CPU_TARGETS and fused_ort) else "dynamic"
    if kv_cache not in KV_CACHES:
        raise OptimizeError(f"unknown KV cache {kv_cache!r}; choose auto, static or dynamic")
    if kv_cache == "dynamic" and source == "static":
        raise OptimizeError("the source bundle already has a static KV cache; optimize the exported bundle for "
                            "--kv-cache dynamic")
    if kv_cache == "static" and precision == "fp16":
        raise OptimizeError("--kv-cache static is not available with --precision fp16: the fp16 graphs keep float32 "
                            "inputs and outputs, so the cache buffer would be cast (copied) every step; use "
                            "--kv-cache dynamic, or --precision fp32 with --kv-cache static")
    if kv_cache == "static" and not fused_ort:
        raise OptimizeError("--kv-cache static needs the decoder's self-attention fused into onnxruntime's "
                            "MultiHeadAttention: use --attention ort (the default) without --no-fuse, or pass "
                            "--kv-cache dynamic")
    return kv_cache


def attention_state(manifest: dict) -> str | None:
    """Which attention op the bundle's graphs already hold: 'ort', 'onnx' or None (decomposed)."""
    ops = {op for g in GRAPHS for op in manifest["graphs"][g].get("op_counts", {})}
    if any(f"com.microsoft.{op}" in ops or op in ops for op in STATIC_ATTENTION_OPS):
        return "ort"
    for name, op in ATTENTION_OPS.items():
        if op in ops:
            return name
    return None


def check_source(bundle_dir: Path, out_dir: Path, manifest: dict, precision: str, fuse: bool, attention: str) -> None:
    """Refuse re-optimizations that would mean nothing or stack conversions; say what was applied before."""
    if out_dir.absolute().resolve() == bundle_dir.absolute().resolve():
        raise OptimizeError(f"--out {out_dir} is the source bundle; write the optimized bundle elsewhere")
    done = manifest.get("passes") or []
    applied = f"passes {', '.join(done)}" if done else "no passes"
    if manifest["precision"] != "fp32":
        raise OptimizeError(f"bundle {bundle_dir} is already {manifest['precision']} ({applied}); optimize the fp32 "
                            f"bundle it was made from")
    fused = attention_state(manifest)
    if fuse and fused is not None and fused != attention:
        raise OptimizeError(f"bundle {bundle_dir} already holds {ATTENTION_OPS[fused]} ({applied}), so it cannot be "
                            f"fused for --attention {attention}: optimize the exported (unfused) bundle, or pass "
                            f"--attention {fused} (or --no-fuse) to only convert its precision")


def source_manifest(bundle_dir: Path, out_dir: Path, precision: str, fuse: bool, attention: str) -> dict:
    """The source bundle's manifest, its files' hashes verified and the source checked against the options."""
    manifest = read_manifest(bundle_dir)
    verify_hashes(bundle_dir, manifest)
    check_source(bundle_dir, out_dir, manifest, precision, fuse, attention)
    return manifest


__all__ = ["source_manifest", "TARGETS", "CPU_TARGETS", "ATTENTION_OPS", "STATIC_ATTENTION_OPS", "OptimizeError",
           "check_options", "resolve_kv_cache", "attention_state", "check_source", "given_gate_inputs"]


def given_gate_inputs(manifest: dict, bundle_dir: Path, texts: list[str] | None, audio: list | None,
                      samples: int) -> ParityInputs | None:
    """The gate's inputs from audio clips given (--gate-audio, read now so a bad file stops optimize before any
    work), else None (the gate chooses: texts, the task's, random); refuses texts for a bundle without a tokenizer
    and both texts and clips."""
    if texts is not None and audio:
        raise OptimizeError("--gate-audio and --input both give the gate's inputs; pass one of them (--gate-audio "
                            "for an audio bundle, --input for a text one)")
    if texts is not None and not manifest.get("tokenizer"):
        raise OptimizeError(f"{bundle_dir} has no tokenizer (it takes token ids), so gate input texts cannot be "
                            f"encoded; leave --input out and the gate uses random ids")
    return choose_inputs(ModelConfig.from_dict(manifest["model"]), samples=samples, audio=audio) if audio else None
