"""Row-wise updates of embedding tables under Keras 3 optimizers.

Keras 3.15's update rules are dense tensor math on the whole variable:
Adagrad's ``variable -= lr * g / sqrt(accumulator + eps)`` reads and takes
the square root of every accumulator row at every step, although on a
sparse (``tf.IndexedSlices``) gradient only the rows of its ids change. On
an embedding table the cost of a step then grows with the table, not with
the batch. And Keras 3 squares a sparse gradient row by row
(``ops.square`` of an IndexedSlices) without summing the rows of repeated
ids first, so the rule needs more of a repeated id than its summed gradient.

Read in ``keras/src/optimizers/{sgd,adagrad,adam}.py`` and
``keras/src/backend/tensorflow/{optimizer,sparse}.py`` (3.15.1): for a
gradient with rows ``g_k`` at ids ``i_k`` (repeats allowed), per distinct id
``r`` with ``S1 = sum_{i_k = r} g_k`` and ``S2 = sum_{i_k = r} g_k**2``:

* SGD without momentum: ``w[r] -= lr * S1`` (a scatter; untouched rows
  keep their values). Keras 3's own update is already row-wise.
* Adagrad: ``acc[r] += S2`` (a scatter of the squared rows), then
  ``w[r] -= lr * S1 / sqrt(acc[r] + eps)`` (the division gathers the dense
  ``sqrt(acc + eps)`` at the ids); untouched rows keep ``w`` and ``acc``.
* Adam: the moments take the densified gradient (``m += (S1 - m)(1 - b1)``,
  ``v += (S2 - v)(1 - b2)`` on every row, ``S1 = S2 = 0`` off the ids), so
  every row's moments decay and every row with a non-zero moment moves.

So for SGD and Adagrad, updating only the touched rows from ``(ids, S1,
S2)`` is exactly Keras 3's rule; for Adam it is the "lazy" rule
(:class:`tf_asyncps.keras3.LazyAdam`, an opt-in), and Keras 3's dense Adam
stays the default.

Under :class:`~tf_asyncps.AsyncParameterServerStrategy` a worker step then
sends each distinct id once (:func:`distinct_rows`, on the worker): the
ids with their ``S1``, and ``S2`` only for the ids that occur more than once
(ordered first; for an id seen once ``S2 = S1**2``, computed on the ps).
On the ps the optimizer's own ``apply`` runs (learning rate, weight decay,
``iterations``, the strategy's ``extended.update``) with its ``update_step``
replaced for table variables by :func:`apply_rows` (:func:`applying`).

What the policy sees: each distinct id's summed gradient ``S1``, as under
tf_keras. A gradient the policy passes on unchanged is applied with the
squares carried beside it (exactly Keras 3's rule); one it transforms
(``staleness_aware``'s scale, ``dc_asgd``'s compensation, an aggregator's
mean) is applied with its rows as the occurrences (``S2`` of the
transformed rows).

Not row-wise (Keras 3's own rule, every occurrence's row sent): other
optimizers, SGD with momentum, a LossScaleOptimizer, and an optimizer with
``clipnorm``, ``clipvalue``, ``global_clipnorm``, ``loss_scale_factor`` or
``gradient_accumulation_steps`` (each transforms the rows before the rule).
"""

from typing import List, Optional

import tensorflow as tf

from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import variables as variables_compat

__all__ = ["RULES", "rule_for", "distinct_sums", "distinct_rows", "applying", "apply_rows"]

#: The row-wise rules: Keras 3 SGD (no momentum), Adagrad, and lazy Adam.
RULES = ("sgd", "adagrad", "lazy_adam")

#: Optimizer settings that change the gradient rows before the update rule.
_ROW_TRANSFORMS = ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor",
                   "gradient_accumulation_steps")


