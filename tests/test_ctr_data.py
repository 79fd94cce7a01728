"""The CTR job's generated Criteo-shaped data (tf_asyncps/app/ctr_data.py):
shapes, ranges, determinism per seed and worker stream, the Zipf law's closed
forms, the labels' base rate, and that the planted model is learnable."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_asyncps.app import ctr_data as cd

ROWS = cd.table_rows(100_000)  # configs/ctr.flags


@pytest.fixture(scope="module")
def data():
    return cd.make(ROWS, 1.1, seed=0)


@pytest.fixture(scope="module")
def held_out(data):
    return data.arrays(cd.TEST_STREAM, 1 << 16)


def test_table_rows_cap_and_scale():
    assert cd.table_rows(10 ** 9) == cd.CRITEO_KAGGLE
    assert sum(cd.table_rows(1_000_000)) == 5_569_296  # the 5.57M rows
    assert ROWS[2] == ROWS[3] == 100_000 and ROWS[0] == 1460 and ROWS[8] == 3
    small = cd.table_rows(1_000_000, scale=0.001)
    assert small[:3] == (1, 1, 1000) and min(small) == 1
    for bad in (dict(max_rows=0), dict(scale=0.0), dict(scale=1.5)):
        with pytest.raises(ValueError, match="--ctr_"):
            cd.table_rows(**bad)


def test_batch_shapes_dtypes_ranges(data):
    x, y = data.batch(cd.train_stream(0), 3, 512)
    assert x["dense"].dtype == tf.float32 and x["dense"].shape == (512, 13)
    assert x["sparse"].dtype == tf.int32 and x["sparse"].shape == (512, 26)
    assert y.dtype == tf.float32 and y.shape == (512, 1)
    ids = x["sparse"].numpy()
    assert (ids >= 0).all() and (ids < np.array(ROWS)).all()
    assert set(np.unique(y.numpy())) <= {0.0, 1.0}
    dense = x["dense"].numpy()
    assert np.isfinite(dense).all() and (dense > 0).all()  # log(1 + a positive count)
    # The counts are log-normal: log(count) = mu + sigma z, z the stored normal draws.
    counts, z = data.counts(cd.train_stream(0), 3, 512)
    np.testing.assert_allclose(np.log(counts.numpy()),
                               np.array(data.dense_mu) + np.array(data.dense_sigma) * z.numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dense, np.log1p(counts.numpy()), rtol=1e-6)


def test_same_seed_same_batches_and_streams_differ(data):
    again = cd.make(ROWS, 1.1, seed=0)
    assert again == data  # planted weights, salts and the calibrated bias
    a = data.batch(cd.train_stream(1), 7, 256)
    b = again.batch(cd.train_stream(1), 7, 256)
    for k in ("dense", "sparse"):
        np.testing.assert_array_equal(a[0][k].numpy(), b[0][k].numpy())
    np.testing.assert_array_equal(a[1].numpy(), b[1].numpy())
    other = data.batch(cd.train_stream(0), 7, 256)[0]["sparse"].numpy()
    assert (other != a[0]["sparse"].numpy()).mean() > 0.3


def test_dataset_fn_gives_worker_w_its_stream(data):
    fn = data.dataset_fn(64)
    for w in (0, 1):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=w)
        got = [b for _, b in zip(range(2), fn(ctx))]
        for i, (x, y) in enumerate(got):
            want_x, want_y = data.batch(cd.train_stream(w), i, 64)
            np.testing.assert_array_equal(x["sparse"].numpy(), want_x["sparse"].numpy())
            np.testing.assert_array_equal(y.numpy(), want_y.numpy())


def test_a_resumed_runs_streams_start_at_the_backups_worker_steps(data):
    # ctr_job passes the backup's worker steps N: worker w's first batch is
    # its stream's batch N (each worker read at most N batches before it).
    fn = data.dataset_fn(64, start=37)
    for w in (0, 1):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=w)
        got = [b for _, b in zip(range(2), fn(ctx))]
        for i, (x, y) in enumerate(got):
            want_x, want_y = data.batch(cd.train_stream(w), 37 + i, 64)
            np.testing.assert_array_equal(x["sparse"].numpy(), want_x["sparse"].numpy())
            np.testing.assert_array_equal(x["dense"].numpy(), want_x["dense"].numpy())
            np.testing.assert_array_equal(y.numpy(), want_y.numpy())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"start must be an int >= 0"):
            data.dataset_fn(64, start=bad)


def test_zipf_law_closed_forms(data):
    a = 1.1
    for n in (3, 24, 1460, 100_000):
        p = cd.zipf_probabilities(n, a)
        assert p.sum() == pytest.approx(1.0, abs=1e-12)
        assert (np.diff(p) < 0).all()  # rank 1 is the most frequent
        m = max(1, n // 100)
        assert p[:m].sum() == pytest.approx(cd.top_share(m, n, a), rel=1e-9)
    assert cd.top_share(1000, 100_000, 1.0) == pytest.approx(math.log(1001) / math.log(100_001))
    assert cd.top_share(1000, 100_000, 0.0) == pytest.approx(1000 / 100_000)


def _ranks(data, ids, f):
    """Rank (1-based) of feature f's ids: the inverse of id = (r-1) m mod N."""
    n, m = data.rows[f], data.multipliers[f]
    return (ids.astype(np.int64) * pow(m, -1, n)) % n + 1 if n > 1 else np.ones_like(ids)


