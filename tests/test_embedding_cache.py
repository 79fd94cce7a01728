"""core/embedding_cache.py: HET's bounded-staleness row cache, in one process
(the engine's update through the table seam; plain variables stand for the
per-worker ones)."""

import contextlib
import dataclasses
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from local_engine import local_engine
from scenarios import cluster, scenario
from tf_asyncps.core import embedding_cache
from tf_asyncps.core.embedding_cache import CachedTable, EmbeddingCache
from tf_asyncps.core.step import WorkerStep

ROWS, DIM = 20, 3


def _plain(init, name):
    return tf.Variable(init, trainable=False, name=name)


def _cache(table, cfg, capacity):
    return CachedTable(table, cfg, capacity, worker_variable=_plain,
                       scope=contextlib.nullcontext)


def _table():
    return tf.Variable(tf.reshape(tf.range(ROWS * DIM, dtype=tf.float32), [ROWS, DIM]) / 10.,
                       name="table")


def _stepper(engine, table, opt, cache=None, dense=None):
    """A worker step: read ``ids`` (through ``cache``), loss = sum(sin(rows @ dense))
    or sum(rows * [1, 2, 3]) without ``dense``, one optimizer update."""
    read = table.sparse_read
    w = tf.constant([1.0, 2.0, 3.0])

    @tf.function
    def step(ids):
        ws = WorkerStep(engine, tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        with ws.active():
            variables = [table] + ([dense] if dense is not None else [])
            with tf.GradientTape() as tape:
                rows = cache.read(read, ids) if cache is not None else tf.gather(table, ids)
                if dense is None:
                    loss = tf.reduce_sum(rows * w)
                else:
                    loss = tf.reduce_sum(tf.sin(tf.matmul(rows, dense)))
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables))
            return rows
    return step


def _same_as_uncached(uncached, cached):
    """Asserts two runs' (table, dense, reads, cache) equal bit for bit;
    returns the cached run's ``cache.stats()``."""
    (t0, d0, r0, _), (t1, d1, r1, cache) = uncached, cached
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_array_equal(d1, d0)
    assert len(r1) == len(r0)
    for a, b in zip(r1, r0):
        np.testing.assert_array_equal(a, b)
    return cache.stats()


def test_the_config_refuses_each_bad_field_by_name():
    with pytest.raises(ValueError, match="EmbeddingCache: rows must be an int >= 1"):
        EmbeddingCache(0)
    with pytest.raises(ValueError, match="EmbeddingCache: pull_bound"):
        EmbeddingCache(10, pull_bound=-1)
    with pytest.raises(ValueError, match="EmbeddingCache: push_bound"):
        EmbeddingCache(10, push_bound=1.5)
    with pytest.raises(ValueError, match="EmbeddingCache: policy must be one of"):
        EmbeddingCache(10, policy="fifo")
    assert EmbeddingCache(10) == EmbeddingCache(10, 5, 5, "lfu")


def test_policies_that_cannot_apply_are_refused_with_the_reason():
    from tf_asyncps import policies
    for name in ("sync_replicas", "local_sgd"):
        with pytest.raises(ValueError, match=f"embedding_cache cannot apply under {name}"):
            embedding_cache.check_policy(policies.get(name))
    for name in ("async", "drop_stale", "staleness_aware", "ssp", "dc_asgd"):
        embedding_cache.check_policy(policies.get(name))


