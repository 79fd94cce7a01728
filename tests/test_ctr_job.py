"""The CTR job end to end: `tf-asyncps launch --flagfile=configs/ctr.flags` on
scaled-down tables (2 ps, 2 workers), its metrics.json and what it learned,
with a ps and then the chief SIGKILLed mid-run and the run resumed from a
step backup each time (one run: the job's quality is measured on the
resumed run). Its Keras 3 raw-id variant (--keras=3
--ctr_embedding=dynamic) resumed by a chief process of its own on tasks
that outlived the crashed one.

The chief scenario sits above the test that reads it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from typing import List, Optional

import numpy as np
import pytest

from conftest import ROOT, poll_until, run_scenario, stop_process, subprocess_env
from scenarios import scenario
from tf_asyncps import recovery
from tf_asyncps.app import ctr_data
from tf_asyncps.callbacks import step_backup
from tf_asyncps.cluster import LocalCluster

pytestmark = pytest.mark.timeout(400)

# Steps enough for a stable held-out AUC: with fewer, async runs spread widely
# (an early Adagrad's last updates are large); figures in docs/guides/ctr.md.
STEPS, EPOCHS, BATCH, MAX_ROWS = 150, 2, 512, 20_000
EVERY = 50  # --backup_every_steps (a multiple of configs/ctr.flags' steps_per_execution)
KILL_PS_AFTER = 100  # worker steps backed up before ps:1 is killed
KILL_CHIEF_AFTER = 200  # ... and before the re-run chief is killed


def _backed_up(backup_dir, steps):
    """Whether the backup at ``steps`` is complete (its meta.json: StepBackup)."""
    return os.path.isfile(os.path.join(backup_dir, f"step-{steps:012d}", step_backup.META_FILE))


def _launch_killing_a_ps_then_the_chief(out):
    """Runs the job under --restart_failed_tasks --backup_every_steps=EVERY,
    SIGKILLs ps:1 once the backup at KILL_PS_AFTER steps is written, then the
    re-run chief once it has written the one at KILL_CHIEF_AFTER; returns
    (launch's exit status, its output)."""
    log_path = os.path.join(out, "launch.log")
    backup_dir = os.path.join(out, "backup")
    progress = os.path.join(backup_dir, step_backup.PROGRESS_FILE)
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tf_asyncps", "launch", "--flagfile=configs/ctr.flags",
             f"--output_dir={out}", f"--ctr_max_rows={MAX_ROWS}", f"--epochs={EPOCHS}",
             f"--steps_per_epoch={STEPS}", "--ctr_test_examples=16384",
             "--restart_failed_tasks", "--max_restarts=2", f"--backup_every_steps={EVERY}",
             "--timeout_s=330"],
            stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(), cwd=ROOT,
            start_new_session=True)
        try:
            poll_until(lambda: _backed_up(backup_dir, KILL_PS_AFTER), proc, 240,
                       f"the backup at {KILL_PS_AFTER} steps")
            state = recovery.read_json(os.path.join(out, "logs", "cluster.json"))
            os.kill(state["tasks"]["ps:1"]["pid"], signal.SIGKILL)
            # The second chief run (ps:1 restarted) backs up KILL_CHIEF_AFTER.
            poll_until(lambda: (recovery.read_json(progress) or {}).get("chief_runs") == 2
                       and _backed_up(backup_dir, KILL_CHIEF_AFTER), proc, 240,
                       f"the re-run chief's backup at {KILL_CHIEF_AFTER} steps")
            state = recovery.read_json(os.path.join(out, "logs", "cluster.json"))
            os.kill(state["tasks"]["chief:0"]["pid"], signal.SIGKILL)
            rc = proc.wait(timeout=300)
        finally:
            stop_process(proc)
            log.seek(0)
            text = log.read()
    return rc, text


