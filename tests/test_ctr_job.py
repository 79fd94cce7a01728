"""The CTR job end to end: `tf-asyncps launch --flagfile=configs/ctr.flags` on
scaled-down tables (2 ps, 2 workers), its metrics.json and what it learned."""

import json
import math
import sys

import pytest

from conftest import run_command
from tf_asyncps.app import ctr_data

pytestmark = pytest.mark.timeout(400)

# Steps enough for a stable held-out AUC: with fewer, async runs spread widely
# (an early Adagrad's last updates are large); figures in docs/guides/ctr.md.
STEPS, EPOCHS, BATCH, MAX_ROWS = 150, 2, 512, 20_000


@pytest.mark.cluster
def test_ctr_job_learns_the_planted_model_and_writes_metrics(tmp_path):
    _, log = run_command([sys.executable, "-m", "tf_asyncps", "launch",
                          "--flagfile=configs/ctr.flags", f"--output_dir={tmp_path}",
                          f"--ctr_max_rows={MAX_ROWS}", f"--epochs={EPOCHS}",
                          f"--steps_per_epoch={STEPS}", "--ctr_test_examples=16384"],
                         timeout=360)
    m = json.loads((tmp_path / "metrics.json").read_text())
    steps = EPOCHS * STEPS
    assert m["num_workers"] == 2 and m["num_ps"] == 2 and m["policy"] == "async"
    assert m["worker_steps"] == steps == m["staleness"]["applied"] == m["optimizer_iterations"]
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
    # CPU per task from /proc (launch), per example trained.
    cpu = m["task_cpu_s"]
    assert sorted(cpu) == ["ps:0", "ps:1", "worker:0", "worker:1"]
    assert all(s > 0 for s in cpu.values())
    assert m["task_cpu_s_per_example"] == {k: v / (steps * BATCH) for k, v in cpu.items()}
    assert 0 < m["chief_cpu_s"] and m["chief_cpu_s_per_example"] == pytest.approx(
        m["chief_cpu_s"] / (steps * BATCH))
    assert "held-out AUC" in log and "CPU seconds per task" in log
