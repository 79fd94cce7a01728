"""Partitioned variables (``variable_partitioner``) over several ps tasks.

An embedding model (40 x 4 table, ids with duplicates inside every batch,
drawn from the first 20 rows only) and its Dense head are split over the ps
tasks. With one worker every policy, LockingOptimizer, Adam and mixed
precision equal one-process tf_keras training on the same batches; with two
workers every policy's counters are exact. Each group runs as one strategy
per case on one cluster (tests/scenarios/sharded.py ``sharded_embedding``).
"""

import json
import os
import sys

import numpy as np
import pytest

from conftest import SCENARIOS_DIR, run_command, run_scenario, wait_dead

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

POLICIES = {
    "async": {}, "drop_stale": {"max_staleness": 1}, "staleness_aware": {},
    "ssp": {"max_staleness": 1}, "dc_asgd": {},
    "sync_replicas": {"replicas_to_aggregate": 1}, "local_sgd": {"sync_every": 3}}
# State beside the shard it serves: sync_replicas' buffers, dc_asgd's second
# moments (adaptive; its read values are reads, not copies), the update lock
# beside the global step.
HOLDS_STATE = {"drop_stale", "sync_replicas", "route"}  # per-variable state

ONE_WORKER = {name: dict(policy=name, policy_args=args) for name, args in POLICIES.items()}
ONE_WORKER.update({
    "locking": dict(policy="async", locking=True),
    "adam": dict(policy="async", optimizer="adam", lr=0.05),
    # Full-batch data: sync_replicas' mean of one gradient is the gradient.
    "sync_replicas_min_full_batch": dict(policy="sync_replicas", partitioner="min",
                                         full_batch=True),
    "async_max": dict(policy="async", partitioner="max"),
    # Steps 2 and 5 have NaN gradients: dropped on each ps task, neither the
    # shards, Adam's slots nor its iterations move (one process trains on
    # the other 10 batches); staleness_aware takes its tau before the update.
    "nan_adam": dict(policy="async", optimizer="adam", lr=0.05, nan_batches=[2, 5]),
    "nan_staleness_aware": dict(policy="staleness_aware", nan_batches=[2, 5]),
    "nan_legacy_adam": dict(policy="async", optimizer="legacy_adam", lr=0.05,
                            nan_batches=[2, 5]),
    # local_sgd reads the worker's local copies: a bfloat16 wire rounds nothing.
    "local_sgd_bfloat16_wire": dict(policy="local_sgd", policy_args={"sync_every": 3},
                                    wire_dtype="bfloat16"),
    # mixed_float16: tf_keras cannot autocast a partitioned Dense kernel
    # (AutoCastVariable wraps ResourceVariables only), so only the table splits.
    "mixed_async": dict(policy="async", partitioner="min", mixed=True),
    "mixed_sync_replicas": dict(policy="sync_replicas", partitioner="min", mixed=True),
    # Tables async, dense layers sync_replicas (N = 1: the mean of one gradient).
    "route": dict(policy="route", policy_args={
        "sparse": "async", "dense": ["sync_replicas", {"replicas_to_aggregate": 1}]}),
})
STEPS = 20
TWO_WORKERS = {name: dict(policy=name, policy_args=dict(args), reference=False, steps=STEPS)
               for name, args in POLICIES.items()}
TWO_WORKERS["sync_replicas"]["policy_args"] = {"replicas_to_aggregate": 2}
TWO_WORKERS["locking"] = dict(policy="async", locking=True, reference=False, steps=STEPS)
TWO_WORKERS["route"] = dict(policy="route", reference=False, steps=STEPS, policy_args={
    "sparse": "async", "dense": ["sync_replicas", {"replicas_to_aggregate": 2}]})


def _runs(cases, num_workers, num_ps):
    r = run_scenario("sharded_embedding", timeout=360, shared=(num_workers, num_ps),
                     runs=list(cases.values()),
                     num_workers=num_workers, num_ps=num_ps)
    return dict(zip(cases, r["runs"]))


@pytest.fixture(scope="module")
def one_worker():
    return _runs(ONE_WORKER, num_workers=1, num_ps=3)


@pytest.fixture(scope="module")
def two_workers():
    return _runs(TWO_WORKERS, num_workers=2, num_ps=2)


def _check_sparse(r, num_ps):
    assert r["shards"] == num_ps and r["shard_tasks"] == list(range(num_ps))
    # Rows no id touches keep their initial values exactly; the others moved.
    assert r["untouched_rows_moved"] == 0.0
    assert r["touched_rows_moved"] > 1e-2