def test_the_bench_names_its_cached_embedding_run():
    """cache@emb (by name only): async+dedup@emb with a 5% cache, bounds 5."""
    from tf_asyncps.app import bench, bench_emb
    (cached,) = bench.hosts_configs(only=["cache@emb"])
    (dedup,) = bench.hosts_configs(only=["async+dedup@emb"])
    assert cached == dict(dedup, name="cache@emb", cache={
        "rows": bench_emb.ROWS // 20, "pull_bound": 5, "push_bound": 5})
    assert "cache@emb" not in bench_emb.DEFAULT_EMB_RUNS


def test_the_bench_cache_sweep_names_its_grid_and_refuses_bad_values():
    """--bench_only=cache_sweep: per Zipf exponent the uncached async+dedup
    run and a cached one per size and bound (issue 40's 3 x (1 + 2 x 4)
    runs by default), on a truncated Zipf stream; each bad value refused
    naming its flag."""
    from tf_asyncps.app import bench_emb
    runs = bench_emb.sweep_configs()
    assert len(runs) == 27
    assert [r["name"] for r in runs[:3]] == [
        "async+dedup_z0.8@emb", "cache_z0.8_r1_b0@emb", "cache_z0.8_r1_b1@emb"]
    assert runs[-1]["name"] == "cache_z1.2_r5_b20@emb"
    (dedup,) = [r for r in bench_emb.emb_configs() if r["name"] == "async+dedup@emb"]
    assert runs[0] == dict(dedup, name="async+dedup_z0.8@emb", zipf=0.8, truncated=True,
                           hosts=False, stream_batches=512)
    assert runs[-1] == dict(dedup, name="cache_z1.2_r5_b20@emb", zipf=1.2, truncated=True,
                            hosts=False, stream_batches=512,
                            cache={"rows": 50_000, "pull_bound": 20, "push_bound": 20})
    assert runs[1]["cache"]["rows"] == 10_000
    assert bench_emb.split_sweep(["cache_sweep", "async@emb"]) == (["async@emb"], True)
    assert bench_emb.split_sweep(None) == ([], False)
    for kwargs, words in [
            ({"zipf": []}, "--bench_emb_zipf: give at least one value"),
            ({"zipf": [-0.5]}, r"--bench_emb_zipf: \[-0.5\] out of range"),
            ({"zipf": [1.0, 1.0]}, r"--bench_emb_zipf: \[1.0, 1.0\] repeats a value"),
            ({"rows_pct": [0]}, r"--bench_cache_rows_pct: \[0\] out of range"),
            ({"rows_pct": [101]}, r"--bench_cache_rows_pct: \[101\] out of range"),
            ({"bounds": [-1, 2.5]}, r"--bench_cache_bounds: \[-1, 2.5\] out of range; each "
                                    r"must be an int >= 0")]:
        with pytest.raises(ValueError, match=words):
            bench_emb.sweep_configs(**kwargs)


def test_the_cache_sweeps_flags_are_parsed_and_need_the_run_set():
    """The sweep's flags (lists of numbers) reach sweep_configs; given
    without cache_sweep in --bench_only, or not numbers, they are refused
    naming the flag."""
    from absl.testing import flagsaver
    from tf_asyncps.app import bench_cmd, shared_flags  # noqa: F401 (--num_workers)
    with flagsaver.as_parsed(bench_emb_zipf="1.2", bench_cache_rows_pct="0.5",
                             bench_cache_bounds="0,5"):
        assert [r["name"] for r in bench_cmd._sweep_runs(True, netns=False)] == [
            "async+dedup_z1.2@emb", "cache_z1.2_r0.5_b0@emb", "cache_z1.2_r0.5_b5@emb"]
        assert all(r["hosts"] for r in bench_cmd._sweep_runs(True, netns=True))
        with pytest.raises(ValueError, match="--bench_emb_zipf sets the runs of the cache "
                                             "sweep; add cache_sweep to --bench_only"):
            bench_cmd._sweep_runs(False, netns=False)
    with flagsaver.as_parsed(bench_cache_bounds="5,x"):
        with pytest.raises(ValueError, match="--bench_cache_bounds=5,x: each value must be "
                                             "an int"):
            bench_cmd._sweep_runs(True, netns=False)
    assert bench_cmd._sweep_runs(False, netns=False) == []


def test_the_sweep_table_reads_each_runs_repeats():
    """sweep_table: medians of the repeats (with min-max where they differ),
    ratios to the limit and to the uncached run of the same exponent; the
    uncached run's rows read and written are its distinct ids."""
    from tf_asyncps.app import bench_emb
    uncached = {"name": "async+dedup_z1.2@emb", "repeats": [
        {"steps_per_sec": 100.0, "bytes_per_step": 66e3, "limit_bytes_per_step": 60e3,
         "distinct_per_step": 220.0, "heldout_loss": 0.5}]}
    cached = {"name": "cache_z1.2_r5_b5@emb", "repeats": [
        {"steps_per_sec": s, "bytes_per_step": b, "limit_bytes_per_step": 60e3,
         "rows_pulled_per_step": 100.0, "rows_pushed_per_step": 20.0, "hit_rate": h,
         "closing_rows_flushed": 2000, "heldout_loss": 0.51}
        for s, b, h in ((80.0, 30e3, 0.5), (90.0, 32e3, 0.6))]}
    failed = {"name": "cache_z1.2_r1_b5@emb", "error": "boom"}
    head, rule, a, b = bench_emb.sweep_table([uncached, cached, failed])
    assert head.startswith("| Zipf | cache | bounds | steps/s |") and rule.count("|---") == 13
    assert a == ("| 1.2 | none | – | 100 | 66.0 | 1.100 | 60.0 | 220.0 | 220.0 | – | – | "
                 "0.50000 | 1.000 |")
    assert b == ("| 1.2 | 5% | 5 | 85 (80-90) | 31.0 (30.0-32.0) | 0.517 | 60.0 | 100.0 | "
                 "20.0 | 0.550 (0.500-0.600) | 2,000 | 0.51000 | 1.020 |")


def test_the_sweeps_truncated_zipf_stream():
    """Ranks 1..rows with P(k) ~ k**-a, hashed: exponent 0 spreads the ids
    evenly, larger ones concentrate them; numpy's Zipf refuses a <= 1."""
    from tf_asyncps.app import bench_emb
    distinct = {}
    for a in (0.0, 0.8, 1.2):
        ids = bench_emb.id_stream(0, batches=8, a=a, truncated=True)
        assert ids.shape == (8, bench_emb.BATCH) and ids.dtype == np.int64
        assert 0 <= ids.min() and ids.max() < bench_emb.ROWS
        distinct[a] = np.mean([len(np.unique(b)) for b in ids])
    assert distinct[0.0] > 500 > distinct[0.8] > distinct[1.2]
    np.testing.assert_array_equal(bench_emb.id_stream(3, 2, a=1.0, truncated=True),
                                  bench_emb.id_stream(3, 2, a=1.0, truncated=True))
    with pytest.raises(ValueError, match="numpy's Zipf needs an exponent > 1"):
        bench_emb.id_stream(0, a=1.0)


def test_a_dynamic_tables_rows_are_read_uncached():
    """Reads in lookup.every_id() (a dynamic table's rows, whose id changes
    on eviction) are the table's own rows; the cache is never built."""
    from tf_asyncps.core import lookup
    table = _table()
    cache = _cache(table, EmbeddingCache(4), 4)
    read = table.sparse_read

    @tf.function
    def rows(ids):
        with lookup.every_id():
            return cache.read(read, ids)

    np.testing.assert_array_equal(rows(tf.constant([3, 1, 3], tf.int64)),
                                  table.numpy()[[3, 1, 3]])
    assert not cache.built and cache.stats()["lookups"] == 0


@pytest.mark.parametrize("make_opt", [
    lambda: tf_keras.optimizers.SGD(0.05),
    lambda: tf_keras.optimizers.Adagrad(0.3),
    lambda: tf_keras.optimizers.Adam(0.05),
], ids=["sgd", "adagrad", "adam"])
def test_bounds_zero_are_the_uncached_step_exactly(make_opt):
    """pull_bound=0, push_bound=0, one worker: every table and dense value
    equals the uncached run's, bit for bit, over steps with repeated ids
    and a cache smaller than the ids read (evictions, uncached rows). Adam
    moves every row each step: every cached row is stale at once."""
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, ROWS, size=(4, 3)) for _ in range(12)]
    out = []
    for cached in (False, True):
        engine = local_engine("async")
        table = _table()
        dense = tf.Variable(tf.ones([DIM, 2]) / 4, name="dense")
        opt = make_opt()
        cache = None
        if cached:
            cache = _cache(table, EmbeddingCache(rows=5, pull_bound=0, push_bound=0), 5)
            engine.register_table(cache.hooks())
        step = _stepper(engine, table, opt, cache, dense)
        reads = [step(tf.constant(b, tf.int64)).numpy() for b in batches]
        out.append((table.numpy(), dense.numpy(), reads, cache))
        engine.stop_watchdogs()
    s = _same_as_uncached(*out)
    assert s["lookups"] == 12 * 12 and s["updates_pushed"] == s["rows_pushed"]
    assert s["hits"] == 0 and s["rows_pulled"] == s["distinct"]
    assert s["evictions"] > 0


