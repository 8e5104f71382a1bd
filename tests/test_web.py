"""onnxformer web (issue 41): the page runs a bundle in headless Chromium (onnxruntime-web, WASM) and gives the
Python runtime's ids, greedy and beam 4, fp32 and int8 (slow); the command's refusals and the server's headers
(fast)."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from toolkit.apps.cli import main
from toolkit.apps.web import site as web

CHROMIUM = "/usr/bin/chromium"
MAX_NEW = 24


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# --- fast: the command's checks and the server ---

def test_unsupported_ops_names_the_op(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("SkipLayerNormalization", ["y", "y", "g"], ["z"], domain="com.microsoft"),
             helper.make_node("NoSuchKernel", ["z"], ["w"], domain="com.microsoft")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "xg"],
                              [helper.make_tensor_value_info("w", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx")
    assert web.unsupported_ops(tmp_path / "m.onnx") == ["com.microsoft::NoSuchKernel"]


def test_web_refuses_user_mistakes(tmp_path):
    result = cli("web", tmp_path / "missing", "--out", tmp_path / "site")
    assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output
    result = cli("web", tmp_path)                                    # neither --out nor --serve
    assert result.exit_code == 2 and "--out" in result.output
    result = cli("web", tmp_path, "--serve")                         # not a site onnxformer wrote
    assert result.exit_code == 2 and "site.json" in result.output
    assert not (tmp_path / "site").exists()


@pytest.fixture()
def served(tmp_path):
    """A minimal site served on a free port: (base url, site folder)."""
    (tmp_path / "index.html").write_text("<p>hi</p>")
    (tmp_path / "x.wasm").write_bytes(b"\0asm")
    (tmp_path / web.SITE_JSON).write_text(json.dumps({"files": ["index.html", "x.wasm"]}))
    server = web.site_server(tmp_path, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", tmp_path
    server.shutdown()
    server.server_close()


def test_serve_sends_isolation_headers(served):
    url, _ = served
    with urllib.request.urlopen(url + "x.wasm") as r:
        assert r.headers["Cross-Origin-Opener-Policy"] == "same-origin"
        assert r.headers["Cross-Origin-Embedder-Policy"] == "require-corp"
        assert r.headers["Content-Type"] == "application/wasm" and r.read() == b"\0asm"


def test_site_kind_knows_its_files(served, tmp_path_factory):
    _, site = served
    assert web.site_files(site) == {"index.html", "x.wasm", web.SITE_JSON}
    foreign = tmp_path_factory.mktemp("foreign")
    (foreign / "notes.txt").write_text("mine")
    kind = web.SITE_KIND
    assert kind.files(foreign) is None                               # never replaced, even with --force


# --- slow: the page in Chromium against runtime.Translator ---

def _inputs() -> list[str]:
    """32 dates in four spellings, years 1961..2056: their outputs vary."""
    formats = ("%b %d %Y", "%d/%m/%Y", "%Y-%m-%d", "%B %d, %Y")
    days = [dt.date(1961, 1, 1) + dt.timedelta(days=1117 * i + 13) for i in range(32)]
    return [d.strftime(formats[i % 4]).lower() if i % 8 == 5 else d.strftime(formats[i % 4]) for i, d in enumerate(days)]


@pytest.fixture(scope="module")
def browser():
    """Skip, with the reason, where Chromium or node/npm are missing; else onnxruntime-web installed (npm ci)."""
    for tool, path in (("chromium", shutil.which(CHROMIUM)), ("node", shutil.which("node")),
                       ("npm", shutil.which("npm"))):
        if path is None:
            pytest.skip(f"{tool} is not installed: the web page cannot be driven here")
    web.ensure_built()
    if not (web.HERE / "node_modules" / "playwright-core").is_dir():
        pytest.skip("playwright-core is not installed in toolkit/apps/web (npm ci installs it)")


@pytest.fixture(scope="module")
def int8_bundle(dates_bundle, tmp_path_factory):
    from exporters.optimize import optimize_bundle

    bundle, _ = optimize_bundle(dates_bundle, tmp_path_factory.mktemp("web_int8") / "dates-int8", precision="int8")
    return bundle


@pytest.fixture(scope="module")
def wasm_int8_bundle(dates_bundle, tmp_path_factory):
    from exporters.optimize import optimize_bundle

    bundle, _ = optimize_bundle(dates_bundle, tmp_path_factory.mktemp("web_wasm") / "dates-wasm", target="wasm",
                                precision="int8")
    return bundle


def _page_answers(site: Path, requests: list[dict], tmp_path: Path, query: str = "") -> dict:
    server = web.site_server(site, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "requests.json").write_text(json.dumps(requests))
        url = f"http://127.0.0.1:{server.server_address[1]}/{query}"
        done = subprocess.run(["node", str(web.HERE / "drive.mjs"), url,
                               str(tmp_path / "requests.json")], capture_output=True, text=True, timeout=600)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "int8", "int8-wasm"])
def test_page_ids_equal_the_runtime(browser, precision, dates_bundle, request, tmp_path):
    from runtime.api import Translator

    bundle = {"fp32": dates_bundle, "int8": request.getfixturevalue("int8_bundle")}.get(precision) \
        or request.getfixturevalue("wasm_int8_bundle")
    site = web.write_site(bundle, tmp_path / "site")
    texts, beams = _inputs(), (1, 4)
    page = _page_answers(site, [{"texts": texts, "beam": b, "maxNewTokens": MAX_NEW} for b in beams], tmp_path)
    assert page["crossOriginIsolated"] is True
    translator = Translator(bundle, provider="cpu")
    for beam, answers in zip(beams, page["answers"]):
        # one input at a time, as the page decodes (int8: an activation range spans a batch)
        expected = [r.hypotheses[0] for r in translator.generate(texts, batch_size=1, beam=beam,
                                                                    max_new_tokens=MAX_NEW)]
        assert len({tuple(h.ids) for h in expected}) >= 8               # outputs that vary
        assert [a["ids"] for a in answers] == [h.ids for h in expected], (precision, beam)
        assert [a["text"] for a in answers] == [h.text for h in expected]


@pytest.mark.slow
def test_wasm_target_projects_by_one_product(int8_bundle, wasm_int8_bundle):
    """optimize --target wasm: the CPU graphs (static per-row cache, int8) but the tied table's projection stays one
    DynamicQuantizeMatMul, not --target cpu's row-sliced QGemms (which onnxruntime-web runs 2.4x slower)."""
    from runtime.manifest import read_manifest

    cpu, wasm = read_manifest(int8_bundle), read_manifest(wasm_int8_bundle)
    assert (cpu["target"], wasm["target"]) == ("cpu", "wasm")
    assert wasm["decoder_layout"] == cpu["decoder_layout"] == "static-per-row"
    ops = {name: m["graphs"]["decoder"]["op_counts"] for name, m in (("cpu", cpu), ("wasm", wasm))}
    assert ops["cpu"].get("com.microsoft.QGemm", 0) >= 1 and "com.microsoft.QGemm" not in ops["wasm"]
    assert "tied_table_rows" in cpu["passes"] and "tied_table_rows" not in wasm["passes"]


