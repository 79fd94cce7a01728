"""tf_asyncps.export: a DeltaPublisher's stream brings its base SavedModel to
the trained model's predictions in a process with no cluster; its dirty
marks are its own (a backup reading the same marks keeps its rows); a
broken stream is refused naming the file (issue 41 item 3)."""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_asyncps import export
from tf_asyncps.callbacks import delta_chain

ROWS, DIM = 200, 4
BATCHES = [[[1, 2, 2]], [[2, 40, 41]], [[41, 41, 1], [7, 8, 9]], [[150, 1, 3]], [[9, 9, 9]]]
QUERY = np.array([[1, 2, 3], [40, 41, 7], [8, 9, 150], [100, 101, 102]], np.int64)


def _model():
    tf_keras.utils.set_random_seed(3)
    model = tf_keras.Sequential([tf_keras.Input((3,), dtype="int64"),
                                 tf_keras.layers.Embedding(ROWS, DIM),
                                 tf_keras.layers.GlobalAveragePooling1D(),
                                 tf_keras.layers.Dense(2)])
    opt = tf_keras.optimizers.Adagrad(0.5)
    opt.build(model.trainable_variables)
    return model, opt


def _train(model, opt, pub, backup, batch):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.constant(batch, tf.int64)) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    # One process, no strategy: the marks are set here (the ps update sets them).
    opt.apply_gradients([(pub.reader.mark(g, v) if pub.reader.owns(v) else g, v)
                         for g, v in zip(grads, model.trainable_variables)])
    assert backup.owns(model.trainable_variables[0])
    return pub.step_done()


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """5 steps, a delta every 2 (after steps 2 and 4) and one by hand after
    step 5; the model's predictions after each delta; a backup reader of
    the same marks beside the publisher."""
    root = str(tmp_path_factory.mktemp("stream"))
    model, opt = _model()
    pub = export.DeltaPublisher(os.path.join(root, "pub"), every_steps=2)
    pub.start(model)
    backup = delta_chain.ModelDeltas(model, opt).track()  # a second reader
    assert backup.bit != pub.reader.bit
    want, backup_rows = [], None
    for batch in BATCHES:
        if _train(model, opt, pub, backup, batch) is not None:
            want.append(model(QUERY).numpy())
        if backup_rows is None and pub.published == 1:
            # The publisher cleared its bit; the backup still sees its rows.
            backup_rows = backup.dirty_ids(model.trainable_variables[0])
            assert pub.reader.dirty_ids(model.trainable_variables[0]).size == 0
    pub.publish()
    want.append(model(QUERY).numpy())
    return pub, want, backup_rows, backup.dirty_ids(model.trainable_variables[0])


def test_the_stream_brings_the_base_to_each_delta_s_predictions(stream):
    pub, want, backup_rows, backup_after = stream
    assert pub.published == 3
    base = tf.saved_model.load(pub.saved_model_dir)
    assert np.max(np.abs(base(QUERY).numpy() - want[-1])) > 1e-3  # the deltas do the work
    for upto, w in enumerate(want, start=1):
        served = export.apply_deltas(pub.saved_model_dir, upto=upto)(QUERY).numpy()
        np.testing.assert_allclose(served, w, rtol=0, atol=1e-6)
    assert export.latest_base(os.path.dirname(pub.delta_dir)) == (pub.saved_model_dir,
                                                                  pub.delta_dir)
    # Rows written: steps 1-2 {1, 2, 40, 41}, 3-4 {1, 3, 7, 8, 9, 41, 150}, 5 {9}.
    metas = [m for _, m in delta_chain.read_chain(
        [os.path.join(pub.delta_dir, f"delta-{i:06d}") for i in (1, 2, 3)], pub.base_id,
        kind="serving")]
    assert [m["shards"][0]["rows"] for m in metas] == [4, 7, 1]
    assert [m["steps"] for m in metas] == [2, 4, 5]
    # The backup's own bit: every row of steps 1-2, then of 1-5, not cleared by the publisher.
    np.testing.assert_array_equal(backup_rows, [1, 2, 40, 41])
    np.testing.assert_array_equal(backup_after, [1, 2, 3, 7, 8, 9, 40, 41, 150])


def test_a_loader_polls_new_deltas(stream):
    pub, want, _, _ = stream
    loader = export.DeltaLoader(pub.saved_model_dir)
    assert loader.refresh(upto=1) == 1
    np.testing.assert_allclose(loader.model(QUERY).numpy(), want[0], rtol=0, atol=1e-6)
    assert loader.refresh() == 3
    np.testing.assert_allclose(loader.model(QUERY).numpy(), want[-1], rtol=0, atol=1e-6)


