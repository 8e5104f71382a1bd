"""ORT-format graphs for minimal / mobile ONNX Runtime builds: encoder.ort, decoder.ort, required_operators.config.

    with stage_bundle(out_dir, force) as tmp:            # inside a bundle writer (optimize, export)
        ...write tmp/encoder.onnx, tmp/decoder.onnx, build `manifest`...
        add_ort_format(tmp, manifest)                    # writes the .ort files, records them in manifest
        write_manifest(tmp, manifest)

The conversion is onnxruntime's own tool (onnxruntime.tools.convert_onnx_models_to_ort), run on the two graphs
together, so one required_operators.config covers both (pass it to ONNX Runtime's build.py as
--include_ops_by_config for a reduced-operator build).

Optimization style: Fixed. The tool applies ORT_ENABLE_ALL (less the x86-only NCHWc layout, unless
target_platform="amd64") before saving, which is the level the runtime opens .onnx graphs with
(runtime.session.SessionConfig), so the .ort graph is the graph the runtime would have run anyway and its
outputs match the .onnx graph's (checked here, within the fp32 CPU tolerance, for every precision: the
conversion is no precision change). The Runtime style saves only basic optimizations plus records replayed
under 'session.enable_saved_runtime_optimizations'; it is meant for compiling providers (NNAPI, CoreML) and
would run these graphs unfused on the CPU provider, so it is not offered.

.ort files are read by ONNX Runtime of the version that wrote them or newer (recorded in the manifest);
the runtime loads them on the CPU provider only (runtime.bundle.graph_file).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import onnxruntime as ort

from exporters.logs import quiet_loggers
from runtime.errors import OnnxformerError
from runtime.manifest import GRAPHS, decoder_layout, sha256_file
from toolkit.parity import ParityError

CONFIG_FILE = "required_operators.config"
STYLE = "fixed"                               # see the module docstring
PLATFORMS = (None, "arm", "amd64")            # the tool's target_platform (None: portable, no NCHWc)
LEVEL_VARIABLE = "ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL"


class OrtFormatError(OnnxformerError):
    """A bundle or option the ORT-format conversion cannot work with (exit 2, nothing written)."""


def check_convertible(manifest: dict, target_platform: str | None = None) -> None:
    """Refuse what cannot become an ORT-format bundle for the CPU provider, before any work."""
    if target_platform not in PLATFORMS:
        raise OrtFormatError(f"unknown target platform {target_platform!r}; choose arm, amd64 or leave it unset")
    if manifest.get("precision") == "fp16" or manifest.get("target") == "cuda":
        raise OrtFormatError("ORT-format graphs are made for the CPU provider (minimal and mobile builds), and this "
                             "bundle targets CUDA; convert an fp32 or int8 bundle made with --target cpu")
    level = os.environ.get(LEVEL_VARIABLE, "all")
    if level != "all":
        raise OrtFormatError(f"{LEVEL_VARIABLE}={level} is set; the runtime runs graphs at level 'all', so unset it "
                             f"before converting")


def add_ort_format(bundle_dir: str | Path, manifest: dict, target_platform: str | None = None,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Write <graph>.ort and required_operators.config into bundle_dir; record them in `manifest` (changed in place).

    bundle_dir holds the manifest's .onnx graphs (a bundle being written). The .ort graphs
    must match the .onnx graphs (outputs within the fp32 CPU tolerance, greedy tokens equal) or ParityError.
    Returns the manifest's new "ort_format" record.
    """
    progress = progress or (lambda msg: None)
    bundle_dir = Path(bundle_dir)
    check_convertible(manifest, target_platform)
    sources = {g: bundle_dir / manifest["graphs"][g]["file"] for g in GRAPHS}
    targets = {g: bundle_dir / (sources[g].stem + ".ort") for g in GRAPHS}
    config = bundle_dir / CONFIG_FILE
    clashes = [p.name for p in (*targets.values(), config) if p.exists()]
    if clashes:
        raise OrtFormatError(f"{bundle_dir} already holds {', '.join(clashes)}; convert a bundle without ORT graphs")
    shared = manifest.get("shared_weights")
    _convert(sources, bundle_dir, target_platform, [bundle_dir / shared["file"]] if shared else [])
    progress(f"converted {', '.join(p.name for p in sources.values())} to ORT format "
             f"({', '.join(f'{p.name} {p.stat().st_size / 1e6:.2f} MB' for p in targets.values())})")
    _relative_config_comments(config)
    record = {"style": STYLE, "optimization_level": "all", "target_platform": target_platform,
              "onnxruntime": ort.__version__, "required_operators": _file_entry(config)}
    record["parity"] = check_ort_parity(sources, targets, manifest["model"], decoder_layout(manifest))
    progress(f"ORT-format parity against the .onnx graphs: {record['parity']['summary']}")
    manifest["ort_graphs"] = {g: {**_file_entry(targets[g]), "source_sha256": manifest["graphs"][g]["sha256"]}
                              for g in GRAPHS}
    manifest["ort_format"] = record
    return record


