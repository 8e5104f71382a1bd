"""The bundle manifest (manifest.json): reading, validating, hash checks, and the inspect report.

Written by exporters/bundle.py, read here. Imports only the standard library (no onnx, no torch), so
`onnxformer inspect` and the runtime work where only numpy, onnxruntime and click are installed:
node counts, op counts and opsets are recorded in the manifest when the bundle is written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from runtime.errors import BundleError, read_json
from runtime.spec import DECODER_LAYOUTS, GraphSpec, TensorSpec, kv_cache_of

FORMAT = "onnxformer-bundle"
FORMAT_VERSION = 3                 # 2: "files" lists every file with its sha256 and size; 3: "decoder_layout"
MANIFEST = "manifest.json"
GRAPHS = ("encoder", "decoder")
PRECISIONS = ("fp32", "fp16", "int8", "int4")
TARGETS = ("any", "cpu", "cuda", "wasm")
REQUIRED = ("format", "format_version", "model", "precision", "decoder_layout", "graphs", "files")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(bundle_dir: str | Path) -> dict:
    """Load and validate manifest.json; BundleError names what is wrong and how to fix it."""
    bundle_dir = Path(bundle_dir)
    if not bundle_dir.exists():
        raise BundleError(f"bundle {bundle_dir} does not exist; create one with 'onnxformer export CHECKPOINT --out {bundle_dir}'")
    if not bundle_dir.is_dir():
        raise BundleError(f"{bundle_dir} is not a directory; a bundle is a directory holding {MANIFEST} and .onnx files")
    path = bundle_dir / MANIFEST
    if not path.is_file():
        raise BundleError(f"{bundle_dir} has no {MANIFEST}, so it is not a bundle; re-export it with 'onnxformer export'")
    manifest = read_json(path, BundleError, "re-export the bundle")
    validate_manifest(manifest, path)
    return manifest


MODEL_INTS = ("vocab_size", "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "max_len", "pad_id",
              "bos_id", "eos_id")                     # what the runtime reads of every model config: ints, required
MODEL_OPTIONAL_INTS = ("src_vocab_size", "d_ff", "d_kv", "unk_id", "relative_buckets", "relative_max_distance")


def check_model_fields(model, where) -> None:
    """The manifest's model config: an object whose sizes and token ids the runtime reads are integers >= 0."""
    if not isinstance(model, dict):
        raise BundleError(f"{where}: 'model' must be the model config object; re-export the bundle")
    for key in MODEL_INTS + MODEL_OPTIONAL_INTS:
        if key not in model:
            if key in MODEL_INTS:
                raise BundleError(f"{where}: the model config lacks {key}; re-export the bundle")
            continue
        value = model[key]
        if value is None and key in MODEL_OPTIONAL_INTS:   # an optional size the config leaves unset
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise BundleError(f"{where}: model field {key!r} must be an integer >= 0, got {value!r}; re-export the "
                              f"bundle")


