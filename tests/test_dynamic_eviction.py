"""DynamicEmbedding eviction on a cluster beyond tests/test_dynamic_cluster.py:
legacy tf_keras optimizers (scenarios in tests/scenarios/dynamic_eviction.py)."""

import pytest

from conftest import run_scenario

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(420)
def test_legacy_optimizers_evict_reset_slots_and_round_trip():
    """tf_keras.optimizers.legacy Adagrad, and Adam under LockingOptimizer
    (unlocked, a pass overlapping another worker's update lost its reset:
    see test_after_update_hooks_run_inside_the_update_lock), 2 workers, 2 ps, 10 ids
    for 6 rows, a pass every 2 steps (LFU, ttl_steps=6), then 2 of the ids
    only: those 2 live at the end, each once; evicted rows and their slots
    back at their initial values (zeros; Adagrad's accumulator 0.1, Adam's
    m and v 0); a checkpoint round trip onto the same shards exact (map,
    rows, predictions, slots)."""
    r = run_scenario("dynamic_legacy_optimizers", timeout=400)
    for name, slots in (("adagrad", ["accumulator"]), ("adam", ["m", "v"])):
        p = r[name]
        assert p["ids"] == p["last_ids"] and p["stats"]["live_rows"] == 2, name
        assert p["stats"]["evicted"] >= 8 and p["stats"]["refused"] > 0, name
        assert p["slot_names"] == slots and p["num_slots"] == 2 * len(slots), name
        assert p["freed_rows"] >= 1, name
        assert p["free_rows_max"] == 0.0 and p["free_slots_max_diff"] == 0.0, name
        t = p["round_trip"]
        assert t["count_equal"] and t["key_equal"], name
        assert t["rows_max_diff"] == 0.0 and t["pred_max_diff"] == 0.0, name
        assert sum(t["index"]) == p["stats"]["live_rows"], name
        assert t["slots_compared"] == slots * 2, name
        assert t["slots_max"] > 0.0 and t["slots_max_diff"] == 0.0, name
        # Counters restored too; the zero step admitted, refused, evicted nothing.
        assert t["stats"] == p["stats"], name


def _adagrad_fresh(steps, target, lr=0.1, initial=0.1, eps=1e-7):
    """A fresh row (zeros, accumulator ``initial``) after ``steps`` tf_keras
    Adagrad steps on batches of one id under the frozen head (Dense(1),
    kernel ones, no bias) of the local_sgd scenarios: all 4 values equal e,
    prediction 12e, and each value's gradient 6 (12e - target) (3 positions
    of the id per sample, mean squared error)."""
    e, acc = 0.0, initial
    for _ in range(steps):
        g = 6.0 * (12.0 * e - target)
        acc += g * g
        e -= lr * g / (acc + eps) ** 0.5
    return e


@pytest.mark.timeout(300)
@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
def test_local_sgd_evicts_at_exchanges_and_a_reused_row_starts_fresh(keras_name):
    """local_sgd, 1 worker, 1 ps, an exchange every 2 local steps, a
    one-row table with a pass at every exchange: 4 steps of id A, then 8 of
    id B. B is refused at steps 5 and 6; the pass at the exchange before
    step 7 (global step 3) evicts A (count 1 after LFU's halvings, B's 2);
    the worker pulls the reset row and its accumulator's row starts again
    at 0.1 on the worker; B trains it in steps 7-12. Before, no pass ran
    under local_sgd (B refused for good). Keras 3 too: its optimizer was not
    matched to the table's shards (its variables are Keras variables), so
    A's accumulator stayed on the worker (0.0416667)."""
    r = run_scenario("dynamic_local_sgd_reused_row", timeout=280, keras_name=keras_name)
    assert r["stats"] == {"live_rows": 1, "capacity": 1, "evicted": 1, "refused": 2}
    assert r["ids"] == [-5] and r["generation"] == 1 and r["count"] == 3
    # 5 exchanges (before steps 3, 5, 7, 9, 11), each running its pass,
    # and the drain's push.
    assert r["passes"] == 5 and r["global_step"] == 6 and r["local_steps"] == 12
    want = _adagrad_fresh(6, target=0.5)
    # A's accumulator kept (37.56 on the worker) would give 0.0416667.
    assert abs(want - 0.0414018) < 1e-6
    assert r["row"] == pytest.approx([want] * 4, abs=1e-6)


@pytest.mark.timeout(300)
def test_local_sgd_drops_a_stale_delta_on_a_reset_row():
    """local_sgd, 1 worker, a custom loop: the worker trains A's row for 2
    local steps; the chief evicts it (a pass of ttl_steps=1 at a far step)
    before the worker's exchange; A is admitted again to that row. Steps 3
    and 4 read the default row (their loss is target^2 = 1.0: the worker's
    copy of the row is stale), the exchange before step 5 drops the
    worker's 2-step delta on it (0.1355 landed before: the row then held
    it), and the row after step 5 is one fresh Adagrad step: 0.0998614."""
    r = run_scenario("dynamic_local_sgd_stale_delta", timeout=280)
    assert r["before"] == {"row": [0.0] * 4, "live": 1}  # steps 1-2 not pushed yet
    assert r["evicted_by_chief"] == 1
    assert r["stats"] == {"live_rows": 1, "capacity": 1, "evicted": 1, "refused": 0}
    assert r["generation"] == 1 and r["losses"] == [1.0, 1.0, 1.0]
    assert r["global_step"] == 2 and r["local_steps"] == 5  # one exchange, the drain
    assert r["row"] == pytest.approx([_adagrad_fresh(1, target=1.0)] * 4, abs=1e-6)


@pytest.mark.timeout(300)
def test_local_sgd_two_workers_keep_the_table_invariants():
    """local_sgd, 2 workers, 2 ps, an exchange every 2 local steps, a pass
    at each with ttl_steps=1: 6 ids in every batch for 4 steps, then 3
    others (40 steps), then 20 steps of the 3 only. Every eviction bumped
    one row's generation; the freed rows hold zeros on the ps (a worker's
    delta pushed after its rows' reset landed there before: 0.002-0.012 in
    3 of 5 runs without the generation check, which
    test_local_sgd_drops_a_stale_delta_on_a_reset_row shows every time);
    at the end only the 3 are
    live (after the first fit, a worker that ran its first batches last
    could leave the 6 live)."""
    r = run_scenario("dynamic_local_sgd_phases", timeout=280)
    for state in (r["first"], r["then"]):
        stats = state["stats"]
        assert stats["capacity"] == 12 and stats["refused"] == 0
        assert len(state["ids"]) == len(set(state["ids"])) == stats["live_rows"] <= 12
        assert state["generations"] == stats["evicted"] and state["free_rows_max"] == 0.0
    last = r["then"]
    assert last["ids"] == r["phase2_ids"] and last["stats"]["live_rows"] == 3
    assert last["stats"]["evicted"] >= 6 and last["freed_rows"] >= 3
    assert r["local_steps"] == 60 and sum(r["closures"]) == 60


@pytest.mark.timeout(300)
def test_after_update_hooks_run_inside_the_update_lock():
    """Under LockingOptimizer the engine's after-update hooks (a dynamic
    table's eviction pass) hold the update lock too, so no locked update
    overlaps a pass: tf_keras Adam rewrites every row's moments at each
    update, which undid a pass's resets. Before, they ran after its release
    (the hook saw the lock's token back: [1, 1, 1])."""
    r = run_scenario("after_update_hook_under_the_lock", timeout=280)
    assert r["global_step"] == 3 and r["free_tokens_seen"] == [0, 0, 0]
