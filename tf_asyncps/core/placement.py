"""Where the engine's and the policies' own variables live.

Under ``ParameterServerStrategy`` a variable created in the strategy's scope
is placed round-robin over the ps tasks (``tf.device`` is overridden) and
split by the ``variable_partitioner``. The engine's state must not be: an
aggregator's buffer, a read snapshot or a second-moment slot belongs on the
ps task of the variable it serves, whole, so that its update is local to that
task; the update lock belongs beside the global step. Colocation gives both
(TensorFlow never partitions a colocated variable), inside the strategy's
scope and outside it.
"""

import contextlib

import tensorflow as tf

from tf_asyncps.compat import tensorflow as tf_compat

__all__ = ["beside"]


@contextlib.contextmanager
def beside(var):
    """Variables created in this context live on ``var``'s device, unpartitioned.

    Args:
      var: a ``tf.Variable`` (a ps shard of a partitioned variable included).
    """
    with tf.init_scope():
        if tf.distribute.has_strategy():
            with tf.variable_creator_scope(tf_compat.colocating_creator(var)):
                yield
        else:
            with tf.device(var.device):
                yield
