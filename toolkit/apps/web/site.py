"""`onnxformer web`: a bundle as a static web page that runs it in the browser (onnxruntime-web, WASM EP).

    write_site(bundle, out, force, webgpu)   # out: index.html, onnxformer.js, text.js, onnxruntime-web's runtime
                                     # and wasm (webgpu: its WebGPU build too), @huggingface/tokenizers, the bundle,
                                     # page-tokenizer.json (page_tokenizer.py)
    serve_site(site, port)           # 127.0.0.1, with the COOP/COEP headers WASM threads need

The page's JS (toolkit/apps/web/src) and its package.json / package-lock.json live here; `npm ci` builds
node_modules beside them on first use (a user without node/npm gets one line saying so). The site is flat: the
page fetches the bundle's files from its own folder.
"""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
from pathlib import Path

from runtime.errors import InputError
from runtime.manifest import read_manifest
from toolkit.apps.web.page_tokenizer import PAGE_TOKENIZER, page_tokenizer
from toolkit.reference.outdir import OutputKind, listed_files, staged_output

HERE = Path(__file__).parent
SRC = HERE / "src"
ORT_DIST = HERE / "node_modules" / "onnxruntime-web" / "dist"
ORT_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")
WEBGPU_FILES = ("ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
PAGE_FILES = ("index.html", "onnxformer.js", "text.js")
TOKENIZERS_JS = HERE / "node_modules" / "@huggingface" / "tokenizers" / "dist" / "tokenizers.min.mjs"
SITE_JSON = "site.json"                    # what marks a folder as a site onnxformer wrote, and lists its files

# Ops of com.microsoft the WASM EP runs. onnxruntime-web's README: its WASM backend is "the native ONNX Runtime
# CPU engine compiled into WebAssembly", with full ONNX operator coverage; its contrib ops are the CPU EP's. These
# are the CPU contrib kernels onnxformer's optimize may write (the fusions, int8) that the WASM build registers.
WASM_CONTRIB_OPS = frozenset({
    "Attention", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding", "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "BiasGelu", "FastGelu", "Gelu", "QuickGelu",
    "MatMulNBits", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QGemm", "QAttention", "FusedMatMul",
    "QuantizeLinear", "DequantizeLinear", "BiasSoftmax", "DecoderMaskedMultiHeadAttention"})
ONNX_DOMAINS = ("", "ai.onnx")


site_files = listed_files(SITE_JSON)     # every file of a site onnxformer web wrote, or None
SITE_KIND = OutputKind("web site", site_files, "'onnxformer web'")


def unsupported_ops(graph_path: Path) -> list[str]:
    """The ops of an ONNX graph the WASM EP lacks, as domain::op (sorted); empty when it runs them all."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    nodes = list(model.graph.node)
    for fn in model.functions:                 # a local function's nodes run as its body's ops
        nodes += fn.node
    local = {(fn.domain, fn.name) for fn in model.functions}
    bad = {f"{n.domain}::{n.op_type}" for n in nodes if (n.domain, n.op_type) not in local
           and n.domain not in ONNX_DOMAINS and not (n.domain == "com.microsoft" and n.op_type in WASM_CONTRIB_OPS)}
    return sorted(bad)


def check_bundle(bundle: Path) -> dict:
    """The page's tokenizer JSON (page_tokenizer), once the bundle's tokenizer and every graph op are ones the page
    runs (InputError: which not)."""
    manifest = read_manifest(bundle)
    tokenizer = page_tokenizer(bundle / manifest.get("tokenizer", "tokenizer.json"))
    for name in ("encoder", "decoder"):
        graph = manifest["graphs"][name]
        bad = unsupported_ops(bundle / graph["file"])
        if bad:
            raise InputError(f"{bundle}: the {name} graph uses {', '.join(bad)}, which onnxruntime-web's WASM "
                             f"execution provider lacks; use a bundle without it (the fp32 export, or optimize "
                             f"with --target cpu)")
    return tokenizer


def _built() -> bool:
    return TOKENIZERS_JS.is_file() and all((ORT_DIST / f).is_file() for f in (*ORT_FILES, *WEBGPU_FILES))


def ensure_built() -> None:
    """node_modules with onnxruntime-web, from package-lock.json (`npm ci`), unless already there."""
    if _built():
        return
    npm = shutil.which("npm")
    if npm is None:
        raise InputError("onnxformer web needs npm once, to install onnxruntime-web from "
                         f"{HERE / 'package-lock.json'}; install Node.js (20 or newer) and run it again")
    done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=HERE, capture_output=True, text=True)
    if done.returncode != 0 or not _built():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise InputError(f"npm ci in {HERE} failed ({tail[0]}); check that the npm registry is reachable and "
                         f"run it again")


def write_site(bundle: str | Path, out: str | Path, force: bool = False, webgpu: bool = False) -> Path:
    """Write the site for `bundle` at `out` (hidden name beside it, then moved into place); webgpu: with
    onnxruntime-web's WebGPU build too (the page uses it when opened with ?ep=webgpu)."""
    bundle, out = Path(bundle), Path(out)
    tokenizer = check_bundle(bundle)
    ensure_built()
    bundle_files = sorted(p.name for p in bundle.iterdir() if p.is_file())
    with staged_output(out, force, SITE_KIND) as tmp:
        for name in bundle_files:
            shutil.copy2(bundle / name, tmp / name)
        for name in PAGE_FILES:
            shutil.copy2(SRC / name, tmp / name)
        ort_files = (*ORT_FILES, *WEBGPU_FILES) if webgpu else ORT_FILES
        for name in ort_files:
            shutil.copy2(ORT_DIST / name, tmp / name)
        shutil.copy2(TOKENIZERS_JS, tmp / TOKENIZERS_JS.name)
        (tmp / PAGE_TOKENIZER).write_text(json.dumps(tokenizer, ensure_ascii=False))
        files = sorted({*bundle_files, *PAGE_FILES, *ort_files, TOKENIZERS_JS.name, PAGE_TOKENIZER})
        (tmp / SITE_JSON).write_text(json.dumps({"bundle": str(bundle.absolute()), "files": files}, indent=2))
    return out


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Static files with the headers that make the page cross-origin isolated (SharedArrayBuffer, WASM threads)."""

    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm"}

    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, *args):              # quiet: a page load is a dozen requests
        pass


def site_server(site: str | Path, port: int = 8000) -> http.server.ThreadingHTTPServer:
    """An HTTP server of the site on 127.0.0.1:port (port 0: any free one); call serve_forever on it."""
    site = Path(site)
    if site_files(site) is None:
        raise InputError(f"{site} is not a site onnxformer web wrote (no {SITE_JSON}); write one first with "
                         f"onnxformer web BUNDLE --out {site}")
    handler = functools.partial(_Handler, directory=str(site))
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError as exc:
        raise InputError(f"cannot listen on 127.0.0.1:{port} ({exc.strerror}); pass another --port") from None
