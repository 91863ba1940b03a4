"""The second run, with sites on, of a test that failed on memory, through pytest's own protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.plugin.site_runs import with_sites

if TYPE_CHECKING:
    from pytest_gpumem.plugin.engines import Freezer

__all__ = ["SECOND_RUN_KEY", "SecondRun", "run_test"]

#: a test's second run for sites: the first run's record, while it waits for them
SECOND_RUN_KEY = pytest.StashKey["SecondRun"]()


class SecondRun:
    """A test's second run for sites: the first run's record; the second run's, once it ran."""

    def __init__(self, first: TestRecord) -> None:
        self.first = first
        self.running = False
        self.record: TestRecord | None = None


class _NextItem:
    """What the first run's teardown is told comes next: the test's parents before a second run."""

    def __init__(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        self._item = item
        self._nextitem = nextitem

    def listchain(self) -> list[Any]:
        if SECOND_RUN_KEY in self._item.stash:
            return self._item.listchain()[:-1]
        return [] if self._nextitem is None else self._nextitem.listchain()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nextitem, name)


def run_test(item: pytest.Item, nextitem: pytest.Item | None, freezer: Freezer | None) -> bool:
    """Run a measured test, its reports held back until a second run (if any) has attached its sites."""
    from _pytest.runner import runtestprotocol

    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=_NextItem(item, nextitem), log=False)  # type: ignore[arg-type]
    second = item.stash.get(SECOND_RUN_KEY, None)
    if second is not None:
        try:
            outcome = _second_run(item, nextitem, second, freezer)
        finally:
            del item.stash[SECOND_RUN_KEY]
        record = with_sites(second.first, second.record, outcome)
        for report in reports:
            if report.when == "call" and getattr(report, "gpumem", None) is not None:
                report.gpumem = record.to_json()  # type: ignore[attr-defined]
    for report in reports:
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _second_run(
    item: pytest.Item, nextitem: pytest.Item | None, second: SecondRun, freezer: Freezer | None
) -> str | None:
    """Run the test again with sites on, its reports and warnings dropped; what it did when it did not pass."""
    import warnings

    from _pytest.outcomes import Exit
    from _pytest.runner import runtestprotocol

    if freezer is not None:
        freezer.refreeze()  # what the first run's teardown dropped is collected, as between tests
    second.running = True
    try:
        with warnings.catch_warnings(record=True):
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
    except Exit as exc:  # the session goes on: the test's own fixtures are torn down as pytest would
        _teardown(item, nextitem)
        return f"called pytest.exit ({exc.msg}), which was ignored"
    except Exception as exc:  # a hook's error: the first run's reports stand
        return f"raised {type(exc).__name__}: {exc}"
    finally:
        second.running = False
    for report in reports:
        if not report.passed:
            return f"{'was skipped' if report.skipped else 'failed'} in its {report.when}: {_short(report)}"
    return None


def _short(report: pytest.TestReport) -> str:
    """The one line that says why ``report`` did not pass."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0] if crash.message else "(no message)"
    lines = str(longrepr).strip().splitlines()
    return lines[-1] if lines else "(no message)"


def _teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Tear down what the test set up, its report dropped, after its second run stopped early."""
    from _pytest.runner import call_and_report

    call_and_report(item, "teardown", False, nextitem=nextitem)
    if hasattr(item, "_request"):
        item._request = False  # as runtestprotocol leaves a test that ran
        item.funcargs = None  # type: ignore[attr-defined]