@pytest.mark.parametrize("case", list(ONE_WORKER))
def test_one_worker_on_three_ps_tasks_equals_one_process(one_worker, case):
    r, spec = one_worker[case], ONE_WORKER[case]
    _check_sparse(r, 3)
    assert r["max_abs_diff"] < 1e-5, r["max_abs_diff"]
    s = r["stats"]
    nan = len(spec.get("nan_batches", ()))
    assert s["dropped"] == s["nonfinite"] == nan and s["max"] == 0  # one worker: tau is 0
    assert r["iterations"] == 12 - nan
    if spec["policy"] == "local_sgd":
        # Every shard has its own local copy on the worker (none trained on the ps).
        assert r["local_copies"] >= r["trainable_parts"]
        assert s["local_steps"] == 12 and s["applied"] == s["global_step"] == 4
    else:
        assert s["applied"] == s["global_step"] == 12 - nan
    assert r["placement"]["elsewhere"] == 0
    if spec["policy"] in HOLDS_STATE or spec.get("locking"):
        assert r["placement"]["beside"] >= 1


@pytest.mark.parametrize("case", list(TWO_WORKERS))
def test_two_workers_on_two_ps_tasks_count_every_step(two_workers, case):
    r, spec = two_workers[case], TWO_WORKERS[case]
    _check_sparse(r, 2)
    s = r["stats"]
    assert r["placement"]["elsewhere"] == 0
    if spec["policy"] == "local_sgd":
        assert s["local_steps"] == STEPS and r["iterations"] == STEPS
        assert r["local_copies"] >= r["trainable_parts"]
        return
    assert s["applied"] + s["dropped"] == STEPS  # every worker step, accounted
    if spec["policy"] == "route":
        # Every step updates its table rows (async): the global step and
        # iterations count worker steps; the dense part made one update per
        # round of 2 (a gradient released at the final drain may be late).
        assert s["global_step"] == s["applied"] == r["iterations"] == STEPS
        assert r["part_updates"] == {"sparse": STEPS, "dense": r["dense_rounds"]}
        assert STEPS // 2 - 1 <= r["dense_rounds"] <= STEPS // 2
    elif spec["policy"] == "sync_replicas":
        assert s["global_step"] == s["applied"] // 2 == r["iterations"]
    else:
        assert s["global_step"] == s["applied"] == r["iterations"]


@pytest.mark.timeout(420)
def test_a_checkpoint_restores_onto_another_number_of_ps_tasks(tmp_path):
    """tf#62215, tf-keras#838: partitioned variables and their optimizer slots
    restored onto 2 -> 3 -> 2 ps tasks (and 2 -> 3 before the optimizer is
    built) give the same values, and the next Adam step (which reads the
    slots and the step count) is the same."""
    run = lambda num_ps, **kw: run_scenario("sharded_checkpoint", timeout=240,
                                            shared=(1, num_ps), num_ps=num_ps, **kw)
    a = run(num_ps=2, save_to=str(tmp_path / "a" / "ckpt"))
    b = run(num_ps=3, restore_from=a["path"], save_to=str(tmp_path / "b" / "ckpt"))
    c = run(num_ps=2, restore_from=b["path"], save_to=str(tmp_path / "c" / "ckpt"))
    # Into an optimizer with no slots yet (tf_keras alone restored its slots
    # wrong: compat.sharded_slots.build_for_pending_restore).
    d = run(num_ps=3, restore_from=a["path"], save_to=str(tmp_path / "d" / "ckpt"),
            build_first=False)
    assert (a["shards"], b["shards"], c["shards"], d["shards"]) == (2, 3, 2, 3)
    assert a["saved"]["iterations"] == 6
    for r in (b, c, d):
        assert r["saved"] == a["saved"]  # exact: table, kernel, step count
        for key in ("table", "kernel"):
            np.testing.assert_allclose(r["next"][key], a["next"][key], rtol=0, atol=1e-6)
    assert a["next"]["table"] != a["saved"]["table"]  # the next step did move the table


def test_a_step_moves_the_rows_it_touches_not_the_table():
    """Loopback bytes per worker step (64 ids of 32 floats) with a 10K-row and
    a 1M-row table (128 MB) on 2 ps tasks: reads are gathers of the touched rows
    and updates IndexedSlices, so the bytes do not grow with the table."""
    small, large = run_scenario("embedding_traffic", timeout=240,
                                rows_list=[10_000, 1_000_000])["runs"]
    assert large["bytes_per_step"] < large["table_bytes"] / 100  # a dense read: 128 MB
    assert large["bytes_per_step"] < 3 * small["bytes_per_step"]


