"""Steps redone after a ps task is SIGKILLed mid-run under
``tf-asyncps launch --restart_failed_tasks`` (docs/benchmarks.md, issue 41
item 4).

    python scripts/ps_kill_resume.py --output_dir=/tmp/kill1 --kill_at=750 -- \
        --model=recommender --dataset=movielens --epochs=2 --steps_per_epoch=1000 \
        --steps_per_execution=10 --num_ps=2 --restart_failed_tasks \
        --backup_every_steps=200

The CTR job, the same way:

    python scripts/ps_kill_resume.py --output_dir=/tmp/kill2 --kill_at=650 -- \
        --flagfile=configs/ctr.flags --steps_per_epoch=500 --restart_failed_tasks \
        --backup_every_steps=200

Runs ``tf-asyncps launch ARGS... --output_dir=OUTPUT_DIR`` (the arguments
after ``--``; ``--output_dir`` last, so it overrides a flagfile's), reads
``OUTPUT_DIR/backup/progress.json`` (the worker steps done, which StepBackup
and the epoch backups' ResumeTracker write about every second) and,
``--delay_s`` seconds after it reaches ``--kill_at``, sends SIGKILL to
``--task`` (its pid from ``OUTPUT_DIR/logs/cluster.json``). Waits for launch
to end and prints one JSON line: launch's exit status, the steps done when
the kill was sent, and from ``metrics.json`` the ``recovery`` section (chief
runs, resumed_from_step, steps_redone), ``worker_steps``, ``steps_per_sec``
and ``wall_time_s`` of the last chief run, plus the launch's wall seconds,
and every value of steps_done seen (seconds, steps). Run it under both CPU
slots (``/work/helpers/locked --exclusive``).
"""

import json
import os
import signal
import subprocess
import sys
import time

from absl import app, flags

flags.DEFINE_string("output_dir", None, "launch's --output_dir (must not exist yet).")
flags.DEFINE_integer("kill_at", 500, "Kill once progress.json's steps_done reaches this.",
                     lower_bound=1)
flags.DEFINE_float("delay_s", 0.0, "Seconds between reaching --kill_at and the kill (to land "
                   "between two backups).", lower_bound=0.0)
flags.DEFINE_string("task", "ps:0", "The task to SIGKILL, as in cluster.json (ps:i, worker:i).")
flags.DEFINE_float("timeout_s", 600.0, "Seconds before launch is stopped (SIGTERM).")
flags.mark_flag_as_required("output_dir")
FLAGS = flags.FLAGS


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(argv):
    out = os.path.abspath(FLAGS.output_dir)
    if os.path.exists(out):
        raise app.UsageError(f"--output_dir={out} exists; give a new folder (a backup there "
                             "would be resumed).")
    # --output_dir last: a --flagfile's own --output_dir (configs/ctr.flags) must not win.
    cmd = [sys.executable, "-m", "tf_asyncps", "launch"] + argv[1:] + [f"--output_dir={out}"]
    progress = os.path.join(out, "backup", "progress.json")
    state = os.path.join(out, "logs", "cluster.json")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    killed, reached, seen = None, None, []
    while proc.poll() is None:
        if time.monotonic() - t0 > FLAGS.timeout_s:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            break
        done = (_read(progress) or {}).get("steps_done", 0)
        if not seen or seen[-1][1] != done:
            seen.append((round(time.monotonic() - t0, 2), done))
        if killed is None:
            if reached is None and done >= FLAGS.kill_at:
                reached = time.monotonic()
            if reached is not None and time.monotonic() - reached >= FLAGS.delay_s:
                pid = int(_read(state)["tasks"][FLAGS.task]["pid"])
                os.kill(pid, signal.SIGKILL)
                killed = {"task": FLAGS.task, "pid": pid, "steps_done_at_kill": done,
                          "at_s": time.monotonic() - t0}
                print(f"ps_kill_resume: SIGKILL {FLAGS.task} (pid {pid}) at steps_done "
                      f"{done}", flush=True)
        time.sleep(0.1)
    metrics = _read(os.path.join(out, "metrics.json")) or {}
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    print(json.dumps({"launch_rc": proc.returncode, "killed": killed,
                      "recovery": metrics.get("recovery"),
                      "worker_steps": metrics.get("worker_steps"),
                      "steps_per_sec": metrics.get("steps_per_sec"),
                      "chief_wall_time_s": metrics.get("wall_time_s"),
                      "launch_wall_s": time.monotonic() - t0, "loadavg_after": load,
                      "progress_seen": seen}),
          flush=True)


if __name__ == "__main__":
    app.run(main)
