"""Straggler injection (tf_asyncps/app/straggler.py): a slowed input
pipeline for one worker (slow_dataset_fn) and a SIGSTOP/SIGCONT cycler
(StopContCycler), which the bench's straggler runs use.

The cluster scenario sits above the test that reads it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests)."""

import dataclasses
import os
import signal
import subprocess
import time

import pytest

from conftest import proc_state, run_scenario, wait_dead
from scenarios import cluster, scenario
from tf_asyncps.app.straggler import StopContCycler, slow_dataset_fn


def test_slow_dataset_fn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="slow_worker"):
        slow_dataset_fn(lambda ctx: None, -1, 10)
    with pytest.raises(ValueError, match="delay_ms"):
        slow_dataset_fn(lambda ctx: None, 0, -5)


@dataclasses.dataclass(frozen=True)
class StragglerCounts:
    """Attributes: counts: closures run by each worker index, counted on the PS."""
    counts: list[int]


@scenario(shares_cluster=True)
def straggler_counts(num_workers=2, slow_worker=0, delay_ms=30, steps=40) -> StragglerCounts:
    """tf_asyncps.straggler.slow_dataset_fn: closures taken by each worker,
    counted on the PS (ClusterCoordinator gives closures to free workers)."""
    import tensorflow as tf
    import tf_asyncps
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            counts = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False)

        def dataset_fn(ctx):
            return tf.data.Dataset.from_tensors(tf.constant(1, tf.int64)).repeat()

        slow = slow_dataset_fn(dataset_fn, slow_worker, delay_ms)
        it = iter(coord.create_per_worker_dataset(
            lambda: slow(tf.distribute.InputContext())))

        @tf.function
        def step(iterator):
            one = next(iterator)
            w = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(),
                        tf.int64)
            counts.scatter_add(tf.IndexedSlices(tf.reshape(one, [1]), tf.reshape(w, [1])))

        for _ in range(steps):
            coord.schedule(step, args=(it,))
        coord.join()
        return StragglerCounts(counts=counts.numpy().tolist())


@pytest.mark.cluster
def test_straggler_injection_slows_the_chosen_worker():
    r = run_scenario(straggler_counts, shared=(2, 1), num_workers=2, slow_worker=0,
                     delay_ms=80, steps=40)
    slow, fast = r.counts
    assert slow + fast == 40  # every closure ran once
    # The slowed worker took far fewer closures (80 ms per batch dwarfs a fast
    # step even with the other test process loading the cores).
    assert slow * 2 < fast


def test_stop_cont_cycler_pauses_and_always_continues():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        with StopContCycler(proc.pid, stop_s=5.0, period_s=10.0) as cyc:
            deadline = time.monotonic() + 5  # bounded poll for the first SIGSTOP
            while proc_state(proc.pid) != "T" and time.monotonic() < deadline:
                pass
            assert proc_state(proc.pid) == "T" and cyc.cycles >= 1
        assert proc_state(proc.pid) != "T"  # continued on exit, before stop_s elapsed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    wait_dead([proc.pid], 10)


@pytest.mark.parametrize("kwargs, match", [
    ({"slow_worker": 0, "delay_ms": float("inf")}, "delay_ms"),
    ({"slow_worker": 0, "delay_ms": "100"}, "delay_ms"),
    ({"slow_worker": 1.0, "delay_ms": 10}, "slow_worker"),
])
def test_slow_dataset_fn_rejects_bad_types(kwargs, match):
    with pytest.raises(ValueError, match=match):
        slow_dataset_fn(lambda ctx: None, **kwargs)


def test_slow_dataset_fn_accepts_numpy_integers():
    import numpy as np
    assert callable(slow_dataset_fn(lambda ctx: None, np.int64(1), np.float32(5)))


@pytest.mark.parametrize("pid", [0, -1, "123", True])
def test_stop_cont_cycler_refuses_process_groups_and_bad_pids(pid):
    with pytest.raises(ValueError, match="pid"):
        StopContCycler(pid, stop_s=1.0, period_s=2.0)


def test_stop_cont_cycler_refuses_itself():
    with pytest.raises(ValueError, match="this process"):
        StopContCycler(os.getpid(), stop_s=1.0, period_s=2.0)
