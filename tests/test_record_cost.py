"""What a passing measured test's record costs where it ran (a contract on the plugin's own calls):
it is never decoded there (whether a second run with sites is due is decided without a copy),
and its timeline, already JSON-ready data, is never walked value by value nor encoded where it
is dropped."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import run
from pytest_gpumem import codec
from pytest_gpumem.judge.record import TestRecord

STEPS = """
import pytest
import torch

pytestmark = pytest.mark.gpumem(peak="1GiB")


@pytest.mark.parametrize("steps", [300, 400])
def test_many_allocations(steps):
    x = torch.ones(8, 8)
    for _ in range(steps):
        x = x * 1.0 + 1.0
"""


def test_a_passing_tests_record_is_not_decoded_where_it_ran(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[str] = []
    from_json = TestRecord.from_json.__func__  # type: ignore[attr-defined]

    def counted(cls: type[TestRecord], text: str) -> TestRecord:
        decoded.append(json.loads(text)["nodeid"])
        return from_json(cls, text)

    monkeypatch.setattr(TestRecord, "from_json", classmethod(counted))
    pytester.makepyfile(test_cost=STEPS)
    run(pytester, "-p", "no:randomly").assert_outcomes(passed=2)
    # the process logs the record it made, not a decoded one, and decides whether a second run is
    # due without a judged copy; the run's end decodes the kept records once for the terminal summary
    per_test = ["test_cost.py::test_many_allocations[300]", "test_cost.py::test_many_allocations[400]"]
    assert sorted(decoded) == per_test


def test_a_records_timeline_is_written_as_it_is(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[int] = []
    to_data = codec.to_data

    def counted(value: Any) -> Any:
        if type(value) in (list, tuple) and len(value) > 64:
            walked.append(len(value))
        return to_data(value)

    monkeypatch.setattr(codec, "to_data", counted)
    pytester.makepyfile(test_cost=STEPS)
    result = run(pytester, "-p", "no:randomly", "--gpumem-json=report.json")
    result.assert_outcomes(passed=2)
    assert walked == []  # no array of the timeline's hundreds of samples went through the codec
    tests = json.loads((pytester.path / "report.json").read_text())["tests"]
    assert len(tests) == 2
    # yet the timelines were there (the record sent from the test's process has it)
    reports = result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
    calls = [TestRecord.from_json(r.gpumem) for r in reports if r.when == "call"]
    assert [len(record.timeline_of_call().events) > 64 for record in calls] == [True, True]
