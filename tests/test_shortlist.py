"""The vocabulary shortlist: the build command and its storage (exporters/shortlist.py), the decoder's shortlist
variant (exporters/shortlist_graph.py), the runtime's use of it (runtime/shortlist.py, feed, engine) and the gate.

Exactness: a row decodes on the shortlist exactly as it does alone (each row sees only its own candidates), and a
shortlist covering the whole vocabulary gives exactly what the full vocabulary gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from exporters.optimize import optimize_bundle
from exporters.shortlist import build_map, shortlist_bundle
from runtime.bundle import load_bundle
from runtime.errors import BundleError, InputError
from runtime.generate import generate_ids
from runtime.manifest import inspect_report, format_inspect
from runtime.search import SearchOptions
from runtime.shortlist import Shortlist
from toolkit.apps.cli import main
from toolkit.parity import ParityError

from conftest import TOY_CHARS

SEQS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [9], [12, 13, 14, 15, 30]]
SEARCHES = {"greedy": SearchOptions(max_new_tokens=12),
            "beam": SearchOptions(max_new_tokens=12, beam=3, num_return=2),
            "sample": SearchOptions(max_new_tokens=12, sample=True, num_return=2, seed=7, top_k=20)}


def _lines(rng, n: int) -> list[str]:
    return ["".join(rng.choice(list(TOY_CHARS), size=int(rng.integers(3, 12)))) for _ in range(n)]


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(2)
    return _lines(rng, 800), _lines(rng, 40)                    # (corpus, held-out gate inputs)


@pytest.fixture(scope="module")
def shortlisted(toy_exported, texts, tmp_path_factory):
    """{layout: bundle with a shortlist}: the exported (dynamic) bundle and its fused static-cache bundle."""
    _, exported = toy_exported
    root = tmp_path_factory.mktemp("shortlist")
    static, _ = optimize_bundle(exported, root / "static")
    corpus, held = texts
    return {layout: restricting_shortlist(source, corpus, held, root / f"{layout}_sl")
            for layout, source in (("dynamic", Path(exported)), ("static", static))}


ALWAYS = (4, 8, 16, 32)     # the always-included set: tried from the smallest, as a user raising --always would


def restricting_shortlist(source: Path, corpus: list[str], held: list[str], out: Path) -> Path:
    """A shortlist of the toy bundle that passes the gate and still restricts SEQS' vocabulary: the smallest
    --always that gives one on this model. The toy model's few wrong tokens decide which --always needs (a token no
    source token's candidates hold), and another CPU's kernels train other wrong tokens: measured, not hoped for."""
    tried = []
    for always in ALWAYS:
        try:
            path, _ = shortlist_bundle(source, corpus, out, sizes=(4, 16, 24), always=always, texts=held)
        except ParityError as exc:
            tried.append((always, [f"size {t['size']}: {t['agreement']:.2%}" for t in exc.report["tried"]]))
            continue
        engine = load_bundle(path, provider="cpu").engine
        if len(set(np.concatenate([engine.shortlist.of(s) for s in SEQS]).tolist())) < engine.vocab_size:
            return path
        tried.append((always, "verified, but its candidates for SEQS cover the whole vocabulary"))
        shutil.rmtree(path)
    raise AssertionError(f"needed a verified shortlist that restricts SEQS' vocabulary; no --always in {ALWAYS} gave "
                         f"one on this toy model: {tried}")


def _tokens(engine, seqs, opts):
    return [[(h.tokens, h.score) for h in hyps] for hyps in generate_ids(engine, seqs, opts)]


@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("search", SEARCHES)
def test_a_row_on_the_shortlist_gets_its_unbatched_output(shortlisted, layout, search):
    engine = load_bundle(shortlisted[layout], provider="cpu").engine
    opts = SEARCHES[search]
    batched = _tokens(engine, SEQS, opts)
    if opts.sample:                       # draws are seeded by the input's index: other neighbours, same index
        assert batched == [_tokens(engine, [[60]] * b + [s], opts)[b] for b, s in enumerate(SEQS)]
    else:
        assert batched == [_tokens(engine, [s], opts)[0] for s in SEQS]
    own = [engine.shortlist.of(s) for s in SEQS]
    assert all(set(t for tokens, _ in hyps for t in tokens) <= set(own[i].tolist()) for i, hyps in enumerate(batched))
    assert len(set(np.concatenate(own).tolist())) < engine.vocab_size          # the shortlist restricts the union


@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("search", SEARCHES)
def test_a_shortlist_of_the_whole_vocabulary_equals_no_shortlist(shortlisted, layout, search):
    engine = load_bundle(shortlisted[layout], provider="cpu").engine
    whole = Shortlist(np.zeros(engine.src_vocab_size + 1, np.int64), np.zeros(0, np.int64),
                      np.arange(engine.vocab_size))
    engine.use_shortlist(whole, engine.feed.shortlist_decoder, engine.feed.shortlist_weight)
    opts = SEARCHES[search]
    full = _tokens(engine, SEQS, SearchOptions(**{**opts.__dict__, "shortlist": False}))
    assert _tokens(engine, SEQS, opts) == full
    assert len({tuple(h[0][0]) for h in full}) == len(SEQS)            # outputs that vary


def test_a_shortlist_too_small_changes_tokens_and_no_shortlist_turns_it_off(shortlisted):
    engine = load_bundle(shortlisted["static"], provider="cpu").engine
    tiny = Shortlist(np.zeros(engine.src_vocab_size + 1, np.int64), np.zeros(0, np.int64), np.array([2, 10, 11]))
    engine.use_shortlist(tiny, engine.feed.shortlist_decoder, engine.feed.shortlist_weight)
    on = _tokens(engine, SEQS, SEARCHES["greedy"])
    off = _tokens(engine, SEQS, SearchOptions(max_new_tokens=12, shortlist=False))
    assert all(set(h[0][0]) <= {2, 10, 11} for h in on) and on != off
    assert off == _tokens(load_bundle(shortlisted["static"], provider="cpu", shortlist=False).engine, SEQS,
                          SEARCHES["greedy"])
    forced = generate_ids(engine, SEQS[:2], SearchOptions(max_new_tokens=4, prefix_ids=((30, 31), (32,))))
    assert forced[0][0].tokens[:2] == [30, 31] and forced[1][0].tokens[0] == 32
    assert all(np.isfinite(h[0].score) for h in forced)              # forced tokens are each input's candidates


def test_the_manifest_records_the_shortlist_and_inspect_shows_it(shortlisted):
    manifest = json.loads((shortlisted["static"] / "manifest.json").read_text())
    record = manifest["shortlist"]
    assert record["verified"] and record["gate"]["agreement"] >= 0.995 and record["size"] in (4, 16, 24)
    assert {record["file"], record["decoder"]["file"]} <= set(manifest["files"])
    assert record["gate"]["distinct_outputs"] >= 10 and record["sizes"]["always"] >= 3
    report = inspect_report(shortlisted["static"])
    assert "shortlist: shortlist.npz + decoder.shortlist.onnx" in format_inspect(report)
    assert report["shortlist"]["gate"]["agreement"] == record["gate"]["agreement"]


@pytest.mark.parametrize("layout", ["dynamic", "static"])
def test_the_projection_rows_are_gathered_once_per_request_from_the_recorded_table(shortlisted, layout,
                                                                                     monkeypatch):
    """A request gathers its candidates' projection rows once (not every step, not at every beam reorder), from
    the table the manifest's weight record maps: the tied embedding in weights.data, no copy."""
    from runtime.shortlist import ShortlistWeight

    record = json.loads((shortlisted[layout] / "manifest.json").read_text())["shortlist"]["weight"]
    assert record["feed"] == "rows" and record["dtype"] == "float32"
    assert record["file"] == "weights.data" and not (shortlisted[layout] / "shortlist.weight.bin").exists()
    engine = load_bundle(shortlisted[layout], provider="cpu").engine
    calls = []
    take = ShortlistWeight.take
    monkeypatch.setattr(ShortlistWeight, "take", lambda self, ids: calls.append(len(ids)) or take(self, ids))
    for search in ("greedy", "beam"):
        calls.clear()
        hyps = generate_ids(engine, SEQS, SEARCHES[search])
        assert len(calls) == 1 and max(len(h.tokens) for hs in hyps for h in hs) > 3, search


