"""The run's manager: owns the run's parts, and takes a test's record from its report to the judge."""

from __future__ import annotations

import shutil
from collections.abc import Generator
from dataclasses import replace

import pytest

from pytest_gpumem.baselines import BaselineFileError
from pytest_gpumem.data.metrics import METRICS
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.plugin.collection import (
    SPEC_KEY,
    CollectionBook,
    MarkerCheck,
    gpumem_marks,
    is_worker,
    settle_spec,
)
from pytest_gpumem.plugin.ending import RunEnd, append_section
from pytest_gpumem.plugin.measuring import MARKS_KEY, RECORD_KEY, RUN_KEY, Measuring
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.session import BaselineSession, file_problem
from pytest_gpumem.plugin.site_runs import fails_on_memory, xfail_of
from pytest_gpumem.plugin.torchrun import launch, rename
from pytest_gpumem.report.details import error_section, failure_text

__all__ = ["RECORD_KEY", "RUN_KEY", "GpumemManager"]


def _terminal_width(config: pytest.Config) -> int:
    writer = getattr(config.pluginmanager.get_plugin("terminalreporter"), "_tw", None)
    return int(writer.fullwidth) if writer is not None else shutil.get_terminal_size().columns


class GpumemManager:
    """Owns the run: its settings, its parts, and the record on its way from its report to the judge."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.worker = is_worker(config)  #: an xdist worker: it measures, its controller judges and writes
        try:
            self.launch = launch()  #: pytest started by torchrun: this process is one rank
        except ValueError as exc:
            raise pytest.UsageError(f"gpumem: {exc}") from None
        self.markers = MarkerCheck()
        self.book = CollectionBook(config)
        self.baselines = BaselineSession(settings.baselines)
        self.measuring = Measuring(config, settings, self.baselines, self.launch)
        self.ending = RunEnd(config, settings, self.baselines, self.book, worker=self.worker, launch=self.launch)
        self._handoff: tuple[str, TestRecord] | None = None  # the call report's record, until it is logged

    def register(self, pluginmanager: pytest.PytestPluginManager) -> None:
        """Register this manager and each of its parts with pytest."""
        pluginmanager.register(self, "gpumem-manager")
        for name, part in (
            ("markers", self.markers),
            ("book", self.book),
            ("measuring", self.measuring),
            ("ending", self.ending),
        ):
            pluginmanager.register(part, f"gpumem-{name}")

    # -- collection: the final word on which tests are measured ------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """The final word on which tests are measured: the markers as they are after every conftest's changes."""
        for item in items:
            item.stash[MARKS_KEY] = marks = gpumem_marks(item)
            settle_spec(item, marks)
        if not self.worker and any(SPEC_KEY in item.stash for item in items):
            try:
                self.baselines.store  # noqa: B018 - a bad baseline file stops the run before it starts
            except BaselineFileError as exc:
                raise pytest.UsageError(file_problem(exc)) from None

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """The xdist controller collects nothing: it reads an existing baseline file now, so a bad one stops the run."""
        if self.worker or self.config.pluginmanager.getplugin("dsession") is None:
            return
        if self.settings.baselines.path.exists():
            try:
                self.baselines.store  # noqa: B018
            except BaselineFileError as exc:
                raise pytest.UsageError(file_problem(exc)) from None

    # -- the record, on the report (in the process that runs the test) -------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if report.when == "teardown":  # what the test kept would cost every later collection
            if RUN_KEY in item.stash:
                del item.stash[RUN_KEY]
            if RECORD_KEY in item.stash:
                del item.stash[RECORD_KEY]
            return report
        record = item.stash.get(RECORD_KEY, None)
        if report.when != "call" or record is None:
            return report
        if self.launch is not None:  # each rank's figures are its own spans
            record = rename(record, self.launch)
        for measurement in record.measurements:
            prefix = "gpumem" if measurement.name == "call" else f"gpumem[{measurement.name}]"
            for metric in METRICS:
                value = measurement.figure(metric)
                if value is not None:
                    item.user_properties.append((f"{prefix}.{metric}", value))
        reason = _xfail_reason(item) if call.excinfo is None else None
        if reason is not None:  # a memory failure of this test is an expected failure
            report.gpumem_xfail = reason  # type: ignore[attr-defined]
        # as JSON text, which the garbage collector never traverses (reports live to the end of the run)
        report.gpumem = text = record.to_json()  # type: ignore[attr-defined]
        if not self.worker:
            self._handoff = (text, record)
        return report

    # -- judging (in the process that owns the run) -------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return
        if report.when == "teardown":  # the judged figures, for pytest's JUnit XML
            report.user_properties.extend(self.ending.properties.pop(report.nodeid, ()))
        if report.when == "teardown" and report.failed:  # a test that failed in any phase records no baseline
            if report.nodeid in self.baselines.records:
                self.baselines.records.failed_in_pytest(report.nodeid)
            return
        data = getattr(report, "gpumem", None)
        if data is None or report.when != "call":
            return
        # the record itself where it was made in this process
        handoff, self._handoff = self._handoff, None
        record = handoff[1] if handoff is not None and handoff[0] is data else TestRecord.from_json(data)
        xfail = getattr(report, "gpumem_xfail", None)
        # an xfail test whose code passed and whose memory fails is an expected failure
        expected = xfail is not None and record.passed and fails_on_memory(self.baselines, record)
        if report.failed and record.passed:
            record = replace(record, passed=False)  # failed for pytest's reason (XPASS(strict)) or another plugin's
        record, problem = self.baselines.judged(record)
        if problem is not None:  # under xdist the controller reads the file at the first record
            self.ending.error = file_problem(problem)
        if expected:  # reported as pytest reports an expected failure
            report.outcome = "skipped"
            report.wasxfail = str(xfail)
            width, verbosity = _terminal_width(self.config), int(self.config.option.verbose)
            report.longrepr = failure_text(record, reports=record.reports, width=width, verbosity=verbosity)
        elif report.passed and record.failed:  # the one place a test's outcome changes
            report.outcome = "failed"
            width, verbosity = _terminal_width(self.config), int(self.config.option.verbose)
            report.longrepr = failure_text(record, reports=record.reports, width=width, verbosity=verbosity)
        elif report.failed and record.reports:
            width, verbosity = _terminal_width(self.config), int(self.config.option.verbose)
            text = error_section(record, reports=record.reports, width=width, verbosity=verbosity)
            append_section(report, "gpumem", text)
        self.ending.judged(report, record)
        self.ending.artifacts(report, record)


def _xfail_reason(item: pytest.Item) -> str | None:
    """The reason of the ``xfail`` mark that applies to ``item`` without ``raises``, or None."""
    xfailed = xfail_of(item)
    return None if xfailed is None or xfailed.raises is not None else str(xfailed.reason)
