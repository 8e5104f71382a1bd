"""In-flight batching (runtime/inflight.py): rows join a running batch and leave at once; every row's tokens,
finished flag and score equal its unbatched generate_ids result (fp32, varied outputs), across staggered
joins, rows at different lengths in one step, rows leaving mid-batch, stopped rows and reused buffer rows, and
rows that each keep their own request's decoding controls (penalties, bans, prefixes, logprobs, sampling)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.bundle import load_bundle
from runtime.errors import BundleError, InputError
from runtime.generate import generate, generate_ids
from runtime.inflight import InflightBatch, answer, check_engine
from runtime.request import Request
from runtime.search import SearchOptions
from runtime.spec import STATIC_PER_ROW, STATIC_SHARED
from toolkit.testing.toy import toy_inputs


@pytest.fixture(scope="module")
def bundles(toy_exported, tmp_path_factory):
    from exporters.optimize import optimize_bundle

    static, report = optimize_bundle(toy_exported[1], tmp_path_factory.mktemp("inflight") / "static")
    assert report.kv_cache == "static"
    return {"dynamic": toy_exported[1], "static": static}


@pytest.fixture(scope="module")
def engine(bundles):
    return load_bundle(bundles["static"], provider="cpu").engine


def poison(batch: InflightBatch) -> None:
    """NaN in every cache slot no live row has filled (beyond each row's length; free rows entirely): a row that
    read another row's slots, or stale ones, would get NaN logits."""
    for buf in batch.buffers:
        for i, row in enumerate(batch.rows):
            buf[i, :, row.length:] = np.nan
        buf[batch.live:] = np.nan


def drive(batch: InflightBatch, seqs, limits, per_join: int = 2, every: int = 1, stop_after: dict | None = None,
          check=None):
    """Join up to `per_join` waiting rows every `every` steps while slots are free; {row index: hypothesis}.
    check(batch): called before every step (e.g. poison)."""
    waiting, done, step = list(range(len(seqs))), {}, 0
    rows = {}
    while waiting or batch.live:
        if check is not None:
            check(batch)
        if waiting and step % every == 0 and batch.free:
            take = waiting[:min(per_join, batch.free)]
            waiting = waiting[len(take):]
            for row in batch.join([seqs[i] for i in take], [limits[i] for i in take], keys=take):
                rows[row.key] = row
                if row.limit == 0:
                    done[row.key] = row.hypothesis()
        for key, after in (stop_after or {}).items():
            if key in rows and len(rows[key].tokens) >= after:
                batch.stop(rows[key])
        for row in batch.step():
            done[row.key] = row.hypothesis()
        step += 1
    return done


def assert_alone(engine, seqs, limits, got, atol=1e-4):
    for i, (seq, limit) in enumerate(zip(seqs, limits)):
        alone = generate_ids(engine, [seq], SearchOptions(max_new_tokens=int(limit)))[0][0]
        assert got[i].tokens == alone.tokens, (i, got[i].tokens, alone.tokens)
        assert got[i].finished == alone.finished, i
        assert abs(got[i].score - alone.score) <= atol, (i, got[i].score, alone.score)


def test_rows_joining_and_leaving_get_their_unbatched_outputs(engine, toy_model_factory):
    config = toy_model_factory().config
    seqs = toy_inputs(config, 40, min_len=1, max_len=12, seed=11)
    limits = np.random.default_rng(4).integers(0, 21, size=len(seqs))
    batch = InflightBatch(engine, slots=6)
    spreads = []
    got = drive(batch, seqs, limits, per_join=2, check=lambda b: spreads.append(
        max((r.length for r in b.rows), default=0) - min((r.length for r in b.rows), default=0)))
    assert batch.joined == int((limits > 0).sum()) and batch.steps < int(limits.sum())   # rows shared steps
    assert max(spreads) >= 8 and sum(s > 0 for s in spreads) > len(spreads) // 2     # rows at different lengths
    assert_alone(engine, seqs, limits, got)
    assert len({tuple(h.tokens) for h in got.values()}) > 20, "outputs do not vary: equality proves nothing"
    assert len({len(h.tokens) for h in got.values()}) > 5 and any(h.finished for h in got.values())


def test_rows_read_only_their_own_slots(engine, toy_model_factory):
    """A 20-position buffer of 4 rows that 24 rows of 8-20 tokens pass through, one joining every 3 steps: each
    buffer row is reused 6 times, a joiner lands on a longer row's leftovers, the rows that move into freed places
    carry their slots. Every slot no row has written is NaN before each step: the outputs are still exact."""
    config = toy_model_factory().config
    seqs = toy_inputs(config, 24, min_len=1, max_len=12, seed=12)
    limits = np.random.default_rng(5).integers(8, 21, size=len(seqs))
    batch = InflightBatch(engine, slots=4, opts=SearchOptions(ignore_eos=True), capacity=20)
    got = drive(batch, seqs, limits, per_join=1, every=3, check=poison)
    for i, limit in enumerate(limits):
        alone = generate_ids(engine, [seqs[i]], SearchOptions(max_new_tokens=int(limit), ignore_eos=True))[0][0]
        assert got[i].tokens == alone.tokens and len(alone.tokens) == limit
        assert abs(got[i].score - alone.score) <= 1e-4


def test_a_stopped_row_leaves_with_what_it_had(engine, toy_model_factory):
    config = toy_model_factory().config
    seqs = toy_inputs(config, 6, min_len=3, max_len=12, seed=13)
    limits = [30] * 6
    batch = InflightBatch(engine, slots=3, opts=SearchOptions(ignore_eos=True))
    got = drive(batch, seqs, limits, per_join=3, stop_after={1: 4, 4: 2})
    full = generate_ids(engine, seqs, SearchOptions(max_new_tokens=30, ignore_eos=True))
    for i in range(6):
        want = full[i][0].tokens
        if i in (1, 4):
            assert 1 <= len(got[i].tokens) < 30 and got[i].tokens == want[:len(got[i].tokens)]
        else:
            assert got[i].tokens == want


def test_engines_in_flight_batching_cannot_drive_are_refused(bundles):
    dynamic = load_bundle(bundles["dynamic"], provider="cpu").engine
    with pytest.raises(InputError, match="static-cache decoder.*--kv-cache static"):
        InflightBatch(dynamic)
    shared = SimpleNamespace(layout=STATIC_SHARED, provider="cpu")      # a CUDA bundle's shared-slot cache
    with pytest.raises(InputError, match="one shared length for all rows.*--target cpu"):
        check_engine(shared)


def test_bundles_before_the_declared_layout_are_refused(bundles, toy_model_factory, tmp_path):
    """Format 2 bundles (some of them exported before per-row positions) are refused at load: re-export. A decoder
    interface without position_ids does not pass the load-time check either."""
    from runtime.bundle import _check_recorded
    from runtime.spec import POSITION_IDS, GraphSpec, graph_specs

    from conftest import copy_with_manifest

    old = copy_with_manifest(bundles["static"], tmp_path / "old", format_version=2)
    with pytest.raises(BundleError, match="format_version 2, older than this onnxformer reads.*re-export"):
        load_bundle(old, provider="cpu")
    expected = graph_specs(toy_model_factory().config.to_dict(), layout=STATIC_PER_ROW)["decoder"]
    without = GraphSpec("decoder", tuple(t for t in expected.inputs if t.name != POSITION_IDS), expected.outputs)
    with pytest.raises(BundleError, match="interface differs"):
        _check_recorded(tmp_path, "decoder", without, expected)


def mixed_options(engine, seqs) -> list[dict]:
    """Search options of requests that share one in-flight batch (request k: inputs 2k and 2k + 1, or 2k alone for
    one prefix): every control a row keeps for itself; requests of equal settings side by side (they join two steps
    apart, so rows of different lengths, forced and choosing, are processed in one call); plain greedy ones. Banned
    words are tokens plain greedy search gives the request's inputs, so the bans change outputs; forced EOS comes
    with a limit the outputs reach (its own max_new_tokens, over the caller's default)."""
    plain = [h[0].tokens for h in generate_ids(engine, seqs, SearchOptions(max_new_tokens=16))]
    common = [t for t, _ in Counter(t for tokens in plain for t in tokens if t != engine.eos_id).most_common(3)]
    word = Counter(t for t in plain[12] + plain[13] if t != engine.eos_id).most_common(1)[0][0]
    pair = next(tuple(t[i:i + 2]) for t in plain[12:14] for i in range(len(t) - 1)
                if not {engine.eos_id, word} & set(t[i:i + 2]))
    sample = dict(sample=True, temperature=1.5, top_k=12, top_p=0.9)
    return [{}, dict(repetition_penalty=2.0), dict(repetition_penalty=2.0), dict(no_repeat_ngram_size=2),
            dict(no_repeat_ngram_size=2, prefix_ids=((common[1], common[2]), ())), dict(min_new_tokens=9),
            dict(bad_words_ids=((word,), pair)), dict(return_logprobs=True), dict(**sample, seed=4, num_return=2),
            dict(**sample, seed=5, prefix_ids=((), (common[2],))),
            dict(sample=True, seed=7, repetition_penalty=1.5, min_new_tokens=3, return_logprobs=True),
            dict(ignore_eos=True, no_repeat_ngram_size=3, prefix_ids=((common[0],),)), {},
            dict(forced_eos=True, max_new_tokens=4), dict(forced_eos=True, sample=True, seed=9, return_logprobs=True,
                                                          max_new_tokens=5)]


def assert_answers(want, got, atol=1e-4):
    """Hypotheses equal (tokens, finished; scores and logprobs within atol)."""
    assert [[(h.tokens, h.finished) for h in per] for per in got] == [[(h.tokens, h.finished) for h in per]
                                                                       for per in want]
    for g, w in zip((h for per in got for h in per), (h for per in want for h in per)):
        assert abs(g.score - w.score) <= atol and (g.logprobs is None) == (w.logprobs is None)
        if w.logprobs is not None:
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=atol, rtol=0)


