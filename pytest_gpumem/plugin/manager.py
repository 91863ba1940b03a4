"""The run's manager: one object that owns the run's state and implements the hooks that
measure (where a test runs) and judge (in the process that owns the run, the one place a
test's outcome changes). The collection book and the end of the run are its mixins."""

from __future__ import annotations

import shutil
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.baselines import BaselineFileError, Environment
from pytest_gpumem.data.metrics import METRICS
from pytest_gpumem.judge.limits import SpecError
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.measurement.observe import choose_observe, observe_conflict
from pytest_gpumem.plugin.collection import (
    SPEC_ERROR_KEY,
    SPEC_KEY,
    MarkerCheck,
    is_worker,
    marker_spec,
    worker_index,
)
from pytest_gpumem.plugin.ending import RunEnd, append_section
from pytest_gpumem.plugin.gate import Gate
from pytest_gpumem.plugin.marker import GpumemSpec
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.sites import run_options, second_run
from pytest_gpumem.plugin.torchrun import launch, rename
from pytest_gpumem.report.details import failure_text

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines import Engine
    from pytest_gpumem.plugin.runner import Engines, Freezer, TestRun

__all__ = ["RECORD_KEY", "RUN_KEY", "GpumemManager"]

RUN_KEY: pytest.StashKey[TestRun] = pytest.StashKey()
RECORD_KEY = pytest.StashKey[TestRecord]()


def _terminal_width(config: pytest.Config) -> int:
    """pytest's terminal width; the environment's (``COLUMNS``, else 80) where there is none (xdist workers)."""
    writer = getattr(config.pluginmanager.get_plugin("terminalreporter"), "_tw", None)
    return int(writer.fullwidth) if writer is not None else shutil.get_terminal_size().columns


class GpumemManager(MarkerCheck, RunEnd):
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

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(SPEC_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)
        spec = item.stash.get(SPEC_KEY, None)
        if spec is None:
            return
        from pytest_gpumem.plugin.runner import DeviceUnavailable, Engines, TestRun, choose_device

        settings = self.settings
        unavailable: DeviceUnavailable | None = None
        try:
            device = choose_device(
                spec.device or settings.device, require_gpu=settings.require_gpu, worker=self._gpu_index()
            )
        except DeviceUnavailable as exc:
            unavailable = exc  # failed or skipped outside the handler: pytest would print it twice (chained)
        if unavailable is not None:
            if unavailable.required:
                pytest.fail(f"{item.nodeid}: {unavailable.reason}", pytrace=False)
            pytest.skip(unavailable.reason)
        if self._engines is None:  # the test runs outside the run loop (pytester's inline runs)
            self._engines = Engines(cuda_rounding=settings.cuda_rounding)
        breakdown = spec.breakdown if spec.breakdown is not None else settings.breakdown
        predict = spec.predict or settings.predict
        observe = self._observe(item, spec, predict)
        engine = self._engines.get(device, breakdown=breakdown, observe=observe, predict=predict)
        # the run's --gpumem-fake applies to the predicted tests; a marker's fake=True needs a prediction
        fake = (spec.fake if spec.fake is not None else settings.fake and predict is not None) and device.type == "cpu"
        if fake and predict is None:
            pytest.fail(
                f"{item.nodeid}: fake=True needs a prediction: predict= on the marker or --gpumem-predict",
                pytrace=False,
            )
        options = run_options(settings, spec)
        item.stash[RUN_KEY] = TestRun(
            item.nodeid,
            spec,
            engine,
            environment=self._environment(engine),
            options=options,
            fake=fake,
        )

    def _gpu_index(self) -> int | None:
        """Which GPU this process measures on when several are visible: the xdist worker's, else
        torchrun's local rank."""
        worker = worker_index()
        if worker is None and self._launch is not None:
            return self._launch.local_rank
        return worker

    def _observe(self, item: pytest.Item, spec: GpumemSpec, predict: str | None) -> str:
        """How the CPU engine observes this test (:func:`~pytest_gpumem.measurement.observe.choose_observe`):
        the run's ``--gpumem-observe=allocations`` yields to a prediction or an emulated device
        limit; the test's own ``observe="allocations"`` under one of them is an error."""
        settings = self.settings
        run_limit = None if settings.device_limit is None else f"--gpumem-device-limit={settings.device_limit}"
        limit = None if spec.device_limit is not None else run_limit  # the marker's own was checked at collection
        conflict = observe_conflict(spec.observe, predict=predict, limit=limit)
        if conflict is not None:
            pytest.fail(f"{item.nodeid}: {conflict}", pytrace=False)
        needs_limit = spec.device_limit is not None or settings.device_limit is not None
        return choose_observe(spec.observe, default=settings.observe, predict=predict, limit=needs_limit)

    def _environment(self, engine: Engine) -> dict[str, Any]:
        key = f"{engine.name}:{engine.device}:{engine.cuda_rounding}:{engine.predicts}"
        if key not in self._environments:
            detected = Environment.detect(engine.name, engine.device, engine.cuda_rounding, predict=engine.predicts)
            problem = None
            try:
                adjusted = self.config.hook.pytest_gpumem_environment(config=self.config, environment=detected)
                if adjusted is not None and not isinstance(adjusted, Environment):
                    raise TypeError(f"expected an Environment or None, got {type(adjusted).__name__}")
                self._environments[key] = (adjusted or detected).to_dict()
            except (TypeError, ValueError) as exc:
                problem = f"pytest_gpumem_environment hook: {exc}"
            if problem is not None:
                pytest.fail(problem, pytrace=False)
        return self._environments[key]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        run = item.stash.get(RUN_KEY, None)
        if run is None:
            return (yield)
        from pytest_gpumem.plugin.returnwatch import code_of

        run.start(code_of(getattr(item, "obj", None)))
        try:
            result = yield
        except BaseException as exc:
            item.stash[RECORD_KEY] = second_run(item, run, run.finish(exc), exc, self.settings, self.gate)
            raise
        item.stash[RECORD_KEY] = second_run(item, run, run.finish(None), None, self.settings, self.gate)
        return result

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
            judged = self.gate.records.get(report.nodeid)
            if judged is not None:
                judged.passed = False
                self.gate.records[report.nodeid] = judged  # the store keeps copies
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
            self.gate.records[record.nodeid] = record  # the store keeps a copy: with the error
        if report.passed and record.failed:  # the one place a test's outcome changes
            report.outcome = "failed"
            width, verbosity = _terminal_width(self.config), int(self.config.option.verbose)
            report.longrepr = failure_text(record, reports=record.reports, width=width, verbosity=verbosity)
        elif report.failed and record.reports:
            append_section(report, "gpumem", "\n\n".join(record.reports))
        self._artifacts(report, record)
