"""StepBackup: a backup every N worker steps under the strategy, a mid-epoch
resume from the newest complete one, steps redone counted (issue 41 item 1);
delta backups beside a DeltaPublisher reading the same dirty marks, and a
chain written over 2 ps restored onto 3 (items 2 and 3).

The cluster scenarios sit above the tests that read them and return the
dataclasses declared with them (docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses
import json
import os
import types

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario
from scenarios.common import full_value, mlp, small_problem
from tf_asyncps import export
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
    ({"every_steps": 5, "period_s": 0}, "period_s"), ({"every_steps": 2**63}, "every_steps")])
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


def test_a_backup_dir_that_is_a_file_is_refused_naming_the_fix(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    with pytest.raises(ValueError, match=r"StepBackup\(backup_dir='.*a_file'\) is a file, not "
                       r"a folder: give a folder path"):
        StepBackup(str(path), 5)
    with pytest.raises(ValueError, match=r"StepBackup\(backup_dir='.*a_file/sub'\): cannot "
                       r"make the folder"):
        StepBackup(str(path / "sub"), 5)



def test_a_full_save_clears_every_mark_of_the_deltas(tmp_path, monkeypatch):
    """A full backup clears its ModelDeltas whole (rows, a dynamic table's
    filter marks and tombstones: ModelDeltas.clear), not its row marks only."""
    calls = []

    class Deltas:
        def clear(self):
            calls.append("clear")

    backup = StepBackup(str(tmp_path), 5)
    backup._deltas = Deltas()
    monkeypatch.setattr(backup, "_write_checkpoint", lambda prefix: None)
    backup._write_full(str(tmp_path / "step-000000000005"), 5, {"format": 1})
    assert calls == ["clear"] and backup._seq == 0


def _in_process(backup, model):
    """``backup`` given ``model`` and a global step, as on_train_begin would
    under the strategy (its checkpoint needs nothing else of a cluster)."""
    backup.model = model
    backup._strategy = types.SimpleNamespace(staleness_tracker=types.SimpleNamespace(
        global_step=tf.Variable(0, dtype=tf.int64)))
    return backup


def _dense(*units):
    model = tf_keras.Sequential([tf_keras.layers.Dense(u) for u in units])
    model.build((None, 4))
    return model


@pytest.mark.parametrize("units", [(5,), (3, 2)], ids=["another_shape", "another_layer"])
def test_a_backup_of_another_model_is_refused_naming_backup_dir_and_the_fix(tmp_path, units):
    """Restoring another model's full backup (the CTR job re-run with another
    --ctr_max_rows into the same --backup_dir, say) says which folder and what
    to do, not TensorFlow's shape or unmatched-object error alone; the same
    model's backup restores its values."""
    root, written = str(tmp_path), _dense(3)
    meta = {"format": 1, "worker_steps": 5, "steps_per_epoch": 10, "global_step": 5}
    _in_process(StepBackup(root, 5), written)._write_full(
        os.path.join(root, "step-000000000005"), 5, meta)
    same = _in_process(StepBackup(root, 5), _dense(3))
    same._restore(*same._resume)
    np.testing.assert_array_equal(same.model.layers[0].kernel.numpy(),
                                  written.layers[0].kernel.numpy())
    other = _in_process(StepBackup(root, 5), _dense(*units))
    with pytest.raises(ValueError) as raised:
        other._restore(*other._resume)
    text = str(raised.value)
    assert f"backup_dir={root} holds a backup this model cannot restore" in text
    assert "step-000000000005" in text
    assert "Use a new backup_dir or delete that one." in text


def test_a_graph_restore_error_is_refused_with_its_telling_line(tmp_path, monkeypatch):
    """Variables on ps tasks are restored by a RestoreV2 op: another shape
    raises InvalidArgumentError whose first line is the graph error's header;
    the message quotes the line that names the tensor and both shapes."""
    root = str(tmp_path)
    _in_process(StepBackup(root, 5), _dense(3))._write_full(
        os.path.join(root, "step-000000000005"), 5,
        {"format": 1, "worker_steps": 5, "steps_per_epoch": 10, "global_step": 5})
    other = _in_process(StepBackup(root, 5), _dense(3))
    shape = ("tensor_name = model/embeddings; shape in shape_and_slice spec [50000,16] does "
             "not match the shape stored in checkpoint: [100000,16]")

    class GraphRestore:
        def read(self, prefix):
            raise tf.errors.InvalidArgumentError(
                None, None, "Graph execution error:\n\nDetected at node RestoreV2 defined at:\n"
                f"  File \"x.py\", line 1, in <module>\n\n{shape}\n\t [[{{{{node RestoreV2}}}}]]")

    monkeypatch.setattr(other, "_checkpoint", GraphRestore)
    with pytest.raises(ValueError) as raised:
        other._restore(*other._resume)
    assert str(raised.value) == (
        f"StepBackup: backup_dir={root} holds a backup this model cannot restore "
        f"({root}/step-000000000005: {shape}); it is probably from another model or "
        "optimizer. Use a new backup_dir or delete that one.")


