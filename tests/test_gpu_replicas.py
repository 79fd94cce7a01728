"""K > 1 replicas per worker (the multi-GPU worker path), run on CPU devices.

A worker with K GPUs runs K replicas per step. The K gradients must meet
once, in one update through the policy, counted once: so one worker with K
replicas equals one-process training on batches K times as large, and the
counters count worker steps, not replicas. On CPU the test stand-in in
scenarios.common.fake_multi_replica_workers gives each worker K CPU devices.
"""

import pytest

from conftest import run_scenario


@pytest.mark.parametrize("policy,optimizer,locking", [
    ("async", "momentum_schedule", False),  # lr schedule reads the step counter
    ("dc_asgd", "adam", True),              # read snapshot + lock; tau = 0 alone
])
@pytest.mark.cluster
def test_two_replicas_one_worker_equal_one_process_training(policy, optimizer, locking):
    r = run_scenario("replicas_fit", replicas=2, num_workers=1, policy=policy,
                     optimizer=optimizer, locking=locking, epochs=2, steps_per_epoch=10,
                     batch=8)
    assert r["replicas"] == 2
    assert r["moved"] > 0.05  # training did move the weights
    assert r["max_abs_diff"] < 1e-5, r
    s = r["stats"]
    assert r["iterations"] == 20 and s["global_step"] == 20 and s["applied"] == 20
    assert s["dropped"] == 0 and s["histogram"][0] == 20  # one worker: tau = 0


@pytest.mark.cluster
def test_two_replicas_two_workers_sync_replicas_counts_worker_steps():
    r = run_scenario("replicas_fit", replicas=2, num_workers=2, policy="sync_replicas",
                     policy_args={"replicas_to_aggregate": 2, "timeout_s": 60},
                     optimizer="sgd", epochs=2, steps_per_epoch=10, batch=8)
    s = r["stats"]
    assert r["replicas"] == 2 and r["finite"]
    # Every worker step (not every replica) reaches the aggregator once.
    assert s["applied"] + s["dropped"] == 20
    # The identity of docs/concepts/staleness.md: a gradient computed before a drain's release
    # may arrive stale and be dropped (seen: 19 applied, 1 dropped, 9 rounds).
    assert s["global_step"] == s["applied"] // 2 == r["rounds"]
    assert r["iterations"] == s["global_step"]


@pytest.mark.cluster
def test_two_replicas_mixed_float16_loss_scaling_once_per_worker_step():
    r = run_scenario("replicas_fit", replicas=2, num_workers=1, policy="async",
                     optimizer="sgd", precision="mixed_float16", epochs=2,
                     steps_per_epoch=10, batch=8)
    # float16 compute: close to float32 one-process training, not equal.
    assert r["finite"] and r["max_abs_diff"] < 1e-3 and r["moved"] > 0.05
    s = r["stats"]
    assert r["iterations"] == 20 == s["global_step"] == s["applied"] and s["dropped"] == 0
    # One loss-scale update per worker step, not per replica: 20 finite steps
    # at the default growth interval (2000) leave the initial scale.
    assert r["loss_scale"] == 2.0 ** 15


@pytest.mark.cluster
def test_two_replicas_sparse_embedding_gradients_stay_exact():
    # Each replica's IndexedSlices are joined by concatenating rows (no
    # densifying); drop_stale takes the locked path.
    r = run_scenario("replicas_embedding_fit", replicas=2, policy="drop_stale")
    assert r["moved"] > 0.01 and r["max_abs_diff"] < 1e-5, r
    assert r["iterations"] == 20 == r["stats"]["global_step"] == r["stats"]["applied"]


@pytest.mark.cluster
@pytest.mark.parametrize("policy", ["drop_stale", "sync_replicas"])
def test_two_replicas_on_a_table_split_over_two_ps_tasks_stay_exact(policy):
    # variable_partitioner with K = 2 replicas: each shard's rows from both
    # replicas are joined and applied once per worker step.
    r = run_scenario("replicas_embedding_fit", replicas=2, policy=policy, num_ps=2)
    assert r["shards"] == 2
    assert r["moved"] > 0.01 and r["max_abs_diff"] < 1e-5, r
    assert r["iterations"] == 20 == r["stats"]["global_step"] == r["stats"]["applied"]
