"""The runtime on the worker-step path.

Everything a worker step runs through between ``strategy.run`` and the PS,
one concept per module:

* ``engine.py``: the policy engine: each variable's mode (per step or local
  copies), the worker step (start here);
* ``update.py``: a step's update by stage: gradients to the ps (a
  ``StepPlan``), τ and the policy's decision applied, the hooks;
* ``table_seam.py``: how tables talk to the engine: ``TableHooks``
  registered through ``extended.register_table`` (a ``StrategySeam``);
* ``protocol.py``: the update-policy protocol the engine calls (``UpdatePolicy``,
  ``StepInfo``, ``Decision``);
* ``step.py``: the worker step's trace-time context and the optimizer hooks;
* ``trace_context.py``: what is current while a step is traced (the step, the
  non-finite check, ...): one ContextVar each, one way to enter and restore;
* ``staleness.py``: the global step and the τ histograms on the PS;
* ``nonfinite_guard.py``: the non-finite check as one cond per variable, on its
  ps task;
* ``locking.py``: the update lock on the PS (bounded wait);
* ``worker_gate.py``: per-worker token gates on the PS (``ssp``, ``sync_replicas``);
* ``watchdog.py``: the chief-side threads that bound every wait;
* ``gpu_replicas.py``: K GPUs per worker: K replicas, one update;
* ``local_copies.py``: per-worker copies and delta exchange (``local_sgd``,
  a route's part on local steps);
* ``grads.py``: dense/IndexedSlices gradient helpers (``unique_rows``: one
  gradient row per distinct id);
* ``lookup.py``: row reads of the tables: each distinct id crosses once;
* ``placement.py``: where the engine's state lives, and each update op beside
  its variable (``beside_inputs``);
* ``mixed_precision.py``: loss scaling under this strategy;
* ``faults.py``: closure retry and worker-failure accounting on the chief.

This layer uses TensorFlow's public API and ``tf_asyncps.compat``; it never
imports the policies, the strategy or the app.
"""
