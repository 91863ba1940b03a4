"""What the plugin keeps of a finished test: its judged record as text, nothing the collector traverses.

Every object kept alive is traversed again by every later full collection, and the plugin
collects garbage twice a test (the clean-state protocol): whatever a test leaves behind makes
every later test slower, so a suite's cost would grow with the square of its length. The
measuring machinery of a test (its run, recorder, engine hooks) is dropped when the test ends;
the record the report carries and the judged record are kept as JSON text.
"""

from __future__ import annotations

import pytest

from conftest import run_fresh

SUITE = """
import pytest, torch


@pytest.mark.parametrize("index", range(20))
@pytest.mark.gpumem(peak="1GiB")
def test_step(index):
    model = torch.nn.Linear(16, 16)
    model(torch.randn(4, 16)).sum().backward()
"""

CONFTEST = """
import gc


def pytest_sessionfinish(session):
    gc.collect()
    kinds = {"TestRun": 0, "Recorder": 0, "TestRecord": 0}
    for obj in gc.get_objects():
        name = type(obj).__name__
        if name in kinds and type(obj).__module__.startswith("pytest_gpumem"):
            kinds[name] += 1
    carried = sum(not isinstance(getattr(report, "gpumem", ""), str) for report in
        session.config.pluginmanager.get_plugin("terminalreporter").stats.get("passed", []))
    print("KEPT", kinds["TestRun"], kinds["Recorder"], kinds["TestRecord"], carried)
"""


@pytest.mark.slow
def test_a_finished_test_keeps_nothing_the_collector_traverses(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(SUITE)
    result = run_fresh(pytester, "-s", "-p", "no:randomly")
    result.assert_outcomes(passed=20)
    # no run, no recorder, no record object: the judged records and the records the reports
    # carried are text
    result.stdout.fnmatch_lines(["*KEPT 0 0 0 0"])
