"""The run's manager: one object that owns the run's state and implements the hooks that
measure (where a test runs) and judge (in the process that owns the run, the one place a
test's outcome changes). The collection book and the end of the run are its mixins."""

from __future__ import annotations

import shutil
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.baselines import BaselineFileError
from pytest_gpumem.data.metrics import METRICS
from pytest_gpumem.judge.limits import SpecError
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.plugin.collection import SPEC_ERROR_KEY, SPEC_KEY, MarkerCheck, gpumem_marks, is_worker, marker_spec
from pytest_gpumem.plugin.ending import RunEnd, append_section
from pytest_gpumem.plugin.gate import Gate
from pytest_gpumem.plugin.measuring import MARKS_KEY, RECORD_KEY, RUN_KEY, Measuring
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.torchrun import launch, rename
from pytest_gpumem.report.details import failure_text

if TYPE_CHECKING:
    from pytest_gpumem.plugin.runner import Engines, Freezer

__all__ = ["RECORD_KEY", "RUN_KEY", "GpumemManager"]


def _terminal_width(config: pytest.Config) -> int:
    """pytest's terminal width; the environment's (``COLUMNS``, else 80) where there is none (xdist workers)."""
    writer = getattr(config.pluginmanager.get_plugin("terminalreporter"), "_tw", None)
    return int(writer.fullwidth) if writer is not None else shutil.get_terminal_size().columns


class GpumemManager(MarkerCheck, Measuring, RunEnd):
    """Owns the run's state: settings, engines, the gate, and the collected node ids."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.gate = Gate(self.settings.gate)
        self.worker = is_worker(config)
        self._engines: Engines | None = None
        self._freezer: Freezer | None = None
        self._environments: dict[str, dict[str, Any]] = {}
        #: the record a report carries, handed to the judge in this process as the object it
        #: was made from (the report's JSON text, decoded, is the same record): held from the
        #: report's making to its logging, never longer
        self._handoff: tuple[str, TestRecord] | None = None
        self._start_book()
        self._error: str | None = None
        self._problems: list[str] = []
        self._escalated = False
        try:
            self._launch = launch()  # pytest started by torchrun: this process is one rank
        except ValueError as exc:
            raise pytest.UsageError(f"gpumem: {exc}") from None

    # -- collection: the final word on which tests are measured ------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """The final word on which tests are measured: markers a conftest added after collection are
        validated here (a bad one errors its test), and a test whose markers were removed is not measured."""
        for item in items:  # the markers as they are now: a conftest may have added or removed some
            item.stash[MARKS_KEY] = gpumem_marks(item)
            try:
                spec = marker_spec(item)
            except SpecError as exc:
                item.stash[SPEC_ERROR_KEY] = f"invalid gpumem marker on {item.nodeid}: {exc}"
                continue
            if spec is not None:
                item.stash[SPEC_KEY] = spec
            elif SPEC_KEY in item.stash:
                del item.stash[SPEC_KEY]
        if not self.worker and any(SPEC_KEY in item.stash for item in items):
            try:
                self.gate.store  # noqa: B018 - read the baseline file now: a bad one stops the run before it starts
            except BaselineFileError as exc:
                raise pytest.UsageError(f"gpumem baselines: {exc}") from None

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Under pytest-xdist the controller collects nothing, so it cannot tell, as a serial run
        does, whether a test is measured before the workers start: it reads an existing
        baseline file now, so that one it cannot read stops the run before any test, as serially."""
        if self.worker or self.config.pluginmanager.getplugin("dsession") is None:
            return
        if self.settings.gate.baselines.exists():
            try:
                self.gate.store  # noqa: B018
            except BaselineFileError as exc:
                raise pytest.UsageError(f"gpumem baselines: {exc}") from None

    # -- running (in the process that runs the test) ------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        if any(SPEC_KEY in item.stash for item in session.items):
            from pytest_gpumem.plugin.runner import Engines, Freezer

            self._freezer = Freezer(self.config)
            self._freezer.start()
            self._engines = Engines(cuda_rounding=self.settings.cuda_rounding, freezer=self._freezer)
        try:
            return (yield)
        finally:
            if self._freezer is not None:
                self._freezer.stop()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if report.when == "teardown":  # done with this test: what it kept would cost every later collection
            if RUN_KEY in item.stash:
                del item.stash[RUN_KEY]
            if RECORD_KEY in item.stash:
                del item.stash[RECORD_KEY]
            return report
        record = item.stash.get(RECORD_KEY, None)
        if report.when != "call" or record is None:
            return report
        if self._launch is not None:  # each rank's figures are its own spans
            rename(record, self._launch)
        for measurement in record.measurements:
            prefix = "gpumem" if measurement.name == "call" else f"gpumem[{measurement.name}]"
            for metric in METRICS:
                value = measurement.figure(metric)
                if value is not None:
                    item.user_properties.append((f"{prefix}.{metric}", value))
        # travels to the xdist controller; as JSON text, which the garbage collector never traverses
        # (the reports stay alive to the end of the run)
        report.gpumem = text = record.to_json()  # type: ignore[attr-defined]
        if not self.worker:
            self._handoff = (text, record)
        return report

    # -- judging (in the process that owns the run) -------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return
        if report.when == "teardown" and report.failed:  # a test that failed in any phase records no baseline
            if report.nodeid in self.gate.records:
                with self.gate.records.edit(report.nodeid) as judged:
                    judged.passed = False
            return
        data = getattr(report, "gpumem", None)
        handoff, self._handoff = self._handoff, None
        if data is None or report.when != "call":
            return
        record = handoff[1] if handoff is not None and handoff[0] is data else TestRecord.from_json(data)
        if report.failed and record.passed:
            record.passed = False  # failed for a reason of pytest's (XPASS(strict)) or another plugin's
        try:
            self.gate.judge(record)
        except BaselineFileError as exc:  # under xdist the controller reads the file at the first record
            self._error = f"gpumem baselines: {exc}"
            record.errors.append(self._error)
            self.gate.records.put(record)  # with the error
        if report.passed and record.failed:  # the one place a test's outcome changes
            report.outcome = "failed"
            width, verbosity = _terminal_width(self.config), int(self.config.option.verbose)
            report.longrepr = failure_text(record, reports=record.reports, width=width, verbosity=verbosity)
        elif report.failed and record.reports:
            append_section(report, "gpumem", "\n\n".join(record.reports))
        self._artifacts(report, record)
