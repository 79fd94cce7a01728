"""The strategy's ClusterCoordinator: watchdogs while closures run, a drain's push, clear errors.

``AsyncParameterServerStrategy`` makes one when it is created (ClusterCoordinator
is one per strategy: ``tf.distribute.coordinator.ClusterCoordinator(strategy)``
and tf_keras's ``fit`` get this object). It starts the engine's watchdogs
when closures are scheduled, tells the engine when the schedule drained
(``join``: local copies and cached rows' updates pushed, watchdogs
stopped; the cache's flush at tf_keras ``fit``'s epoch-end joins deferred to
the end of fit, its validation or a save), turns a timed-out wait
into a TimeoutError and an input that ran out into an OutOfRangeError that
says why.
"""

import threading

import tensorflow as tf

from tf_asyncps.compat import call_scopes
from tf_asyncps.compat import coordinator as coordinator_compat
from tf_asyncps.compat import strategy as strategy_compat
from tf_asyncps.compat import tf_keras as tf_keras_compat
from tf_asyncps.core import faults

__all__ = ["AsyncClusterCoordinator", "INPUT_RAN_OUT_MESSAGE"]

INPUT_RAN_OUT_MESSAGE = (
    "tf_asyncps: a worker's input ran out (End of sequence), so TensorFlow cancelled the "
    "closures scheduled after it. With model.fit(steps_per_epoch=...) the input must "
    "repeat (`.repeat()` on the dataset, in a DatasetCreator's dataset_fn too): each epoch "
    "runs steps_per_epoch worker steps from one iterator per worker that lasts the whole "
    "fit; evaluate a finite dataset with pss_evaluation_shards=\"auto\" (tf_keras) or "
    "steps=.")