def validate_manifest(manifest, where: str | Path = MANIFEST, written: bool = True) -> None:
    """Check the manifest's structure (format, version, required fields, graph entries, the file list).
    written=False: a manifest being built, before its "files" list is made (exporters.bundle.write_manifest)."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{where} is not an onnxformer bundle manifest (format is not {FORMAT!r}); re-export the bundle")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise BundleError(f"{where} has a bad format_version {version!r}; re-export the bundle")
    if version > FORMAT_VERSION:
        raise BundleError(f"{where} has format_version {version}, newer than this onnxformer reads ({FORMAT_VERSION}); "
                          f"upgrade onnxformer or re-export the bundle with this version")
    if version < FORMAT_VERSION:
        raise BundleError(f"{where} has format_version {version}, older than this onnxformer reads (its manifest "
                          f"does not declare the decoder layout); re-export the bundle with this onnxformer (format "
                          f"{FORMAT_VERSION})")
    missing = [key for key in REQUIRED if key not in manifest and (written or key != "files")]
    if missing:
        raise BundleError(f"{where} lacks field(s) {', '.join(missing)}; re-export the bundle")
    if manifest["precision"] not in PRECISIONS:
        raise BundleError(f"{where} has unknown precision {manifest['precision']!r} (known: {', '.join(PRECISIONS)})")
    layout = manifest["decoder_layout"]
    if layout not in DECODER_LAYOUTS:
        raise BundleError(f"{where} has unknown decoder_layout {layout!r} (known: {', '.join(DECODER_LAYOUTS)}); "
                          f"re-export or re-optimize the bundle with this onnxformer")
    if manifest.get("kv_cache", kv_cache_of(layout)) != kv_cache_of(layout):
        raise BundleError(f"{where} has kv_cache {manifest.get('kv_cache')!r} but decoder_layout {layout!r} (a "
                          f"{kv_cache_of(layout)} cache); re-export or re-optimize the bundle with this onnxformer")
    check_model_fields(manifest["model"], where)
    graphs = manifest["graphs"]
    if not isinstance(graphs, dict) or any(name not in graphs for name in GRAPHS):
        raise BundleError(f"{where} must list graphs {' and '.join(GRAPHS)}; re-export the bundle")
    for name in GRAPHS:
        entry = graphs[name]
        if not isinstance(entry, dict) or any(k not in entry for k in ("file", "sha256", "inputs", "outputs")):
            raise BundleError(f"{where}: graph {name!r} needs file, sha256, inputs and outputs; re-export the bundle")
        if not isinstance(entry["inputs"], list) or not isinstance(entry["outputs"], list):
            raise BundleError(f"{where}: graph {name!r} inputs and outputs must be lists; re-export the bundle")
        for kind in ("inputs", "outputs"):
            if not all(isinstance(t, dict) and {"name", "dtype", "shape"} <= t.keys() for t in entry[kind]):
                raise BundleError(f"{where}: graph {name!r} has {kind} without a name, dtype and shape; re-export "
                                  f"the bundle")
        _safe_file(entry["file"], where)
    ort_graphs = manifest.get("ort_graphs") or {}
    if not isinstance(ort_graphs, dict):
        raise BundleError(f"{where}: 'ort_graphs' must be an object; re-export the bundle")
    for name, entry in ort_graphs.items():
        if not isinstance(entry, dict) or "file" not in entry or "sha256" not in entry:
            raise BundleError(f"{where}: ort graph {name!r} needs file and sha256; re-export the bundle")
        _safe_file(entry["file"], where)
    if manifest.get("tokenizer") is not None:
        _safe_file(manifest["tokenizer"], where)
    _check_shortlist(manifest.get("shortlist"), where)
    if "files" in manifest:
        _check_file_list(manifest, where)


def _check_shortlist(record, where) -> None:
    """An optional vocabulary shortlist (`onnxformer shortlist`): its map file and its decoder graph."""
    if record is None:
        return
    decoder = record.get("decoder") if isinstance(record, dict) else None
    if not isinstance(record, dict) or "file" not in record or not isinstance(decoder, dict) or any(
            k not in decoder for k in ("file", "sha256", "inputs", "outputs")):
        raise BundleError(f"{where}: 'shortlist' needs a file and a decoder graph entry (file, sha256, inputs, "
                          f"outputs); rebuild it with onnxformer shortlist")
    _safe_file(record["file"], where)
    _safe_file(decoder["file"], where)
    weight = record.get("weight")                            # the projection table a request's rows come from
    if weight is not None:
        if not isinstance(weight, dict) or any(k not in weight for k in ("file", "offset", "length", "shape", "dtype",
                                                                          "feed")):
            raise BundleError(f"{where}: the shortlist's 'weight' needs file, offset, length, shape, dtype and feed; "
                              f"rebuild it with onnxformer shortlist")
        _safe_file(weight["file"], where)


def _check_file_list(manifest: dict, where) -> None:
    """"files" maps every file of the bundle to its sha256 and size; every file named elsewhere is in it."""
    files = manifest["files"]
    if not isinstance(files, dict):
        raise BundleError(f"{where}: 'files' must map file names to sha256 and bytes; re-export the bundle")
    for name, entry in files.items():
        _safe_file(name, where)
        if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or len(entry["sha256"]) != 64
                or not isinstance(entry.get("bytes"), int) or isinstance(entry["bytes"], bool) or entry["bytes"] < 0):
            raise BundleError(f"{where}: file {name!r} needs a sha256 (64 hex digits) and a size in bytes; "
                              f"re-export the bundle")
    for name, sha in _named_files(manifest):
        if name not in files:
            raise BundleError(f"{where} names {name} but does not list it under 'files', so it cannot be verified; "
                              f"re-export the bundle")
        if sha is not None and sha != files[name]["sha256"]:
            raise BundleError(f"{where} records two different sha256 for {name}; re-export the bundle")


def _named_files(manifest: dict) -> list[tuple[str, str | None]]:
    """(file, sha256 or None) of every file the manifest names outside 'files' (graphs, .ort, tokenizer, ...)."""
    named = []
    for section in ("graphs", "ort_graphs"):
        entries = manifest.get(section)
        for entry in (entries.values() if isinstance(entries, dict) else ()):
            if isinstance(entry, dict) and isinstance(entry.get("file"), str):
                named.append((entry["file"], entry.get("sha256") if isinstance(entry.get("sha256"), str) else None))
    record = manifest.get("ort_format")
    ops = record.get("required_operators") if isinstance(record, dict) else None
    if isinstance(ops, dict) and isinstance(ops.get("file"), str):
        named.append((ops["file"], ops.get("sha256") if isinstance(ops.get("sha256"), str) else None))
    if isinstance(manifest.get("tokenizer"), str):
        named.append((manifest["tokenizer"], None))
    shortlist = manifest.get("shortlist")                    # the vocabulary shortlist's map and decoder graph
    for entry in ((shortlist, shortlist.get("decoder"), shortlist.get("weight")) if isinstance(shortlist, dict)
                  else ()):
        if isinstance(entry, dict) and isinstance(entry.get("file"), str):
            named.append((entry["file"], entry.get("sha256") if isinstance(entry.get("sha256"), str) else None))
    shared = manifest.get("shared_weights")                  # the graphs' external data (exporters/shared_weights)
    if isinstance(shared, dict) and isinstance(shared.get("file"), str):
        named.append((shared["file"], shared.get("sha256") if isinstance(shared.get("sha256"), str) else None))
    return named


def _safe_file(name, where) -> None:
    """Files must be plain names inside the bundle directory."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", "..") or name == MANIFEST:
        raise BundleError(f"{where}: file {name!r} must be a file name inside the bundle; re-export the bundle")