def _convert(sources: dict[str, Path], out_dir: Path, target_platform: str | None, data: list[Path] = ()) -> None:
    """Run onnxruntime's converter on exactly these graphs (linked into a scratch folder with their external
    data files), output in out_dir."""
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    with tempfile.TemporaryDirectory(prefix=".ort-src-", dir=out_dir) as scratch:
        for path in [*sources.values(), *data]:
            _link_or_copy(path, Path(scratch) / path.name)
        quiet = io.StringIO()
        with contextlib.redirect_stdout(quiet), quiet_loggers("ort_format_model.utils", level=logging.WARNING):
            try:
                convert_onnx_models_to_ort(Path(scratch), output_dir=Path(out_dir),
                                           optimization_styles=[OptimizationStyle.Fixed],
                                           target_platform=target_platform)
            except Exception as exc:           # the tool raises whatever the session raised (Fail, RuntimeError, ...)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise OrtFormatError(f"onnxruntime {ort.__version__} could not convert the graphs to ORT format "
                                     f"({first}); the graphs must load on the CPU provider") from None


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)                      # same filesystem: no copy of a large graph
    except OSError:
        shutil.copyfile(src, dst)


def _relative_config_comments(config: Path) -> None:
    """The tool names the .ort files by absolute path in comments; keep only their names (same file anywhere)."""
    lines = config.read_text().splitlines()
    lines = [f"# - {Path(line[4:]).name}" if line.startswith("# - ") else line for line in lines]
    config.write_text("\n".join(lines) + "\n")


def _file_entry(path: Path) -> dict:
    return {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}


def check_ort_parity(onnx_paths: dict[str, Path], ort_paths: dict[str, Path], config: dict, layout: str) -> dict:
    """The .ort graphs against the .onnx graphs they came from (decoder layout `layout`): fp32 CPU tolerance,
    teacher-forced tokens equal."""
    from toolkit.parity.graphs import bundle_parity
    from toolkit.parity.tolerances import tolerance

    tol = tolerance("fp32", "cpu")              # a format change, not a precision change, whatever the precision
    record = bundle_parity(onnx_paths, ort_paths, config, "cpu", tol, labels=("ORT format", ".onnx graphs"),
                           layouts=(layout, layout)).to_dict()
    if not record["verified"] or record["teacher_forced_tokens_equal"] < 1.0:
        raise ParityError(f"the ORT-format graphs differ from the .onnx graphs: {record['summary']} (tokens equal "
                          f"{record['teacher_forced_tokens_equal']:.2%}); nothing was written", record)
    keep = ("verified", "provider", "tolerance", "max_abs", "summary", "teacher_forced_tokens_equal", "steps", "batch")
    return {k: record[k] for k in keep}


__all__ = ["add_ort_format", "check_ort_parity", "check_convertible", "OrtFormatError",
           "CONFIG_FILE"]
