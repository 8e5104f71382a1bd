"""Writing bundles: the manifest builder and the atomic writer shared by export and optimize.

    with stage_bundle(out_dir, force) as tmp:      # a temporary directory next to out_dir
        ...write tmp/encoder.onnx, tmp/decoder.onnx, check them...
        write_manifest(tmp, build_manifest(config, {name: graph_entry(path)}, ...))
    # clean exit: tmp replaces out_dir; any exception (or Ctrl-C): tmp is removed, out_dir untouched;
    # --force replaces only a bundle onnxformer wrote (toolkit/reference/outdir.py)

The manifest records everything `inspect` and the runtime need (specs, node and op counts, opsets,
hashes), so neither has to import onnx. Its reader lives in runtime/manifest.py.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shutil
from collections import Counter
from importlib import metadata
from pathlib import Path

import onnx

from runtime.errors import BundleError
from runtime.manifest import (FORMAT, FORMAT_VERSION, MANIFEST, PRECISIONS, TARGETS, bundle_files, file_entries,
                              sha256_file, validate_manifest)
from runtime.spec import DYNAMIC, kv_cache_of
from runtime.tokenizer import load_tokenizer, tokenizer_files
from toolkit.reference.outdir import OutputKind, check_output, staged_output

TENSOR_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT64: "int64",
                onnx.TensorProto.INT32: "int32", onnx.TensorProto.BOOL: "bool", onnx.TensorProto.INT8: "int8",
                onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.DOUBLE: "float64"}


BUNDLE_KIND = OutputKind("bundle", bundle_files, "'onnxformer export' or 'optimize'")


def check_destination(out_dir: str | Path, force: bool) -> Path:
    """Refuse, before any work, an out_dir that stage_bundle would not write (see toolkit/reference/outdir.py)."""
    return check_output(out_dir, force, BUNDLE_KIND)


def stage_bundle(out_dir: str | Path, force: bool = False):
    """A temporary directory beside out_dir that replaces it on success and is removed on any failure."""
    return staged_output(out_dir, force, BUNDLE_KIND)


def tensor_specs(values) -> list[dict]:
    """TensorSpec dicts (name, dtype, shape with dim names or sizes) of graph inputs or outputs."""
    specs = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
                 for d in t.shape.dim]
        specs.append({"name": v.name, "dtype": TENSOR_TYPES.get(t.elem_type, str(t.elem_type)), "shape": shape})
    return specs


def op_counts(graph: onnx.GraphProto) -> Counter:
    """Node counts by op type (domain-qualified outside the default domain), subgraphs included."""
    counts = Counter()
    for node in graph.node:
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        counts[f"{domain}.{node.op_type}" if domain else node.op_type] += 1
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                counts.update(op_counts(sub))
    return counts


def graph_entry(path: str | Path, model: onnx.ModelProto | None = None) -> dict:
    """The manifest entry of one graph file, read from the file itself: hash, size, opset, interface, op counts."""
    path = Path(path)
    model = model if model is not None else onnx.load(str(path), load_external_data=False)
    counts = op_counts(model.graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size, "opset": opset,
            "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "inputs": tensor_specs(model.graph.input), "outputs": tensor_specs(model.graph.output),
            "nodes": sum(counts.values()), "op_counts": dict(sorted(counts.items()))}


def producer_versions() -> dict[str, str]:
    """Versions of the packages that made the bundle."""
    versions = {}
    for package in ("onnxformer", "torch", "onnx", "onnxscript", "onnxruntime"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            with contextlib.suppress(metadata.PackageNotFoundError):
                versions[package] = metadata.version(f"{package}-gpu")
    return versions


def build_manifest(config: dict, graphs: dict[str, dict], precision: str = "fp32", target: str = "any",
                   opset: int | None = None, fusions: dict | None = None, passes: list | None = None,
                   parity: dict | None = None, tokenizer: str | None = None, ort_graphs: dict | None = None,
                   source: dict | None = None, decoder_layout: str = DYNAMIC) -> dict:
    """The manifest dict (its "files" list is added by write_manifest). graphs: {name: graph_entry(path)}; parity: a
    report's to_dict(); decoder_layout: how the runtime feeds the decoder (runtime/spec.py's DECODER_LAYOUTS), with
    the kv_cache it implies."""
    if precision not in PRECISIONS:
        raise BundleError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if target not in TARGETS:
        raise BundleError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model": dict(config), "precision": precision,
        "target": target, "opset": opset if opset is not None else graphs["encoder"].get("opset"),
        "kv_cache": kv_cache_of(decoder_layout), "decoder_layout": decoder_layout,
        "graphs": graphs, "ort_graphs": ort_graphs or {}, "tokenizer": tokenizer,
        "fusions": dict(fusions or {}), "passes": list(passes or []), "producer": producer_versions(),
        "parity": parity if parity is not None else {"verified": False},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if source is not None:
        manifest["source"] = source
    validate_manifest(manifest, "the new manifest", written=False)
    return manifest


def write_manifest(bundle_dir: str | Path, manifest: dict) -> Path:
    """Write manifest.json, listing every file in bundle_dir under "files" with its sha256 and size (whatever
    wrote it), after checking that each file the manifest names is there with the hash it records."""
    bundle_dir = Path(bundle_dir)
    manifest["files"] = file_entries(bundle_dir)
    languages = tokenizer_languages(bundle_dir, manifest)
    if languages and "languages" not in manifest:
        manifest["languages"] = languages
    validate_manifest(manifest, "the new manifest")
    path = bundle_dir / MANIFEST
    path.write_text(readable_json(manifest) + "\n")
    return path


def readable_json(value, width: int = 120, indent: int = 0, lead: int = 0) -> str:
    """JSON indented by two spaces a level, where every list or object whose whole line fits in `width` columns
    stays on that line (a graph input's name, dtype and shape, a shape's dims): as readable as json's indent=2, at
    three quarters of its bytes (flan-t5-base int8: 57.6 KB -> 44.5 KB). lead: the columns the line
    already holds before the value (its key)."""
    flat = json.dumps(value, allow_nan=True)
    if not isinstance(value, (dict, list)) or not value or indent + lead + len(flat) <= width:
        return flat
    if isinstance(value, dict):
        items = [f"{json.dumps(k)}: " + readable_json(v, width, indent + 2, len(json.dumps(k)) + 2)
                 for k, v in value.items()]
    else:
        items = [readable_json(v, width, indent + 2) for v in value]
    opened, closed = "[]" if isinstance(value, list) else "{}"
    pad = " " * (indent + 2)
    return opened + "\n" + ",\n".join(pad + item for item in items) + "\n" + " " * indent + closed


def tokenizer_languages(bundle_dir: Path, manifest: dict) -> dict | None:
    """A multilingual bundle's manifest `languages` ({"source": codes, "target": codes}, the model's own codes): those
    its tokenizer.json records, where the target language is chosen per request (target_start); else None."""
    name = manifest.get("tokenizer")
    if not name:
        return None
    spec = json.loads((bundle_dir / name).read_text())
    codes = spec.get("languages") if isinstance(spec, dict) and spec.get("target_start") else None
    return {"source": list(codes), "target": list(codes)} if codes else None


def copy_tokenizer(tokenizer: str | Path | None, bundle_dir: Path) -> str | None:
    """Copy tokenizer.json and the files it names (SentencePiece models, vocabularies) into the bundle; returns its
    name for the manifest (None when the model has none); write_manifest hashes them with every other file."""
    if tokenizer is None:
        return None
    tokenizer = Path(tokenizer)
    for name in tokenizer_files(load_tokenizer(tokenizer)):
        shutil.copyfile(tokenizer.parent / name, bundle_dir / name)
    shutil.copyfile(tokenizer, bundle_dir / "tokenizer.json")
    return "tokenizer.json"

