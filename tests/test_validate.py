"""tf_asyncps/validate.py: the package's one wording of "an int >= N" and
"a number > x" checks (NumPy values pass, bools never), and its place at the
bottom of the import graph."""

import ast
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from tf_asyncps.validate import check_int, check_number, is_int


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3), np.intp(3)])
def test_ints_and_numpy_ints_pass_as_python_ints(value):
    out = check_int(value, "n", min=1)
    assert out == 3 and type(out) is int
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 3.0, np.float64(3.0), "3",
                                   None, [3]])
def test_bools_floats_strings_and_none_are_not_ints(value):
    assert not is_int(value)
    with pytest.raises(ValueError) as e:
        check_int(value, "--epochs", min=1)
    assert str(e.value) == f"--epochs must be an int >= 1, got {value!r}."


def test_the_int_message_names_the_field_the_range_the_hint_and_the_value():
    with pytest.raises(ValueError) as e:
        check_int(0, "ssp: max_staleness", min=1, below=2 ** 63, hint="clocks")
    assert str(e.value) == "ssp: max_staleness must be an int >= 1 and < 2**63 (clocks), got 0."
    with pytest.raises(ValueError) as e:
        check_int(2 ** 63, "n", min=0, below=2 ** 63)
    assert str(e.value) == f"n must be an int >= 0 and < 2**63, got {2 ** 63}."
    with pytest.raises(ValueError) as e:
        check_int(3, "feature", min=0, below=3, hint="a feature index")
    assert str(e.value) == "feature must be an int >= 0 and < 3 (a feature index), got 3."
    assert check_int(2 ** 63 - 1, "n", min=0, below=2 ** 63) == 2 ** 63 - 1
    assert check_int(-5, "n") == -5  # no bound: any int


@pytest.mark.parametrize("value", [0.5, 2, np.float32(0.5), np.float64(2.0), np.int64(2)])
def test_numbers_and_numpy_numbers_pass_as_python_floats(value):
    out = check_number(value, "timeout_s", above=0)
    assert out == float(value) and type(out) is float


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "1", None, np.bool_(True)])
def test_numbers_out_of_range_nan_bools_and_strings_are_refused(value):
    with pytest.raises(ValueError) as e:
        check_number(value, "sync_replicas: timeout_s", above=0, hint="seconds")
    assert str(e.value) == f"sync_replicas: timeout_s must be > 0 (seconds), got {value!r}."


def test_number_bounds_inclusive_and_exclusive():
    assert check_number(0, "m", min=0, below=1) == 0.0
    with pytest.raises(ValueError, match=r"^m must be >= 0 and < 1, got 1\.$"):
        check_number(1, "m", min=0, below=1)
    assert check_number(3600e3, "delay_ms", min=0, max=3600e3) == 3600e3
    with pytest.raises(ValueError,
                       match=r"^delay_ms must be >= 0 and <= 3600000 \(ms\), got inf\.$"):
        check_number(float("inf"), "delay_ms", min=0, max=3600e3, hint="ms")
    with pytest.raises(ValueError, match=r"^x must be a number, got 'a'\.$"):
        check_number("a", "x")


def test_the_package_checks_give_the_one_wording():
    """A few of the package's checks, each from another floor: NumPy ints
    pass, bools fail, the message names the field."""
    from tf_asyncps import policies
    from tf_asyncps.app.straggler import slow_dataset_fn
    from tf_asyncps.cluster import devices
    assert policies.get("ssp", max_staleness=np.int64(2)).max_staleness == 2
    with pytest.raises(ValueError, match=r"^ssp: max_staleness must be an int >= 0 and < 2\*\*63 "
                                         r"\(clocks\), got True\.$"):
        policies.get("ssp", max_staleness=True)
    with pytest.raises(ValueError, match=r"^ssp: timeout_s must be > 0 \(seconds\), got 0\.$"):
        policies.get("ssp", timeout_s=0)
    with pytest.raises(ValueError, match=r"^slow_worker must be an int >= 0 \(a worker index\), "
                                         r"got 1\.0\.$"):
        slow_dataset_fn(lambda ctx: None, 1.0, 10)
    assert devices.plan_gpus(np.int64(2), 0, 0).gpus_per_worker == 0
    with pytest.raises(ValueError, match=r"^--num_workers must be an int >= 1, got False\.$"):
        devices.plan_gpus(False, 0, 0)


def test_the_module_imports_nothing_of_the_package_nor_tensorflow_or_numpy():
    """Every floor may use it (the command line before TensorFlow loads)."""
    path = os.path.join(ROOT, "tf_asyncps", "validate.py")
    names = {a.name for n in ast.walk(ast.parse(open(path).read()))
             if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(ast.parse(open(path).read()))
              if isinstance(n, ast.ImportFrom)}
    assert names == {"numbers", "typing"}
    code = ("import sys, tf_asyncps.validate; "
            "print(sorted({'tensorflow', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
