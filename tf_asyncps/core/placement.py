"""Where the engine's and the policies' own variables live, and what their
locks and queues are named.

Under ``ParameterServerStrategy`` a variable created in the strategy's scope
is placed round-robin over the ps tasks (``tf.device`` is overridden) and
split by the ``variable_partitioner``. The engine's state must not be: an
aggregator's buffer, a read snapshot or a second-moment slot belongs on the
ps task of the variable it serves, whole, so that its update is local to that
task; the update lock belongs beside the global step. Colocation gives both
(TensorFlow never partitions a colocated variable), inside the strategy's
scope and outside it.

Names: a ps task can outlive the chief (a chief re-run by ``launch
--restart_failed_tasks``, a chief pod restarted by Kubernetes, each bench
run). TensorFlow 2.21 names an eagerly created ``tf.queue.FIFOQueue`` by a
per-process counter (``ops.uid()``) and a ``tf.CriticalSection`` by its
``name``, so a new chief process got the old chief's queues back on such a
ps: an update lock whose token was already there, so that creating it blocked
forever (seen: a second drop_stale chief on the same ps hung), or gate
queues holding the last run's tokens. An eager
``tf.lookup.experimental.MutableHashTable`` is named by the same counter: a
re-run chief got the old chief's DynamicEmbedding id -> row maps and
tombstones back (a table with no backup to restore then started with the
dead chief's ids; the first delta after a resume carried its tombstones).
:func:`fifo_queue`, :func:`critical_section` and :func:`mutable_hash_table`
give each one a name of its own (a UUID), as TensorFlow already does for
eager variables.
"""

import contextlib
import uuid

import tensorflow as tf

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import lookup as lookup_compat
from tf_asyncps.compat import strategy as strategy_compat
from tf_asyncps.core import trace_context

__all__ = ["beside", "beside_inputs", "creating_beside", "fifo_queue", "critical_section",
           "mutable_hash_table", "one_per_device"]

@contextlib.contextmanager
def beside(var):
    """Variables created in this context live on ``var``'s device,
    unpartitioned, and untracked: they are a policy's or the engine's own
    state (an accumulator, a second moment, a read snapshot), not model
    variables, so the strategy gives them no local copies (``local_sgd``) and
    no read snapshots. Exported as ``tf_asyncps.policies.beside`` for
    policies' ``init``.

    Args:
      var: a ``tf.Variable`` (a ps shard of a partitioned variable included).

    Example::

        def init(self, variables):
            out = []
            for v in variables:
                with tf_asyncps.policies.beside(v):
                    out.append(tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False))
            return out
    """
    depth = trace_context.BESIDE_DEPTH.get()
    with trace_context.entered(trace_context.BESIDE_DEPTH, depth + 1), tf.init_scope():
        if tf.distribute.has_strategy():
            with tf.variable_creator_scope(strategy_compat.colocating_creator(var)):
                yield
        else:
            with tf.device(var.device):
                yield


def creating_beside() -> bool:
    """Whether this thread is inside :func:`beside` (the strategy does not
    track the variables created there)."""
    return trace_context.BESIDE_DEPTH.get() > 0


#: Stands for an unknown dimension when inputs are compared by size.
_UNKNOWN_DIM = 1 << 20


def _num_elements(t) -> int:
    if t.shape.rank is None:
        return _UNKNOWN_DIM
    n = 1
    for d in t.shape.as_list():
        n *= _UNKNOWN_DIM if d is None else d
    return n


def _source(t):
    """The tensor a function's captured placeholder stands for (through
    nested functions: a ``tf.cond`` branch inside the step; an eager tensor
    such as a variable's handle), else ``t``."""
    graph = t.graph
    while t.op.type == "Placeholder" and getattr(graph, "captures", None):
        outer = next((ext for ext, inner in graph.captures if inner is t), None)
        if outer is None:
            break
        if not hasattr(outer, "graph"):  # an eager capture: a variable's handle
            return outer
        t, graph = outer, outer.graph
    return t


#: Ops that run where their first input is when they name no device: a
#: variable read is placed by colocation with its handle, not by a device.
_FOLLOW_FIRST_INPUT = {"Identity", "ReadVariableOp", "ResourceGather", "Cast"}