@pytest.mark.cluster
def test_ctr_job_resumes_from_a_step_backup_learns_the_planted_model_and_writes_metrics(
        tmp_path):
    rc, log = _launch_killing_a_ps_then_the_chief(str(tmp_path))
    assert rc == 0, log[-4000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    steps = EPOCHS * STEPS
    assert m["num_workers"] == 2 and m["num_ps"] == 2 and m["policy"] == "async"
    # ps:1 died after the backup at KILL_PS_AFTER: the chief lost it (exit
    # 75), launch restarted it and re-ran the chief, which resumed from the
    # newest backup (a delta on the full one at EVERY); that chief, SIGKILLed
    # after its backup at KILL_CHIEF_AFTER, was re-run and resumed from its
    # newest backup: at most EVERY steps redone each time.
    rec = m["recovery"]
    assert "tasks restarted: {'ps:1': 1}" in log and log.count("re-running it") == 2, log[-3000:]
    assert "the chief was killed by SIGKILL; re-running it" in log, log[-3000:]
    assert rec["chief_runs"] == 3, rec
    resumed = rec["resumed_from_step"]
    assert KILL_CHIEF_AFTER <= resumed < steps and resumed % EVERY == 0, rec
    assert 0 <= rec["steps_redone"] <= 2 * EVERY, rec
    assert rec["backups"] == (steps - resumed) // EVERY, rec
    # Each worker's stream goes on from batch `resumed` (ctr_job's docstring).
    assert rec["stream_start_batch"] == resumed
    assert m["worker_steps"] == m["scheduled_steps"] == steps - resumed
    assert m["worker_steps"] == m["staleness"]["applied"]
    # The global step and the optimizer's iterations are restored and go on.
    assert m["optimizer_iterations"] == steps == m["staleness"]["global_step"]
    assert m["examples_per_sec"] == pytest.approx(BATCH * m["steps_per_sec"])
    assert m["ctr"]["rows"] == list(ctr_data.table_rows(MAX_ROWS))
    assert m["ctr"]["embedding"] == "tables" and m["ctr"]["zipf_a"] == 1.1
    # The tables over 512 KiB are split over both ps tasks.
    assert m["sharded_variables"]["embedding_2/embeddings"] in ([0, 1], [1, 0])
    # Held-out quality: between learning nothing and the planted model itself.
    n = 16384
    rate = m["test_base_rate"]
    assert abs(rate - ctr_data.BASE_RATE) < 5 * math.sqrt(2 * 0.25 * 0.75 / n)
    constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert 0.6 < m["test_auc"] < m["planted_test_auc"], m["test_auc"]
    assert "test_accuracy" not in m  # about 1 - base rate whatever was learnt
    assert m["planted_test_loss"] - 0.01 < m["test_loss"] < constant - 0.005, (
        m["test_loss"], constant)
    # CPU per task from /proc (launch), per example the last chief run trained.
    cpu, examples = m["task_cpu_s"], m["worker_steps"] * BATCH
    assert sorted(cpu) == ["ps:0", "ps:1", "worker:0", "worker:1"]
    assert all(s > 0 for s in cpu.values())
    assert m["task_cpu_s_per_example"] == {k: v / examples for k, v in cpu.items()}
    assert 0 < m["chief_cpu_s"] and m["chief_cpu_s_per_example"] == pytest.approx(
        m["chief_cpu_s"] / examples)
    assert "held-out AUC" in log and "CPU seconds per task" in log


# -- the Keras 3 raw-id variant: a chief crash, a new chief process resumes ------

# --keras=3 --ctr_embedding=dynamic at a small scale: 26 DynamicEmbedding
# tables of 5% of their feature's ids (full after a step, so that passes
# evict; those of 512 rows or more split over both ps), an eviction pass
# every 2 steps, a backup every 4 worker steps of 2-step closures.
DYN_FLAGS = dict(keras="3", ctr_embedding="dynamic", ctr_max_rows=20_000, min_shard_bytes=32768,
                 dynamic_capacity=0.05, dynamic_evict_every=2, batch_size=512, epochs=2,
                 steps_per_epoch=6, steps_per_execution=2, backup_every_steps=4,
                 ctr_test_examples=4096)
DYN_CRASH_AT = 10  # worker steps when the first chief's fit fails (backups at 4, 8)


@dataclasses.dataclass(frozen=True)
class CtrChiefRun:
    """One chief process of the CTR job (``DYN_FLAGS``) on tasks that outlive it.

    Attributes:
      crashed: whether its fit failed at ``crash_at`` (bool).
      metrics: its metrics.json (dict), None when it crashed.
      backups: worker steps of each backup it wrote (list of ints).
      ids_at_start: ids in its tables' id -> row maps on the ps tasks once
        the model was built, before any restore (int; a new model's: 0).
      tombstones_at_start: ids in the tables' tombstones once the backup
        callback began (restored and tracking; int; 0: none of the last chief's).
      tombstones_at_end: ids in the tables' tombstones when fit stopped (int).
      evicted: ids its tables evicted, restored counters included (int).
      tables: DynamicEmbedding layers (int).
    """
    crashed: bool
    metrics: Optional[dict]
    backups: List[int]
    ids_at_start: int
    tombstones_at_start: int
    tombstones_at_end: int
    evicted: int
    tables: int


@scenario
def ctr_chief_run(tf_config, out, crash_at=None, dump_at=None) -> CtrChiefRun:
    """``ctr_job.run`` of ``DYN_FLAGS`` into ``out`` (backups in out/backup)
    as a chief process of its own on the tasks of ``tf_config``, failing once ``crash_at`` worker steps
    ran (drained first); the 26 tables' checkpoint state (ids, rows,
    counts, last steps, values, Adagrad slot rows, filters, counters) saved
    as ``out/backup-<N>.npz`` at its backup of N = ``dump_at`` steps, and
    as ``out/restored-<N>.npz`` after a resumed run's restore at N."""
    from tf_asyncps import cluster as cluster_lib
    from tf_asyncps.app import ctr_job
    from tf_asyncps.app.job_config import CtrConfig
    from tf_asyncps.callbacks.dynamic import dynamic_layers
    from tf_asyncps.callbacks.step_backup import StepBackup
    from tf_asyncps.dynamic import checkpoint as dynamic_checkpoint
    from tf_asyncps.dynamic import deltas as dynamic_deltas

    seen = {"backups": []}

    def shards(model):
        return [s for layer in dynamic_layers(model) for s in layer.dynamic_table.shards]

    def tombstones(model):
        return sum(int(s.delta_marks.tombs.size().numpy()) for s in shards(model))

    def dump(model, name):
        arrays = {}
        for layer in dynamic_layers(model):
            # With its slot rows (a table that has not met the optimizer
            # in a traced update yet saves them whole instead).
            dynamic_checkpoint.track_optimizer(layer.dynamic_table, model.optimizer)
            for k, v in dynamic_deltas.state_of(layer.dynamic_table).items():
                arrays[f"{layer.name}/{k}"] = v
        np.savez(os.path.join(out, f"{name}.npz"), **arrays)

    class Probe(StepBackup):
        def on_train_begin(self, logs=None):
            seen["ids_at_start"] = sum(int(s.index.size().numpy()) for s in shards(self.model))
            super().on_train_begin(logs)
            seen["tombstones_at_start"] = tombstones(self.model)
            seen["model"] = self.model
            if self.resumed_from_step:
                dump(self.model, f"restored-{self.resumed_from_step}")

        def backup_now(self):
            path = super().backup_now()
            seen["backups"].append(self._scheduled)
            if self._scheduled == dump_at:
                dump(self.model, f"backup-{dump_at}")
            return path

        def after_closures(self, epoch, steps_in_epoch):
            super().after_closures(epoch, steps_in_epoch)
            if crash_at is not None and self._scheduled >= crash_at:
                self._coordinator.join()
                raise RuntimeError("crash")

    import tf_asyncps.callbacks as callbacks_lib
    callbacks_lib.StepBackup = Probe  # what app/job_backup.py makes (a process of its own)
    cfg = CtrConfig(output_dir=out, backup_dir=os.path.join(out, "backup"), **DYN_FLAGS)
    resolver = cluster_lib.cluster_resolver(cluster_lib.validate_tf_config(tf_config))
    try:
        metrics, crashed = ctr_job.run(cfg, resolver, print_fn=lambda line: None), False
    except RuntimeError as e:
        assert str(e) == "crash", e
        metrics, crashed = None, True
    model = seen["model"]
    return CtrChiefRun(
        crashed=crashed, metrics=metrics, backups=seen["backups"],
        ids_at_start=seen["ids_at_start"], tombstones_at_start=seen["tombstones_at_start"],
        tombstones_at_end=tombstones(model),
        evicted=sum(layer.stats()["evicted"] for layer in dynamic_layers(model)),
        tables=len(dynamic_layers(model)))


@pytest.mark.timeout(400)
@pytest.mark.long  # about 110 s on the 2 cores (two chiefs build 26 Keras 3 tables each)
@pytest.mark.cluster
def test_the_keras3_raw_id_ctr_job_resumes_in_a_new_chief_from_its_step_backup(tmp_path):
    """--keras=3 --ctr_embedding=dynamic: a chief that fails at step 10
    (backups: full at 4, delta at 8; eviction passes after the backup at 8)
    and a new chief process on the same ps tasks, as launch re-runs a
    SIGKILLed chief. The new one starts with empty id -> row maps and
    tombstones (it got the dead chief's before: TensorFlow names an eager
    MutableHashTable by a per-process counter), restores base 4 + delta 8
    exactly, redoes 2 steps, reads each stream from batch 8, and ends at
    step 12 with a delta on the same base. Not compared with an
    uninterrupted run: free rows get fresh random values at a restore
    (dynamic/checkpoint.py), so a resumed run admits ids onto other values."""
    out = str(tmp_path)
    with LocalCluster(num_workers=1, num_ps=2) as c:
        first = run_scenario(ctr_chief_run, timeout=300, tf_config=c.tf_config("chief", 0),
                             out=out, crash_at=DYN_CRASH_AT, dump_at=8)
        second = run_scenario(ctr_chief_run, timeout=300, tf_config=c.tf_config("chief", 0),
                              out=out)
    assert first.crashed and first.backups == [4, 8] and first.tables == 26
    assert first.ids_at_start == 0 and first.tombstones_at_start == 0
    # Passes after the backup at 8 left tombstones on the ps (unread by a
    # backup): what a re-run chief must not inherit.
    assert first.evicted > 0 and first.tombstones_at_end > 0
    assert second.ids_at_start == 0 and second.tombstones_at_start == 0
    assert not second.crashed and second.backups == [12]
    m = second.metrics
    assert m["recovery"] == {"chief_runs": 2, "resumed_from_step": 8, "steps_redone": 2,
                             "backups": 1, "stream_start_batch": 8}
    assert m["worker_steps"] == m["scheduled_steps"] == 4 == m["staleness"]["applied"]
    assert m["optimizer_iterations"] == 12 == m["staleness"]["global_step"]
    assert m["keras"].startswith("3.") and m["ctr"]["embedding"] == "dynamic"
    # The restore equals the first chief's tables at its backup at 8, each
    # array of each table (ids, rows, counts, last steps, values, slots, ...).
    backup, restored = (dict(np.load(os.path.join(out, f"{name}-8.npz")))
                        for name in ("backup", "restored"))
    assert sorted(backup) == sorted(restored)
    assert len({name.split("/")[0] for name in backup}) == 26
    for name, want in backup.items():
        np.testing.assert_array_equal(restored[name], want, err_msg=name)
    # Rows live at 8: written at the base (4) or by the delta.
    assert sum(len(v) for k, v in backup.items() if k.endswith("/rows")) > 1000
    kinds = {d: step_backup._kind(os.path.join(out, "backup", d))
             for d in sorted(os.listdir(os.path.join(out, "backup"))) if d.startswith("step-")}
    assert kinds == {"step-000000000004": "full", "step-000000000008": "delta",
                     "step-000000000012": "delta"}
