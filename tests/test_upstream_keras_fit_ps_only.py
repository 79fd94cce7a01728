"""tf_keras's own dataset_creator_model_fit_ps_only_test.py (model.fit and its
callbacks under parameter servers only), run with AsyncParameterServerStrategy
swapped in (tests/upstream/README.md): every test passes as under vanilla but
for the accepted differences."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream"))
import run_upstream  # noqa: E402

# Outside the suite's 20 minutes: ASYNCPS_UPSTREAM_LONG=1 runs it.
pytestmark = run_upstream.long_file_marks(23, timeout=1260)


def test_dataset_creator_model_fit_ps_only_test_passes_with_the_class_swapped():
    run_upstream.pytest_check("dataset_creator_model_fit_ps_only_test", timeout=1200)
