"""In-flight batching (runtime/inflight.py): rows join a running batch and leave at once; every row's tokens,
finished flag and score equal its unbatched greedy generate_ids result (fp32, varied outputs), across staggered
joins, rows at different lengths in one step, rows leaving mid-batch, stopped rows and reused buffer rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from runtime.bundle import load_bundle
from runtime.errors import BundleError, InputError
from runtime.generate import generate_ids
from runtime.inflight import InflightBatch, check_engine
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
    assert max(spreads) >= 10 and sum(s > 0 for s in spreads) > len(spreads) // 2    # rows at different lengths
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
