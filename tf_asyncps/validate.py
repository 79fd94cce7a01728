"""Argument checks in one wording: the field, the valid range, what the value
means (or how to fix it) and the value given.

Python ints and NumPy integers count as ints, Python and NumPy floats as
numbers (both register with :mod:`numbers`); bools are refused everywhere
(``True`` is an int to Python, never a count or a duration here). No
TensorFlow or NumPy import and no import of the package: the command line
checks its flags with these before loading TensorFlow, and every floor of
the package may use them.
"""

import numbers
from typing import Optional

__all__ = ["check_int", "check_number", "is_int"]


def is_int(value) -> bool:
    """True for a Python int or a NumPy integer, False for a bool (also NumPy's)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _bound(b) -> str:
    # 2**63 reads better than 9223372036854775808.
    if isinstance(b, int) and b >= 2 ** 16 and b & (b - 1) == 0:
        return f"2**{b.bit_length() - 1}"
    if isinstance(b, float) and b.is_integer() and abs(b) < 2 ** 53:
        return str(int(b))
    return f"{b:g}" if isinstance(b, float) else str(b)


def _range(low, low_open, high, high_open) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {_bound(low)}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {_bound(high)}")
    return " and ".join(parts)


def _fail(name, what, hint, value):
    raise ValueError(f"{name} must be {what}{f' ({hint})' if hint else ''}, got {value!r}.")


def check_int(value, name: str, *, min: Optional[int] = None, below: Optional[int] = None,
              hint: Optional[str] = None) -> int:
    """``value`` as a Python int, if it is an int (or NumPy integer; not a
    bool) with ``min <= value < below`` (either bound may be None).

    Args:
      value: what the caller passed.
      name: the field as the caller knows it, with any prefix
        (``"--epochs"``, ``"ssp: max_staleness"``).
      min: the least valid value, inclusive.
      below: the first invalid value above the range (exclusive).
      hint: what the value means or how to fix it (``"global steps"``).

    Returns:
      ``int(value)``.

    Raises:
      ValueError: ``"{name} must be an int >= {min} ({hint}), got {value!r}."``,
        also for a value of the wrong type (a bool, a float, a string, None).
    """
    if not is_int(value) or (min is not None and value < min) \
            or (below is not None and value >= below):
        bounds = _range(min, False, below, True)
        _fail(name, "an int" + (" " + bounds if bounds else ""), hint, value)
    return int(value)


def check_number(value, name: str, *, min: Optional[float] = None,
                 above: Optional[float] = None, max: Optional[float] = None,
                 below: Optional[float] = None, hint: Optional[str] = None) -> float:
    """``value`` as a Python float, if it is a real number (int, float or a
    NumPy one; not a bool) inside the given bounds. NaN is never inside.

    Args:
      value: what the caller passed.
      name: the field as the caller knows it, with any prefix.
      min / above: the lower bound, inclusive / exclusive (at most one).
      max / below: the upper bound, inclusive / exclusive (at most one).
      hint: the unit, what the value means or how to fix it (``"seconds"``).

    Returns:
      ``float(value)``.

    Raises:
      ValueError: ``"{name} must be > {above} ({hint}), got {value!r}."``,
        also for a value of the wrong type.
    """
    assert min is None or above is None, "one lower bound"
    assert max is None or below is None, "one upper bound"
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value
    if ok:
        ok = ((min is None or value >= min) and (above is None or value > above)
              and (max is None or value <= max) and (below is None or value < below))
    if not ok:
        low = min if min is not None else above
        high = max if max is not None else below
        _fail(name, _range(low, above is not None, high, below is not None) or "a number",
              hint, value)
    return float(value)
