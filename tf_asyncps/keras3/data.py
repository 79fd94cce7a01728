"""Input for Keras 3 ``fit``/``evaluate``/``predict`` on parameter servers.

``fit`` takes a ``tf.data.Dataset`` (replicated: every worker reads it from
its start, as tf_keras does with a dataset under ParameterServerStrategy) or
a :class:`DatasetFn` (one pipeline per worker, built on that worker), and
turns it into a per-worker iterator (``ClusterCoordinator.create_per_worker_dataset``).
``evaluate`` gives every worker the whole (finite) dataset and splits it into
shards by batch, one closure per shard (``trainer.py``).
"""

import tensorflow as tf

from tf_asyncps.compat import data as data_compat

__all__ = ["DatasetFn", "is_input", "as_input", "train_iterator", "eval_datasets", "check_eval_input",
           "chief_dataset"]


class DatasetFn:
    """A per-worker input pipeline for Keras 3 ``model.fit`` under
    ``AsyncParameterServerStrategy``; the counterpart of tf_keras's
    ``tf_keras.utils.experimental.DatasetCreator`` (which is accepted too).

    ``dataset_fn(input_context)`` runs on each worker and returns a batched
    ``tf.data.Dataset`` of ``(x, y)`` or ``(x, y, sample_weight)``. Under this
    strategy ``input_context.num_input_pipelines`` is the number of workers
    and ``input_context.input_pipeline_id`` the worker's index (an int64
    scalar tensor), so ``ds.shard(ctx.num_input_pipelines,
    ctx.input_pipeline_id)`` gives each worker its own part. Training input
    should repeat: ``fit`` runs ``steps_per_epoch`` worker steps per epoch
    from one iterator per worker that lasts the whole fit.

    For ``evaluate``, ``dataset_fn`` is called with a context of one pipeline
    (id 0) on every worker, since exact evaluation needs each worker to hold
    the whole dataset and splits it into shards itself.

    Args:
      dataset_fn: callable ``(tf.distribute.InputContext) -> tf.data.Dataset``.
      input_options: optional ``tf.distribute.InputOptions``.

    Raises:
      TypeError: ``dataset_fn`` is not callable.
    """

    def __init__(self, dataset_fn, input_options=None):
        if not callable(dataset_fn):
            raise TypeError(f"DatasetFn needs a callable dataset_fn(input_context) -> "
                            f"tf.data.Dataset, got {dataset_fn!r}.")
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, input_context):
        ds = self.dataset_fn(input_context)
        if not isinstance(ds, tf.data.Dataset):
            raise TypeError(f"DatasetFn's dataset_fn must return a tf.data.Dataset, got "
                            f"{type(ds).__name__}.")
        return ds

    def __repr__(self):
        return f"DatasetFn({getattr(self.dataset_fn, '__name__', self.dataset_fn)!r})"


def is_input(x) -> bool:
    """Whether ``x`` is a dataset input: a Dataset, a DatasetFn or tf_keras's
    DatasetCreator (anything else, e.g. arrays, is not)."""
    return isinstance(x, (tf.data.Dataset, DatasetFn)) or \
        (type(x).__name__ == "DatasetCreator" and callable(x))


def as_input(x, field="x"):
    """``x`` as a Dataset or a DatasetFn; tf_keras's DatasetCreator becomes a
    DatasetFn. Raises TypeError naming ``field`` for anything else."""
    if isinstance(x, (tf.data.Dataset, DatasetFn)):
        return x
    if is_input(x):  # a DatasetCreator
        return DatasetFn(x, getattr(x, "input_options", None))
    raise TypeError(
        f"{field} must be a batched tf.data.Dataset of (x, y) or (x, y, sample_weight), "
        f"or tf_asyncps.keras3.DatasetFn(dataset_fn) for one pipeline per worker "
        f"(parameter-server training reads input on the workers); got "
        f"{type(x).__name__}. Wrap arrays as tf.data.Dataset.from_tensor_slices((x, y))"
        f".batch(batch_size).")


def element_spec(inp, num_workers=1):
    """The element spec of an input, built on the chief (a DatasetFn is
    called once with worker 0's context: tf.data is lazy, nothing is read)."""
    if isinstance(inp, DatasetFn):
        return inp(tf.distribute.InputContext(num_workers, 0, 1)).element_spec
    return inp.element_spec


def train_iterator(inp, strategy, coordinator):
    """One iterator per worker for a whole fit (a PerWorker iterator)."""
    if isinstance(inp, DatasetFn):
        def per_worker_fn():
            return strategy.distribute_datasets_from_function(inp, options=inp.input_options)
        return iter(coordinator.create_per_worker_dataset(per_worker_fn))
    return iter(coordinator.create_per_worker_dataset(inp))


def eval_datasets(inp, steps, coordinator):
    """Each worker's copy of the whole evaluation dataset (``steps`` batches,
    or all of a finite dataset), as one value for ``coordinator.schedule``.
    Callers check the input first (:func:`check_eval_input`)."""
    if isinstance(inp, DatasetFn):
        return data_compat.per_worker_datasets(
            coordinator, lambda: _take(inp(tf.distribute.InputContext(1, 0, 1)), steps))
    return data_compat.per_worker_datasets(coordinator, _take(inp, steps))


def check_eval_input(inp, steps, field):
    """Raises ValueError for an evaluation input that would never end (an
    infinite dataset without ``steps``), before any step runs."""
    ds = inp(tf.distribute.InputContext(1, 0, 1)) if isinstance(inp, DatasetFn) else inp
    _check_finite(ds, steps, field)


def chief_dataset(x, batch_size, field="x"):
    """A dataset for ``predict`` on the chief: a Dataset as is, a DatasetFn
    with one pipeline, arrays batched by ``batch_size`` (default 32)."""
    if isinstance(x, DatasetFn):
        return x(tf.distribute.InputContext(1, 0, 1))
    if isinstance(x, tf.data.Dataset):
        return x
    try:
        return tf.data.Dataset.from_tensor_slices(x).batch(batch_size or 32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{field} must be a tf.data.Dataset, a DatasetFn or arrays "
                        f"(numpy / tensors); got {type(x).__name__}: {e}") from None


def _take(ds, steps):
    return ds.take(steps) if steps is not None else ds


def _check_finite(ds, steps, field):
    if steps is None and ds.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"{field} is an infinite dataset (it repeats) and no steps were given: "
            f"pass steps= (evaluate) or validation_steps= (fit), or drop the repeat(), "
            f"so that evaluation visits each batch once.")