def test_a_shortlist_weight_record_that_does_not_fit_its_file_is_refused(shortlisted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shortlisted["static"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shortlist"]["weight"]["offset"] = manifest["files"]["weights.data"]["bytes"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="shortlist weight.*rebuild the shortlist with onnxformer shortlist"):
        load_bundle(copy, provider="cpu")
    assert load_bundle(copy, provider="cpu", shortlist=False).engine.shortlist is None


def test_a_changed_shortlist_file_is_refused(shortlisted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shortlisted["dynamic"], copy)
    with open(copy / "shortlist.npz", "ab") as f:
        f.write(b"x")
    with pytest.raises(BundleError, match="shortlist.npz"):
        load_bundle(copy, provider="cpu")


def test_the_gate_refuses_with_the_figure_or_writes_unverified(toy_exported, texts, tmp_path):
    _, exported = toy_exported
    corpus, held = texts
    (tmp_path / "corpus.txt").write_text("\n".join(corpus) + "\n")
    (tmp_path / "held.txt").write_text("\n".join(held) + "\n")
    args = ["shortlist", str(exported), "--corpus", str(tmp_path / "corpus.txt"), "--input", str(tmp_path / "held.txt"),
            "--size", "1", "--always", "0", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "did not pass the gate" in result.output and "size 1 " in result.output
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(main, args + ["--allow-unverified"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "manifest.json").read_text())["shortlist"]
    assert not record["verified"] and record["allowed_unverified"] and record["gate"]["agreement"] < 0.995
    bad = CliRunner().invoke(main, args[:-2] + ["--size", "0", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "positive counts" in bad.output


def test_the_map_keeps_the_most_frequent_pairs_beyond_the_always_set():
    config = {"vocab_size": 10, "pad_id": 0, "bos_id": 1, "eos_id": 2}
    sources = [[3, 4], [3], [4, 5]]
    targets = [[6, 7, 9], [6, 8], [7, 9]]
    m = build_map(sources, targets, config, size=1, always=1)
    assert m.always.tolist() == [0, 1, 2, 6]                         # specials, then the most frequent target (6)
    assert m.of([3]).tolist() == [0, 1, 2, 6, 7]                     # 3: 7 once, 8 once, 9 once: lowest id first
    assert m.of([5]).tolist() == [0, 1, 2, 6, 7]
    vocab, allowed = m.select(np.array([[3, 5, 0], [4, 0, 0]]), np.array([[1, 1, 0], [1, 0, 0]]), [(), (8,)])
    assert vocab.tolist() == [0, 1, 2, 6, 7, 8] and allowed.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]


def test_in_flight_rows_on_the_shortlist_get_their_unbatched_outputs(shortlisted, toy_model_factory):
    from runtime.inflight import InflightBatch
    from test_inflight import assert_alone, drive
    from toolkit.testing.toy import toy_inputs

    engine = load_bundle(shortlisted["static"], provider="cpu").engine
    seqs = toy_inputs(toy_model_factory().config, 16, min_len=1, max_len=12, seed=5)
    limits = np.random.default_rng(3).integers(1, 16, size=len(seqs))
    got = drive(InflightBatch(engine, slots=4), seqs, limits, per_join=2)
    assert_alone(engine, seqs, limits, got)                            # tokens equal, scores within rounding
    assert len({tuple(h.tokens) for h in got.values()}) > 8
    batch, mixed = InflightBatch(engine, slots=4), {}                 # one row without the shortlist among them
    for row in batch.join(seqs[:3], [12] * 3, shortlist=[True, False, True]):
        mixed[row.key] = row
    while batch.live:
        batch.step()
    for i, on in enumerate([True, False, True]):
        want = generate_ids(engine, [seqs[i]], SearchOptions(max_new_tokens=12, shortlist=on))[0][0]
        assert mixed[i].tokens == want.tokens and abs(mixed[i].score - want.score) <= 1e-4


@pytest.mark.slow                        # an int8 optimize of its own
@pytest.mark.parametrize("recipe", ["default", "per-channel", "fp32-projection", "blocks"])
def test_an_int8_bundle_gets_a_shortlist_equal_to_its_full_vocabulary_when_it_covers_it(toy_exported, texts,
                                                                                          tmp_path, recipe):
    _, exported = toy_exported
    int8, made = optimize_bundle(exported, tmp_path / "int8", precision="int8", allow_unverified=True,
                                 recipe=recipe)        # its projection: QGemms by the table's row slices, or MatMul in fp32
    corpus, held = texts
    out, report = shortlist_bundle(int8, corpus, tmp_path / "int8_sl", sizes=(16,), always=4, texts=held,
                                   allow_unverified=True)
    assert report.tried[0]["agreement"] > 0.9
    manifest = json.loads((out / "manifest.json").read_text())
    weight = manifest["shortlist"]["weight"]
    if recipe == "fp32-projection":
        assert (weight["file"], weight["feed"], weight["offset"]) == ("shortlist.weight.bin", "rows", 0)
        assert weight["length"] == (out / "shortlist.weight.bin").stat().st_size      # W^T, written once
    else:                          # the tied int8 table [V, D] where it lies in weights.data (exporters/tied_table)
        table = next(t for t in manifest["shared_weights"]["tensors"] if t["dtype"] == "int8")
        assert (weight["file"], weight["feed"], weight["offset"], weight["length"]) == \
               ("weights.data", "columns", table["offset"], table["length"])
        assert not (out / "shortlist.weight.bin").exists()
    engine = load_bundle(out, provider="cpu").engine
    whole = Shortlist(np.zeros(engine.src_vocab_size + 1, np.int64), np.zeros(0, np.int64),
                      np.arange(engine.vocab_size))
    engine.use_shortlist(whole, engine.feed.shortlist_decoder, engine.feed.shortlist_weight)
    for opts in (SEARCHES["greedy"], SEARCHES["beam"]):
        assert _tokens(engine, SEQS, opts) == _tokens(engine, SEQS, SearchOptions(**{**opts.__dict__,
                                                                                     "shortlist": False}))


@pytest.mark.slow                        # an int8 optimize of its own
def test_a_per_row_int8_bundle_is_refused_with_the_recipes_the_shortlist_reads(toy_exported, texts, tmp_path):
    _, exported = toy_exported
    int8, _ = optimize_bundle(exported, tmp_path / "int8", precision="int8", allow_unverified=True, recipe="per-row")
    corpus, held = texts
    with pytest.raises(InputError, match="recipe default"):
        shortlist_bundle(int8, corpus, tmp_path / "out", sizes=(16,), always=4, texts=held, allow_unverified=True)
    assert not (tmp_path / "out").exists()


def _by_transposed_table(path: Path):
    """The toy decoder projecting by Transpose(table [V, D]), as large tied decoders do: (model, its MatMul, table)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    matmul = next(n for n in graph.node if "logits" in n.output)
    weight = next(t for t in graph.initializer if t.name == matmul.input[1])
    table = numpy_helper.to_array(weight).T.copy()
    graph.initializer.remove(weight)
    graph.initializer.append(numpy_helper.from_array(table, "table"))
    graph.node.insert(0, helper.make_node("Transpose", ["table"], [matmul.input[1]], perm=[1, 0]))
    return model, matmul, table


def _decoder_feeds(session) -> dict:
    """Random inputs for the toy decoder session (batch 2, lengths 3), its masks all ones."""
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        shape = [2 if d in ("batch",) else 3 if isinstance(d, str) else d for d in i.shape]
        feeds[i.name] = (rng.integers(3, 60, size=shape) if "int" in i.type else
                         rng.standard_normal(shape).astype(np.float32))
    feeds["encoder_attention_mask"] = np.ones_like(feeds["encoder_attention_mask"])
    feeds["decoder_attention_mask"] = np.ones_like(feeds["decoder_attention_mask"])
    return feeds


@pytest.mark.parametrize("bias", [False, True])
def test_a_projection_by_a_transposed_table_gathers_the_table_itself(toy_exported, tmp_path, bias):
    """Large tied decoders multiply by Transpose(embedding) (not folded): the shortlist graph takes the
    embedding's rows, and its logits for any ids are the full graph's columns (with a final logits bias too, as
    Marian and BART have)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from exporters.shortlist_graph import shortlist_decoder

    _, exported = toy_exported
    model, matmul, table = _by_transposed_table(Path(exported) / "decoder.onnx")
    graph = model.graph
    if bias:                                                         # logits = MatMul + final_logits_bias
        matmul.output[0] = "projected"
        graph.initializer.append(numpy_helper.from_array(np.linspace(-1, 1, table.shape[0], dtype=np.float32),
                                                         "final_logits_bias"))
        graph.node.append(helper.make_node("Add", ["projected", "final_logits_bias"], ["logits"]))
    full = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    short, found = shortlist_decoder(onnx.ModelProto.FromString(model.SerializeToString()), tmp_path)
    assert not any(n.op_type == "Transpose" and "table" in n.input for n in short.graph.node)
    assert not any(n.op_type == "Gather" and "table" in n.input for n in short.graph.node)  # rows come bound
    assert found.feed == "rows" and np.array_equal(found.array, table)   # inline here: written beside the graph
    session = ort.InferenceSession(short.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds, ids = _decoder_feeds(full), np.array([2, 5, 17, 40, 63])
    want = full.run(["logits"], feeds)[0][..., ids]
    assert np.array_equal(session.run(["logits"], {**feeds, "vocab_ids": ids, "shortlist_weight": table[ids]})[0],
                          want)


def test_an_fp32_projection_by_row_slices_gathers_the_table_where_it_lies(toy_exported, tmp_path):
    """optimize's fp32 CPU bundles project a tied table by Gemm row slices over its own bytes (exporters/tied_table):
    the shortlist graph reads them as the one table they are, from weights.data (no copy), with the same logits."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    from exporters.shared_weights import save_graph, share_weights
    from exporters.shortlist_graph import shortlist_decoder
    from exporters.tied_table import TiedTablePass

    _, exported = toy_exported
    model, _, table = _by_transposed_table(Path(exported) / "decoder.onnx")
    graph = model.graph
    lookup = next(n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    lookup.input[0] = "table"                                         # tied: the lookup reads the same table
    converted = ir.from_proto(model)
    step = TiedTablePass(floats=True, float_slice_bytes=table.shape[1] * 4 * 16)
    step(converted)
    assert step.counts["tied_table_float_projection"] == 1
    converted_proto = ir.to_proto(converted).SerializeToString()
    save_graph(converted, tmp_path / "decoder.onnx")
    save_graph(ir.from_proto(onnx.load(str(Path(exported) / "encoder.onnx"))), tmp_path / "encoder.onnx")
    share_weights({g: tmp_path / f"{g}.onnx" for g in ("encoder", "decoder")}, external_bytes=4096)   # toy sizes
    saved = onnx.load(str(tmp_path / "decoder.onnx"), load_external_data=False)
    assert sum(n.op_type == "Gemm" for n in saved.graph.node) > 1
    gather = next(n for n in saved.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    stored = {e.key: e.value for e in next(t for t in saved.graph.initializer if t.name == gather.input[0]).external_data}
    short, found = shortlist_decoder(onnx.ModelProto.FromString(saved.SerializeToString()), tmp_path)
    assert found.feed == "rows" and found.array is None                # the lookup's own table, in place
    assert found.source == {"file": "weights.data", "offset": int(stored["offset"]), "length": table.nbytes}
    assert not any(n.op_type == "Gemm" and n.name != "shortlist.projection" for n in short.graph.node)
    onnx.save(short, str(tmp_path / "short.onnx"))
    full = ort.InferenceSession(str(tmp_path / "decoder.onnx"), providers=["CPUExecutionProvider"])
    session = ort.InferenceSession(str(tmp_path / "short.onnx"), providers=["CPUExecutionProvider"])
    feeds, ids = _decoder_feeds(full), np.array([2, 5, 17, 40, 63])
    want = full.run(["logits"], feeds)[0][..., ids]
    got = session.run(["logits"], {**feeds, "vocab_ids": ids, "shortlist_weight": table[ids]})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)         # Gemm by other rows: other sums, float eps
    inline, found = shortlist_decoder(onnx.ModelProto.FromString(converted_proto), tmp_path)   # slices in the graph
    assert found.feed == "rows" and np.array_equal(found.array, table)  # (a small table): gathered from a copy


NLLB_TEXTS = ["the quick fox jumps", "a lazy dog", "seven wizards hex the box", "over the jolly fox", "quietly",
              "the box", "brown dog jumps", "wizards", "the jolly wizards", "a quick box", "dog and fox",
              "seven boxes", "hex the dog", "the lazy wizards jump", "quick quick", "over the box"]


@pytest.fixture(scope="module")
def per_language(nllb_bundle, tmp_path_factory):
    """The tiny NLLB bundle, optimized, with one shortlist map per target language (deu_Latn, spa_Latn): (bundle,
    report)."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("per_language")
    static, _ = optimize_bundle(nllb_bundle, root / "static")             # in-flight batching needs a static cache
    return shortlist_bundle(static, NLLB_TEXTS * 4, root / "nllb_sl", sizes=(8,), always=8, texts=NLLB_TEXTS,
                            allow_unverified=True, src_lang="fra_Latn",     # the default length: the model's
                            tgt_langs=("deu_Latn", "spa_Latn"))            # max_len (48) less the language token


def test_a_multilingual_bundle_gets_one_map_per_target_language(per_language):
    """Each target language's map is built from the corpus translated into it; a request decodes on its own
    target language's map (picked by its forced first token), and on the union of all when it names none."""
    from runtime.request import languages

    out, report = per_language
    record = json.loads((out / "manifest.json").read_text())["shortlist"]
    codes = [lang["code"] for lang in record["languages"]]
    assert codes == ["deu_Latn", "spa_Latn"] and [t["language"] for t in report.tried] == codes
    bundle = load_bundle(out, provider="cpu")
    table = bundle.engine.shortlist
    leads = {code: languages(bundle.tokenizer, "fra_Latn", code)[1] for code in codes}
    assert sorted(table.languages) == sorted(lead[0] for lead in leads.values())
    assert record["sizes"]["languages"] == 2
    source = languages(bundle.tokenizer, "fra_Latn", "deu_Latn")[0].encode("the quick fox")
    deu, spa = (table.of(source, leads[c]) for c in codes)
    assert not np.array_equal(deu, spa)                              # the maps differ: each language's own targets
    assert leads["deu_Latn"][0] in deu and leads["spa_Latn"][0] in spa
    both = table.of(source)                                          # no language named: every language's map
    assert set(deu.tolist()) - set(leads["deu_Latn"]) <= set(both.tolist())
    assert set(spa.tolist()) - set(leads["spa_Latn"]) <= set(both.tolist())
    opts = SearchOptions(max_new_tokens=8, prefix_ids=(tuple(leads["deu_Latn"]),), prefix_counted=1)
    hyp = generate_ids(bundle.engine, [source], opts)[0][0]
    assert hyp.tokens[0] == leads["deu_Latn"][0] and set(hyp.tokens) <= set(deu.tolist())


def test_per_language_maps_covering_the_vocabulary_equal_no_shortlist_in_flight_too(per_language):
    from runtime.inflight import InflightBatch
    from runtime.processors import Controls
    from runtime.request import languages

    out, _ = per_language
    bundle = load_bundle(out, provider="cpu")
    engine = bundle.engine
    whole = Shortlist(np.zeros(engine.src_vocab_size + 1, np.int64), np.zeros(0, np.int64),
                      np.arange(engine.vocab_size))
    engine.use_shortlist(Shortlist.per_language({lead: whole for lead in engine.shortlist.languages}),
                         engine.feed.shortlist_decoder, engine.feed.shortlist_weight)
    framed, lead = languages(bundle.tokenizer, "fra_Latn", "spa_Latn")
    seqs = [framed.encode(t) for t in NLLB_TEXTS[:6]]
    opts = SearchOptions(max_new_tokens=8, prefix_ids=(tuple(lead),) * len(seqs), prefix_counted=1)
    on = [h[0].tokens for h in generate_ids(engine, seqs, opts)]
    off = [h[0].tokens for h in generate_ids(engine, seqs, SearchOptions(**{**opts.__dict__, "shortlist": False}))]
    assert on == off and len({tuple(t) for t in on}) >= 4            # outputs that vary
    batch = InflightBatch(engine, slots=4)
    controls = Controls.of(opts, len(seqs), 1, engine.eos_id)
    rows = batch.join(seqs[:4], [8] * 4, controls=[(controls, i) for i in range(4)])
    assert all(lead[0] in r.candidates for r in rows)                # a row's forced language is its candidate
    while batch.live:
        batch.step()
    assert [r.tokens for r in rows] == off[:4]


def test_a_multilingual_bundle_needs_its_target_languages_for_a_shortlist(nllb_bundle, tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "corpus.txt").write_text("\n".join(NLLB_TEXTS) + "\n")
    result = CliRunner().invoke(main, ["shortlist", str(nllb_bundle), "--corpus", str(tmp_path / "corpus.txt"),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "multilingual: give the target language" in result.output
    assert not (tmp_path / "out").exists()