def _copy(pub, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(pub.delta_dir, dst)
    return dst


def test_a_gap_is_refused_naming_the_file(stream, tmp_path):
    pub, _, _, _ = stream
    d = _copy(pub, tmp_path)
    shutil.rmtree(os.path.join(d, "delta-000002"))
    with pytest.raises(delta_chain.ChainError,
                       match=r"delta 2 of base .* is missing .*delta-000003.meta\.json"):
        export.apply_deltas(os.path.join(d, "saved_model"))


def test_a_duplicate_is_refused(stream, tmp_path):
    pub, _, _, _ = stream
    d = _copy(pub, tmp_path)
    shutil.copytree(os.path.join(d, "delta-000002"), os.path.join(d, "delta-000004"))
    with pytest.raises(delta_chain.ChainError, match=r"both hold sequence number 2 .*duplicate"):
        export.apply_deltas(os.path.join(d, "saved_model"))


def test_a_delta_of_another_base_is_refused(stream, tmp_path):
    pub, _, _, _ = stream
    d = _copy(pub, tmp_path)
    stamp = os.path.join(d, "saved_model", export.BASE_FILE)
    with open(stamp) as f:
        meta = json.load(f)
    with open(stamp, "w") as f:
        json.dump(dict(meta, base_id="other"), f)
    with pytest.raises(delta_chain.ChainError,
                       match=r"delta-000001.meta\.json is a delta of base 's0.*', not of 'other'"):
        export.apply_deltas(os.path.join(d, "saved_model"))


def test_a_truncated_file_is_refused(stream, tmp_path):
    pub, _, _, _ = stream
    d = _copy(pub, tmp_path)
    path = os.path.join(d, "delta-000002", "0.npz")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(delta_chain.ChainError,
                       match=r"delta-000002.0\.npz does not match its sha256"):
        export.apply_deltas(os.path.join(d, "saved_model"))


def test_a_saved_model_of_no_publisher_is_refused(stream, tmp_path):
    pub, _, _, _ = stream
    d = _copy(pub, tmp_path)
    os.remove(os.path.join(d, "saved_model", export.BASE_FILE))
    with pytest.raises(delta_chain.ChainError, match=r"tf_asyncps_delta_base\.json is missing"):
        export.apply_deltas(os.path.join(d, "saved_model"))


def test_bad_arguments_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"DeltaPublisher\(every_steps\) must be"):
        export.DeltaPublisher(str(tmp_path), 0)
    with pytest.raises(ValueError, match=r"publish_dir=''"):
        export.DeltaPublisher("", 2)
    dense = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="no embedding table"):
        export.DeltaPublisher(str(tmp_path), 2).start(dense)


def test_apply_deltas_refuses_a_bad_path_naming_the_argument(tmp_path):
    with pytest.raises(TypeError, match=r"apply_deltas\(saved_model_dir=None\): give a "
                       r"folder path \(str\), the base SavedModel"):
        export.apply_deltas(None)
    with pytest.raises(ValueError, match=r"apply_deltas\(saved_model_dir=''\): the path is "
                       r"empty; give the base SavedModel"):
        export.apply_deltas("")
    with pytest.raises(ValueError, match=r"apply_deltas\(saved_model_dir='.*nowhere'\): no "
                       r"folder there"):
        export.apply_deltas(str(tmp_path / "nowhere"))
    with pytest.raises(TypeError, match=r"apply_deltas\(delta_dir=3\)"):
        export.apply_deltas(str(tmp_path), 3)


DYN_BATCHES = [[[11, 12], [13, 11]], [[14, 15], [11, 16]], [[17, 18], [17, 11]],
               [[17, 18], [11, 12]], [[17, 18], [11, 19]]]
DYN_QUERY = np.array([[11, 12], [13, 14], [17, 18], [19, 16], [99, 15]], np.int64)


def _dynamic_model(keras_name, **layer_args):
    """Ids [2] -> DynamicEmbedding(DIM, capacity=6, **layer_args) -> Flatten
    -> Dense(1), Adagrad(0.5), the layer stepped by the optimizer's
    iterations (one process)."""
    if keras_name == "keras3":
        keras = pytest.importorskip("keras")
        import tf_asyncps
        make = tf_asyncps.keras3.DynamicEmbedding
    else:
        from tf_asyncps.layers.dynamic_embedding import DynamicEmbedding as make
        keras = tf_keras
    keras.utils.set_random_seed(7)
    opt = keras.optimizers.Adagrad(0.5)
    i = keras.Input((2,), dtype="int64")
    layer = make(DIM, capacity=6, name="emb", **layer_args)
    model = keras.Model(i, keras.layers.Dense(1)(keras.layers.Flatten()(layer(i))))
    opt.build(model.trainable_variables)
    layer.use_step(opt.iterations)
    layer.use_optimizer(opt, model.trainable_variables)
    return model, opt, layer


