"""Helpers that scenarios of several test modules share: the small
problems and models, the scheduled step, optimizers by name."""

import numpy as np
import tensorflow as tf
import tf_keras

from tf_asyncps.compat import variables as variables_compat


def stats_of(strategy):
    return strategy.staleness_stats().to_dict()


def step_fn(strategy, params, opt, loss_fn, with_batch=False):
    """A scheduled worker step: one gradient step of ``opt`` on ``loss_fn``.

    ``loss_fn()`` (or ``loss_fn(batch)`` with ``with_batch``, the batch coming
    from the per-worker iterator passed to the step) runs inside the replica.
    """
    @tf.function
    def step(iterator=None):
        batch = next(iterator) if with_batch else ()

        def replica_fn(*batch):
            with tf.GradientTape() as tape:
                loss = loss_fn(*batch)
            opt.apply_gradients(zip(tape.gradient(loss, params), params))
            return loss
        return strategy.run(replica_fn, args=tuple(batch))

    return step


def run_steps(coord, step, steps, iterator=None):
    for _ in range(steps):
        coord.schedule(step, args=(iterator,) if iterator is not None else ())
    coord.join()


def small_problem(n=320, features=8, classes=3, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, features).astype(np.float32)
    w = rng.randn(features, classes).astype(np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int64)
    return x, y


def mlp(features=8, classes=3):
    return tf_keras.Sequential([
        tf_keras.Input(shape=(features,)),
        tf_keras.layers.Dense(16, activation="tanh"),
        tf_keras.layers.Dense(classes)])


def make_optimizer(name, lr, keras_name="tf_keras"):
    """A new optimizer by name: the tests' one table of them.

    Args:
      name: "sgd", "momentum" (SGD, momentum 0.9), "adam" or "adagrad"; for
        tf_keras also "legacy_sgd", "legacy_adam" and "momentum_schedule"
        (momentum SGD whose learning rate decays by 0.9 every 5 steps).
      lr: the learning rate (float).
      keras_name: "tf_keras" or "keras3" (Keras 3).

    Raises:
      KeyError: a name that this table has not.
    """
    if keras_name == "keras3":
        import keras
        opt = keras.optimizers
    else:
        opt = tf_keras.optimizers
    makers = {"sgd": lambda: opt.SGD(lr), "momentum": lambda: opt.SGD(lr, momentum=0.9),
              "adam": lambda: opt.Adam(lr), "adagrad": lambda: opt.Adagrad(lr)}
    if keras_name != "keras3":
        makers.update({
            "legacy_sgd": lambda: opt.legacy.SGD(lr), "legacy_adam": lambda: opt.legacy.Adam(lr),
            # A learning-rate schedule reads optimizer.iterations every step.
            "momentum_schedule": lambda: opt.SGD(
                opt.schedules.ExponentialDecay(lr, 5, 0.9), momentum=0.9)})
    if name not in makers:
        raise KeyError(f"no {keras_name} optimizer {name!r} in this table: {sorted(makers)}")
    return makers[name]()


def least_squares(n=64, features=5, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, features).astype(np.float32)
    y = (x @ rng.randn(features, 1) + 0.1 * rng.randn(n, 1)).astype(np.float32)
    return x, y


def train_with_straggler(strategy, coord, x, y, slow_worker, delay_ms, steps, lr=0.01):
    """Full-batch least squares; ``slow_worker``'s input pipeline sleeps
    ``delay_ms`` before each batch (tf.data, chosen by worker index)."""
    from tensorflow.python.data.experimental.ops import testing as data_testing
    with strategy.scope():
        w = tf.Variable(tf.zeros([x.shape[1], 1]), name="w")
        opt = tf_keras.optimizers.SGD(lr)

    def dataset_fn():
        me = tf.distribute.coordinator.experimental_get_current_worker_index()
        delay_us = tf.where(tf.equal(me, slow_worker), delay_ms * 1000, 0)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        return ds.apply(data_testing.sleep(tf.cast(delay_us, tf.int64)))

    step = step_fn(strategy, [w], opt, with_batch=True,
                   loss_fn=lambda xb, yb: tf.reduce_mean(tf.square(tf.matmul(xb, w) - yb)))
    run_steps(coord, step, steps, iter(coord.create_per_worker_dataset(dataset_fn)))


#: A token above any global step: ends a lagging worker's wait at the schedule's end.
LAG_RELEASE = 2 ** 62


