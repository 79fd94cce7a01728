"""``route`` with a mapping of labels, and ``route(sparse="async",
dense=LocalSteps(k))``: the tables updated every step on the PS, the dense
weights on per-worker copies exchanged every k steps (PERSIA's hybrid).

Fast tier: the labels and the refusals. Cluster tier: closed forms on one
worker (the table is plain SGD, the PS copy of the dense weight is the SGD
trajectory sampled at the exchanges) and exact counters on two.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_asyncps import policies
from conftest import run_scenario


def _vars(*names):
    return [tf.Variable(0.0, name=n) for n in names]


def test_a_mapping_of_labels_splits_in_the_order_of_its_parts():
    r = policies.route({"user": "async", "item": policies.get("drop_stale", max_staleness=1),
                        "dense": "async"},
                       labels={"user": "user_ids", "item": "item_ids|embeddings"})
    vs = _vars("user_ids/embeddings", "dense/kernel", "item_ids/embeddings/part_1", "bias")
    # "user_ids/embeddings" matches both patterns: the first label in order wins.
    assert r.split(vs) == ([0], [2], [1, 3])
    assert r.labels == ("user", "item", "dense")
    assert r.build(2, "/job:localhost/replica:0/task:0/device:CPU:0").counts.shape == [3]
    assert r.part_updates() == {"user": 0, "item": 0, "dense": 0}


def test_the_two_label_form_is_the_mapping_with_sparse_names():
    vs = _vars("movie/embeddings", "dense/kernel")
    two = policies.route(sparse="async", dense="ssp", sparse_names="embeddings")
    mapped = policies.route({"sparse": "async", "dense": "ssp"},
                            labels={"sparse": "embeddings"})
    assert two.split(vs) == mapped.split(vs) == ([0], [1])
    assert repr(two).endswith("sparse_names='embeddings')")
    assert repr(mapped) == repr(two)  # one route, two spellings


def test_labels_may_be_a_callable():
    r = policies.route({"a": "async", "b": "async"},
                       labels=lambda name: "a" if name.startswith("a") else "b")
    assert r.split(_vars("a1", "b1", "a2")) == ([0, 2], [1])
    with pytest.raises(ValueError, match=r"labels\('zz:0'\) returned 'c'"):
        policies.route({"a": "async", "b": "async"}, labels=lambda name: "c").split(_vars("zz"))


def test_variable_modes_of_a_route_with_local_steps():
    r = policies.route(sparse="async", dense=policies.LocalSteps(sync_every=4))
    assert r.local_copies and r.updates_on_ps
    # The dense part's trainable variables and their slots: local copies;
    # the tables, their slots and every non-trainable non-slot variable: per step.
    assert r.variable_mode("dense/kernel:0", trainable=True, slot=False) == "local_copies"
    assert r.variable_mode("dense/kernel/momentum:0", trainable=False, slot=True) == \
        "local_copies"
    assert r.variable_mode("emb/embeddings:0", trainable=True, slot=False) == "per_step"
    assert r.variable_mode("emb/embeddings/momentum:0", trainable=False, slot=True) == \
        "per_step"
    assert r.variable_mode("SGD/iter:0", trainable=False, slot=False) == "per_step"
    assert int(r.exchange_due(tf.constant(3, tf.int64))) == 0
    assert int(r.exchange_due(tf.constant(4, tf.int64))) == 1
    local_sgd = policies.get("local_sgd")
    assert local_sgd.variable_mode("x", trainable=False, slot=False) == "local_copies"
    assert not local_sgd.updates_on_ps
    assert policies.get("async").variable_mode("x", True, False) == "per_step"


@pytest.mark.parametrize("make,words", [
    (lambda: policies.route({"a": "local_sgd", "b": policies.LocalSteps(2), "c": "async"},
                            labels={"a": "x", "b": "y"}), "at most one part"),
    (lambda: policies.route(sparse="async", dense=policies.chain("local_sgd", "async")),
     "per-worker copies|mixes local steps"),
    (lambda: policies.route(sparse="sync_replicas", dense=policies.LocalSteps(2)),
     "atomic"),
    (lambda: policies.route({"a": "async", "b": "async"}, labels={}),
     "every label but one"),
    (lambda: policies.route({"a": "async", "b": "async"}, labels={"c": "x"}),
     "no policy"),
    (lambda: policies.route({"a": "async", "b": "async"}),
     "needs labels"),
    (lambda: policies.route({"a": "async", "b": "async"}, labels={"a": "x"}, sparse="async"),
     "not both"),
    (lambda: policies.route({"a": "async", "b": "async"}, labels={"a": 3}),
     "non-empty regular expression"),
])
def test_bad_mappings_are_refused_with_the_fix(make, words):
    with pytest.raises(ValueError, match=words):
        make()


# -- cluster tier ------------------------------------------------------------
LR, K = 0.1, 3


def _one_worker_data(n=7, batch=2, d=3, rows=4, seed=0):
    rng = np.random.RandomState(seed)
    return dict(ids=rng.randint(0, rows, size=(n, batch)).tolist(),
                x=rng.randn(n, batch, d).round(2).tolist(),
                y=rng.randn(n, batch).round(2).tolist(),
                table0=rng.randn(rows, 2).round(2).tolist(),
                w0=rng.randn(d).round(2).tolist())


def _sgd_trajectory(ids, x, y, table0, w0, lr):
    """Plain SGD on pred = sum(table[id]) + x @ w, loss = mean((pred-y)^2)/2:
    the table and w after each step (float64)."""
    table, w = np.array(table0, np.float64), np.array(w0, np.float64)
    tables, ws = [table.copy()], [w.copy()]
    for ids_j, x_j, y_j in zip(np.array(ids), np.array(x), np.array(y)):
        err = table[ids_j].sum(axis=1) + x_j @ w - y_j  # [batch]
        g_rows = err / len(ids_j)
        grad_w = x_j.T @ g_rows
        np.add.at(table, ids_j, -lr * g_rows[:, None] * np.ones((1, table.shape[1])))
        w = w - lr * grad_w
        tables.append(table.copy())
        ws.append(w.copy())
    return tables, ws


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_one_worker_table_is_sgd_and_the_ps_dense_copy_is_sgd_sampled_at_the_exchanges():
    data = _one_worker_data()
    r = run_scenario("route_local_steps_one_worker", shared=(1, 1), lr=LR, sync_every=K,
                     **data)
    n = len(data["ids"])
    tables, ws = _sgd_trajectory(**data, lr=LR)
    for j in range(1, n + 1):
        # After step j the table is SGD's (updated on the PS every step) ...
        np.testing.assert_allclose(r["tables"][j - 1], tables[j], rtol=1e-5, atol=1e-6)
        # ... and the PS copy of w is the trajectory at the last exchange:
        # made at the start of steps K+1, 2K+1, ... (the first step pulls).
        np.testing.assert_allclose(r["ws"][j - 1], ws[K * ((j - 1) // K)], rtol=1e-5,
                                   atol=1e-6)
    assert not np.allclose(ws[K * ((n - 1) // K)], ws[n])  # the last window is still local
    # The join pushes the rest: the PS copy is SGD's end point.
    np.testing.assert_allclose(r["w"], ws[n], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["table"], tables[n], rtol=1e-5, atol=1e-6)
    # Local copies: the dense kernel and its slot (tf_keras SGD makes one even
    # at momentum 0); the table, its slot and the step counter stay on the PS.
    assert r["local_copies"] == ["SGD/m/dense/kernel:0", "dense/kernel:0"]
    assert r["part_updates"] == {"sparse": n, "dense": math.ceil(n / K)}
    s = r["stats"]
    assert s["parts"] == r["part_updates"]  # staleness_stats().parts
    assert (s["applied"], s["dropped"], s["global_step"], s["local_steps"]) == (n, 0, n, n)
    assert r["iterations"] == n


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_two_workers_sum_exactly_and_count_each_exchange():
    steps, lr, k = 20, 0.5, 4
    r = run_scenario("route_local_steps_two_workers", shared=(2, 1), steps=steps, lr=lr,
                     sync_every=k, ids=[0, 1, 1])
    assert r["table"] == [[-lr * steps] * 2, [-2 * lr * steps] * 2, [0.0, 0.0]]
    assert r["w"] == [2.0 - lr * steps] * 4
    closures = r["closures"]
    assert sum(closures) == steps
    # Per worker: an exchange at the start of each closure after k local
    # steps since its last, then the join's push of the rest: ceil(c / k).
    syncs = sum(math.ceil(c / k) for c in closures)
    assert r["part_updates"] == {"sparse": steps, "dense": syncs}
    s = r["stats"]
    assert s["parts"] == r["part_updates"]  # staleness_stats().parts
    assert (s["applied"], s["dropped"], s["global_step"], s["local_steps"]) == (
        steps, 0, steps, steps)
    assert r["iterations"] == steps
