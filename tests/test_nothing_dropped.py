"""A limit the user wrote is never dropped in silence: the closest marker wins keyword by keyword
(a ``pytest.param``'s marks before the function's), a marker added once the test is
collected (``request.applymarker`` in a fixture, ``request.node.add_marker`` in the test)
applies, or is an error that says why it cannot, and a baseline the run no longer produces
(a span, a ``max_microbatch``) is reported, and fails under ``--gpumem-strict``."""

from __future__ import annotations

import json

import pytest

from conftest import run


def test_a_parameters_marker_wins_over_the_functions(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(peak="1MiB", allocated="1MiB")
@pytest.mark.parametrize("n", [pytest.param(100, marks=pytest.mark.gpumem(peak="100B"), id="tight"), 100])
def test_step(n):
    x = torch.ones(n)   # 400 B
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*peak cost 400 B exceeds the limit 100 B (100B)*", "FAILED *test_step[[]tight[]]*"])


def test_a_limit_a_fixture_applies_is_applied(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.fixture
def tight(request):
    request.applymarker(pytest.mark.gpumem(peak="1KiB"))

@pytest.mark.gpumem(allocated="1MiB")
def test_marked(tight):
    x = torch.ones(10_000)   # 39 KiB

def test_unmarked(tight):
    x = torch.ones(10_000)
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*peak cost 39.06 KiB exceeds the limit 1.00 KiB (1KiB)*"])
    assert sum(line.startswith("peak cost 39.06 KiB exceeds the limit 1.00 KiB") for line in result.outlines) == 2


def test_a_limit_the_test_adds_to_itself_is_applied(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(allocated="1MiB")
def test_adds(request):
    request.node.add_marker(pytest.mark.gpumem(peak="1KiB"))
    x = torch.ones(10_000)
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*peak cost 39.06 KiB exceeds the limit 1.00 KiB (1KiB)*"])


def test_a_marker_added_too_late_to_measure_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.fixture
def limited(request):
    request.applymarker(pytest.mark.gpumem(device_limit="1MiB"))

@pytest.mark.gpumem(peak="1GiB")
def test_setup_keyword(limited):
    x = torch.ones(10_000)

def test_unmarked_adds_in_its_body(request):
    request.node.add_marker(pytest.mark.gpumem(peak="1KiB"))
    x = torch.ones(10_000)
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=2)
    text = result.stdout.str()
    assert "test_setup_keyword: device_limit=" in text and "too late" in text
    assert "test_unmarked_adds_in_its_body: a gpumem marker added while the test ran" in text


def test_a_late_limit_that_a_closer_marker_overrides_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest, torch

@pytest.fixture
def tight(request):
    request.applymarker(pytest.mark.gpumem(peak="1KiB"))

@pytest.mark.gpumem(peak="1MiB")
def test_overridden(tight):
    x = torch.ones(10)

@pytest.mark.gpumem(peak="1KiB")
def test_same_value(tight):
    x = torch.ones(10)
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*::test_overridden: the gpumem marker added after collection sets peak='1KiB', but peak='1MiB' *wins*"]
    )


SEARCHING = """
import pytest, torch

@pytest.mark.gpumem(peak="1MiB")
def test_step(gpumem):
    with gpumem.measure("encode"):
        x = torch.ones(100)
    gpumem.max_microbatch(lambda size: torch.ones(size), upper=8)
"""

REFACTORED = """
import pytest, torch

@pytest.mark.gpumem(peak="1MiB")
def test_step(gpumem):
    x = torch.ones(100)
"""


def test_a_recorded_span_or_microbatch_the_run_does_not_produce_is_reported(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_model=SEARCHING)
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=1)
    spans = json.loads((pytester.path / "gpumem-baselines.json").read_text())["environments"]
    recorded = next(iter(spans.values()))["tests"]["test_model.py::test_step"]["spans"]
    assert set(recorded) == {"call", "encode"} and recorded["call"]["max_microbatch"] == 8
    pytester.makepyfile(test_model=REFACTORED)
    result = run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*max_microbatch*stale*", "*encode*stale*"])
    strict = run(pytester, "--gpumem-strict")
    strict.assert_outcomes(failed=1)
    strict.stdout.fnmatch_lines(
        [
            "stale baseline: max_microbatch 8 was recorded for test_model.py::test_step, not measured by this run*",
            "stale baseline: the span 'encode' of test_model.py::test_step was recorded, not measured by this run*",
        ]
    )
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=1)  # recording again drops them
    spans = json.loads((pytester.path / "gpumem-baselines.json").read_text())["environments"]
    recorded = next(iter(spans.values()))["tests"]["test_model.py::test_step"]["spans"]
    assert set(recorded) == {"call"} and "max_microbatch" not in recorded["call"]
    run(pytester, "--gpumem-strict").assert_outcomes(passed=1)
