"""Sites in a run: which runs record them, and the second run of a test that failed on memory, through pytest's
own protocol (docs/sites.md)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pytest
from _pytest.outcomes import Exit
from _pytest.runner import call_and_report, runtestprotocol

from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.judge.record import TestRecord

if TYPE_CHECKING:
    from pytest_gpumem.plugin.options import Settings
    from pytest_gpumem.plugin.run_engines import Freezer
    from pytest_gpumem.plugin.runner import TestRun
    from pytest_gpumem.plugin.session import BaselineSession

__all__ = [
    "SECOND_RUN_KEY",
    "SecondRun",
    "no_second_run",
    "no_sites_note",
    "run_test",
    "wants_sites",
    "with_sites",
    "xfail_of",
]


def xfail_of(item: pytest.Item) -> Any:
    """The ``xfail`` mark that applies to ``item`` as pytest's skipping plugin reads it, or None."""
    if getattr(item.config.option, "runxfail", False):
        return None
    try:
        from _pytest.skipping import evaluate_xfail_marks, xfailed_key
    except ImportError:  # pragma: no cover - pytest moved it: no xfail is seen, every run works
        return None
    xfailed = item.stash.get(xfailed_key, None)
    return evaluate_xfail_marks(item) if xfailed is None else xfailed


def _expected(item: pytest.Item, exc: BaseException) -> bool:
    """Whether pytest reports ``exc`` as an expected failure (whose report shows no sites)."""
    xfailed = xfail_of(item)
    if xfailed is None:
        return False
    raises = xfailed.raises
    if raises is None:
        return True
    if isinstance(raises, (type, tuple)):
        return isinstance(exc, raises)
    matches = getattr(raises, "matches", None)  # pytest.RaisesExc (pytest 8.4 and later)
    return bool(matches(exc)) if callable(matches) else False


def wants_sites(
    item: pytest.Item,
    run: TestRun,
    record: TestRecord,
    exc: BaseException | None,
    session: BaselineSession,
) -> bool:
    """Whether the test's first run failed on memory without recording sites: its sites need a second run."""
    from pytest_gpumem.diagnose.oom import is_oom

    if run.plan.sites != "rerun" or run.plan.options.sites is not None or run.engine.sites is None:
        return False
    if exc is not None:
        return is_oom(exc) and not _expected(item, exc)
    return session.fails(record)


#: how launchers (torchrun, mpirun, srun) tell a process how many ranks run a test together
_WORLD_SIZES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def _ranks() -> int:
    for name in _WORLD_SIZES:
        try:
            count = int(os.environ.get(name, ""))
        except ValueError:
            continue
        if count > 1:
            return count
    return 1


def no_second_run(item: pytest.Item, record: TestRecord, seconds: float, settings: Settings) -> str | None:
    """Why the test that wants sites cannot run again safely, or None when it can."""
    config = item.config
    ranks = _ranks()
    if ranks > 1:
        return f"it runs on {ranks} ranks (a launcher started them), which would not run it again together"
    if record.ranks_measured:
        return "the test ran ranks (gpumem.distributed), which would not run it again together"
    if seconds > settings.sites_rerun_limit:
        return f"its call took {seconds:.1f} s, over --gpumem-sites-rerun-limit={settings.sites_rerun_limit:g} s"
    timeout = _timeout(item)
    if timeout is not None:
        return f"a per-test timeout is set ({timeout})"
    if config.getoption("usepdb", False) or config.getoption("trace", False):
        return "pytest runs under a debugger (--pdb, --trace)"
    for name in ("rerunfailures", "flaky"):
        if config.pluginmanager.hasplugin(name):
            return f"the {name} plugin runs tests again itself"
    if item.session.shouldfail or item.session.shouldstop:
        return "the session is stopping"
    return None


def _timeout(item: pytest.Item) -> str | None:
    config = item.config
    if not config.pluginmanager.hasplugin("timeout"):
        return None
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        return None if not value else f"@pytest.mark.timeout({value})"
    for getter in (lambda: config.getoption("timeout", None), lambda: config.getini("timeout")):
        try:
            value = getter()
            if value not in (None, "") and float(value) > 0:
                return f"--timeout={value}"
        except (KeyError, TypeError, ValueError):
            continue
    return None


def no_sites_note(reason: str) -> str:
    """The failure's note where the second run for sites was not run."""
    return (
        f"sites: not recorded: no second run, since {reason}. To name the lines, run this test with "
        '--gpumem-sites=always (or sites="always" on its marker): its only run then records them.'
    )


def with_sites(first: TestRecord, second: TestRecord | None, outcome: str | None) -> TestRecord:
    """``first`` with the sites of ``second``, span by span; ``outcome``: what the second run did if it did not pass."""
    seconds = {m.name: m for m in second.measurements} if second is not None else {}
    measurements = []
    for measurement in first.measurements:
        other = seconds.get(measurement.name)
        if other is None or other.sites is None:
            measurements.append(measurement)
        else:
            note = f"the second run {outcome}" if outcome is not None else _differs(measurement, other)
            measurements.append(replace(measurement, sites=replace(other.sites, second_run=True, note=note)))
    reports = first.reports  # the leak and out-of-memory reports stay the first run's
    if second is None or not any(m.sites is not None for m in second.measurements):
        reports = [*reports, f"sites: the second run recorded none ({outcome or 'it measured nothing'})"]
    return replace(first, measurements=measurements, reports=reports)


def _differs(first: Measurement, second: Measurement) -> str:
    """How the second run's figures differ from the first's ("" when its costs are the same)."""
    differ = [
        f"{metric} cost {second.cost(metric)} B, the first run's {first.cost(metric)} B"
        for metric in ("peak", "allocated")
        if second.cost(metric) != first.cost(metric)
    ]
    if not differ:
        return ""
    return "the second run's figures differ (" + "; ".join(differ) + "): the figures shown are the first run's"


#: a test's second run for sites: the first run's record, while it waits for them
SECOND_RUN_KEY = pytest.StashKey["SecondRun"]()


@dataclass
class SecondRun:
    """A test's second run for sites: the first run's record; the second run's, once it ran."""

    first: TestRecord
    running: bool = False
    record: TestRecord | None = None


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
    if freezer is not None:
        freezer.refreeze()  # what the first run's teardown dropped is collected, as between tests
    second.running = True
    try:
        with warnings.catch_warnings(record=True):
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
    except Exit as exc:  # the session goes on: the test's own fixtures are torn down as pytest would (no report)
        call_and_report(item, "teardown", False, nextitem=nextitem)
        if hasattr(item, "_request"):
            item._request = False  # as runtestprotocol leaves a test that ran
            item.funcargs = None  # type: ignore[attr-defined]
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