@pytest.mark.parametrize("offset", [0, 2 ** 31 - 3])
def test_two_workers_pull_and_push_at_the_closed_form_steps(offset):
    """pull_bound=1, push_bound=1, 2 slots, SGD, loss sum(rows * [1, 2, 3]):
    each update of a row is the gradient [1, 2, 3]. Workers A and B share
    the ps clock; the counters, the clock and the table follow the rule
    step by step (see the comments). ``offset``: every row's clock starts
    there; clocks cross as their low 31 bits, so from 2**31 - 3 they wrap
    mid-run and the rule must not see it."""
    lr = 0.1
    cfg = EmbeddingCache(rows=2, pull_bound=1, push_bound=1)
    table = _table()
    init = table.numpy()
    engines = [local_engine("async"), local_engine("async")]
    opts = [tf_keras.optimizers.SGD(lr), tf_keras.optimizers.SGD(lr)]
    a, b = _cache(table, cfg, 2), _cache(table, cfg, 2)
    a.build()
    b.build()
    b.clock = a.clock  # one ps: one clock per row
    a.clock.assign_add(tf.fill(a.clock.shape, tf.constant(offset, tf.int64)))
    steps = []
    for engine, cache, opt in zip(engines, (a, b), opts):
        engine.register_table(cache.hooks())
        steps.append(_stepper(engine, table, opt, cache))
    step_a, step_b = steps
    g = np.array([1.0, 2.0, 3.0], np.float32)

    step_a(tf.constant([1, 2], tf.int64))  # A pulls 1, 2; 1 update each, kept
    step_b(tf.constant([1], tf.int64))     # B pulls 1; kept
    np.testing.assert_array_equal(table.numpy(), init)
    step_a(tf.constant([1, 2], tf.int64))  # A hits 1, 2 (0 behind); 2 > 1: pushes both (2 each)
    assert (a.clock.numpy()[:4] - offset).tolist() == [0, 2, 2, 0]
    np.testing.assert_allclose(table.numpy()[1], init[1] - 2 * lr * g, rtol=1e-6)
    rows = step_b(tf.constant([1], tf.int64)).numpy()  # 2 behind > 1: pulled, + own update
    np.testing.assert_allclose(rows[0], init[1] - 2 * lr * g - lr * g, rtol=1e-6)
    assert (a.clock.numpy()[:4] - offset).tolist() == [0, 4, 2, 0]  # B pushed its 2
    step_a(tf.constant([1, 3], tf.int64))  # 1: 4 behind, pulled; 3 takes 2's clean slot
    step_a(tf.constant([2], tf.int64))     # 2: no clean slot (1, 3 unpushed): pushed at once
    assert (a.clock.numpy()[:4] - offset).tolist() == [0, 4, 3, 0]
    np.testing.assert_allclose(table.numpy()[1], init[1] - 4 * lr * g, rtol=1e-6)
    np.testing.assert_allclose(table.numpy()[2], init[2] - 3 * lr * g, rtol=1e-6)
    np.testing.assert_array_equal(table.numpy()[3], init[3])
    sa, sb = a.stats(), b.stats()
    assert {k: sa[k] for k in embedding_cache.STATS} == {
        "lookups": 7, "distinct": 7, "hits": 2, "rows_pulled": 5, "rows_pushed": 3,
        "updates_pushed": 5, "evictions": 1, "rows_flushed": 0, "updates": 7,
        "updates_lost": 0}
    assert sa["staleness"] == [2, 0]
    assert {k: sb[k] for k in embedding_cache.STATS} == {
        "lookups": 2, "distinct": 2, "hits": 0, "rows_pulled": 2, "rows_pushed": 1,
        "updates_pushed": 2, "evictions": 0, "rows_flushed": 0, "updates": 2,
        "updates_lost": 0}
    # A holds 1 and 3 with one unpushed update each.
    assert sorted(a.ids.numpy().tolist()) == [1, 3]
    assert a.count.numpy().tolist() == [1, 1]
    # A dies: its replacement's state is the initial one (TensorFlow rebuilds
    # per-worker variables so); the updates it held are counted lost.
    for k, v in a.worker_state().items():
        v.assign(tf.fill(v.shape, tf.constant(-1, v.dtype)) if k in ("slot_of", "ids")
                 else tf.zeros_like(v))
    assert a.count_lost() == 2 and a.stats()["updates_lost"] == 2
    assert a.count_lost() == 0 and a.stats()["updates_lost"] == 2  # counted once
    for e in engines:
        e.stop_watchdogs()


