"""StepBackup: a backup every N worker steps under the strategy, a mid-epoch
resume from the newest complete one, steps redone counted (issue 41 item 1)."""

import json
import os

import pytest

from conftest import run_scenario
from tf_asyncps.callbacks import StepBackup, step_backup


def _backup_dir(root, steps, meta=True, name=None):
    path = os.path.join(root, name or f"step-{steps:012d}")
    os.makedirs(path)
    if meta:
        with open(os.path.join(path, step_backup.META_FILE), "w") as f:
            json.dump({"format": 1, "kind": "full", "worker_steps": steps,
                       "steps_per_epoch": 10, "global_step": steps}, f)
    return path


def test_newest_complete_backup_is_the_resume_point(tmp_path):
    root = str(tmp_path)
    _backup_dir(root, 5)
    newest = _backup_dir(root, 10)
    _backup_dir(root, 15, meta=False)  # renamed but meta.json missing: never read
    _backup_dir(root, 20, name=f".tmp-step-{20:012d}-123")  # a save that did not end
    path, meta = step_backup.newest_backup(root)
    assert path == newest and meta["worker_steps"] == 10
    assert StepBackup(root, 5).resume_step == 10
    assert StepBackup(str(tmp_path / "empty"), 5).resume_step == 0


def test_a_backup_of_another_format_is_refused_naming_its_file(tmp_path):
    path = _backup_dir(str(tmp_path), 5)
    with open(os.path.join(path, step_backup.META_FILE), "w") as f:
        f.write('{"format": 99')  # truncated
    with pytest.raises(ValueError, match=r"step-000000000005/meta\.json is unreadable"):
        StepBackup(str(tmp_path), 5)


def test_steps_redone_add_up_across_runs(tmp_path):
    root = str(tmp_path)
    with open(os.path.join(root, step_backup.PROGRESS_FILE), "w") as f:
        json.dump({"steps_done": 9, "chief_runs": 2, "steps_redone": 4}, f)
    b = StepBackup(root, 5)
    assert b.chief_runs == 3 and b.steps_redone == 4 and not b.started


@pytest.mark.parametrize("kwargs, field", [
    ({"every_steps": 0}, "every_steps"), ({"every_steps": True}, "every_steps"),
    ({"every_steps": 5, "keep": 0}, "keep"), ({"every_steps": 5, "full_every": 0}, "full_every"),
    ({"every_steps": 5, "period_s": 0}, "period_s")])
def test_bad_arguments_are_refused_naming_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=rf"StepBackup\({field}\) must be"):
        StepBackup(str(tmp_path), **kwargs)


def test_the_backup_dir_flag_says_what_sets_its_default():
    from tf_asyncps.app import cli
    text = " ".join(cli.FLAGS["backup_dir"].help.split())
    assert "every --backup_every_steps worker steps" in text
    assert "--restart_failed_tasks or --backup_every_steps default it to OUTPUT_DIR/backup" in text


def test_backup_dir_is_required():
    with pytest.raises(ValueError, match="backup_dir=''"):
        StepBackup("", 5)


@pytest.mark.timeout(300)
@pytest.mark.cluster
def test_fit_resumes_mid_epoch_from_its_step_backup(tmp_path):
    """One worker, two ps, SGD: a fit that fails at step 9 and its re-run end
    with the weights of one uninterrupted process; the global step goes on;
    a third run of the ended fit trains nothing."""
    cases = [dict(keras="tf_keras", spe=2, epochs=2, steps=7, every=5, crash_at=9),
             dict(keras="3", spe=1, epochs=2, steps=7, every=5, crash_at=9),
             dict(keras="tf_keras_table", spe=1, epochs=2, steps=7, every=2, crash_at=9,
                  full_every=5)]
    r = run_scenario("step_backup_resume", shared=(1, 2), tmpdir=str(tmp_path), cases=cases)
    _deltas_resume(r["cases"].pop())
    # tf_keras, 2 steps per closure: backups land on closure ends (6, 11, 14).
    # Keras 3, 1 step per closure: at 5, 10 and the end (14).
    for got, (first, later, redone) in zip(r["cases"], [(6, 11, 3), (5, 10, 4)]):
        assert got["moved"] > 1e-2
        crash, resumed, again = got["runs"]
        # One traced checkpoint write per fit, however many full saves
        # (the resumed fit writes 2): none retraced.
        assert [run["save_traces"] for run in got["runs"]] == [1, 1, 0]
        assert crash["crashed"] and crash["backups"] == [first]
        assert crash["global_step"] == crash["iterations"] == 9
        assert crash["summary"] == {"chief_runs": 1, "resumed_from_step": 0,
                                    "steps_redone": 0, "backups": 1}
        assert not resumed["crashed"] and resumed["resume_step"] == first
        assert resumed["backups"] == [later, 14]
        # Restored at `first`, then 14 - first steps: the global step goes on.
        assert resumed["global_step"] == resumed["iterations"] == 14
        assert resumed["summary"] == {"chief_runs": 2, "resumed_from_step": first,
                                      "steps_redone": redone, "backups": 2}
        assert resumed["diff_to_reference"] < 1e-5
        assert resumed["dirs"] == [f"step-{later:012d}", f"step-{14:012d}"]  # keep=2
        # The ended fit: restored at 14, nothing trained, nothing redone.
        assert not again["started"] and again["backups"] == [] and again["resume_step"] == 14
        assert again["global_step"] == again["iterations"] == 14
        assert again["summary"]["steps_redone"] == redone
        assert again["diff_to_reference"] < 1e-5


def _deltas_resume(got):
    """An Embedding table under Adagrad, a backup every 2 steps, full_every=5:
    full at 2, deltas at 4, 6, 8; the crash at 9 resumes from base 2 + the
    chain (4, 6, 8); then delta 10, full 12, delta 14; the re-run equals one
    uninterrupted process (rows and Adagrad slots restored exactly)."""
    crash, resumed, again = got["runs"]
    assert got["moved"] > 1e-2
    assert crash["crashed"] and crash["backups"] == [2, 4, 6, 8]
    assert resumed["resume_step"] == 8 and resumed["backups"] == [10, 12, 14]
    assert resumed["summary"]["steps_redone"] == 1
    assert resumed["global_step"] == resumed["iterations"] == 14
    assert resumed["diff_to_reference"] < 1e-5
    # keep=2: both fulls (2 and 12) and their deltas stay.
    assert resumed["dirs"] == [f"step-{n:012d}" for n in range(2, 15, 2)]
    assert resumed["kinds"] == ["full", "delta", "delta", "delta", "delta", "full", "delta"]
    # The ended fit restores from 14 (base 12 + delta 1) and trains nothing.
    assert not again["started"] and again["resume_step"] == 14 and again["backups"] == []
    assert again["global_step"] == again["iterations"] == 14
    assert again["diff_to_reference"] < 1e-5
