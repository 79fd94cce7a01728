"""TensorFlow's own coordinator/cluster_coordinator_test.py, run with
AsyncParameterServerStrategy swapped in (tests/upstream/README.md): every test
passes or skips as under vanilla."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream"))
import run_upstream  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(660)]


def test_cluster_coordinator_test_passes_with_the_class_swapped():
    run_upstream.pytest_check("cluster_coordinator_test", timeout=600)