def _ps_device(t, depth: int = 0) -> str:
    src = _source(t)
    if not hasattr(src, "graph"):  # eager: a handle knows its device
        device = getattr(src, "device", "") or ""
    else:
        op = src.op
        device = op.device
        if not device and depth < 4 and op.inputs and (
                op.type in _FOLLOW_FIRST_INPUT or op.inputs[0].dtype == tf.resource):
            return _ps_device(op.inputs[0], depth + 1)
    return device if "/job:ps" in device else ""


@contextlib.contextmanager
def beside_inputs(default_device: str):
    """Ops created in this context run on the ps task of their largest input.

    A step's update mixes tensors of several ps tasks: each variable's
    gradient on its own task, τ and the counters on ``/job:ps/task:0``. Under
    a plain ``tf.device(ps0)`` every op that transforms a gradient (a policy's
    scaling, tf_keras's de-duplication in ``apply_gradients``) ran on ps 0,
    so a gradient of a variable on ps 1 crossed ps1 -> ps0 -> ps1 (figures:
    docs/benchmarks.md#placement-of-a-steps-ops). Here such an op runs
    where its largest input is (a scalar such as τ is what moves); an op with
    no input on a ps (a constant) runs on ``default_device``. A ``tf.device``
    or colocation inside the context still wins (the counters on ps 0, the
    optimizer's updates beside their variables). Applies in ``tf.cond``
    branches created inside too (they inherit the device stack). On exit,
    a constant created here whose consumers all run on another device moves
    there (:func:`tf_asyncps.compat.graph.constants_beside_consumers`).

    Args:
      default_device: device string for ops without an input on a ps task.
    """
    def device_for(op):
        best, device = -1, ""
        for t in op.inputs:
            d = _ps_device(t)
            if d and _num_elements(t) > best:
                best, device = _num_elements(t), d
        return device or default_device

    if tf.executing_eagerly():
        # An eager op runs where its inputs are already (TensorFlow copies
        # them); a device function is refused there ("tf.device does not
        # support functions when eager execution is enabled": strategy.run
        # outside a tf.function, as TensorFlow's own strategy tests do).
        with tf.device(default_device):
            yield
        return
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    with tf.compat.v1.device(device_for):
        yield
    graph_compat.constants_beside_consumers(graph.get_operations()[first:])


def one_per_device(ops) -> list:
    """``ops`` as one ``tf.group`` per device (ops with no device as they
    are), for a control dependency on all of them.

    TensorFlow sends one control message per source op that an op on another
    task depends on: the engine's counters on ps 0 waited for each op of the
    optimizer's update on ps 1 (docs/benchmarks.md#placement-of-a-steps-ops).
    Grouped, each task sends one.
    """
    by_device, out = {}, []
    for op in ops:
        if op.type == "Const":  # nothing to wait for (and it may move)
            continue
        if op.device:
            by_device.setdefault(op.device, []).append(op)
        else:
            out.append(op)
    for device, group in by_device.items():
        # Colocated, not tf.device: beside_inputs' device function would
        # move an op with no inputs to its default device.
        with graph_compat.colocated_with(group[0]):
            out.append(tf.group(*group))
    return out


def fifo_queue(capacity: int, name: str) -> tf.queue.QueueBase:
    """A FIFO queue of int64 scalars on the current device, unique to this
    call (see the module docstring): ``tf.queue.FIFOQueue``'s eager
    ``shared_name`` would be a per-process counter.

    Args:
      capacity: most elements held (int > 0).
      name: readable prefix of the queue's names.
    """
    ref = tf.raw_ops.FIFOQueueV2(component_types=[tf.int64], shapes=[[]], capacity=capacity,
                                 shared_name=f"{name}_{uuid.uuid4().hex}", name=name)
    return tf.queue.QueueBase([tf.int64], [tf.TensorShape([])], None, ref)


def critical_section(name: str) -> tf.CriticalSection:
    """A ``tf.CriticalSection`` on the current device, unique to this call
    (its shared name would otherwise be ``name``: see the module docstring)."""
    return tf.CriticalSection(name=name, shared_name=f"{name}_{uuid.uuid4().hex}")


def mutable_hash_table(key_dtype, value_dtype, default_value, name: str):
    """A ``tf.lookup.experimental.MutableHashTable`` (key -> value, scalar
    values, ``default_value`` for missing keys; checkpointed as TensorFlow's)
    on the current device, unique to this call (its eager shared name would
    be a per-process counter: see the module docstring)."""
    return lookup_compat.mutable_hash_table(key_dtype, value_dtype, default_value, name=name,
                                            shared_name=f"{name}_{uuid.uuid4().hex}")