def test_rows_with_their_own_options_get_their_unbatched_outputs(engine, toy_model_factory):
    """Requests with different decoding controls join one batch at different steps (a request with two prefixes,
    one empty; two samples of an input; rows forced, choosing and sampling in one step; EOS forced at the limit):
    each request's answer is what runtime.generate.generate gives it alone."""
    config = toy_model_factory().config
    seqs = toy_inputs(config, 26, min_len=2, max_len=12, seed=31) + toy_inputs(config, 4, min_len=2, max_len=12,
                                                                                 seed=32)
    options = mixed_options(engine, seqs)
    requests = []
    for k, opts in enumerate(options):
        inputs = seqs[2 * k:2 * k + 1 + ("prefix_ids" not in opts or len(opts["prefix_ids"]) == 2)]
        requests.append(Request.build(engine, inputs, None, SearchOptions(**{"max_new_tokens": 10 + k % 5, **opts})))
    batch, waiting, rows, kinds = InflightBatch(engine, slots=7), list(range(len(requests))), {}, []
    while waiting or batch.live:
        parts = batch.request_rows(requests[waiting[0]]) if waiting and len(kinds) % 2 == 0 else [[None] * 99]
        if len(parts[0]) <= batch.free:                              # one request joins every other step
            k = waiting.pop(0)
            rows[k] = batch.join(*parts, keys=[k] * len(parts[0]))
            for row in rows[k]:                                      # as the server sets them
                row.ignore_eos, row.forced_eos = requests[k].opts.ignore_eos, requests[k].opts.forced_eos
        kinds.append(len({r.controls.settings if r.controls else None for r in batch.rows}))
        batch.step()
    assert max(kinds) >= 4, "rows of different options never shared a step"
    plain = generate_ids(engine, seqs, SearchOptions(max_new_tokens=14))
    changed = 0
    for k, request in enumerate(requests):
        want = generate(engine, request)
        assert_answers(want, answer(rows[k], len(want[0])))
        changed += any(per[0].tokens != plain[2 * k + b][0].tokens[:len(per[0].tokens)] for b, per in enumerate(want))
    assert changed >= 2 * len(options) / 3, "the controls changed too few outputs: equality proves little"


def test_processors_read_a_left_padded_history_as_each_row_alone():
    """Rows of different lengths processed in one call (histories left-padded with -1) get what each row's own
    history gives it: repetition penalty, n-gram bans, bad words."""
    from runtime.processors import bad_words, no_repeat_ngram, repetition_penalty

    rng = np.random.default_rng(0)
    histories = [rng.integers(0, 6, size=n).tolist() for n in (1, 2, 3, 5, 9, 9)]   # few ids: repeats, matches
    width = max(map(len, histories))
    padded = np.array([[-1] * (width - len(h)) + h for h in histories])
    scores = rng.normal(size=(len(histories), 16)).astype(np.float32)
    for apply in (lambda s, h: repetition_penalty(s, h, 2.0), lambda s, h: no_repeat_ngram(s, h, 2),
                  lambda s, h: no_repeat_ngram(s, h, 3), lambda s, h: bad_words(s, h, [(3,), (1, 2), (4, 5, 1)])):
        together = scores.copy()
        apply(together, padded)
        assert (together != scores).any()
        for r, history in enumerate(histories):
            alone = scores[r:r + 1].copy()
            apply(alone, np.array([history]))
            np.testing.assert_array_equal(together[r], alone[0])