def test_pulled_rows_cross_in_the_wire_dtype_with_their_clocks():
    """wire_dtype=bfloat16: a pulled row is served as bfloat16 rounds it,
    its clock and position (int32 bits beside it in the same tensor) intact:
    the second read of a fresh row hits, a row another push moved is pulled."""
    cfg = EmbeddingCache(rows=4, pull_bound=0, push_bound=5)
    table = tf.Variable(tf.reshape(tf.range(ROWS * DIM, dtype=tf.float32), [ROWS, DIM]) / 7.,
                        name="table")
    init = table.numpy()
    engine = local_engine("async")
    cache = CachedTable(table, cfg, 4, worker_variable=_plain, scope=contextlib.nullcontext,
                        wire_dtype=tf.bfloat16)
    cache.build()
    cache.clock.assign_add(tf.fill(cache.clock.shape, tf.constant(2 ** 31 - 1, tf.int64)))
    engine.register_table(cache.hooks())
    step = _stepper(engine, table, tf_keras.optimizers.SGD(0.0), cache)
    bf16 = lambda x: tf.cast(tf.cast(x, tf.bfloat16), tf.float32).numpy()
    rows = step(tf.constant([5, 2, 5], tf.int64)).numpy()
    assert not np.array_equal(bf16(init[[5, 2, 5]]), init[[5, 2, 5]])  # bfloat16 rounds
    np.testing.assert_array_equal(rows, bf16(init[[5, 2, 5]]))
    assert cache.seen.numpy()[np.argsort(cache.ids.numpy())][-2:].tolist() == [2 ** 31 - 1] * 2
    step(tf.constant([2, 5], tf.int64))  # both 0 behind: hits
    cache.clock.scatter_add(tf.IndexedSlices(tf.constant([1], tf.int64), tf.constant([5])))
    step(tf.constant([2, 5], tf.int64))  # 5 is 1 behind > 0: pulled
    s = cache.stats()
    assert (s["distinct"], s["hits"], s["rows_pulled"]) == (6, 3, 3)
    assert s["staleness"] == [3]
    engine.stop_watchdogs()


