"""The fast tier (``-m "not cluster"``) starts no TensorFlow servers: a test
without the ``cluster`` marker that tries (a scenario, a LocalCluster, an
in-process ``tf.distribute.Server``) fails, naming itself and the marker
(tests/conftest.py, ``refuse_servers_outside_cluster_tests``). These tests are
unmarked, so each attempt below must be refused before anything starts."""

import pytest
import tensorflow as tf

import conftest
from tf_asyncps.cluster import LocalCluster

REFUSED = r"test_fast_tier\.py::\S+ starts TensorFlow servers \({}\) without the cluster marker"


def test_a_scenario_in_an_unmarked_test_is_refused():
    # Another file's test may have left a shared cluster in this process
    # (pytest-xdist runs files one after another in it): none is made here.
    before = dict(conftest._SHARED_CLUSTERS)
    with pytest.raises(pytest.fail.Exception, match=REFUSED.format("scenario 'fit_exactness'")):
        conftest.run_scenario("fit_exactness", timeout=1)
    with pytest.raises(pytest.fail.Exception, match=REFUSED.format("scenario 'x'")):
        conftest.run_scenario("x", shared=(1, 1), timeout=1)
    assert dict(conftest._SHARED_CLUSTERS) == before


def test_a_local_cluster_in_an_unmarked_test_is_refused(tmp_path):
    cluster = LocalCluster(1, 1, log_dir=str(tmp_path))  # making one starts nothing
    with pytest.raises(pytest.fail.Exception, match=REFUSED.format(r"LocalCluster\.start")):
        cluster.start()
    with pytest.raises(pytest.fail.Exception, match=REFUSED.format(r"LocalCluster\.restart")):
        cluster.restart("ps:0")
    assert cluster.pids == {}


def test_an_in_process_server_in_an_unmarked_test_is_refused():
    spec = tf.train.ClusterSpec({"worker": ["localhost:1"]})
    with pytest.raises(pytest.fail.Exception,
                       match=REFUSED.format(r"tf\.distribute\.Server")):
        tf.distribute.Server(spec, job_name="worker", task_index=0, start=False)


def test_the_marker_lifts_the_refusal(monkeypatch):
    """What a cluster-marked test sees (the setup hook leaves no node id)."""
    monkeypatch.setattr(conftest, "_UNMARKED_TEST", None)
    conftest.refuse_servers_outside_cluster_tests("anything")  # no failure