def train_with_lagging_worker(strategy, coord, x, y, slow_worker, lag, steps, lr=0.01):
    """Full-batch least squares where every step of ``slow_worker`` lags ``lag`` updates.

    No sleep: the slow worker's step, once its gradient is computed, waits in
    the step until the global step is at least its read step r + ``lag`` (r:
    the step's ``WorkerStep.read_step``, read before any variable), so the
    policy sees its gradient with τ >= ``lag``. It waits on a FIFO queue on
    the ps (a blocking dequeue, as core/worker_gate.py does): every step puts
    the global step after its own update there, and the slow worker takes
    tokens until one reaches its target; the step that makes a global step
    puts its value, so no wake-up is missed. When the other workers are out of
    closures the slow worker's last step could wait forever: the step that
    leaves at most one of ``steps`` unfinished puts ``LAG_RELEASE`` instead,
    and only the slow worker's own last step can still be waiting for it. A
    failed run closes the queue, which ends a waiting step with an error.

    Returns:
      int: slow steps that the release let through (0 or 1) instead of ``lag``
      updates.
    """
    from tf_asyncps.core import placement
    from tf_asyncps.core.step import current_step
    with strategy.scope():
        w = tf.Variable(tf.zeros([x.shape[1], 1]), name="w")
        opt = tf_keras.optimizers.SGD(lr)
    ps = strategy.extended.global_step.device
    with tf.init_scope(), tf.device(ps):
        tokens = placement.fifo_queue(1 << 30, "lagging_worker_tokens")
        finished = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                               name="lagging_worker_finished")
        released = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                               name="lagging_worker_released")

    def wait_for_updates(step):
        with tf.device(ps):
            target = tf.cast(step.read_step, tf.int64) + lag
            token = tf.while_loop(lambda t: t < target, lambda t: (tokens.dequeue(),),
                                  (tokens.dequeue(),))[0]
            count = released.assign_add(tf.cast(token >= LAG_RELEASE, tf.int64))
        with tf.control_dependencies([count]):
            return tf.constant(True)

    @tf.function
    def train_step():
        def replica_fn():
            step = current_step()
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
            grad = tape.gradient(loss, w)
            with tf.control_dependencies([grad]):
                waited = tf.cond(tf.equal(step.worker_index, slow_worker),
                                 lambda: wait_for_updates(step), lambda: tf.constant(False))
            with tf.control_dependencies([waited]):
                grad = tf.identity(grad)
            g_after = opt.apply_gradients([(grad, w)])
            with tf.device(ps), tf.control_dependencies([g_after]):
                done = finished.assign_add(1)
                token = tf.where(done >= steps - 1, tf.constant(LAG_RELEASE, tf.int64),
                                 tf.cast(g_after, tf.int64))
                put = tokens.enqueue(token)
            with tf.control_dependencies([put]):
                return tf.identity(loss)
        return strategy.run(replica_fn)

    try:
        run_steps(coord, train_step, steps)
    finally:
        tokens.close(cancel_pending_enqueues=True)
    return int(released.numpy())


def fake_multi_replica_workers(replicas):
    """Makes ParameterServerStrategy see ``replicas`` devices per worker on CPU.

    The strategy counts GPUs to decide its replicas per worker; on a machine
    without GPUs this test stand-in reports ``replicas`` and names the worker
    servers' logical CPUs instead (the servers are made with that many CPU
    devices, see :func:`in_process_cluster`). The multi-replica code path
    (one replica thread per device, merge_call, AggregatingVariable) is then
    the one a K-GPU worker takes.
    """
    from tensorflow.python.distribute import parameter_server_strategy_v2 as pss_v2
    ext = pss_v2.ParameterServerStrategyV2Extended

    def _set_num_gpus(self):
        self._num_gpus_per_worker = replicas

    ext._set_num_gpus = _set_num_gpus
    ext.worker_devices = property(
        lambda self: tuple(f"/device:CPU:{i}" for i in range(replicas)))


def in_process_cluster(num_workers, cpus_per_worker=1, num_ps=1):
    """ps and worker servers in this process (TensorFlow's own PS tests do
    this); each worker server has ``cpus_per_worker`` CPU devices."""
    import portpicker
    from tf_asyncps import cluster as cluster_lib
    ports = [portpicker.pick_unused_port() for _ in range(num_workers + num_ps + 1)]
    spec = tf.train.ClusterSpec({
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{p}" for p in ports[1:1 + num_ps]],
        "worker": [f"127.0.0.1:{p}" for p in ports[1 + num_ps:]]})
    servers = []
    for job, n in (("ps", num_ps), ("worker", num_workers)):
        for i in range(n):
            cfg = cluster_lib.server_config(num_workers)
            if job == "worker":
                cfg.device_count["CPU"] = cpus_per_worker
            servers.append(tf.distribute.Server(spec, job_name=job, task_index=i, config=cfg,
                                                protocol="grpc", start=True))
    return servers, tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc")


def make_partitioner(name, num_ps):
    p = tf.distribute.experimental.partitioners
    return {"fixed": lambda: p.FixedShardsPartitioner(num_ps),
            "min": lambda: p.MinSizePartitioner(min_shard_bytes=64, max_shards=num_ps),
            "max": lambda: p.MaxSizePartitioner(max_shard_bytes=256)}[name]()


def full_value(var):
    """The full value of a ShardedVariable (its shards concatenated) or variable."""
    return np.concatenate([np.asarray(p.numpy()) for p in variables_compat.shards(var) or [var]],
                          axis=0)


def cluster_tcp_bytes(c):
    """Bytes sent so far on every TCP connection to or from a task of
    cluster ``c`` (``ss -tin``, per socket: other jobs sharing the loopback
    interface do not count). Both ends of a loopback connection are listed,
    so this is what the tasks sent, all together."""
    import re
    import subprocess
    ports = {a.rsplit(":", 1)[1] for addrs in c.config.values() for a in addrs}
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    total, ours = 0, False
    for line in out.splitlines():
        if line and not line[0].isspace():  # "Recv-Q Send-Q local peer": a socket
            local, peer = line.split()[2:4]
            ours = bool({local.rsplit(":", 1)[1], peer.rsplit(":", 1)[1]} & ports)
        elif ours:
            m = re.search(r"\bbytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total