def _keras3_stepper(engine, table, dense, opt, cache=None):
    """A worker step as Keras 3 takes it: ``table``, ``dense`` Keras 3
    variables; rows read per id (lookup.per_id_gradients), loss =
    sum(sin(rows @ dense)) or sum(rows * [1, 2, 3]) without ``dense``."""
    from tf_asyncps.core import lookup
    read = table.value.sparse_read
    variables = [table] + ([dense] if dense is not None else [])
    w = tf.constant([1.0, 2.0, 3.0])

    @tf.function
    def step(ids):
        ws = WorkerStep(engine, tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        with ws.active():
            with tf.GradientTape() as tape:
                with lookup.per_id_gradients():
                    rows = (cache.read(read, ids) if cache is not None
                            else tf.gather(table.value, ids))
                flat = tf.reshape(rows, [-1, DIM])
                loss = (tf.reduce_sum(flat * w) if dense is None
                        else tf.reduce_sum(tf.sin(tf.matmul(flat, dense.value))))
            grads = tape.gradient(loss, [v.value for v in variables])
            opt.apply(grads, variables)
            return rows
    return step


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_keras3_bounds_zero_are_the_uncached_step_exactly(name):
    """Keras 3 optimizers (their rules see a row per id occurrence; Adagrad's
    and Adam's square each one): pull_bound=0, push_bound=0 gives the
    uncached step's table, dense kernel and reads bit for bit over 12 steps
    with repeated ids, evictions and rows left uncached."""
    keras = pytest.importorskip("keras")
    make = {"sgd": lambda: keras.optimizers.SGD(0.05),
            "adagrad": lambda: keras.optimizers.Adagrad(0.3),
            "adam": lambda: keras.optimizers.Adam(0.05)}[name]
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, ROWS, size=(4, 3)) for _ in range(12)]
    out = []
    for cached in (False, True):
        engine = local_engine("async")
        table = keras.Variable(_table().numpy(), name="table")
        dense = keras.Variable(np.ones([DIM, 2], np.float32) / 4, name="dense")
        opt = make()
        opt.build([table, dense])
        cache = None
        if cached:
            cache = _cache(table.value, EmbeddingCache(rows=5, pull_bound=0, push_bound=0), 5)
            engine.register_table(cache.hooks())
        step = _keras3_stepper(engine, table, dense, opt, cache)
        reads = [step(tf.constant(b, tf.int64)).numpy() for b in batches]
        out.append((table.numpy(), dense.numpy(), reads, cache))
        engine.stop_watchdogs()
    s = _same_as_uncached(*out)
    assert s["lookups"] == 12 * 12 and s["distinct"] < s["lookups"]  # ids repeat
    assert s["hits"] == 0 and s["rows_pulled"] == s["rows_pushed"] == s["distinct"]
    assert s["updates_pushed"] == s["rows_pushed"] and s["evictions"] > 0


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_a_keras3_deferred_push_carries_the_occurrences_and_the_earlier_sum(name):
    """push_bound=2, one worker, every step ids [1, 1, 2] with loss
    sum(rows * [1, 2, 3]) (each occurrence's gradient g = [1, 2, 3]). Steps
    1-2 stay on the worker; step 3 pushes, per id, this step's occurrence
    rows and the earlier unpushed sum as one more occurrence: id 1 rows g,
    g, 4g (S1 = 6g, squares 18 g**2), id 2 rows g, 2g (S1 = 3g, squares
    5 g**2). SGD: w -= lr * S1; Adagrad: acc += squares, w -= lr * S1 /
    sqrt(acc + eps). Clocks advance by 3 updates per pushed row."""
    keras = pytest.importorskip("keras")
    lr = 0.1
    opt = {"sgd": keras.optimizers.SGD(lr), "adagrad": keras.optimizers.Adagrad(lr)}[name]
    engine = local_engine("async")
    table = keras.Variable(_table().numpy(), name="table")
    init = table.numpy()
    opt.build([table])
    cache = _cache(table.value, EmbeddingCache(rows=4, pull_bound=5, push_bound=2), 4)
    engine.register_table(cache.hooks())
    step = _keras3_stepper(engine, table, None, opt, cache)
    g = np.array([1.0, 2.0, 3.0], np.float32)
    ids = tf.constant([1, 1, 2], tf.int64)
    step(ids)
    step(ids)
    np.testing.assert_array_equal(table.numpy(), init)
    rows = step(ids).numpy()  # served from the cache: 2 local SGD steps
    np.testing.assert_allclose(rows[0], init[1] - lr * 2 * (2 * g), rtol=1e-6)
    np.testing.assert_allclose(rows[2], init[2] - lr * 2 * g, rtol=1e-6)
    s1 = {1: 6 * g, 2: 3 * g}
    squares = {1: 18 * g ** 2, 2: 5 * g ** 2}
    for r in (1, 2):
        if name == "sgd":
            want = init[r] - lr * s1[r]
        else:
            acc = opt.initial_accumulator_value + squares[r]
            want = init[r] - lr * s1[r] / np.sqrt(acc + opt.epsilon)
        np.testing.assert_allclose(table.numpy()[r], want, rtol=1e-6)
    assert cache.clock.numpy()[:4].tolist() == [0, 3, 3, 0]
    s = cache.stats()
    assert {k: s[k] for k in ("lookups", "distinct", "hits", "rows_pulled", "rows_pushed",
                              "updates_pushed", "updates")} == {
        "lookups": 9, "distinct": 6, "hits": 4, "rows_pulled": 2, "rows_pushed": 2,
        "updates_pushed": 6, "updates": 6}
    assert cache.count.numpy().tolist() == [0, 0, 0, 0]
    engine.stop_watchdogs()


