"""The CTR job's DLRM (tf_asyncps/app/ctr_model.py) in tf_keras and Keras 3,
its settings' checks, and the AUC and log loss it is measured by
(tf_asyncps/app/ctr_job.py). No cluster."""

import itertools
import math
import sys

import numpy as np
import pytest
import tf_keras

from conftest import run_command
from tf_asyncps.app import ctr_data, ctr_job, ctr_model

ROWS = (50, 3, 1000, 7)


def _keras(name):
    if name == "tf_keras":
        return tf_keras
    import keras
    return keras


def _inputs(rows, batch=8, raw=False, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, r, batch) for r in rows], axis=1)
    return {"dense": rng.normal(size=(batch, 13)).astype(np.float32),
            "sparse": ids.astype(np.int64 if raw else np.int32)}


@pytest.mark.parametrize("keras", ["tf_keras", "3"])
@pytest.mark.parametrize("embedding", ["tables", "offset", "collection"])
def test_dlrm_builds_and_its_interaction_is_the_upper_triangle_of_x_xt(keras, embedding):
    k = _keras(keras)
    model = ctr_model.build(ROWS, dim=4, bottom=(8,), top=(16, 8), seed=0,
                            embedding=embedding, keras=k)
    x = _inputs(ROWS)
    logits = np.asarray(model(x))
    assert logits.shape == (8, 1) and np.isfinite(logits).all()
    # The interaction's output from the bottom MLP's and the rows' values.
    bottom = k.Model(model.inputs, model.get_layer("bottom_1").output)(x)
    inter = model.get_layer("interaction")
    rows_in = inter.input[1]
    rows = np.asarray(k.Model(model.inputs, rows_in)(x))
    b = np.asarray(bottom)
    got = np.asarray(inter([bottom, rows]))
    assert got.shape == (8, ctr_model.interaction_width(4, 4)) == (8, 4 + 10)
    for n in range(8):
        xs = np.concatenate([b[n][None], rows[n]], axis=0)  # [5, 4]
        want = [xs[i] @ xs[j] for i, j in itertools.combinations(range(5), 2)]
        np.testing.assert_allclose(got[n], np.concatenate([b[n], want]), rtol=1e-5, atol=1e-6)
    if embedding == "tables":
        tables = [l for l in model.layers if l.name.startswith("embedding_")]
        assert [int(l.embeddings.shape[0]) for l in tables] == list(ROWS)
        # Row f of the stacked rows is feature f's table at its id.
        np.testing.assert_allclose(rows[:, 2], np.asarray(tables[2].embeddings)[
            x["sparse"][:, 2]], rtol=1e-6)
    else:
        (table,) = [w for w in model.weights if "embeddings" in w.name]
        assert tuple(table.shape) == (sum(ROWS), 4)
    if embedding == "offset":
        # Feature f's id i is row i + rows[0] + ... + rows[f-1] of the one table.
        np.testing.assert_allclose(rows[:, 2], np.asarray(table)[
            x["sparse"][:, 2] + ROWS[0] + ROWS[1]], rtol=1e-6)


@pytest.mark.parametrize("keras", ["tf_keras", "3"])
@pytest.mark.parametrize("embedding", ["dynamic", "dynamic_collection"])
def test_dynamic_dlrm_takes_raw_int64_ids(keras, embedding):
    k = _keras(keras)
    model = ctr_model.build(ROWS, dim=4, bottom=(8,), top=(8,), embedding=embedding, keras=k,
                            dynamic={"capacity": list(ROWS), "evict_every": 10})
    x = _inputs(ROWS, raw=True)
    x["sparse"] = x["sparse"] * 1_000_003 + 2 ** 40  # raw ids beyond int32
    if embedding == "dynamic":
        assert model.get_layer("embedding_2").capacity == 1000
    else:
        # One table of the features' capacities; 64-bit hashes (negative too)
        # reach it as their low 56 bits.
        layer = model.get_layer("embedding_collection")
        assert (layer.capacity, layer.num_features) == (sum(ROWS), len(ROWS))
        x["sparse"][:, 1] = -x["sparse"][:, 1] - 2 ** 62
    out = np.asarray(model(x, training=True))
    assert out.shape == (8, 1) and np.isfinite(out).all()
    if embedding == "dynamic_collection":
        got = layer.export()
        for f in range(len(ROWS)):
            assert sorted(got[f][0]) == sorted(set(x["sparse"][:, f] & (2 ** 56 - 1)))