@pytest.mark.slow
def test_page_generate_takes_ids_holds_eos_back_and_runs_threads(browser, dates_bundle, tmp_path):
    """window.onnxformer.generate (what benchmarks/race_web.py times): source ids in, no tokenizer; minNewTokens
    holds EOS back as the runtime's min_new_tokens does; ?threads=2 gives ONNX Runtime two WASM threads. The ids
    equal runtime.Translator's on the same ids, greedy and beam 4, and every answer has its search's ms."""
    from runtime.api import Translator
    from runtime.tokenizer import load_tokenizer

    texts, least = _inputs()[:12], 18                     # the dates' outputs end sooner: EOS must be held back
    sources = [load_tokenizer(dates_bundle / "tokenizer.json").encode(t) for t in texts]
    site = web.write_site(dates_bundle, tmp_path / "site")
    requests = [{"sources": sources, "beam": b, "maxNewTokens": MAX_NEW, "minNewTokens": least} for b in (1, 4)]
    page = _page_answers(site, requests, tmp_path, query="?threads=2")
    assert page["threads"] == 2 and page["crossOriginIsolated"] is True
    translator = Translator(dates_bundle, provider="cpu")
    free = translator.generate(sources, batch_size=1, max_new_tokens=MAX_NEW)
    assert min(len(r.hypotheses[0].ids) for r in free) < least       # the option matters on these inputs
    for beam, answers in zip((1, 4), page["answers"]):
        expected = [r.hypotheses[0] for r in translator.generate(sources, batch_size=1, beam=beam,
                                                                    max_new_tokens=MAX_NEW, min_new_tokens=least)]
        assert len({tuple(h.ids) for h in expected}) >= 6                # outputs that vary
        assert all(len(h.ids) >= least for h in expected)
        assert [a["ids"] for a in answers] == [h.ids for h in expected], beam
        assert all(a["ms"] > 0 for a in answers)


@pytest.mark.slow
def test_web_cli_refuses_an_op_and_replaces_only_with_force(int8_bundle, monkeypatch, tmp_path):
    """exit 2 naming the op where the WASM EP lacks one (here: the int8 graphs' attention, with the list emptied);
    an existing site is replaced with --force only."""
    monkeypatch.setattr(web, "WASM_CONTRIB_OPS", frozenset())
    result = cli("web", int8_bundle, "--out", tmp_path / "site")
    assert result.exit_code == 2 and "com.microsoft::MultiHeadAttention" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "site").exists()
    monkeypatch.undo()
    assert cli("web", int8_bundle, "--out", tmp_path / "site").exit_code == 0
    result = cli("web", int8_bundle, "--out", tmp_path / "site")
    assert result.exit_code == 2 and "--force" in result.output
    assert cli("web", int8_bundle, "--out", tmp_path / "site", "--force").exit_code == 0
    assert web.site_files(tmp_path / "site") == {p.name for p in (tmp_path / "site").iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["site"]          # no hidden staging folder left beside it