# -- under the strategy: fit on a cluster -----------------------------------------
FIT_ROWS, FIT_DIM, BATCH, SEQ = 40, 4, 4, 2


@dataclasses.dataclass(frozen=True)
class CachedFits:
    """Attributes: runs: per case, the model's weights after fit (lists),
    ``cache_stats()`` and ``staleness_stats()`` (cached_reads)."""
    runs: list


def _fit(c, optimizer="sgd", cache=None, steps=12, keras="tf_keras", layer="embedding"):
    """One fit on cluster ``c``: ids -> Embedding (or an EmbeddingCollection
    of 2 features x FIT_ROWS // 2 ids) -> Flatten -> Dense(1), mse, in
    ``keras`` ("tf_keras" or "keras3")."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, FIT_ROWS, size=(steps * BATCH, SEQ))
    if layer == "collection":
        x = x % (FIT_ROWS // SEQ)
    y = rng.normal(size=(steps * BATCH, 1)).astype(np.float32)
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), embedding_cache=None if cache is None else EmbeddingCache(**cache))
    if keras == "keras3":
        import keras as k
        from tf_asyncps import keras3
        collection = keras3.EmbeddingCollection
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    else:
        from tf_asyncps.layers import embedding_collection
        k, collection = tf_keras, embedding_collection.EmbeddingCollection
        data = tf_keras.utils.experimental.DatasetCreator(
            lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat())
    init = k.initializers.RandomUniform(-0.5, 0.5, seed=1)
    with strategy.scope():
        table = (k.layers.Embedding(FIT_ROWS, FIT_DIM, embeddings_initializer=init)
                 if layer == "embedding" else
                 collection([FIT_ROWS // SEQ] * SEQ, FIT_DIM, embeddings_initializer=init))
        model = k.Sequential([
            k.Input((SEQ,), dtype="int64"), table, k.layers.Flatten(),
            k.layers.Dense(1, kernel_initializer=k.initializers.GlorotUniform(2))])
        opt = {"sgd": lambda: k.optimizers.SGD(0.1),
               "adagrad": lambda: k.optimizers.Adagrad(0.2),
               "adam": lambda: k.optimizers.Adam(0.05)}[optimizer]()
        model.compile(opt, "mse")
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "cache": strategy.cache_stats(),
            "cached_reads": strategy.staleness_stats().cached_reads}


@scenario(shares_cluster=True)
def cached_fits(cases) -> CachedFits:
    """Fits on one worker, one strategy per case (kwargs of _fit)."""
    with cluster(num_workers=1, num_ps=1) as c:
        return CachedFits(runs=[_fit(c, **case) for case in cases])


#: (optimizer, keras, layer) of each uncached / bounds-0 pair.
_EXACT_CASES = [("sgd", "tf_keras", "embedding"), ("adagrad", "tf_keras", "embedding"),
                ("adam", "tf_keras", "collection"), ("sgd", "keras3", "embedding"),
                ("adagrad", "keras3", "collection"), ("adam", "keras3", "embedding")]


@pytest.mark.cluster
def test_fit_with_bounds_zero_equals_the_uncached_fit_exactly():
    """SGD, Adagrad and Adam, tf_keras and Keras 3 fit, an Embedding or an
    EmbeddingCollection: pull_bound=0, push_bound=0 (cache of 6 rows, 8
    ids per batch) gives the uncached fit's weights exactly; every row read
    was pulled and pushed once per step, the cached reads' staleness all 0."""
    zero = {"rows": 6, "pull_bound": 0, "push_bound": 0}
    cases = []
    for optimizer, keras, layer in _EXACT_CASES:
        case = {"optimizer": optimizer, "keras": keras, "layer": layer}
        cases += [case, dict(case, cache=zero)]
    r = run_scenario(cached_fits, shared=(1, 1), timeout=420, cases=cases).runs
    for i, name in enumerate(_EXACT_CASES):
        plain, cached = r[2 * i], r[2 * i + 1]
        for a, b in zip(plain["weights"], cached["weights"]):
            np.testing.assert_array_equal(np.array(b), np.array(a), err_msg=str(name))
        (stats,) = cached["cache"].values()
        assert stats["lookups"] == 12 * BATCH * SEQ, name
        assert stats["rows_pulled"] == stats["distinct"] and stats["hits"] == 0, name
        assert stats["updates_pushed"] == stats["rows_pushed"] == stats["distinct"], name
        assert list(cached["cached_reads"].values()) == [[0]], name
        assert plain["cache"] == {} and plain["cached_reads"] == {}, name


