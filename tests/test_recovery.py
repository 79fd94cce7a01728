"""ps and chief failures under `launch --restart_failed_tasks` (#6 item 4).

A ps task that dies takes its variables with it; the chief fails, the
supervisor restarts the ps, and launch re-runs the chief, which resumes from
the latest BackupAndRestore checkpoint (or, with --backup_every_steps, its
newest step backup, mid-epoch). A SIGKILLed chief is re-run the same way. The result must be as good as an uninterrupted run with the same seed.

Each scenario sits above the tests that read it and returns the dataclass
declared with it (docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import (ROOT, poll_until, run_command, run_scenario, stop_process,
                      subprocess_env)
from scenarios import scenario
from scenarios.common import make_optimizer, mlp, small_problem
from tf_asyncps import StalenessStats, recovery
from tf_asyncps.cluster import LocalCluster

FLAGS = ["--num_workers=1", "--num_ps=1", "--epochs=8", "--steps_per_epoch=50",
         "--steps_per_execution=10", "--hidden=64", "--seed=0", "--timeout_s=200"]


def _launch_cmd(out, *extra):
    return [sys.executable, "-m", "tf_asyncps", "launch", *FLAGS,
            f"--output_dir={out}", *extra]


def _latest_checkpoint(out):
    """The checkpoint the state file names (it is rewritten atomically)."""
    try:
        with open(os.path.join(out, "backup", "chief", "checkpoint")) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _kill_task(out, name):
    state = recovery.read_json(os.path.join(out, "logs", "cluster.json"))
    pid = state["tasks"][name]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """metrics.json of the uninterrupted run (no --backup_dir), shared."""
    base = str(tmp_path_factory.mktemp("uninterrupted"))
    run_command(_launch_cmd(base), timeout=150)
    with open(os.path.join(base, "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["recovery"] is None  # no --backup_dir: no checkpoints
    return metrics


def _launch_with_kills(tmp_path, extra, kills):
    """Runs launch (FLAGS + ``extra``) into ``tmp_path/interrupted`` and
    calls ``kills(out, proc)`` while it runs; the launch process group is
    stopped whatever happens. Asserts it exits 0; returns (its output,
    metrics.json)."""
    out = str(tmp_path / "interrupted")
    log = open(tmp_path / "launch.log", "w+")
    proc = subprocess.Popen(_launch_cmd(out, *extra), stdout=log, stderr=subprocess.STDOUT,
                            env=subprocess_env(), cwd=ROOT, start_new_session=True)
    try:
        kills(out, proc)
        rc = proc.wait(timeout=150)
    finally:
        stop_process(proc)
        log.seek(0)
        text = log.read()
        log.close()
    assert rc == 0, text[-4000:]
    with open(os.path.join(out, "metrics.json")) as f:
        return text, json.load(f)


@pytest.mark.timeout(300)
@pytest.mark.cluster
def test_ps_and_chief_sigkill_resume_from_checkpoint(tmp_path, baseline):
    progress = os.path.join(str(tmp_path / "interrupted"), "backup", recovery.PROGRESS_FILE)

    def kills(out, proc):
        # 1. ps:0 dies after the first epoch checkpoint.
        first = poll_until(lambda: _latest_checkpoint(out), proc, 120, "the first checkpoint")
        _kill_task(out, "ps:0")
        # 2. The re-run chief resumed and wrote a newer checkpoint: kill it.
        poll_until(lambda: (recovery.read_json(progress) or {}).get("chief_runs") == 2 and
                   _latest_checkpoint(out) not in (None, first),
                   proc, 120, "the second chief run to checkpoint an epoch")
        _kill_task(out, "chief:0")

    text, m = _launch_with_kills(tmp_path, ["--restart_failed_tasks", "--max_restarts=2"],
                                 kills)
    rec = m["recovery"]
    assert rec["chief_runs"] == 3, rec
    # Resumed from an epoch boundary after the first failure, not from zero.
    assert rec["resumed_from_step"] >= 100 and rec["resumed_from_step"] % 50 == 0, rec
    assert rec["steps_redone"] >= 0
    assert m["scheduled_steps"] == 400 - rec["resumed_from_step"] == m["worker_steps"]
    assert "tasks restarted: {'ps:0': 1}" in text
    assert text.count("re-running it") == 2
    assert "lost ps:0 during training" in text
    assert not os.path.exists(progress)  # removed once fit completed
    assert abs(m["test_accuracy"] - baseline["test_accuracy"]) <= 0.02, (
        m["test_accuracy"], baseline["test_accuracy"])


@pytest.mark.timeout(300)
@pytest.mark.cluster
def test_a_chief_sigkilled_mid_epoch_resumes_from_its_step_backup(tmp_path, baseline):
    """Issue 41: with --backup_every_steps=30 (epochs of 50 steps) a chief
    SIGKILLed after the backup at step 90 is re-run, resumes mid-epoch from
    its newest complete step backup with at most 30 steps redone, and ends
    within 0.01 of the uninterrupted run's test accuracy."""
    def kills(out, proc):
        meta = os.path.join(out, "backup", "step-000000000090", "meta.json")
        poll_until(lambda: os.path.exists(meta), proc, 150, "the step backup at 90")
        _kill_task(out, "chief:0")

    text, m = _launch_with_kills(
        tmp_path, ["--restart_failed_tasks", "--max_restarts=1", "--backup_every_steps=30"],
        kills)
    rec = m["recovery"]
    assert rec["chief_runs"] == 2, rec
    # A step backup's step (epoch checkpoints would give multiples of 50).
    assert rec["resumed_from_step"] >= 90 and rec["resumed_from_step"] % 30 == 0, rec
    assert 0 <= rec["steps_redone"] <= 30, rec
    assert m["scheduled_steps"] == 400 - rec["resumed_from_step"] == m["worker_steps"]
    assert text.count("re-running it") == 1
    assert abs(m["test_accuracy"] - baseline["test_accuracy"]) <= 0.01, (
        m["test_accuracy"], baseline["test_accuracy"])