def file_entries(bundle_dir: str | Path) -> dict[str, dict]:
    """{name: {sha256, bytes}} of every file in a bundle directory but the manifest (what write_manifest lists)."""
    bundle_dir = Path(bundle_dir)
    entries = {}
    for path in sorted(bundle_dir.iterdir()):
        if path.name == MANIFEST:
            continue
        if not path.is_file() or path.is_symlink():
            raise BundleError(f"{path} is not a plain file; a bundle holds only files, so remove it")
        entries[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return entries


def verify_hashes(bundle_dir: str | Path, manifest: dict) -> None:
    """Check every file the manifest lists exists with its recorded size and sha256 (a tampered, truncated,
    swapped or missing file fails), whatever kind of file it is."""
    bundle_dir = Path(bundle_dir)
    for name, entry in manifest["files"].items():
        path = bundle_dir / name
        if not path.is_file():
            raise BundleError(f"bundle {bundle_dir} is missing {name}; copy the whole bundle directory")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise BundleError(f"{path} is {size} bytes, the manifest says {entry['bytes']}: the file is truncated or "
                              f"was changed; copy the bundle again or re-export it")
        if sha256_file(path) != entry["sha256"]:
            raise BundleError(f"{path} does not match its sha256 in {MANIFEST}: the file was changed or corrupted; "
                              f"copy the bundle again or re-export it")


def listed_files(manifest: dict) -> set[str]:
    """Every file name the manifest accounts for (its 'files' list and every file it names elsewhere)."""
    names = {name for name, _ in _named_files(manifest)}
    if isinstance(manifest.get("files"), dict):
        names.update(name for name in manifest["files"] if isinstance(name, str))
    return names


def bundle_files(bundle_dir: str | Path) -> set[str] | None:
    """The files of the onnxformer bundle at bundle_dir (its manifest and what it lists), or None when bundle_dir
    holds no onnxformer manifest: what `--force` may replace (toolkit/reference/outdir.py)."""
    try:
        manifest = json.loads((Path(bundle_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    return {MANIFEST, *listed_files(manifest)}


def decoder_layout(manifest: dict) -> str:
    """The decoder layout a (validated) manifest declares: how the runtime feeds its decoder (runtime/spec.py)."""
    return manifest["decoder_layout"]


def manifest_specs(manifest: dict) -> dict[str, GraphSpec]:
    """The graphs' interfaces as recorded in the manifest (a malformed entry is a BundleError)."""
    specs = {}
    for name, entry in manifest["graphs"].items():
        try:
            specs[name] = GraphSpec(name, tuple(_tensor(t) for t in entry["inputs"]),
                                    tuple(_tensor(t) for t in entry["outputs"]))
        except (KeyError, TypeError, ValueError):
            raise BundleError(f"{MANIFEST}: graph {name!r} has a malformed input or output entry (each needs a "
                              f"name, a dtype and a shape list); re-export the bundle") from None
    return specs


def _tensor(t) -> TensorSpec:
    spec = TensorSpec.from_dict(t)
    if not isinstance(spec.name, str) or not isinstance(spec.dtype, str) or not isinstance(t["shape"], list) or \
            not all(isinstance(d, (str, int)) and not isinstance(d, bool) or d is None for d in spec.shape):
        raise ValueError(t)
    return spec


# ---------------------------------------------------------------------------------------------- inspect

def inspect_report(bundle_dir: str | Path) -> dict:
    """Everything `onnxformer inspect` shows, as JSON-ready data (hashes verified, sizes from disk)."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    verify_hashes(bundle_dir, manifest)
    graphs = {}
    for name, entry in manifest["graphs"].items():
        graphs[name] = {
            "file": entry["file"], "bytes": (bundle_dir / entry["file"]).stat().st_size, "sha256": entry["sha256"],
            "opset": entry.get("opset", manifest.get("opset")), "nodes": entry.get("nodes"),
            "op_counts": entry.get("op_counts", {}), "inputs": entry["inputs"], "outputs": entry["outputs"],
        }
    extra = sorted(p.name for p in bundle_dir.iterdir() if p.is_file() and p.suffix == ".data")
    return {
        "bundle": str(bundle_dir), "format_version": manifest["format_version"], "model": manifest["model"],
        "precision": manifest["precision"], "target": manifest.get("target", "any"), "opset": manifest.get("opset"),
        "kv_cache": kv_cache_of(decoder_layout(manifest)), "decoder_layout": decoder_layout(manifest), "graphs": graphs,
        "ort_graphs": manifest.get("ort_graphs") or {}, "external_data": extra,
        "tokenizer": manifest.get("tokenizer"), "fusions": manifest.get("fusions") or {},
        "passes": manifest.get("passes") or [], "producer": manifest.get("producer") or {},
        "languages": manifest.get("languages"),
        "parity": _parity_summary(manifest.get("parity")), "created": manifest.get("created"),
        "shortlist": _shortlist_summary(manifest.get("shortlist")),
        "files": manifest["files"],
        "total_bytes": sum(p.stat().st_size for p in bundle_dir.iterdir() if p.is_file()),
    }


def _shortlist_summary(record) -> dict | None:
    """The shortlist record without its decoder's interface."""
    if not isinstance(record, dict):
        return None
    return {k: v for k, v in record.items() if k != "decoder"} | {"decoder": record["decoder"]["file"]}


def _parity_summary(parity) -> dict | None:
    """The parity record without its per-step detail."""
    if not isinstance(parity, dict):
        return None
    keep = ("verified", "provider", "precision", "steps", "tolerance", "max_abs", "summary")
    summary = {k: parity[k] for k in keep if k in parity}
    for key in ("encoder", "decoder"):
        if isinstance(parity.get(key), dict):
            summary[key] = {k: v for k, v in parity[key].items() if k in ("max_abs", "max_rel", "ok", "worst_output")}
    return summary


def format_shortlist(s: dict | None) -> str:
    """The inspect line of a bundle's vocabulary shortlist."""
    if s is None:
        return "shortlist: none"
    sizes, gate = s.get("sizes") or {}, s.get("gate") or {}
    agreement = gate.get("agreement")
    return (f"shortlist: {s['file']} + {s['decoder']}, {sizes.get('most_candidates')} candidates a source token "
            f"(mean {sizes.get('mean_candidates')}) + {sizes.get('always')} always; "
            + (f"one map per target language ({', '.join(str(lang.get('code')) for lang in s['languages'])}); "
               if isinstance(s.get("languages"), list) and s["languages"] else "")
            + ("verified" if s.get("verified") else "NOT verified")
            + (f", {agreement:.2%} of tokens equal to the full vocabulary on {gate.get('source')}"
               if isinstance(agreement, (int, float)) else ""))


def _shape(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_inspect(report: dict, max_io: int = 8) -> str:
    """A readable multi-line inspect report."""
    m = report["model"]
    lines = [f"bundle {report['bundle']}  (format v{report['format_version']}, {_size(report['total_bytes'])})",
             f"model: {m.get('n_encoder_layers')}+{m.get('n_decoder_layers')} layers, d_model {m.get('d_model')}, "
             f"{m.get('n_heads')} heads, d_ff {m.get('d_ff')}, vocab {m.get('vocab_size')}, norm {m.get('norm')}, "
             f"{m.get('activation')}, {'tied' if m.get('tie_embeddings') else 'untied'}",
             f"tokens: start {m.get('bos_id')}, end {m.get('eos_id')}, pad {m.get('pad_id')}"
             + ("; pad never generated" if m.get("suppress_pad") else "")
             + ("; EOS forced at the length limit (forced_eos; --no-forced-eos turns it off)" if m.get("forced_eos")
                else ""),
             f"precision {report['precision']}, target {report['target']}, opset {report['opset']}, "
             f"KV cache {report['kv_cache']} (decoder layout {report['decoder_layout']}), "
             f"tokenizer {report['tokenizer'] or 'none'}"]
    for name, g in report["graphs"].items():
        lines.append(f"\n{name}: {g['file']}  {_size(g['bytes'])}  opset {g['opset']}  {g['nodes']} nodes  "
                     f"sha256 {g['sha256'][:12]}")
        for kind in ("inputs", "outputs"):
            specs = g[kind]
            lines.append(f"  {kind}:")
            shown = specs if len(specs) <= max_io else specs[:max_io - 1]
            for t in shown:
                lines.append(f"    {t['name']:<36} {t['dtype']:<8} {_shape(t['shape'])}")
            if len(shown) < len(specs):
                lines.append(f"    ... {len(specs) - len(shown)} more (same pattern per layer; --json lists all)")
        ops = sorted(g["op_counts"].items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append("  ops: " + ", ".join(f"{op} {n}" for op, n in ops))
    for name, g in report["ort_graphs"].items():
        lines.append(f"\nort {name}: {g['file']}  {_size(g.get('bytes', 0))}")
    files = report.get("files") or {}
    lines.append(f"\nfiles ({len(files)}, sizes and sha256 verified): "
                 + ", ".join(f"{name} {_size(e['bytes'])}" for name, e in files.items()))
    languages = report.get("languages")
    if isinstance(languages, dict):
        for side in ("source", "target"):
            codes = [str(c) for c in languages.get(side) or []]
            lines.append(f"{side} languages ({len(codes)}): " + " ".join(codes))
    fusions = report["fusions"]
    lines.append("\nfusions: " + (", ".join(f"{k} {v}" for k, v in fusions.items()) if fusions else "none"))
    if report["passes"]:
        lines.append("passes: " + ", ".join(report["passes"]))
    lines.append("producer: " + ", ".join(f"{k} {v}" for k, v in report["producer"].items()))
    p = report["parity"]
    if p is None:
        lines.append("parity: not recorded")
    else:
        status = "verified" if p.get("verified") else "NOT verified"
        detail = ", ".join(f"{k} max abs {v['max_abs']:.2e}" for k, v in p.items()
                           if isinstance(v, dict) and isinstance(v.get("max_abs"), (int, float)))
        lines.append(f"parity: {status} on {p.get('provider')} {p.get('precision')}"
                     + (f" (tolerance {p['tolerance']:g})" if isinstance(p.get("tolerance"), (int, float)) else "")
                     + (f"; {detail}" if detail else ""))
    lines.append(format_shortlist(report.get("shortlist")))
    if report.get("created"):
        lines.append(f"created: {report['created']}")
    return "\n".join(lines)