@dataclasses.dataclass(frozen=True)
class NothingLost:
    """Attributes: table: the table after fit and join (list of rows).
    expected: the closed form init - lr * n_r / (BATCH * SEQ) * steps.
    stats: cache_stats() of the one table. closures: closures per worker.
    unpushed: every worker's unpushed update counts after join (lists).
    flushes: the cache's flushes during fit. saved: the table a checkpoint
    wrote after epoch 2; expected_at_save: the closed form after its steps;
    closures_at_save: closures per worker then."""
    table: list
    expected: list
    stats: dict
    closures: list
    unpushed: list
    flushes: int
    saved: list
    expected_at_save: list
    closures_at_save: list


def pooled_ones_model(rows, dim, seq):
    """tf_keras: ``seq`` int64 ids -> a zeros-initialized ``rows x dim``
    Embedding, average-pooled, @ a frozen ones kernel: each occurrence's
    gradient of mean(output) is 1 / (batch * seq) per element whatever the
    weights (the closed forms of the cache's cluster tests)."""
    return tf_keras.Sequential([
        tf_keras.Input([seq], dtype="int64"),
        tf_keras.layers.Embedding(rows, dim, embeddings_initializer="zeros"),
        tf_keras.layers.GlobalAveragePooling1D(),
        tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
                              trainable=False)])