def test_crash_inside_a_checkpoint_save_leaves_the_previous_one_latest(tmp_path, monkeypatch):
    # A process that dies inside its second epoch-end save (before the shards
    # are merged, or after the data is written but before the state file names
    # it) leaves on disk what was written up to that call: each point's files
    # are copied when the save reaches it (what a crash there would leave), in
    # this process, not one process killed per point. The latest checkpoint of
    # each copy must still be the complete first.
    import shutil
    from tensorflow.python.checkpoint import checkpoint_management, functional_saver
    backup = str(tmp_path / "backup")
    x, y = small_problem()
    model = mlp()
    model.compile(tf_keras.optimizers.SGD(0.1),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    save = lambda: tf_keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)
    model.fit(x, y, epochs=1, batch_size=32, verbose=0, callbacks=[save()])
    epoch1 = model.get_weights()
    reached = []

    def crash_point(name, original):
        def at(*args, **kwargs):
            if name not in reached:  # a crash stops at the first call
                reached.append(name)
                shutil.copytree(backup, str(tmp_path / name))
            return original(*args, **kwargs)
        return at

    monkeypatch.setattr(functional_saver.gen_io_ops, "merge_v2_checkpoints", crash_point(
        "merge", functional_saver.gen_io_ops.merge_v2_checkpoints))
    monkeypatch.setattr(checkpoint_management, "update_checkpoint_state_internal", crash_point(
        "state", checkpoint_management.update_checkpoint_state_internal))
    model.fit(x, y, epochs=2, batch_size=32, verbose=0, callbacks=[save()])
    assert reached == ["merge", "state"]  # in the second epoch's save, in this order
    assert tf.train.latest_checkpoint(os.path.join(backup, "chief")).endswith("ckpt-2")
    for point in reached:
        latest = tf.train.latest_checkpoint(str(tmp_path / point / "chief"))
        assert latest is not None and latest.endswith("ckpt-1"), (point, latest)
        reader = tf.train.load_checkpoint(latest)
        assert reader.get_tensor("ckpt_saved_epoch/.ATTRIBUTES/VARIABLE_VALUE") == 0
        for i, key in enumerate(["model/layer_with_weights-0/kernel",
                                 "model/layer_with_weights-0/bias",
                                 "model/layer_with_weights-1/kernel",
                                 "model/layer_with_weights-1/bias"]):
            np.testing.assert_array_equal(
                reader.get_tensor(key + "/.ATTRIBUTES/VARIABLE_VALUE"), epoch1[i])


