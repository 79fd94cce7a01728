"""tf_keras's own parameter_server_evaluation_test.py (two workers killed and
restarted mid-evaluation), run with AsyncParameterServerStrategy swapped in
(tests/upstream/README.md): every test passes as under vanilla."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream"))
import run_upstream  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(660)]


def test_parameter_server_evaluation_test_passes_with_the_class_swapped():
    run_upstream.pytest_check("parameter_server_evaluation_test", timeout=600)