def rule_for(optimizer) -> Optional[str]:
    """The row-wise rule (one of :data:`RULES`) of a Keras 3 optimizer, or None.

    A class sets its own rule with a ``rowwise_rule`` class attribute
    (``LazyAdam``); Keras 3's ``SGD`` (momentum 0) and ``Adagrad`` have one
    unless a subclass overrides ``update_step``.
    """
    cls = optimizers_compat.optimizer_class()
    if cls is None or not isinstance(optimizer, cls):
        return None
    if any(getattr(optimizer, name, None) for name in _ROW_TRANSFORMS):
        return None
    own = getattr(type(optimizer), "rowwise_rule", None)
    if own is not None:
        return own if own in RULES else None
    import keras
    update = type(optimizer).update_step
    if isinstance(optimizer, keras.optimizers.SGD) and \
            update is keras.optimizers.SGD.update_step and not optimizer.momentum:
        return "sgd"
    if isinstance(optimizer, keras.optimizers.Adagrad) and \
            update is keras.optimizers.Adagrad.update_step:
        return "adagrad"
    return None


def _is_table_gradient(grad, variable) -> bool:
    return isinstance(grad, tf.IndexedSlices) and (variable.shape.rank or 0) >= 2


def distinct_sums(grad: tf.IndexedSlices, squares: bool = True):
    """``(ids, S1, S2)`` of a sparse gradient: its distinct ids (int, [U]), per id
    the sum of its rows (``[U, ...]``) and, if ``squares``, of their squares
    (else None)."""
    ids, position = tf.unique(tf.reshape(grad.indices, [-1]))
    n = tf.shape(ids)[0]
    s1 = tf.math.unsorted_segment_sum(grad.values, position, n)
    s2 = tf.math.unsorted_segment_sum(tf.square(grad.values), position, n) if squares else None
    return ids, s1, s2


def distinct_rows(optimizer, grads: List, variables: List):
    """On the worker: each table gradient of a row-wise optimizer with each
    distinct id once.

    Args:
      optimizer: the Keras 3 optimizer of the step.
      grads: the step's gradients (tf.Tensor or tf.IndexedSlices whose rows
        are one per id occurrence, as Keras 3's own lookups give them).
      variables: their variables.

    Returns:
      ``(grads, squares)``: ``grads`` with each table gradient as
      ``IndexedSlices(S1, ids)``, the ids that occur more than once first;
      ``squares[i]`` is ``S2`` of those ids (``[k, ...]``, float) when
      gradient ``i`` needs it (Adagrad, lazy Adam), else None. Other
      gradients are returned as they are.
    """
    rule = rule_for(optimizer)
    out, squares = [], []
    for g, v in zip(grads, variables):
        if rule is None or not _is_table_gradient(g, v):
            out.append(g)
            squares.append(None)
            continue
        ids, position = tf.unique(tf.reshape(g.indices, [-1]))
        n = tf.shape(ids)[0]
        s1 = tf.math.unsorted_segment_sum(g.values, position, n)
        if rule == "sgd":  # its rule needs S1 only
            out.append(tf.IndexedSlices(s1, ids, g.dense_shape))
            squares.append(None)
            continue
        counts = tf.math.unsorted_segment_sum(tf.ones_like(position), position, n)
        repeated = counts > 1
        # Repeated ids first: only they need S2 on the wire.
        order = tf.argsort(tf.cast(tf.logical_not(repeated), tf.int32), stable=True)
        k = tf.reduce_sum(tf.cast(repeated, tf.int32))
        s2 = tf.math.unsorted_segment_sum(tf.square(g.values), position, n)
        out.append(tf.IndexedSlices(tf.gather(s1, order), tf.gather(ids, order), g.dense_shape))
        squares.append(tf.gather(s2, order[:k]))
    return out, squares


