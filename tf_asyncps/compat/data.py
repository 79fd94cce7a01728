"""tf.data on the workers: each worker's own ``tf.data.Dataset`` built by the
coordinator, as one value to schedule (as tf_keras's exact evaluation does),
and tf.data's test-only transformation that sleeps before each element
(straggler injection, ``tf_asyncps/app/straggler.py``).

Tested with TensorFlow 2.18.1, 2.19.1, 2.20.0 and 2.21.0
(:data:`tf_asyncps.compat.versions.TENSORFLOW_TESTED`; ``pyproject.toml``
asks for ``tensorflow>=2.18,<2.22``): nothing below differs between them,
unless a function names its own versions.
Importing this module imports nothing; each function imports TensorFlow
when called.
"""

__all__ = ["per_worker_datasets", "dataset_sleep"]


def per_worker_datasets(coordinator, dataset_fn):
    """Each worker's own ``tf.data.Dataset`` (not an iterator), as one value to
    pass to ``coordinator.schedule``: ``PerWorkerDatasetFromDatasetFunction.build()``,
    as tf_keras's exact evaluation uses it (TF 2.21)."""
    return coordinator.create_per_worker_dataset(dataset_fn).build()


def dataset_sleep(delay_us):
    """tf.data's test transformation that sleeps ``delay_us`` (int64
    microseconds, may be a tensor) before each element."""
    from tensorflow.python.data.experimental.ops import testing as data_testing
    return data_testing.sleep(delay_us)