def test_atomic_write_json_keeps_the_old_file_when_a_write_fails(tmp_path):
    path = str(tmp_path / "metrics.json")
    recovery.atomic_write_json(path, {"steps": 1})
    with pytest.raises(TypeError):  # not serialisable: fails mid-write
        recovery.atomic_write_json(path, {"steps": 2, "bad": object()})
    assert recovery.read_json(path) == {"steps": 1}
    assert os.listdir(tmp_path) == ["metrics.json"]  # no temp file left
    recovery.atomic_write_json(path, {"steps": 3})
    assert recovery.read_json(path) == {"steps": 3}


@pytest.mark.timeout(200)
@pytest.mark.cluster
def test_a_checkpoint_of_another_model_fails_once_with_the_fix(tmp_path):
    # --backup_dir holds a checkpoint of a 16-unit MLP; the job builds 32
    # units. The chief must say so, and launch must not re-run a chief whose
    # error would recur.
    from tf_asyncps.app import datasets
    from tf_asyncps.app import models
    backup = str(tmp_path / "backup")
    data = datasets.load("digits", seed=0)
    other = models.build_model("mlp", data.num_features, data.num_classes, (16,), 0)
    other.compile(tf_keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    other.fit(data.x_train[:64], data.y_train[:64], epochs=1, verbose=0,
              callbacks=[tf_keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    assert tf.train.latest_checkpoint(os.path.join(backup, "chief"))
    rc, out = run_command(_launch_cmd(str(tmp_path / "out"), "--hidden=32", "--epochs=2",
                                      "--steps_per_epoch=10", "--restart_failed_tasks",
                                      f"--backup_dir={backup}"), timeout=150, check=False)
    assert rc != 0
    assert "holds a checkpoint this job cannot restore" in out, out[-3000:]
    assert "Use a new --backup_dir or delete that one" in out
    assert "error that a re-run would repeat" in out and "re-running it" not in out
    assert "a re-run resumes" not in out  # no step ran: nothing to resume
    assert not os.path.exists(os.path.join(backup, recovery.PROGRESS_FILE))
    # The matching model, but the checkpoint (epoch 1 done) is already at
    # --epochs=1: nothing to train, said so, and the resume point reported.
    out_dir = tmp_path / "past"
    _, out = run_command(_launch_cmd(str(out_dir), "--hidden=16", "--epochs=1",
                                     "--steps_per_epoch=10", f"--backup_dir={backup}"),
                         timeout=150)
    assert "is already at worker step 10 of 10 (--epochs=1): nothing was trained" in out
    m = json.loads((out_dir / "metrics.json").read_text())
    assert m["recovery"]["resumed_from_step"] == 10
    assert m["scheduled_steps"] == 0 == m["worker_steps"]


def test_lost_task_messages_and_exit_descriptions():
    from tf_asyncps.app import cli, launch_cmd
    e = tf.errors.UnavailableError(None, None, "Socket closed\nAdditional GRPC error "
                                   "information from remote target /job:ps/replica:0/task:0")
    with_backup = cli._lost_task_message(e, "/b")
    assert with_backup.startswith("lost ps:0 during training (Socket closed)")
    assert "same --backup_dir" in with_backup
    without = cli._lost_task_message(e, None)
    assert "without --backup_dir there is no checkpoint" in without
    assert cli._lost_task_message(ValueError("x"), "/b") is None
    assert launch_cmd._describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert "a task of the cluster was lost" in launch_cmd._describe_exit(cli.EXIT_LOST_TASK)
    assert launch_cmd._describe_exit(1) == "exited with code 1"


@dataclasses.dataclass(frozen=True)
class FitOnRunningCluster:
    """A chief's model.fit (the small MLP, SGD 0.1) on tasks it did not start.

    Attributes:
      stats: the strategy's staleness counters.
      iterations: the optimizer's step counter at the end (int).
    """
    stats: StalenessStats
    iterations: int


@scenario
def fit_on_running_cluster(tf_config, policy, policy_args=None, epochs=2,
                           steps_per_epoch=20) -> FitOnRunningCluster:
    """A chief on ps/worker tasks it did not start (and that outlive it), as
    a re-run chief: model.fit of the small MLP; exact counters."""
    x, y = small_problem()
    config = tf_asyncps.cluster.validate_tf_config(tf_config)
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        tf_asyncps.cluster.cluster_resolver(config),
        update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    with strategy.scope():
        model = mlp()
        model.compile(make_optimizer("sgd", 0.1),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    return FitOnRunningCluster(stats=strategy.staleness_stats(),
                               iterations=int(model.optimizer.iterations.numpy()))


@dataclasses.dataclass(frozen=True)
class DynamicMaps:
    """A chief's DynamicEmbedding (2 shards) once built and given delta marks.

    Attributes:
      ids: ids in its shards' id -> row maps (int; a new table's: 0).
      tombstones: ids in its shards' tombstones (int; a new table's: 0).
    """
    ids: int
    tombstones: int


@scenario
def dynamic_maps_on_running_cluster(tf_config) -> DynamicMaps:
    """A chief process on tasks it did not start: a DynamicEmbedding over the
    ps tasks with StepBackup's delta marks; returns its maps' and
    tombstones' sizes, then puts an id in each (what a run leaves there)."""
    from tf_asyncps.callbacks import delta_chain
    from tf_asyncps.layers import DynamicEmbedding
    config = tf_asyncps.cluster.validate_tf_config(tf_config)
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        tf_asyncps.cluster.cluster_resolver(config),
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((2,), dtype="int64"),
                                     DynamicEmbedding(4, capacity=8, initializer="zeros")])
        optimizer = tf_keras.optimizers.Adagrad(0.1)
        model.compile(optimizer, "mse")
        optimizer.build(model.trainable_variables)
        delta_chain.ModelDeltas(model, optimizer,
                                [strategy.staleness_tracker.global_step]).track()
    shards = model.layers[0].dynamic_table.shards
    out = DynamicMaps(ids=sum(int(s.index.size().numpy()) for s in shards),
                      tombstones=sum(int(s.delta_marks.tombs.size().numpy()) for s in shards))
    for s in shards:
        with tf.device(s.device):
            s.index.insert(tf.constant([7], tf.int64), tf.constant([s.offset], tf.int64))
            s.delta_marks.tombs.insert(tf.constant([9], tf.int64), tf.constant([1], tf.int64))
    return out


@pytest.mark.timeout(300)
@pytest.mark.cluster
def test_a_chief_rerun_on_tasks_that_outlived_the_last_chief_gets_its_own_locks():
    """Regression: TensorFlow names eagerly created queues by a per-process
    counter, so a second chief process on the same ps got the first one's
    update lock (creating it blocked forever: drop_stale hung) and gate
    queues (ssp), and its DynamicEmbedding maps and tombstones. Each chief
    now makes its own; counters stay exact."""
    with LocalCluster(num_workers=2, num_ps=1) as c:
        for policy in ("drop_stale", "drop_stale", "ssp", "ssp"):
            r = run_scenario(fit_on_running_cluster, timeout=90,
                             tf_config=c.tf_config("chief", 0), policy=policy,
                             policy_args={"max_staleness": 1})
            s = r.stats
            assert s.applied + s.dropped == 40, (policy, s)
            assert s.global_step == s.applied == r.iterations, (policy, s)
        # A DynamicEmbedding's id -> row maps and tombstones are TensorFlow
        # MutableHashTables, named by the same per-process counter: the second
        # chief got the first one's ids (a table with no backup then started
        # with them; a resume's first delta carried the old tombstones).
        for _ in range(2):
            maps = run_scenario(dynamic_maps_on_running_cluster, timeout=90,
                                tf_config=c.tf_config("chief", 0))
            assert maps == DynamicMaps(ids=0, tombstones=0)