def test_backup_and_restore_resumes_a_crashed_fit_exactly(tmp_path):
    """BackupAndRestore of a model partitioned over 2 ps tasks, with Adam's
    slots: the process (and its cluster) dies right after epoch 1's
    checkpoint; a new fit on a new cluster runs epochs 2 and 3 only and ends
    exactly where an uninterrupted fit ends. The same model written with a
    checkpoint sharding callback (tf#73836) reads back into a third one."""
    backup = str(tmp_path / "backup")
    rc, out = run_command([sys.executable, SCENARIOS_DIR, "sharded_backup",
                           json.dumps({"backup_dir": backup, "crash_after_epoch": 1})],
                          timeout=180, check=False)
    assert rc == 17 and "crashing after epoch 1" in out, out[-3000:]
    pids = json.loads(out.split("PIDS: ", 1)[1].splitlines()[0])
    wait_dead(pids)  # the crashed chief's ps and worker went with it
    assert "checkpoint" in os.listdir(os.path.join(backup, "chief"))
    r = run_scenario("sharded_backup", timeout=240, shared=(1, 2), backup_dir=backup)
    resumed, full, reread = r["resumed"], r["uninterrupted"], r["reread"]
    assert full["epochs_run"] == [0, 1, 2] and resumed["epochs_run"] == [1, 2]
    assert resumed["shards"] == full["shards"] == reread["shards"] == 2
    assert resumed["iterations"] == full["iterations"] == reread["iterations"] == 12
    for key in ("table", "kernel"):
        np.testing.assert_allclose(resumed[key], full[key], rtol=0, atol=1e-6, err_msg=key)
    assert len(resumed["slots"]) == len(full["slots"]) > 0
    for a, b in zip(resumed["slots"], full["slots"]):  # Adam's m and v, each part
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for key in ("table", "kernel", "slots"):
        assert reread[key] == full[key], key  # a checkpoint round trip is exact
    assert sum(np.count_nonzero(v) for v in full["slots"]) > 0  # Adam's m and v moved
    assert r["backup_left"] == []  # BackupAndRestore removes its checkpoint after fit
    assert r["files"] > 3  # the sharding callback did split the save


def test_zipf_example_reports_rows_memory_and_traffic(tmp_path):
    """examples/zipf_embedding.py, small: one table size, 2 ps tasks."""
    out = tmp_path / "zipf.json"
    _, log = run_command([sys.executable, "examples/zipf_embedding.py", "--rows=20000,30000",
                          "--steps=20", "--num_ps=2", "--num_workers=1", "--batch_size=64",
                          f"--output={out}"], timeout=300)
    runs = json.loads(out.read_text())
    assert [r["rows"] for r in runs] == [20000, 30000]
    for r in runs:
        assert r["shards"] == 2 and sorted(r["ps_rss_mb"]) == ["ps:0", "ps:1"]
        assert r["global_step"] == 40 + 20  # warm-up and measured steps, all applied
        assert 1 <= r["rows_per_step"] <= 64 and r["bytes_per_step"] > 0
        assert r["steps_per_sec"] > 0
    assert "RSS per ps task (MiB)" in log


def test_zipf_drift_stream_keeps_the_dynamic_table_within_capacity(tmp_path):
    """examples/zipf_embedding.py --drift_every, small: 5,000 possible ids whose
    popularity rotates every 5 steps, a DynamicEmbedding of 300 rows."""
    out = tmp_path / "drift.json"
    _, log = run_command([sys.executable, "examples/zipf_embedding.py", "--drift_every=5",
                          "--drift_ids=5000", "--drift_capacity=300", "--drift_shift=100",
                          "--drift_steps=60", "--drift_segment=20", "--drift_evict_every=5",
                          "--drift_tables=dynamic", "--num_ps=2", "--num_workers=1",
                          "--batch_size=64", f"--output={out}"], timeout=300)
    (r,) = json.loads(out.read_text())
    assert (r["table"], r["rows"], r["ids"], r["min_count"]) == ("dynamic", 300, 5000, 1)
    segs = r["segments"]
    assert [s["worker_steps"] for s in segs] == [20, 40, 60]
    assert [s["phase"] for s in segs] == [3, 7, 11]  # one worker: (step - 5 // 2) // 5
    for s in segs:
        assert 0 < s["live_rows"] <= s["capacity"] == 300
        assert sorted(s["ps_rss_mb"]) == ["ps:0", "ps:1"] and 0 <= s["eval_auc"] <= 1
    # The stream holds far more than 300 ids: ids were refused rows and the
    # passes (every 5 global steps) evicted, at most one row per refusal.
    last = segs[-1]
    assert 0 < last["evicted"] <= last["refused"]
    assert "live rows" in log