# -- cluster scenarios ------------------------------------------------------------


class CrashAt(StepBackup):
    """A StepBackup whose fit fails once ``crash_at`` worker steps have run
    (drained first, so exactly that many updates are applied)."""

    def __init__(self, *args, crash_at, **kwargs):
        super().__init__(*args, **kwargs)
        self.crash_at = crash_at

    def after_closures(self, epoch, steps_in_epoch):
        super().after_closures(epoch, steps_in_epoch)
        if epoch * self.params["steps"] + steps_in_epoch >= self.crash_at:
            tf.distribute.coordinator.ClusterCoordinator(self.model.distribute_strategy).join()
            raise RuntimeError("crash")


def _weights(model):
    """Every layer's weights, a table split over shards as one array."""
    return [full_value(getattr(layer, name)) for layer in model.layers
            for name in ("embeddings", "kernel", "bias") if hasattr(layer, name)]


def _set_weights(model, values):
    from tf_asyncps.callbacks import delta_chain
    variables = [getattr(layer, name) for layer in model.layers
                 for name in ("embeddings", "kernel", "bias") if hasattr(layer, name)]
    for var, value in zip(variables, values):
        delta_chain.assign_whole(var, value)


def _max_diff(a, b):
    return float(max(np.max(np.abs(np.asarray(p) - np.asarray(q))) for p, q in zip(a, b)))


def _k3_model(spe):
    import keras
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    return model


