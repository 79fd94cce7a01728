"""core/embedding_cache.py on a cluster: a restarted worker starts with an
empty cache, the other worker's cache is untouched, and the restarted
worker's unpushed updates are counted lost (issue 40's restart test)."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario
from test_embedding_cache import pooled_ones_model
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core.embedding_cache import EmbeddingCache

ROWS, DIM, BATCH, SEQ, LR = 40, 4, 4, 2, 0.5
#: Slots per worker, and bounds no row reaches in this test (< 50 steps):
#: a cached row is never pulled again nor pushed before the join's flush.
SLOTS, BOUND = 4, 50
#: The batch of every step: ids 0..6 and 8, id 0 twice (7 distinct, 8 ids).
IDS = np.array([[0, 1], [2, 3], [4, 8], [6, 0]], np.int64)


@dataclasses.dataclass(frozen=True)
class RestartedCache:
    """Attributes (per worker lists are by worker index):
    before: each worker's cache state after the steps before the restart,
    after: after the steps after it (before the join): per worker
    ``{"ids": cached ids (-1: free slot), "count": unpushed updates per slot,
    "lookups": ids read (the worker's own counter)}``.
    done_before, done_after: closures completed per worker up to the restart,
    and since it. stats_before: ``cache_stats()`` of the table at the
    restart; stats: after the join (the flush). table: the table after the
    join (list of rows)."""
    before: list
    after: list
    done_before: list
    done_after: list
    stats_before: dict
    stats: dict
    table: list


def _worker_states(table):
    """Each worker's cached ids, unpushed counts and lookups (eager reads
    on the workers)."""
    out = []
    values = {k: variables_compat.per_worker_values(getattr(table, k))
              for k in ("ids", "count", "local")}
    for w in range(len(values["ids"])):
        state = {}
        for k, name in (("ids", "ids"), ("count", "count"), ("local", "lookups")):
            v = values[k][w]
            with tf.device(v.device):
                state[name] = v.read_value().numpy().tolist()
        state["lookups"] = state["lookups"][0]  # WORKER_STATS[0]
        out.append(state)
    return out


@scenario
def restarted_cache(batches=6) -> RestartedCache:
    """Two workers, one ps, SGD, loss mean(avg-pooled rows @ ones): each
    occurrence's gradient is 1 / (BATCH * SEQ) per element whatever the
    weights. A custom loop (one step per closure) runs batches of 4 steps
    until both workers ran some (fetching each, no join: the unpushed updates
    stay on the workers), worker:1 is killed and restarted, then batches
    until the restarted worker ran a step, then the join flushes."""
    with cluster(num_workers=2, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), embedding_cache=EmbeddingCache(SLOTS, BOUND, BOUND))
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = pooled_ones_model(ROWS, DIM, SEQ)
            opt = tf_keras.optimizers.SGD(LR)

        @tf.function
        def step(xb):
            def replica(xb):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(model(xb, training=True))
                variables = model.trainable_variables
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return loss
            return strategy.run(replica, args=(xb,))

        x = tf.constant(IDS)

        def run_until(done):
            for _ in range(batches):
                for v in [coordinator.schedule(step, args=(x,)) for _ in range(4)]:
                    v.fetch()  # waits for that step (a join would flush)
                if done():
                    return
            raise AssertionError(f"the workers' closures {strategy.closures_done_per_worker()} "
                                 f"never met the condition in {batches} batches of 4")

        run_until(lambda: min(strategy.closures_done_per_worker()) >= 1)
        (table,) = [t for t in strategy.extended.caches.tables if t.built]  # not the kernel
        done_before = list(strategy.closures_done_per_worker())
        before, stats_before = _worker_states(table), strategy.cache_stats()[table.name]
        c.restart("worker:1")  # SIGKILL, then the same task on its port
        run_until(lambda: strategy.closures_done_per_worker()[1] > done_before[1])
        done_after = [a - b for a, b in zip(strategy.closures_done_per_worker(), done_before)]
        after = _worker_states(table)
        coordinator.join()
        return RestartedCache(before=before, after=after, done_before=done_before,
                              done_after=done_after, stats_before=stats_before,
                              stats=strategy.cache_stats()[table.name],
                              table=model.get_weights()[0].tolist())


@pytest.mark.timeout(180)
@pytest.mark.cluster
def test_a_restarted_worker_starts_with_an_empty_cache():
    """Every worker's first step caches 4 of the 7 distinct ids (all pulled),
    every later step serves those 4 from its cache and pulls and pushes the 3
    others (no cached row reaches the bounds). worker:1, restarted, starts
    again from an empty cache: its lookups counter and unpushed counts start
    at 0 and its first step pulls all 7 ids (4 more pulls, 4 fewer hits than a
    warm step); worker:0's cached ids and unpushed counts go on as if nothing
    happened; the updates worker:1 held are counted in updates_lost at the
    join, and they are exactly what the table misses."""
    r = run_scenario(restarted_cache, timeout=150)
    w0, w1 = r.before
    a0, a1 = r.after
    n0, n1 = r.done_before
    m0, m1 = r.done_after
    assert n0 >= 1 and n1 >= 1 and m1 >= 1, (r.done_before, r.done_after)
    # Before: each worker's 4 slots hold 4 of the ids, each with one
    # unpushed update per step of that worker.
    for state, n in ((w0, n0), (w1, n1)):
        cached = [i for i in state["ids"] if i >= 0]
        assert len(cached) == SLOTS and set(cached) <= set(IDS.ravel().tolist()), state
        assert state["count"] == [n] * SLOTS and state["lookups"] == IDS.size * n, state
    steps = n0 + n1
    s = r.stats_before
    assert s["hits"] == SLOTS * steps - SLOTS * 2, s  # each worker's first step: no hit
    assert s["rows_pulled"] == 3 * steps + SLOTS * 2 and s["updates_lost"] == 0, s
    # After the restart: worker:0 untouched (same ids, counts and lookups
    # counting on), worker:1 from an empty cache (counters from 0).
    assert a0["ids"] == w0["ids"], (w0, a0)
    assert a0["count"] == [n0 + m0] * SLOTS and a0["lookups"] == IDS.size * (n0 + m0), a0
    assert len([i for i in a1["ids"] if i >= 0]) == SLOTS, a1
    assert a1["count"] == [m1] * SLOTS and a1["lookups"] == IDS.size * m1, a1
    # The restarted worker's first step pulled all 7 ids: one more cold
    # start than the two before the restart.
    total = steps + m0 + m1
    s = r.stats
    assert s["hits"] == SLOTS * total - SLOTS * 3, s
    assert s["rows_pulled"] == 3 * total + SLOTS * 3, s
    assert s["lookups"] == IDS.size * (n0 + m0 + m1), s  # the live workers' counters
    # Lost: worker:1's unpushed updates at the kill, counted at the join.
    lost = sum(w1["count"])
    assert lost == SLOTS * n1 and s["updates_lost"] == lost, s
    assert s["updates"] == 7 * total and s["updates_pushed"] == 7 * total - lost, s
    # And that is exactly what the table misses: each of worker:1's cached
    # ids lost its n1 steps, every other id has all of them.
    n = np.bincount(IDS.ravel(), minlength=ROWS)
    applied = np.full(ROWS, total)
    for i in w1["ids"]:
        applied[i] -= n1
    expected = -LR * (n * applied / IDS.size)[:, None] * np.ones((1, DIM))
    np.testing.assert_allclose(np.array(r.table), expected, rtol=1e-6, atol=1e-7)
