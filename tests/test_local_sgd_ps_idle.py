"""#24 item 3: a local_sgd closure in which no exchange is due runs nothing on a ps.

The scheduled function of a local step holds no op on a ps task and captures
no ps resource (so TensorFlow makes it no ps partition), and the ps tasks'
sockets carry not one byte while such closures run; the exchange, when due,
runs as a function of its own before the closure (core/local_copies.py).

The scenario (a cluster of its own: it measures the ps tasks' sockets) is
above the test (docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses
import os
import re
import subprocess

import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario


def _ps_sockets(ps_ports):
    """{(local address, peer address): (bytes sent, data segments sent)} of
    every TCP connection with a ps task at one end (``ss -tin``; both ends of
    a loopback connection are listed, so both directions are there)."""
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    sockets, ours = {}, None
    for line in out.splitlines():
        if line and not line[0].isspace():  # "Recv-Q Send-Q local peer": a socket
            local, peer = line.split()[2:4]
            ours = (local, peer) if {local.rsplit(":", 1)[1],
                                     peer.rsplit(":", 1)[1]} & ps_ports else None
        elif ours:
            sent = re.search(r"\bbytes_sent:(\d+)", line)
            segs = re.search(r"\bdata_segs_out:(\d+)", line)
            sockets[ours] = (int(sent.group(1)) if sent else 0,
                             int(segs.group(1)) if segs else 0)
    return sockets


def _sent_since(before, after):
    """[(bytes, segments)] each ps socket sent between two _ps_sockets()."""
    return [(b - before.get(k, (0, 0))[0], s - before.get(k, (0, 0))[1])
            for k, (b, s) in after.items()]


def _devices_and_captures(concrete):
    """Every device named by a node of ``concrete``'s graph and of the
    functions in its library (cond/while bodies, nested calls), and the
    devices of the tensors it captures (a ps resource captured is a ps
    partition: TensorFlow places the argument on its ps)."""
    graph_def = concrete.graph.as_graph_def()
    devices = {n.device for n in graph_def.node}
    for f in graph_def.library.function:
        devices |= {n.device for n in f.node_def}
    captured = {getattr(t, "device", "") for t in concrete.graph.external_captures}
    return sorted(d for d in devices if d), sorted(d for d in captured if d)


def _reads_before_adds(concrete):
    """[(ps read, its assign_add ancestors)] for every ReadVariableOp placed
    on a ps task in ``concrete``'s graph; an ancestor is a data or control
    input, followed back through the graph."""
    nodes = {n.name: n for n in concrete.graph.as_graph_def().node}
    parents = {name: {i.lstrip("^").split(":")[0] for i in n.input}
               for name, n in nodes.items()}

    def ancestors(name):
        seen, todo = set(), list(parents[name])
        while todo:
            x = todo.pop()
            if x not in seen and x in nodes:
                seen.add(x)
                todo.extend(parents[x])
        return seen

    return [(name, sorted(a for a in ancestors(name)
                          if nodes[a].op == "AssignAddVariableOp"))
            for name, n in nodes.items()
            if n.op == "ReadVariableOp" and "/job:ps" in n.device]


@dataclasses.dataclass(frozen=True)
class IdlePs:
    """Attributes: idle: [bytes, data segments] each ps socket sent while the
    closures with no exchange due ran. exchange_bytes: bytes the ps sockets
    sent during the closure that exchanged. ps_reads: [ps ReadVariableOp
    name, its AssignAddVariableOp ancestors] in the exchange function.
    exchanged_variables: variables the exchange moves. g: the global step
    [after closure sync_every, after closure sync_every + 1]. devices,
    captured: the scheduled step's op devices and captured tensors' devices.
    local_steps, applied: the staleness counters at the end. table: the
    table's shards' values (nested lists). b: the vector b, shards joined."""
    idle: list[list[int]]
    exchange_bytes: int
    ps_reads: list
    exchanged_variables: int
    g: list[int]
    devices: list[str]
    captured: list[str]
    local_steps: int
    applied: int
    table: list
    b: list[float]


@scenario
def idle_ps(sync_every=8, num_ps=2) -> IdlePs:
    """One worker, a table split over ``num_ps`` ps tasks and a dense
    vector, both split over the ps tasks, SGD on loss = sum of a few rows + sum(b): one worker step per
    closure. Closure 1 pulls; closures 2..sync_every train without an
    exchange (3..sync_every are counted); closure sync_every + 1 exchanges."""
    # gRPC's bandwidth probes (HTTP/2 PINGs sent a while after data arrives)
    # off on every task's client channels (they inherit this environment, and
    # this process's channels open after the cluster starts); servers ignore
    # it and still probe (TRANSPORT_FRAMES_BYTES).
    os.environ["TF_GRPC_DEFAULT_OPTIONS"] = "grpc.http2.bdp_probe=0"
    with cluster(num_workers=1, num_ps=num_ps) as c:
        ps_ports = {a.rsplit(":", 1)[1] for a in c.config["ps"]}
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get("local_sgd",
                                                                  sync_every=sync_every),
            variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(
                num_ps))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            table = tf.Variable(tf.ones([8, 4]), name="table")
            b = tf.Variable(tf.ones([4]), name="b")  # also split: 2 + 2
            opt = tf_keras.optimizers.SGD(0.5)
        ids = tf.constant([0, 5, 5, 7])

        @tf.function
        def step():
            def replica_fn():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids)) + tf.reduce_sum(b)
                params = list(table.variables) + list(b.variables)
                opt.apply_gradients(zip(tape.gradient(loss, params), params))
                return loss
            return strategy.run(replica_fn)

        def run(n):
            """n closures; waits for the last (one worker: for all of them)."""
            out = [coord.schedule(step) for _ in range(n)]
            return float(out[-1].fetch())

        # Closure 1 is traced and pulls the ps copy; closure 2 has nothing due
        # and lets the HTTP/2 frames that answer the pull's data (below) pass.
        run(2)
        before = _ps_sockets(ps_ports)  # no read of the ps in between
        run(sync_every - 2)  # closures 3..sync_every: nothing due
        idle = _sent_since(before, _ps_sockets(ps_ports))
        g_idle = strategy.staleness_stats().global_step
        between = _ps_sockets(ps_ports)
        run(1)  # local steps == sync_every: this closure exchanges first
        exchanged = sum(b for b, _ in _sent_since(between, _ps_sockets(ps_ports)))
        g_after = strategy.staleness_stats().global_step
        devices, captured = _devices_and_captures(step.get_concrete_function())
        local = strategy.extended.engine.local
        exchange = local._exchange[3]  # (copies key, check, pull, exchange)
        ps_reads = _reads_before_adds(exchange)
        n_exchanged = len(local.exchanged(local._copies.values()))
        coord.join()
        s = strategy.staleness_stats()
        return IdlePs(idle=[list(x) for x in idle], exchange_bytes=exchanged,
                      ps_reads=ps_reads, exchanged_variables=n_exchanged,
                      g=[g_idle, g_after], devices=devices, captured=captured,
                      local_steps=s.local_steps, applied=s.applied,
                      table=[v.numpy().tolist() for v in table.variables],
                      b=[x for v in b.variables for x in v.numpy().tolist()])


# -- the test ---------------------------------------------------------------------
#: The most a ps socket may carry in the window: gRPC's own HTTP/2 frames, no
#: call: a WINDOW_UPDATE (13 B) and two PINGs (17 B each; a server probes the
#: bandwidth a while after data arrived, here the reads of closures 1-2, and
#: the client answers). Seen here under load: 17, 30, 34 and 47 B. A call to
#: a ps carries more: its request (the operation and its function's name,
#: the context id) in a DATA frame, with a HEADERS frame for a new stream.
TRANSPORT_FRAMES_BYTES = 13 + 2 * 17


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_closure_without_an_exchange_runs_nothing_on_the_ps():
    """Before: every closure ran its ps partition (the exchange's tf.cond,
    lowered into the scheduled function): here 43.7 KB in 237 TCP segments
    to and from the 2 ps tasks for the 6 closures (up to 19.2 KB on one
    socket), taken branch or not."""
    r = run_scenario(idle_ps, timeout=200, sync_every=8)
    # The scheduled function: no op placed on a ps task, no ps resource captured.
    assert [d for d in r.devices + r.captured if "/job:ps" in d] == []
    # 6 closures with no exchange due: no call reached a ps task (usually
    # not one byte; at most gRPC's own frames).
    assert max(b for b, _ in r.idle) <= TRANSPORT_FRAMES_BYTES, r.idle
    # ... and no exchange counted; the 9th closure's exchange reached the ps.
    assert r.g == [0, 1]  # [after closure 8, after closure 9]
    assert r.exchange_bytes > 4 * (8 * 4 + 4)  # the deltas pushed and the model pulled
    # The exchange reads each ps copy before its own add, so the model comes
    # down while the deltas go up (before: every read waited for every add,
    # and each direction of a link idled while the other carried a model).
    # Those reads, one per exchanged variable (2 table shards, 2 b shards,
    # the optimizer's iterations and learning rate), have no assign_add
    # among their inputs; the rest (the global step's) come after the adds.
    early = [name for name, adds in r.ps_reads if not adds]
    assert len(early) == r.exchanged_variables == 6, r.ps_reads
    assert len(r.ps_reads) > len(early)
    # The drain pushes the last step: 9 local steps in all, plain SGD's result.
    assert r.local_steps == 9
    # d loss / d row: the number of times its id appears; d loss / d b: 1.
    rows = [1.0 - 0.5 * 9 * {0: 1, 5: 2, 7: 1}.get(i, 0) for i in range(8)]
    assert [x for shard in r.table for x in shard] == [[v] * 4 for v in rows]
    assert r.b == [1.0 - 0.5 * 9] * 4
