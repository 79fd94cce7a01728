"""Scenarios of tests/test_step_backup.py."""

import os

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps
from tf_asyncps import export
from tf_asyncps.callbacks import StepBackup, step_backup

from scenarios import cluster, scenario
from scenarios.common import mlp, small_problem


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


def _one_framework(c, backup_dir, keras, spe, epochs, steps, every, crash_at, batch=16,
                   full_every=10, publish_every=None):
    x, y = small_problem(n=steps * epochs * batch)
    make = _k3_model if keras == "3" else _tf_keras_model
    if keras in ("tf_keras_table", "3_table"):
        make, keras = (_table_model, "tf_keras") if keras == "tf_keras_table" else \
            (_k3_table_model, "3")
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

    runs = []
    for run in range(3):  # crashes at crash_at; resumes and ends; re-run of an ended fit
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        if run == 0:
            # The reference: one process (the chief's CPU, made after connecting),
            # the same batches in order, no interruption.
            ref = make(spe)
            w0 = ref.get_weights()
            ref.fit(data(0), epochs=epochs, steps_per_epoch=steps, verbose=0)
        with strategy.scope():
            model = make(spe)
        if run == 0:
            model.set_weights(w0)  # later runs start elsewhere: the restore must overwrite
            backup = CrashAt(backup_dir, every, crash_at=crash_at, period_s=3600,
                             full_every=full_every)
        else:
            backup = StepBackup(backup_dir, every, period_s=3600, full_every=full_every)
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
        runs.append({
            "crashed": crashed, "resume_step": resume_step, "summary": backup.summary(),
            "backups": backup.backups, "started": backup.started,
            "global_step": int(strategy.staleness_tracker.global_step.numpy()),
            "iterations": int(model.optimizer.iterations.numpy()),
            "diff_to_reference": _max_diff(model.get_weights(), ref.get_weights()),
            "dirs": sorted(d for d in os.listdir(backup_dir) if not d.endswith(".json")),
            "save_traces": (backup.save_function.experimental_get_tracing_count()
                            if backup.save_function is not None else 0),
            "kinds": [step_backup._kind(os.path.join(backup_dir, d))
                      for d in sorted(os.listdir(backup_dir)) if d.startswith("step-")]})
        if pub is not None:
            query = x[:8]
            runs[-1].update({"published": pub.published, "saved_model": pub.saved_model_dir,
                             "query": query.tolist(),
                             "predictions": np.asarray(model(query, training=False)).tolist()})
    return {"runs": runs, "moved": _max_diff(ref.get_weights(), w0)}


@scenario(shares_cluster=True)
def step_backup_resume(tmpdir, cases):
    """For each case (keras, spe, epochs, steps, every, crash_at): a fit that
    fails at ``crash_at`` worker steps, its re-run with the same backup_dir,
    and a third run of the ended fit; each run on a new strategy (a re-run
    chief), one worker, two ps."""
    with cluster(num_workers=1, num_ps=2) as c:
        return {"cases": [_one_framework(c, os.path.join(tmpdir, f"backup{i}"), **case)
                          for i, case in enumerate(cases)]}