@contextlib.contextmanager
def _appending(calls):
    calls.append(1)
    yield


@scenario(shares_cluster=True)
def nothing_lost(steps=30, rows=4, bound=5, lr=0.5) -> NothingLost:
    """Two workers, SGD, every batch the same 7 distinct ids (a 4-row cache:
    4 cached, 3 pushed at once), loss mean(avg-pooled rows @ ones): each
    occurrence's gradient is 1 / (BATCH * SEQ) per element whatever the
    weights, so the table after fit is a closed form iff no update is lost."""
    batch = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int64)
    batch[3, 1] = 0  # id 0 twice, 7 ids
    batch[2, 1] = 8
    n = np.bincount(batch.ravel(), minlength=FIT_ROWS)

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensors((batch, np.zeros((BATCH, 1), np.float32))).repeat()

    with cluster(num_workers=2, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), embedding_cache=EmbeddingCache(rows, bound, bound))
        with strategy.scope():
            model = pooled_ones_model(FIT_ROWS, FIT_DIM, SEQ)
            model.compile(tf_keras.optimizers.SGD(lr), lambda y, p: tf.reduce_mean(p))
        flushes, saved = [], []
        strategy.extended.caches.observe_flushes(lambda: _appending(flushes))
        path = os.path.join(tempfile.mkdtemp(), "table")

        class SaveAfterTwoEpochs(tf_keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:  # a checkpoint between epochs flushes first
                    tf.train.Checkpoint(table=model.layers[0].embeddings).write(path)
                    saved.append(tf.train.load_checkpoint(path).get_tensor(
                        "table/.ATTRIBUTES/VARIABLE_VALUE").tolist())
                    saved.append(list(strategy.closures_done_per_worker()))

        # Three epochs: their joins defer the flush to a save and fit's end.
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=3,
                  steps_per_epoch=steps // 3, verbose=0, callbacks=[SaveAfterTwoEpochs()])
        (table,) = strategy.extended.caches.tables[:1]
        from tf_asyncps.compat import variables as variables_compat
        unpushed = [v.numpy().tolist()
                    for v in variables_compat.per_worker_values(table.count)]
        expected = -lr * n[:, None] / (BATCH * SEQ) * steps * np.ones((1, FIT_DIM))
        at_save = expected * (2 * (steps // 3)) / steps
        return NothingLost(table=model.get_weights()[0].tolist(), expected=expected.tolist(),
                           stats=list(strategy.cache_stats().values())[0],
                           closures=list(strategy.closures_done_per_worker()),
                           unpushed=unpushed, flushes=len(flushes), saved=saved[0], closures_at_save=saved[1],
                           expected_at_save=at_save.tolist())


@pytest.mark.cluster
def test_no_unpushed_update_is_lost_at_the_end_of_fit():
    """After fit (3 epochs), every worker's unpushed updates reached the ps,
    flushed before a checkpoint written after epoch 2 (then the closed form of
    its 20 steps) and at fit's end, not at the epoch-end joins: the table is the
    closed form, each worker's counts are 0, and the counters add up: 7
    distinct ids x 30 updates pushed, at each flush the cached rows of a worker
    whose steps since the last flush are not a multiple of 6 flushed."""
    r = run_scenario(nothing_lost, shared=(2, 1), timeout=300)
    np.testing.assert_allclose(np.array(r.table), np.array(r.expected), rtol=1e-6)
    assert r.unpushed == [[0] * 4, [0] * 4]
    assert sum(r.closures) == 30 and r.flushes == 2
    np.testing.assert_allclose(np.array(r.saved), np.array(r.expected_at_save), rtol=1e-6)
    s = r.stats
    assert s["distinct"] == 7 * 30 and s["lookups"] == 8 * 30
    assert s["updates_pushed"] == s["updates"] == 7 * 30 and s["updates_lost"] == 0
    at_save = r.closures_at_save
    assert sum(at_save) == 20
    assert s["rows_flushed"] == 4 * (sum(1 for k in at_save if k % 6) + sum(
        1 for k, end in zip(at_save, r.closures) if (end - k) % 6))
    assert s["hits"] + s["rows_pulled"] == s["distinct"]