class AsyncClusterCoordinator(tf.distribute.coordinator.ClusterCoordinator):
    """ClusterCoordinator that runs the engine's watchdogs while closures run,
    tells the engine when it drained, and turns a timed-out wait into a
    TimeoutError."""

    def __init__(self, strategy):
        # ClusterCoordinator is one per strategy: tf_keras's later
        # ClusterCoordinator(strategy) returns this object and re-runs __init__.
        first = not coordinator_compat.coordinator_initialized(self)
        _check_tf_keras_evaluate()  # before evaluate builds its input
        super().__init__(strategy)
        if first:
            # Threads inside join/done/fetch: several user threads may wait
            # at once while the gates' watchdog threads read the count.
            self._waiting_callers = 0
            self._waiting_lock = threading.Lock()
            self.engine = strategy.extended.engine
            self.accounting = faults.attach(
                self, faults.ClosureAccounting(strategy_compat.num_workers(strategy.extended)))
            # An input that ran out is raised with INPUT_RAN_OUT_MESSAGE (or
            # Keras 3's own): not also logged in full once per closure.
            coordinator_compat.hide_closure_error_logs(tf.errors.OutOfRangeError)
            # A cache's flush skipped at a fit's epoch-end join, still to run.
            self._flush_deferred = False
            call_scopes.before_save(self._run_deferred_flush)

    def has_queued_closures(self, waiting_workers=()) -> bool:
        """True unless the caller is draining: inside ``join``/``done``/``fetch``
        with no closure left in the queue that a worker outside
        ``waiting_workers`` (indices) could run. Only then may waiting workers
        be released: while the program is still scheduling, the queue can be
        empty for a moment between two ``schedule`` calls."""
        if self._waiting_callers <= 0:
            return True
        return coordinator_compat.closure_queue_nonempty(self, ignore_workers=waiting_workers)

    def schedule(self, fn, args=None, kwargs=None):
        if self._flush_deferred and call_scopes.TF_KERAS_EVALUATE.get() is not None:
            self._run_deferred_flush()  # fit's validation reads every update
        try:
            out = super().schedule(fn, args=args, kwargs=kwargs)
        except tf.errors.OpError as e:
            self._explain_input_ran_out(e)
            raise
        self.engine.start_watchdogs()  # after the trace: it may create the lock
        # Waiting on the result (RemoteValue.fetch/get, as TensorFlow's tutorial
        # does) drains like join: a gated worker (ssp, sync_replicas) waiting for
        # one with nothing left to run must be released there too.
        coordinator_compat.route_remote_value_get(out, self._translate)
        return out

    def _translate(self, call, *args, **kwargs):
        with self._waiting_lock:
            self._waiting_callers += 1
        try:
            return call(*args, **kwargs)
        except (tf.errors.OpError, RuntimeError) as e:
            msg = self.engine.timeout_error()
            if msg:
                raise TimeoutError(msg) from e
            self._explain_input_ran_out(e)
            raise
        finally:
            with self._waiting_lock:
                self._waiting_callers -= 1

    _input_ran_out = False  # a closure's input ran out since the last clean join

    def _explain_input_ran_out(self, e) -> None:
        """After a closure's OutOfRangeError, TensorFlow cancels the queued
        closures and the next call raises their CancelledError
        (``RemoteExecuteNode::RunAsync``), which hides why: that one is
        raised as the OutOfRangeError it follows, explained."""
        if isinstance(e, tf.errors.OutOfRangeError):
            self._input_ran_out = True
            if not (e.message or "").startswith(INPUT_RAN_OUT_MESSAGE):
                # Raised itself (before any cancellation): explained too.
                raise tf.errors.OutOfRangeError(
                    e.node_def, e.op, f"{INPUT_RAN_OUT_MESSAGE} (TensorFlow: "
                    f"{(e.message or '').strip().splitlines()[-1][:300]})") from e
        elif isinstance(e, tf.errors.CancelledError) and self._input_ran_out:
            self._input_ran_out = False
            raise tf.errors.OutOfRangeError(
                None, None, f"{INPUT_RAN_OUT_MESSAGE} (Then: {type(e).__name__}: "
                f"{e.message.splitlines()[0] if e.message else ''})") from e

    def join(self):
        try:
            out = self._translate(super().join)
        except BaseException:
            self.engine.stop_watchdogs()  # keep the join's error, not a flush's
            raise
        self._input_ran_out = False
        try:
            self._flush_caches()
        finally:
            # local_sgd: push what workers trained since their last exchange;
            # every policy: no watchdog polls the PS once the schedule drained.
            self.engine.drained()
        return out

    def _flush_caches(self) -> None:
        """embedding_cache: every worker's unpushed row updates reach the ps;
        at a tf_keras ``fit``'s epoch-end join only when the fit returns, its
        validation starts or a checkpoint or model is saved: nothing else
        needs every update on the ps between two epochs, and each flush
        moves every deferred row of every worker."""
        caches = getattr(self.strategy.extended, "caches", None)
        if caches is None:
            return
        fit = call_scopes.TF_KERAS_FIT.get()
        if fit is not None and call_scopes.TF_KERAS_EPOCH_JOIN.get() and \
                call_scopes.TF_KERAS_EVALUATE.get() is None:
            if not self._flush_deferred:
                self._flush_deferred = True
                fit.at_exit.append(self._run_deferred_flush)
            return
        self._flush_deferred = False
        caches.flush()

    def _run_deferred_flush(self) -> None:
        """The deferred flush, through ``join`` (nothing left to drain then)."""
        if self._flush_deferred:
            self.join()

    def done(self):
        finished = self._translate(super().done)
        if finished:
            self.engine.stop_watchdogs()
        return finished

    def fetch(self, val):
        return self._translate(super().fetch, val)


def _check_tf_keras_evaluate() -> None:
    """Refuses tf_keras ``model.evaluate`` of a finite ``tf.data.Dataset``
    without ``steps`` or ``pss_evaluation_shards``: each closure would take
    batches from a per-worker iterator until one runs out, then TensorFlow
    cancels the rest and evaluate fails with CancelledError after hundreds
    of log lines (vanilla ParameterServerStrategy too)."""
    call = tf_keras_compat.evaluate_call()
    if call is None:
        return
    model, x, steps = call
    if steps is not None or tf_keras_compat.pss_evaluation_shards(model) or \
            not isinstance(x, tf.data.Dataset):
        return
    if int(x.cardinality()) < 0:  # infinite (needs steps: tf_keras says so) or unknown
        return
    raise ValueError(
        f"model.evaluate got a finite tf.data.Dataset ({int(x.cardinality())} batches) "
        "without steps= under a parameter-server strategy: the workers would read it "
        "until one runs out, and the closures after that would be cancelled "
        "(CancelledError). Compile with pss_evaluation_shards=\"auto\" (exact: each batch "
        "evaluated once; also for fit's validation_data), or pass steps= with "
        "a repeating dataset (`.repeat()`).")
