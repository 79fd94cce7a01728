"""The scenario convention (tests/scenarios/__init__.py): a test module's
scenario returns a dataclass, which comes back typed from its process."""

import dataclasses

import numpy as np
import pytest

import conftest
from scenarios import from_json, scenario, to_json
from tf_asyncps import StalenessStats


@dataclasses.dataclass(frozen=True)
class _Part:
    """Attributes: n: a count."""
    n: int


@dataclasses.dataclass(frozen=True)
class _Result:
    """Attributes: w: a value; error: a name or None; parts: nested results;
    stats: staleness counters."""
    w: float
    error: str | None
    parts: list[_Part]
    stats: StalenessStats


def test_a_result_comes_back_as_its_dataclass_and_a_misspelt_field_fails():
    stats = StalenessStats(global_step=3, applied=3, dropped=1,
                           histogram=np.array([2, 1, 0]), dropped_histogram=np.zeros(3, int),
                           mean=np.float32(0.5), max=1)
    sent = to_json(_Result(w=np.float32(-2.0), error=None, parts=[_Part(1), _Part(2)],
                           stats=stats))
    assert sent["stats"]["histogram"] == [2, 1, 0] and type(sent["w"]) is float
    r = from_json(_Result, sent)
    assert r == _Result(w=-2.0, error=None, parts=[_Part(1), _Part(2)],
                        stats=StalenessStats(3, 3, 1, [2, 1, 0], [0, 0, 0], 0.5, 1))
    assert r.stats.worker_steps == 4  # a StalenessStats again, with its properties
    with pytest.raises(AttributeError):
        r.w_min  # noqa: B018 - a field the dataclass does not declare
    with pytest.raises(TypeError, match=r"_Result has no field\(s\) \['w_min'\]"):
        from_json(_Result, dict(sent, w_min=1.0))
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'w'"):
        from_json(_Result, {k: v for k, v in sent.items() if k != "w"})


def test_a_scenario_without_its_result_dataclass_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"must be annotated with the dataclass it returns"):
        @scenario
        def untyped():
            return {}
    with pytest.raises(TypeError, match=r"got <class 'dict'>"):
        @scenario(shares_cluster=True)
        def a_dict() -> dict:
            return {}

    @scenario
    def typed() -> _Part:
        return _Part(1)
    assert typed.scenario_key == "test_scenarios.py::typed" and typed.result_type is _Part


def test_run_scenario_refuses_a_function_that_is_not_a_scenario():
    def plain():
        return _Part(1)
    with pytest.raises(pytest.fail.Exception, match="plain is not a scenario: decorate it"):
        conftest.run_scenario(plain)