def _tf_keras_model(spe):
    model = mlp()
    model.compile(tf_keras.optimizers.SGD(0.1),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    return model


def _table_model(spe):
    """An embedding table (50 rows) under Adagrad: StepBackup writes deltas."""
    model = tf_keras.Sequential([tf_keras.Input((3,), dtype="int64"),
                                 tf_keras.layers.Embedding(50, 4),
                                 tf_keras.layers.Flatten(), tf_keras.layers.Dense(3)])
    model.compile(tf_keras.optimizers.Adagrad(0.1),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    return model


def _k3_table_model(spe):
    """A Keras 3 embedding table (50 rows) under Adagrad: StepBackup writes deltas."""
    import keras
    model = keras.Sequential([keras.Input((3,), dtype="int64"), keras.layers.Embedding(50, 4),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adagrad(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    return model


def _dynamic_model(spe):
    """A DynamicEmbedding of 26 rows (2 shards of 13 under ``_partitioner(2)``)
    for the data's 29 ids, LFU eviction every 2 steps, under Adagrad. Its
    rows start at zero: a restore gives the free rows fresh initializer
    values and an eviction pass the evicted ones, so only a constant
    initializer lets a resumed fit equal an uninterrupted one exactly."""
    from tf_asyncps.layers import DynamicEmbedding
    model = tf_keras.Sequential([tf_keras.Input((3,), dtype="int64"),
                                 DynamicEmbedding(4, capacity=26, evict_every=2,
                                                  initializer="zeros"),
                                 tf_keras.layers.Flatten(), tf_keras.layers.Dense(3)])
    model.compile(tf_keras.optimizers.Adagrad(0.1),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    return model


def _dynamic_values(model):
    """The DynamicEmbedding's checkpoint state (dynamic/checkpoint.py's
    entry: rows, ids, counts, last steps, values, Adagrad slot rows, filter,
    counters), each shard's id -> row map, its stats and reshard stats, as
    numpy; after a restore onto other shards, once re-homed (as the first
    lookup and update would)."""
    from tf_asyncps.dynamic import checkpoint as dynamic_checkpoint
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    from tf_asyncps.dynamic import reshard
    layer = model.layers[0]
    table = layer.dynamic_table
    dynamic_checkpoint.track_optimizer(table, model.optimizer)
    table.prepare()
    reshard.prepare_slots(table, dynamic_checkpoint.slot_sets(table, model.optimizer))
    out = dynamic_deltas.state_of(table)
    out.update({f"reshard:{k}": np.asarray(v) for k, v in table.reshard_stats().items()})
    for j, shard in enumerate(table.shards):
        keys, rows = (t.numpy() for t in shard.index.export())
        order = np.argsort(rows)
        out[f"index{j}"] = np.stack([keys[order], rows[order]])
    out.update({f"stats:{k}": np.asarray(v) for k, v in layer.stats().items()})
    return out


def _partitioner(num_ps):
    """Splits the 50 x 4 table (800 bytes) over ``num_ps`` shards and leaves
    the Dense head (under 200 bytes) whole."""
    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=200, max_shards=num_ps)


@dataclasses.dataclass(frozen=True)
class BackupRun:
    """One chief run of a fit with a StepBackup (and a DeltaPublisher when asked).

    Attributes:
      crashed: the fit raised at ``crash_at`` worker steps.
      resume_step: worker steps of the backup it resumed from (0: none).
      summary: ``StepBackup.summary()`` (chief_runs, resumed_from_step,
        steps_redone, backups: counts).
      backups: worker steps of each backup this run wrote.
      started: the fit reached an epoch (False for an ended fit's re-run).
      global_step, iterations: the strategy's global step and the
        optimizer's step counter at the end (ints).
      diff_to_reference: max |weight - uninterrupted one-process weight|.
      dirs: the backup folders left in ``backup_dir``.
      save_traces: traces of the full-save function (0: no full save).
      kinds: "full" or "delta" per backup folder, oldest first.
      table, slot: the table's rows and their Adagrad accumulator at the
        end, ``[rows][dim]`` floats (table cases only, else None).
      shards: the table's shards (ps tasks holding it; table cases).
      dynamic: the DynamicEmbedding's state, maps and stats
        (``_dynamic_values``; dynamic cases only, else None).
      published: deltas the publisher wrote (None without a publisher).
      serving_diff: max |prediction of the publisher's SavedModel brought up
        by ``apply_deltas`` - the chief's model's| on 8 inputs (None without).
    """
    crashed: bool
    resume_step: int
    summary: dict
    backups: list[int]
    started: bool
    global_step: int
    iterations: int
    diff_to_reference: float
    dirs: list[str]
    save_traces: int
    kinds: list[str]
    table: list | None = None
    slot: list | None = None
    shards: int | None = None
    dynamic: dict | None = None
    published: int | None = None
    serving_diff: float | None = None


@dataclasses.dataclass(frozen=True)
class BackupCase:
    """Attributes: runs: the crashed fit, its re-run, a re-run of the ended
    fit (fewer with ``runs``). moved: max |w_end - w_0| of the reference."""
    runs: list[BackupRun]
    moved: float


@dataclasses.dataclass(frozen=True)
class StepBackupResume:
    """Attributes: cases: one per case asked, in order."""
    cases: list[BackupCase]


def _table_values(model):
    """(table rows, Adagrad accumulator rows, shards) of the first layer's table."""
    emb = model.layers[0].embeddings
    from tf_asyncps.callbacks import delta_chain
    from tf_asyncps.compat import optimizers as opt_compat
    shards = delta_chain.shards_of(emb)
    slots = [opt_compat.slot(model.optimizer, "accumulator", emb if len(shards) == 1 else s)
             for s in shards]
    return (full_value(emb).tolist(),
            np.concatenate([np.asarray(delta_chain.shards_of(s)[0].numpy())
                            for s in slots]).tolist(), len(shards))


def _one_framework(c, backup_dir, keras, spe, epochs, steps, every, crash_at, batch=16,
                   full_every=10, publish_every=None, num_ps=None, runs=(0, 1, 2)):
    x, y = small_problem(n=steps * epochs * batch)
    make = _k3_model if keras == "3" else _tf_keras_model
    table = keras in ("tf_keras_table", "3_table")
    dynamic = keras == "tf_keras_dynamic"
    if table:
        make, keras = (_table_model, "tf_keras") if keras == "tf_keras_table" else \
            (_k3_table_model, "3")
    if dynamic:
        make, keras = _dynamic_model, "tf_keras"
    if table or dynamic:
        x = (np.abs(x[:, :3]) * 10).astype(np.int64) % 50

    def data(skip):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat().skip(skip)

    def fit(model, callbacks, skip):
        if keras == "3":
            return model.fit(data(skip), epochs=epochs, steps_per_epoch=steps, verbose=0,
                             callbacks=callbacks)
        creator = tf_keras.utils.experimental.DatasetCreator(lambda ctx: data(skip))
        return model.fit(creator, epochs=epochs, steps_per_epoch=steps, verbose=0,
                         callbacks=callbacks)

    out = []
    # The reference: one process (the chief's CPU, made after connecting),
    # the same batches in order, no interruption. A DynamicEmbedding's
    # (its rows, ids, counts and slots): the uninterrupted fit on the
    # cluster, run "ref" (a StepBackup of its own beside it, as the others).
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), variable_partitioner=_partitioner(num_ps) if num_ps else None)
    ref = make(spe)
    w0 = _weights(ref)
    if dynamic and 0 in runs:
        runs = ("ref",) + tuple(runs)
    else:
        ref.fit(data(0), epochs=epochs, steps_per_epoch=steps, verbose=0)
    for run in runs:  # 0: crashes at crash_at; 1: resumes and ends; 2: re-run of an ended fit
        if run != runs[0]:
            strategy = tf_asyncps.AsyncParameterServerStrategy(
                c.resolver(), variable_partitioner=_partitioner(num_ps) if num_ps else None)
        with strategy.scope():
            model = make(spe)
        run_dir = backup_dir + ("_ref" if run == "ref" else "")
        if run in (0, "ref"):
            _set_weights(model, w0)  # later runs start elsewhere: the restore must overwrite
        if run == 0:
            backup = CrashAt(backup_dir, every, crash_at=crash_at, period_s=3600,
                             full_every=full_every)
        else:  # the reference: its marks as the others', one backup (at the end)
            backup = StepBackup(run_dir, 2**62 if run == "ref" else every, period_s=3600,
                                full_every=full_every)
        resume_step = backup.resume_step
        # A serving stream beside the backups: it reads its own bit of the
        # same dirty marks (after the backup's restore: listed after it).
        pub = export.DeltaPublisher(f"{backup_dir}_publish{run}", publish_every) \
            if publish_every else None
        try:
            fit(model, [backup] + ([pub] if pub else []), resume_step)
            crashed = False
        except RuntimeError as e:
            assert "crash" in str(e), e
            backup.record_failure()
            crashed = True
        fields = {}
        if table:
            fields["table"], fields["slot"], fields["shards"] = _table_values(model)
        if dynamic:
            fields["dynamic"] = _dynamic_values(model)
            fields["shards"] = len(model.layers[0].dynamic_table.shards)
        if pub is not None:
            fields["published"] = pub.published
            if not crashed:  # a crashed fit's last steps are past its last delta
                query = tf.constant(x[:8])
                served = export.apply_deltas(pub.saved_model_dir)
                serve = served.serve if keras == "3" else served
                fields["serving_diff"] = _max_diff([np.asarray(serve(query))],
                                                   [np.asarray(model(query, training=False))])
        out.append(BackupRun(
            crashed=crashed, resume_step=resume_step, summary=backup.summary(),
            backups=backup.backups, started=backup.started,
            global_step=int(strategy.staleness_tracker.global_step.numpy()),
            iterations=int(model.optimizer.iterations.numpy()),
            diff_to_reference=_max_diff(_weights(model), _weights(ref)),
            dirs=sorted(d for d in os.listdir(run_dir) if not d.endswith(".json")),
            save_traces=(backup.save_function.experimental_get_tracing_count()
                         if backup.save_function is not None else 0),
            kinds=[step_backup._kind(os.path.join(run_dir, d))
                   for d in sorted(os.listdir(run_dir)) if d.startswith("step-")],
            **fields))
        if run == "ref":
            ref = model
    return BackupCase(runs=out, moved=_max_diff(_weights(ref), w0))


@scenario(shares_cluster=True)
def step_backup_resume(tmpdir, cases, num_ps=2) -> StepBackupResume:
    """For each case (keras, spe, epochs, steps, every, crash_at, and
    optionally full_every, publish_every, num_ps: the table split over that
    many shards, runs: which of the three runs): a fit that fails at
    ``crash_at`` worker steps, its re-run with the same backup_dir, and a
    third run of the ended fit; each run on a new strategy (a re-run chief),
    one worker, ``num_ps`` ps. A case's ``name`` names its backup_dir."""
    with cluster(num_workers=1, num_ps=num_ps) as c:
        return StepBackupResume(cases=[
            _one_framework(c, os.path.join(tmpdir, case.pop("name", f"backup{i}")), **case)
            for i, case in enumerate(cases)])


@pytest.mark.timeout(420)
@pytest.mark.cluster
def test_fit_resumes_mid_epoch_from_its_step_backup(tmp_path):
    """One worker, two ps, SGD: a fit that fails at step 9 and its re-run end
    with the weights of one uninterrupted process; the global step goes on;
    a third run of the ended fit trains nothing. Table cases: deltas beside
    a DeltaPublisher, and a chain written with the table over 2 ps restored
    onto 3 ps. A DynamicEmbedding over 2 ps: the resumed fit holds the
    uninterrupted one's table exactly, and its chain restored on 3 ps
    equals that fit's full backup restored there."""
    table = dict(keras="tf_keras_table", spe=1, epochs=2, steps=7, every=2, crash_at=9,
                 full_every=5)
    cases = [dict(keras="tf_keras", spe=2, epochs=2, steps=7, every=5, crash_at=9),
             dict(keras="3", spe=1, epochs=2, steps=7, every=5, crash_at=9),
             dict(table, publish_every=3),
             dict(table, num_ps=2, runs=[0, 1], name="sharded"),
             dict(table, keras="3_table", publish_every=3),
             dict(table, keras="tf_keras_dynamic", num_ps=2, runs=[0, 1], name="dynamic")]
    r = run_scenario(step_backup_resume, shared=(1, 2), tmpdir=str(tmp_path), cases=cases)
    # The ended fit again, on 3 ps: base 12 + delta 14 written over 2 shards;
    # the DynamicEmbedding's too, and its uninterrupted fit's full backup at 14.
    dynamic = dict(table, keras="tf_keras_dynamic", num_ps=3, runs=[2])
    on3 = run_scenario(step_backup_resume, shared=(1, 3), tmpdir=str(tmp_path), num_ps=3,
                       cases=[dict(table, num_ps=3, runs=[2], name="sharded"),
                              dict(dynamic, name="dynamic"), dict(dynamic, name="dynamic_ref")])
    _dynamic_resharded(*(case.runs[0] for case in on3.cases[1:]))
    _dynamic_resume(r.cases.pop())
    _deltas_resume(r.cases.pop())  # Keras 3
    _resharded(r.cases.pop(), on3.cases[0].runs[0])
    _deltas_resume(r.cases.pop())
    # tf_keras, 2 steps per closure: backups land on closure ends (6, 11, 14).
    # Keras 3, 1 step per closure: at 5, 10 and the end (14).
    for got, (first, later, redone) in zip(r.cases, [(6, 11, 3), (5, 10, 4)]):
        assert got.moved > 1e-2
        crash, resumed, again = got.runs
        # One traced checkpoint write per fit, however many full saves
        # (the resumed fit writes 2): none retraced.
        assert [run.save_traces for run in got.runs] == [1, 1, 0]
        assert crash.crashed and crash.backups == [first]
        assert crash.global_step == crash.iterations == 9
        assert crash.summary == {"chief_runs": 1, "resumed_from_step": 0,
                                 "steps_redone": 0, "backups": 1}
        assert not resumed.crashed and resumed.resume_step == first
        assert resumed.backups == [later, 14]
        # Restored at `first`, then 14 - first steps: the global step goes on.
        assert resumed.global_step == resumed.iterations == 14
        assert resumed.summary == {"chief_runs": 2, "resumed_from_step": first,
                                   "steps_redone": redone, "backups": 2}
        assert resumed.diff_to_reference < 1e-5
        assert resumed.dirs == [f"step-{later:012d}", f"step-{14:012d}"]  # keep=2
        # The ended fit: restored at 14, nothing trained, nothing redone.
        assert not again.started and again.backups == [] and again.resume_step == 14
        assert again.global_step == again.iterations == 14
        assert again.summary["steps_redone"] == redone
        assert again.diff_to_reference < 1e-5


def _deltas_resume(got):
    """An Embedding table under Adagrad, a backup every 2 steps, full_every=5,
    and a DeltaPublisher every 3 steps reading the same dirty marks: full at
    2, deltas at 4, 6, 8; the crash at 9 resumes from base 2 + the chain
    (4, 6, 8); then delta 10, full 12, delta 14; the re-run equals one
    uninterrupted process (rows and Adagrad slots restored exactly: the
    publisher's clears take no row from the backup), and the publisher's
    SavedModel brought up by apply_deltas predicts as the chief's model."""
    crash, resumed, again = got.runs
    assert got.moved > 1e-2
    assert crash.crashed and crash.backups == [2, 4, 6, 8]
    assert resumed.resume_step == 8 and resumed.backups == [10, 12, 14]
    assert resumed.summary["steps_redone"] == 1
    assert resumed.global_step == resumed.iterations == 14
    assert resumed.diff_to_reference < 1e-5
    # keep=2: both fulls (2 and 12) and their deltas stay.
    assert resumed.dirs == [f"step-{n:012d}" for n in range(2, 15, 2)]
    assert resumed.kinds == ["full", "delta", "delta", "delta", "delta", "full", "delta"]
    # Published after 3 and 6 steps of each run (the crash at 9 came first
    # in its run; the resumed run's 6 steps end on its second delta).
    assert crash.published == 2 and resumed.published == 2
    assert resumed.serving_diff < 1e-6
    # The ended fit restores from 14 (base 12 + delta 1) and trains nothing.
    assert not again.started and again.resume_step == 14 and again.backups == []
    assert again.global_step == again.iterations == 14
    assert again.diff_to_reference < 1e-5 and again.published == 0


def _dynamic_resume(got):
    """A DynamicEmbedding split over 2 ps, LFU eviction every 2 steps, the
    same backups as _deltas_resume's (full at 2, deltas at 4, 6, 8; the
    crash at 9 resumes from base 2 + 3 deltas; delta 10, full 12, delta
    14): the resumed fit holds the uninterrupted fit's table exactly (live
    rows, ids, counts, last steps, values, Adagrad slot rows, filters,
    counters, each shard's map) and its dense weights."""
    ref, crash, resumed = got.runs
    assert ref.shards == 2 and not ref.crashed and ref.backups == [14]
    assert ref.dynamic["stats:evicted"] > 0  # the chains cross eviction passes
    assert crash.crashed and crash.backups == [2, 4, 6, 8]
    assert crash.kinds == ["full", "delta", "delta", "delta"]
    assert resumed.resume_step == 8 and resumed.backups == [10, 12, 14]
    assert resumed.global_step == resumed.iterations == ref.global_step == 14
    assert resumed.kinds == ["full", "delta", "delta", "delta", "delta", "full", "delta"]
    assert resumed.diff_to_reference < 1e-6
    assert sorted(resumed.dynamic) == sorted(ref.dynamic)
    for name, want in ref.dynamic.items():
        np.testing.assert_array_equal(resumed.dynamic[name], want, err_msg=name)


def _dynamic_resharded(chain, full):
    """The DynamicEmbedding's base 12 + delta 14, written over 2 ps,
    restored on 3 ps and re-homed, equals the uninterrupted fit's full
    backup at 14 restored there: rows, ids, counts, last steps, values,
    Adagrad slot rows, each shard's map, counters, moved and dropped ids."""
    for run in (chain, full):
        assert run.shards == 3 and run.resume_step == 14 and not run.started
        assert run.dynamic["reshard:from_shards"] == 2
    assert chain.kinds[-2:] == ["full", "delta"] and full.kinds == ["full"]
    assert sorted(chain.dynamic) == sorted(full.dynamic)
    for name, want in full.dynamic.items():
        np.testing.assert_array_equal(chain.dynamic[name], want, err_msg=name)


def _resharded(got, on3):
    """The table split over 2 ps: the same chain, exact; restored on a 3-ps
    cluster (3 shards) its rows and Adagrad accumulator equal the 2-ps
    fit's at step 14, value for value."""
    crash, resumed = got.runs
    assert crash.crashed and crash.backups == [2, 4, 6, 8] and crash.shards == 2
    assert resumed.resume_step == 8 and resumed.backups == [10, 12, 14]
    assert resumed.diff_to_reference < 1e-5
    assert resumed.kinds[-2:] == ["full", "delta"]
    assert on3.shards == 3 and on3.resume_step == 14 and not on3.started
    assert on3.global_step == on3.iterations == 14
    assert on3.table == resumed.table and on3.slot == resumed.slot