def applying(optimizer, apply_fn, variables, grads, squares):
    """``apply_fn`` (the optimizer's own update on ``(gradient, variable)``
    pairs) with each table variable's update made row-wise.

    Args:
      optimizer: the Keras 3 optimizer.
      apply_fn: ``pairs -> update``.
      variables, grads, squares: as :func:`distinct_rows` returned them,
        copied to the ps; a pair whose gradient is ``grads[i]`` itself is
        applied with ``squares[i]``.

    Returns:
      ``apply_fn`` itself when the optimizer has no row-wise rule needing it
      (SGD's own update is row-wise), else the row-wise ``apply_fn``.
    """
    rule = rule_for(optimizer)
    if rule is None or rule == "sgd":
        return apply_fn
    carried = {id(variables_compat.backing_variable(v)): (g, s)
               for g, v, s in zip(grads, variables, squares) if s is not None}

    def apply(pairs):
        current = {}
        for g, v in pairs:
            key = id(variables_compat.backing_variable(v))
            if key in carried and carried[key][0] is g:
                current[key] = carried[key][1]

        def make(original):
            def update_step(gradient, variable, learning_rate):
                if not _is_table_gradient(gradient, variable):
                    return original(gradient, variable, learning_rate)
                key = id(variables_compat.backing_variable(variable))
                if key in current:
                    ids, s1, head = gradient.indices, gradient.values, current[key]
                    k = tf.shape(head)[0]
                    s2 = tf.concat([tf.cast(head, s1.dtype), tf.square(s1[k:])], 0)
                else:
                    ids, s1, s2 = distinct_sums(gradient)
                return apply_rows(optimizer, rule, variable, ids, s1, s2, learning_rate)
            return update_step

        with optimizers_compat.replacing_update_step(optimizer, make):
            return apply_fn(pairs)

    return apply


def apply_rows(optimizer, rule, variable, ids, s1, s2, learning_rate):
    """Updates the rows ``ids`` of ``variable`` and of its optimizer slots.

    Args:
      optimizer: the built Keras 3 optimizer (its hyperparameters and slots).
      rule: one of :data:`RULES`.
      variable: the tf.Variable (a table, or one shard of one).
      ids: int tensor ``[U]``, distinct row ids.
      s1: ``[U, ...]``, per id the sum of its gradient rows.
      s2: ``[U, ...]``, per id the sum of their squares (None for "sgd").
      learning_rate: scalar tensor.

    Returns:
      The last update op.
    """
    dtype = variable.dtype
    lr = tf.cast(learning_rate, dtype)
    s1 = tf.cast(s1, dtype)
    if rule == "sgd":
        return variable.scatter_sub(tf.IndexedSlices(lr * s1, ids))
    s2 = tf.cast(s2, dtype)
    if rule == "adagrad":
        acc = optimizers_compat.slot(optimizer, "accumulator", variable)
        added = acc.scatter_add(tf.IndexedSlices(s2, ids))
        with tf.control_dependencies([added.op] if hasattr(added, "op") else []):
            a = tf.gather(acc, ids)
        eps = tf.cast(optimizer.epsilon, dtype)
        return variable.scatter_sub(tf.IndexedSlices(lr * s1 / tf.sqrt(a + eps), ids))
    if rule == "lazy_adam":
        m = optimizers_compat.slot(optimizer, "momentum", variable)
        v = optimizers_compat.slot(optimizer, "velocity", variable)
        t = tf.cast(optimizer.iterations + 1, dtype)
        b1 = tf.cast(optimizer.beta_1, dtype)
        b2 = tf.cast(optimizer.beta_2, dtype)
        alpha = lr * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t))
        m_rows = tf.gather(m, ids)
        v_rows = tf.gather(v, ids)
        m_new = m_rows + (s1 - m_rows) * (1 - b1)
        v_new = v_rows + (s2 - v_rows) * (1 - b2)
        wrote = [m.scatter_update(tf.IndexedSlices(m_new, ids)),
                 v.scatter_update(tf.IndexedSlices(v_new, ids))]
        with tf.control_dependencies([w.op for w in wrote if hasattr(w, "op")]):
            eps = tf.cast(optimizer.epsilon, dtype)
            return variable.scatter_sub(
                tf.IndexedSlices(m_new * alpha / (tf.sqrt(v_new) + eps), ids))
    raise ValueError(f"rowwise rule must be one of {RULES}, got {rule!r}.")