def _stream(tmp_path, keras_name, batches, query, **layer_args):
    """Trains on ``batches`` (one step each, an eviction pass after each),
    the publisher started after step 1 with a delta every 2 steps; returns
    (publisher, layer, the model's predictions of ``query`` at each delta,
    the tombstones of each delta sorted, the served predictions of
    ``query``: the base, then the base + deltas 1..k for each k)."""
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    from tf_asyncps.dynamic.table import optimizer_slots
    model, opt, layer = _dynamic_model(keras_name, **layer_args)
    pub = export.DeltaPublisher(str(tmp_path / "pub"), every_steps=2)
    reader, want = None, []
    for n, batch in enumerate(batches):
        if n == 1:
            pub.start(model)  # the base: after step 1
            reader = pub.reader
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.constant(batch, tf.int64), training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients([(reader.mark(g, v) if reader else g, v)
                             for g, v in zip(grads, model.trainable_variables)])
        layer.dynamic_table.maybe_evict(int(opt.iterations.numpy()),
                                        lambda var: optimizer_slots(opt, var))
        if reader is not None and pub.step_done() is not None:
            want.append(np.asarray(model(query)))
    tombs = [sorted(dynamic_deltas.decode_keys(
        np.load(os.path.join(pub.delta_dir, f"delta-{k:06d}", "0.npz")), "tomb:").tolist())
        for k in range(1, pub.published + 1)]

    def served(loaded):  # Keras 3: model.export's endpoint; tf_keras: the model's call
        return (loaded.serve if keras_name == "keras3" else loaded)(query).numpy()

    got = [served(tf.saved_model.load(pub.saved_model_dir))]
    got += [served(export.apply_deltas(pub.saved_model_dir, upto=k))
            for k in range(1, pub.published + 1)]
    return pub, layer, want, tombs, got


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
def test_a_dynamic_embedding_s_stream_serves_the_trained_model(tmp_path, keras_name):
    """DynamicEmbedding of 6 rows, LFU eviction every 2 steps (13 and 14
    evicted for 17 and 18 after step 4): the base exported after step 1 plus
    the deltas after steps 3 and 5 predicts as the trained model; evicted
    ids read the default row, re-used rows their new id's values. Keras 3:
    the base is model.export's archive with the maps named
    (export.default_export), its ``serve`` endpoint the served one."""
    pub, layer, want, tombs, got = _stream(tmp_path, keras_name, DYN_BATCHES, DYN_QUERY,
                                           evict_every=2)
    assert pub.published == 2 and layer.stats()["evicted"] == 2
    assert tombs == [[], [13, 14]]
    # 19 refused (the table is full); 13 and 14 gone, their rows 17's and 18's.
    assert sorted(layer.export()[0].numpy().tolist()) == [11, 12, 15, 16, 17, 18]
    assert np.max(np.abs(got[0] - want[-1])) > 1e-3  # the deltas do the work
    for served, w in zip(got[1:], want):
        np.testing.assert_allclose(served, w, rtol=0, atol=1e-6)


TTL_BATCHES = [[[21, 22], [23, 21]], [[21, 21], [21, 21]], [[21, 24], [21, 21]],
               [[21, 21], [21, 21]], [[21, 21], [21, 21]]]
TTL_QUERY = np.array([[21, 22], [23, 24], [22, 23], [24, 99]], np.int64)


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
def test_a_stream_of_evictions_only_serves_the_evicted_ids_the_default_row(tmp_path,
                                                                           keras_name):
    """ttl_steps=1, a pass every step: 22 and 23 (seen at step 1) and 24
    (step 3) expire and no id takes their rows, so each shard's map in the
    served SavedModel ends with fewer ids than the base's live rows (the
    served function must read the map as it stands, not rebuild it from the
    base's row keys, which would bring 22 and 23 back): predictions equal
    the trained model's at each delta, the expired ids reading the default
    row."""
    pub, layer, want, tombs, got = _stream(tmp_path, keras_name, TTL_BATCHES, TTL_QUERY,
                                           evict_every=1, ttl_steps=1)
    assert pub.published == 2
    assert tombs == [[22, 23], [24]]
    assert layer.export()[0].numpy().tolist() == [21]
    for served, w in zip(got[1:], want):
        np.testing.assert_allclose(served, w, rtol=0, atol=1e-6)
    # Rows 22, 23, 24 read zeros: [24, 99] and [22, 23] both predict the bias.
    np.testing.assert_allclose(got[-1][3], got[-1][2], rtol=0, atol=0)


def test_a_keras3_export_that_drops_the_dynamic_maps_is_refused_at_start(tmp_path):
    """Keras 3's plain model.export keeps the id -> row maps as unnamed
    ``_misc_assets``: a publisher given it refuses at start, naming the
    missing path and the fix, and leaves no base behind."""
    model, _, _ = _dynamic_model("keras3")
    pub = export.DeltaPublisher(str(tmp_path / "pub"), 2, export=lambda m, path: m.export(
        path, format="tf_saved_model", verbose=False))
    with pytest.raises(ValueError, match=r"holds no tf_asyncps_dynamic_maps/v0/0 .*"
                       r"tf_asyncps\.export\.default_export"):
        pub.start(model)
    assert not os.path.exists(os.path.join(str(tmp_path / "pub"), "latest.json"))
