"""The only place that touches private TensorFlow, tf_keras and Keras APIs.

Like Keras 3's ``keras/src/backend/<name>/``: the rest of tf_asyncps calls
these modules, never ``tensorflow.python.*``, ``tf_keras.src.*``,
``keras.src.*`` or a private attribute of a TensorFlow/Keras object, so a
TensorFlow upgrade has one place to look (``tests/test_architecture.py``
checks it). One module per library for what is that library's alone, one
per topic where a topic spans libraries, each stating the versions it was
tested with:

* :mod:`tf_asyncps.compat.versions`: the supported ranges (TensorFlow checked at
  import, Keras 3 where ``tf_asyncps/keras3`` is used) and the tested releases.
* :mod:`tf_asyncps.compat.startup`: TensorFlow 2.18.1-2.21.0 (TensorFlow
  imported without its Keras import, a ps/worker task's server runtime
  imported lean, whether the context is connected to a cluster).
* :mod:`tf_asyncps.compat.strategy`: TensorFlow 2.18.1-2.21.0
  (ParameterServerStrategy's ``extended``: the base class, the hooks a
  subclass may use, its replacement, worker and GPU counts, autograph as
  ``_call_for_each_replica`` does it, its creator's ``colocate_with``).
* :mod:`tf_asyncps.compat.coordinator`: TensorFlow 2.18.1-2.21.0
  (ClusterCoordinator's closure queue and worker threads, its error logs,
  a RemoteValue's ``get``).
* :mod:`tf_asyncps.compat.data`: TensorFlow 2.18.1-2.21.0 (a worker's own
  dataset built by the coordinator, tf.data's test-only sleep).
* :mod:`tf_asyncps.compat.hooks`: TensorFlow 2.21.0, tf_keras 2.21.0,
  Keras 3.15.1 (what tf_asyncps adds to any TensorFlow/Keras object: method
  hooks and untracked attributes).
* :mod:`tf_asyncps.compat.variables`: TensorFlow 2.21.0's resource variable
  read path (a variable's dense reads replaced on one instance, redirected
  while one update is traced), an optimizer counter's ``assign_add`` made
  conditional, and a row read recorded on the gradient tape; TensorFlow
  2.18.1-2.21.0's ShardedVariable shards, CachingVariable, sparse read,
  per-worker variables and resource-variable ops by handle; Keras
  3.10.0-3.15.1's variables (the tf.Variable behind one, atomic adds).
* :mod:`tf_asyncps.compat.checkpoint`: TensorFlow 2.21.0's ``Trackable``
  save/restore protocol (a dynamic table's metadata saved as whole-table
  tensors; variables saved elsewhere, still whole in a SavedModel) and
  whether a SavedModel export is tracing; Keras 3's savers given whole values.
* :mod:`tf_asyncps.compat.graph`: TensorFlow 2.21.0's ``Operation._set_device``
  (constants moved beside their consumers) and a gather gradient's parts;
  TensorFlow 2.18.1-2.21.0's tracing state (inside a function, the outermost
  graph, the resources a function writes) and colocation.
* :mod:`tf_asyncps.compat.lookup`: TensorFlow 2.21.0 (an eager
  ``MutableHashTable`` made under a shared name of the caller's, not a
  per-process counter).
* :mod:`tf_asyncps.compat.tf_keras`: tf_keras 2.18.0-2.21.0 (what is tf_keras's
  alone: BackupAndRestore's training state, its evaluate's call, its
  optimizer classes, whether an optimizer has built its slots).
* :mod:`tf_asyncps.compat.keras_models`: Keras 3.10.0-3.15.1 (Keras 3 models in
  training: compile, symbolic build, train step, the refusal hook on Keras
  3's own loops, layers, BackupAndRestore's epoch, TensorBoard's profiling
  range).
* :mod:`tf_asyncps.compat.mixed_precision`: tf_keras 2.18.0-2.21.0 and Keras
  3.10.0-3.15.1 (a LossScaleOptimizer's dynamic scale and its update,
  tf_keras's loss-scaling allowlist and AutoCastVariable).
* :mod:`tf_asyncps.compat.sharded_slots`: Keras 3.15.1 and tf_keras 2.21.0
  with TensorFlow 2.21.0 (an optimizer's slots of sharded or partitioned
  weights, and Keras 3's partitioned weights themselves, saved whole in
  ``tf.train.Checkpoint``, restored by global row onto any number of
  shards, also when restored before the slots exist).
* :mod:`tf_asyncps.compat.optimizers`: tf_keras 2.18.0-2.21.0 and Keras
  3.10.0-3.15.1 (the optimizers' ``apply_gradients``/``apply`` hooks, Keras
  3's counter made atomic, a tf_keras optimizer's strategy, the optimizers
  whose sparse updates touch every row, the optimizer and LossScaleOptimizer
  classes, an optimizer creating a slot; Keras 3.15.1: a slot of one
  variable, ``update_step`` replaced while an update is traced).
* :mod:`tf_asyncps.compat.call_scopes`: Keras 3.10.0-3.15.1 and tf_keras
  2.18.0-2.21.0: which Keras call runs on this thread (a compile, a tf_keras
  evaluate, an optimizer creating a slot, Keras 3's own loops), known by
  hooking the call, not by reading the stack.
* :mod:`tf_asyncps.compat.keras_layers`: Keras 3.15.1, tf_keras 2.21.0 (what
  ``tf_asyncps.layers`` needs: a weight made under Keras 3's symbolic build,
  whether a ``train_step`` runs, the frames that pick a layer's Keras: the
  package's only frame walks, listed with why in tests/test_architecture.py).
* :mod:`tf_asyncps.compat.saved_model`: Keras 3.15.1, TensorFlow 2.21.0
  (Keras 3's ``model.export`` archive with extra objects under names the
  loaded SavedModel keeps, ``ExportArchive._tf_trackable``; object paths in a
  SavedModel's object graph, on disk and loaded).

Each module is importable without the library it wraps being imported
first: functions import what they need when called.
"""
