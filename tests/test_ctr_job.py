"""The CTR job end to end: `tf-asyncps launch --flagfile=configs/ctr.flags` on
scaled-down tables (2 ps, 2 workers), its metrics.json and what it learned,
with a ps SIGKILLed mid-run and the run resumed from a step backup (one run:
the job's quality is measured on the resumed run)."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, poll_until, stop_process, subprocess_env
from tf_asyncps import recovery
from tf_asyncps.app import ctr_data
from tf_asyncps.callbacks import step_backup

pytestmark = pytest.mark.timeout(400)

# Steps enough for a stable held-out AUC: with fewer, async runs spread widely
# (an early Adagrad's last updates are large); figures in docs/guides/ctr.md.
STEPS, EPOCHS, BATCH, MAX_ROWS = 150, 2, 512, 20_000
EVERY = 50  # --backup_every_steps (a multiple of configs/ctr.flags' steps_per_execution)
KILL_AFTER = 100  # worker steps backed up before ps:1 is killed


def _launch_killing_a_ps(out):
    """Runs the job under --restart_failed_tasks --backup_every_steps=EVERY and
    SIGKILLs ps:1 once the backup at KILL_AFTER steps is written; returns
    (launch's exit status, its output)."""
    log_path = os.path.join(out, "launch.log")
    backup_dir = os.path.join(out, "backup")
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
            # A backup is complete once its folder holds meta.json (StepBackup).
            poll_until(lambda: os.path.isfile(os.path.join(
                backup_dir, f"step-{KILL_AFTER:012d}", step_backup.META_FILE)),
                proc, 240, f"the backup at {KILL_AFTER} steps")
            state = recovery.read_json(os.path.join(out, "logs", "cluster.json"))
            os.kill(state["tasks"]["ps:1"]["pid"], signal.SIGKILL)
            rc = proc.wait(timeout=300)
        finally:
            stop_process(proc)
            log.seek(0)
            text = log.read()
    return rc, text


@pytest.mark.cluster
def test_ctr_job_resumes_from_a_step_backup_learns_the_planted_model_and_writes_metrics(
        tmp_path):
    rc, log = _launch_killing_a_ps(str(tmp_path))
    assert rc == 0, log[-4000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    steps = EPOCHS * STEPS
    assert m["num_workers"] == 2 and m["num_ps"] == 2 and m["policy"] == "async"
    # ps:1 died after the backup at KILL_AFTER: the chief lost it (exit 75),
    # launch restarted it and re-ran the chief, which resumed from the newest
    # backup (a delta on the full one at EVERY) with at most EVERY steps redone.
    rec = m["recovery"]
    assert "tasks restarted: {'ps:1': 1}" in log and log.count("re-running it") == 1, log[-3000:]
    assert rec["chief_runs"] == 2, rec
    resumed = rec["resumed_from_step"]
    assert KILL_AFTER <= resumed < steps and resumed % EVERY == 0, rec
    assert 0 <= rec["steps_redone"] <= EVERY, rec
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