def test_unknown_embedding_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--ctr_embedding='bags'"):
        ctr_model.build(ROWS, embedding="bags")


def test_a_missing_embedding_collection_fails_clearly(monkeypatch):
    import tf_asyncps.layers as layers
    monkeypatch.delattr(layers, "EmbeddingCollection")
    with pytest.raises(ValueError, match="--ctr_embedding=collection needs.*--ctr_embedding="
                                         "tables"):
        ctr_model.build(ROWS, embedding="collection")


@pytest.mark.parametrize("fields, words", [
    (dict(ctr_embedding="bags"), "--ctr_embedding"),
    (dict(ctr_top_mlp=()), "--ctr_top_mlp"),
    (dict(ctr_bottom_mlp=(0,)), "--ctr_bottom_mlp"),
    (dict(ctr_max_rows=0), "--ctr_max_rows"),
    (dict(ctr_scale=2.0), "--ctr_scale"),
    (dict(ctr_zipf=-0.5), "--ctr_zipf"),
    (dict(ctr_test_examples=1), "--ctr_test_examples"),
    (dict(dynamic_ids=True), "--ctr_embedding=dynamic"),
    (dict(backup_every_steps=50), "--backup_every_steps needs --backup_dir"),
    (dict(backup_every_steps=-1, backup_dir="/tmp"), "--backup_every_steps must be an int >= 0"),
    (dict(backup_every_steps=2 ** 63, backup_dir="/tmp"), "--backup_every_steps must be an int"),
    (dict(backup_every_steps=True, backup_dir="/tmp"), "--backup_every_steps must be an int"),
    (dict(ctr_embedding="dynamic", dynamic_capacity=0.0), "--dynamic_capacity"),
    (dict(dataset="digits"), "--dataset=digits"),
])
def test_bad_ctr_settings_name_the_flag(fields, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        ctr_job.CtrConfig(**fields).validate()


def test_the_ctr_job_takes_backups_every_n_steps(tmp_path):
    # Refused until the CTR job checkpointed ("the CTR job does not checkpoint").
    cfg = ctr_job.CtrConfig(backup_dir=str(tmp_path), backup_every_steps=50)
    cfg.validate()
    assert cfg.backup_every_steps == 50


def test_ctr_defaults_validate():
    cfg = ctr_job.CtrConfig()
    cfg.validate()
    assert cfg.rows() == ctr_data.table_rows(1_000_000)


def test_auc_is_the_share_of_correctly_ordered_pairs_ties_half():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 300)
    s = np.round(rng.normal(size=300) + y, 1)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    want = (np.sum(pos[:, None] > neg[None, :]) + 0.5 * np.sum(pos[:, None] == neg[None, :])
            ) / (len(pos) * len(neg))
    assert ctr_job.auc(y, s) == pytest.approx(want, abs=1e-12)
    assert ctr_job.auc([0, 1], [0.2, 0.9]) == 1.0 and ctr_job.auc([1, 0], [0.2, 0.9]) == 0.0
    with pytest.raises(ValueError, match="both classes"):
        ctr_job.auc([1, 1], [0.1, 0.2])


def test_log_loss_closed_form():
    assert ctr_job.log_loss([1, 0], [0.8, 0.4]) == pytest.approx(
        -(math.log(0.8) + math.log(0.6)) / 2)


@pytest.mark.parametrize("args, words", [
    # At flag parsing, before TensorFlow is imported:
    (["--model=mlp"], "--model=dlrm goes with --dataset=criteo_synthetic"),
])
def test_cli_refuses_bad_ctr_flags_in_one_line(args, words):
    rc, out = run_command([sys.executable, "-m", "tf_asyncps", "launch",
                           "--flagfile=configs/ctr.flags", *args], timeout=60, check=False)
    assert rc != 0 and words in out and "Traceback" not in out, out[-2000:]