@pytest.mark.parametrize("f", [2, 0, 8])  # 100,000, 1,460 and 3 ids
def test_top_1_percent_of_ids_get_the_closed_form_share(data, held_out, f):
    ids = held_out[0]["sparse"][:, f]
    n, draws = data.rows[f], len(ids)
    m = max(1, n // 100)
    share = cd.top_share(m, n, data.zipf_a)
    got = np.mean(_ranks(data, ids, f) <= m)
    # A binomial count: within 5 standard deviations.
    assert abs(got - share) < 5 * math.sqrt(share * (1 - share) / draws), (got, share)
    if n == 100_000:
        assert share > 0.72  # the skew: 1% of the ids take most lookups


def test_the_multiplier_permutes_ids_so_hot_ids_spread_over_the_table(data, held_out):
    f = 2
    n = data.rows[f]
    assert math.gcd(data.multipliers[f], n) == 1
    hot = (np.arange(100) * data.multipliers[f]) % n  # ranks 1..100
    assert len(set(hot)) == 100 and (hot >= n // 2).sum() > 30  # both halves (shards)


def test_labels_base_rate_and_planted_model_is_learnable(data, held_out):
    x, y, planted = held_out
    n = len(y)
    # The bias was set on another stream: both means have binomial noise.
    assert abs(y.mean() - cd.BASE_RATE) < 5 * math.sqrt(2 * 0.25 * 0.75 / n)
    from tf_asyncps.app.ctr_job import auc, log_loss
    planted_auc = auc(y, planted)
    assert planted_auc > 0.75, planted_auc
    base = log_loss(y, np.full(n, y.mean()))  # the constant predictor's
    assert log_loss(y, planted) < base - 0.08
    # The planted probabilities are the labels' law: calibrated on average.
    assert abs(planted.mean() - y.mean()) < 5 * math.sqrt(0.25 * 0.75 / n)


def test_mix32_numpy_and_tensorflow_agree_and_are_bijective():
    x = np.arange(0, 1 << 16, dtype=np.int64) * 65_521 + 17
    a = cd.mix32(x)
    np.testing.assert_array_equal(a, cd.mix32(tf.constant(x)).numpy())
    assert len(np.unique(a)) == len(x) and a.min() >= 0 and a.max() < 2 ** 32


def test_raw_ids_are_distinct_per_feature_and_id():
    raw = cd.make(ROWS, 1.1, seed=0, raw_ids=True)
    x, _ = raw.batch(cd.TEST_STREAM, 0, 4096)
    ids = raw.ids(cd.TEST_STREAM, 0, 4096).numpy()
    got = x["sparse"].numpy()
    assert got.dtype == np.int64 and got.shape == (4096, 26)
    pairs_ids = {(f, i) for f in range(26) for i in np.unique(ids[:, f])}
    pairs_raw = {(f, r) for f in range(26) for r in np.unique(got[:, f])}
    assert len(pairs_raw) == len(pairs_ids)  # one raw id per (feature, id)
    same = raw.raw(tf.zeros([1, 26], tf.int64)).numpy()[0]  # id 0 of every feature
    assert len(set(same.tolist())) == 26


def test_bad_settings_name_their_flag():
    with pytest.raises(ValueError, match="--ctr_zipf"):
        cd.make(ROWS, -1.0)
    with pytest.raises(ValueError, match="--seed"):
        cd.make(ROWS, 1.1, seed=-1)
