"""The pytest layer: options, the ``gpumem`` marker and fixture, and hooks that wire the
library together. Each hook is a few lines over an object that works without pytest:

* :class:`~pytest_gpumem.plugin.runner.TestRun` measures one test where it runs and returns
  its :class:`~pytest_gpumem.judge.record.TestRecord`, attached to the call report
  (``report.gpumem``, so it travels to the xdist controller);
* :class:`~pytest_gpumem.plugin.gate.Gate`, in the process that owns the run, compares
  each record with the baseline file, and at the end records and writes it once,
  with the reports;
* :mod:`pytest_gpumem.report.text` renders the terminal summary.

Importing this module does not import torch, and a run without a measured test
never imports it nor reads the baseline file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.baselines import BaselineFileError, Environment
from pytest_gpumem.data.metrics import METRICS
from pytest_gpumem.judge.limits import SpecError
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.plugin import hookspecs
from pytest_gpumem.plugin.gate import Gate, write_artifacts
from pytest_gpumem.plugin.marker import GpumemSpec, marker_help, parse_marker
from pytest_gpumem.plugin.options import OPTIONS, OptionError, Settings
from pytest_gpumem.plugin.torchrun import launch, rename
from pytest_gpumem.report.text import failure_text, terminal_summary

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.measurement.engines import Engine
    from pytest_gpumem.plugin.fixture import GpuMem, UnmeasuredGpuMem
    from pytest_gpumem.plugin.runner import Engines, Freezer, TestRun

SPEC_KEY = pytest.StashKey[GpumemSpec]()
SPEC_ERROR_KEY = pytest.StashKey[str]()
RUN_KEY: pytest.StashKey[TestRun] = pytest.StashKey()
RECORD_KEY = pytest.StashKey[TestRecord]()
#: the device of a test run while the plugin is disabled (``--gpumem-disable``)
DISABLED_KEY: pytest.StashKey[torch.device] = pytest.StashKey()


# -- options, marker, fixture, hooks --------------------------------------------------


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "GPU memory guards (pytest-gpumem)")
    for option in OPTIONS:
        help = option.help.replace("%", "%%")  # argparse %-formats help texts
        if option.flag:
            group.addoption(option.flag_name, dest=option.dest, action="store_true", default=None, help=help)
            parser.addini(option.dest, f"default for {option.flag_name}", type="bool", default=False)
        else:
            group.addoption(option.flag_name, dest=option.dest, default=None, metavar=option.metavar, help=help)
            parser.addini(option.dest, f"default for {option.flag_name}", default=option.default)


def _settings(config: pytest.Config) -> Settings:
    """The run's settings: each option from the command line, else its ini value (flags too)."""

    def value(name: str) -> Any:
        given = config.getoption(name)
        return given if given is not None else config.getini(name)

    cache = getattr(config, "cache", None)
    try:
        return Settings.read(value, config.rootpath, None if cache is None else lambda: cache.mkdir("gpumem-artifacts"))
    except OptionError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", marker_help())
    settings = _settings(config)
    manager = DisabledManager(settings) if settings.disable else GpumemManager(config, settings)
    config.pluginmanager.register(manager, "gpumem-manager")


@pytest.fixture
def gpumem(request: pytest.FixtureRequest) -> GpuMem | UnmeasuredGpuMem:
    """Measure memory in a test: ``gpumem.device``, ``gpumem.measure(name)``, ``gpumem.track(...)``,
    ``gpumem.train_step(...)``, ``gpumem.budget()``. See pytest-gpumem's README."""
    from pytest_gpumem.plugin.fixture import GpuMem, UnmeasuredGpuMem

    disabled = request.node.stash.get(DISABLED_KEY, None)
    if disabled is not None:
        from pytest_gpumem.plugin.fixture import UnmeasuredGpuMem

        return UnmeasuredGpuMem(disabled, request.node.nodeid)
    run = request.node.stash.get(RUN_KEY, None)
    if run is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the gpumem fixture works only in test functions")
    return GpuMem(run.recorder, request.node.nodeid, run.spec.limits)


def _terminal_width(config: pytest.Config) -> int:
    """pytest's terminal width; the environment's (``COLUMNS``, else 80) where there is none (xdist workers)."""
    writer = getattr(config.pluginmanager.get_plugin("terminalreporter"), "_tw", None)
    return int(writer.fullwidth) if writer is not None else shutil.get_terminal_size().columns


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _worker_index() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def _append(report: pytest.TestReport, title: str, text: str) -> None:
    """Add ``text`` to a failed report's message, keeping pytest's own rendering of its error."""
    addsection = getattr(report.longrepr, "addsection", None)
    if addsection is not None:
        addsection(title, text)
    else:
        report.longrepr = f"{report.longrepr}\n\n{text}"


def _marker_spec(item: pytest.Item) -> GpumemSpec | None:
    """The item's validated marker (None when it is not measured); raises :class:`SpecError`."""
    markers = [(mark.args, mark.kwargs) for mark in item.iter_markers("gpumem")]
    if not markers and "gpumem" not in getattr(item, "fixturenames", ()):
        return None
    return parse_marker(markers)


def _validate_markers(report: pytest.CollectReport) -> None:
    """Validate the markers of the items a collector made: a bad one is a collection error
    naming the test and the value, as pytest's own markers give (also under xdist)."""
    if not report.passed:
        return
    errors = []
    for item in report.result:
        if not isinstance(item, pytest.Item):
            continue
        try:
            spec = _marker_spec(item)
        except SpecError as exc:
            errors.append(f"invalid gpumem marker on {item.nodeid}: {exc}")
            continue
        if spec is not None:
            item.stash[SPEC_KEY] = spec
    if errors:
        report.outcome = "failed"
        report.longrepr = "\n".join(errors)
        report.result = []


class MarkerCheck:
    """Validates the markers of every collected item, enabled or not: a bad one is an error."""

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        report = yield
        _validate_markers(report)
        return report


class DisabledManager(MarkerCheck):
    """The plugin switched off (``--gpumem-disable``): markers are still validated (a bad one
    is still an error) and the fixture still works, but nothing is measured, judged or written."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def pytest_report_header(self) -> str:
        return "gpumem: disabled (--gpumem-disable): nothing is measured, judged or written"

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:  # markers a conftest added after collection
            try:
                _marker_spec(item)
            except SpecError as exc:
                item.stash[SPEC_ERROR_KEY] = f"invalid gpumem marker on {item.nodeid}: {exc}"

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(SPEC_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)
        spec = _marker_spec(item)
        if spec is None:
            return
        from pytest_gpumem.plugin.runner import DeviceUnavailable, choose_device

        unavailable: DeviceUnavailable | None = None
        try:  # the test still runs on the device it asks for, and is skipped where there is none
            item.stash[DISABLED_KEY] = choose_device(spec.device or self.settings.device, worker=_worker_index())
        except DeviceUnavailable as exc:
            unavailable = exc
        if unavailable is not None:
            pytest.skip(unavailable.reason)


class GpumemManager(MarkerCheck):
    """Owns the run's state: settings, engines, the gate, and the collected node ids."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.gate = Gate(self.settings.gate)
        self.worker = _is_worker(config)
        self._engines: Engines | None = None
        self._freezer: Freezer | None = None
        self._environments: dict[str, dict[str, Any]] = {}
        self._collected: set[str] = set()
        self._collection_complete = True
        self._skipped: set[str] = set()  # collectors skipped as they were collected: their tests are never stale
        self._xdist = False  # a controller that heard from xdist workers
        self._error: str | None = None
        try:
            self._launch = launch()  # pytest started by torchrun: this process is one rank
        except ValueError as exc:
            raise pytest.UsageError(f"gpumem: {exc}") from None

    # -- collection: markers are validated as their module is collected (MarkerCheck) ------

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        self._collected.add(item.nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_ignore_collect(self, collection_path: Path) -> Generator[None, bool | None, bool | None]:
        """A path left out of the collection (``--ignore``, a conftest's ``collect_ignore``, where a
        library is missing) still exists: its tests are never stale, as a skipped module's are."""
        ignored = yield
        if ignored:
            try:
                relative = collection_path.relative_to(self.config.rootpath)
            except ValueError:
                return ignored
            self._skipped.add(relative.as_posix())
        return ignored

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._collection_complete = False
        elif report.skipped:  # a module skipped at import (pytest.importorskip): its tests still exist
            self._skipped.add(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """The final word on which tests are measured: markers a conftest added after collection are
        validated here (a bad one errors its test), and a test whose markers were removed is not measured."""
        for item in items:  # the markers as they are now: a conftest may have added or removed some
            try:
                spec = _marker_spec(item)
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

            self._freezer = Freezer()
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
        from pytest_gpumem.plugin.runner import DeviceUnavailable, Engines, RunOptions, TestRun, choose_device

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
        options = RunOptions(
            leak_check=settings.leak_check,
            snapshots=settings.artifacts if settings.snapshot else None,
            device_limit=settings.device_limit,
        )
        item.stash[RUN_KEY] = TestRun(
            item.nodeid,
            spec,
            engine,
            environment=self._environment(engine),
            options=options,
        )

    def _gpu_index(self) -> int | None:
        """Which GPU this process measures on when several are visible: the xdist worker's, else
        torchrun's local rank."""
        worker = _worker_index()
        if worker is None and self._launch is not None:
            return self._launch.local_rank
        return worker

    def _observe(self, item: pytest.Item, spec: GpumemSpec, predict: str | None) -> str:
        """How the CPU engine observes this test: an emulated device limit and a prediction need
        the operator tracker (an allocation replayed afterwards cannot be refused; a prediction
        follows the operators), so the run's ``--gpumem-observe=allocations`` yields to them; the
        test's own ``observe="allocations"`` under ``--gpumem-device-limit`` or a prediction is an
        error."""
        settings = self.settings
        if spec.observe is None:
            needs = spec.device_limit is not None or settings.device_limit is not None or predict is not None
            return "operators" if needs else settings.observe
        if spec.observe == "allocations" and predict is not None:
            pytest.fail(
                f"{item.nodeid}: observe='allocations' cannot predict={predict!r} (a prediction follows the operators)",
                pytrace=False,
            )
        if spec.observe == "allocations" and spec.device_limit is None and settings.device_limit is not None:
            pytest.fail(
                f"{item.nodeid}: observe='allocations' cannot run under --gpumem-device-limit="
                f"{settings.device_limit} (an emulated device limit needs observe='operators')",
                pytrace=False,
            )
        return spec.observe

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
            item.stash[RECORD_KEY] = run.finish(exc)
            raise
        item.stash[RECORD_KEY] = run.finish(None)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
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
        report.gpumem = record.to_dict()  # type: ignore[attr-defined]  # travels to the xdist controller
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
            return
        data = getattr(report, "gpumem", None)
        if data is None or report.when != "call":
            return
        record = TestRecord.from_dict(data)
        if report.failed and record.passed:
            record.passed = False  # failed for a reason of pytest's (XPASS(strict)) or another plugin's
        try:
            self.gate.judge(record)
        except BaselineFileError as exc:  # under xdist the controller reads the file at the first record
            self._error = f"gpumem baselines: {exc}"
            record.errors.append(self._error)
        if report.passed and record.failed:  # the one place a test's outcome changes
            report.outcome = "failed"
            report.longrepr = failure_text(record, reports=record.reports, width=_terminal_width(self.config))
        elif report.failed and record.reports:
            _append(report, "gpumem", "\n\n".join(record.reports))
        if report.failed or self.settings.artifacts_all:
            written = write_artifacts(record, self.settings.artifacts)
            if report.failed:
                _append(report, "gpumem artifacts", "gpumem artifacts: " + ", ".join(written))
        elif record.snapshot:
            Path(record.snapshot).unlink(missing_ok=True)

    # -- the end ------------------------------------------------------------------------

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.worker:
            output = self.config.workeroutput  # type: ignore[attr-defined]
            output["gpumem_collected"] = sorted(self._collected)
            output["gpumem_skipped"] = sorted(self._skipped)
            output["gpumem_complete"] = self._collection_complete and self._whole_suite()
            return
        complete = self._collection_complete and (self._xdist or self._whole_suite())
        if self._launch is not None and not self._gather(session):
            return  # another rank writes, or the gather failed and nothing may be written
        if self._error is None:
            try:
                self.gate.finish(self._collected if complete and self._collected else None, skipped=self._skipped)
            except (BaselineFileError, OSError) as exc:
                session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
                self._error = f"gpumem: could not write the baseline file: {exc}"
            else:
                if self.gate.stale_failed and not self.settings.gate.update:
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
        else:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        try:
            self.gate.write_reports()
        except OSError as exc:  # checked before the first test; a test may still have removed the folder
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
            failed = f"gpumem: {exc.strerror or exc}"
            self._error = failed if self._error is None else f"{self._error}\n{failed}"

    def _gather(self, session: pytest.Session) -> bool:
        """Under torchrun: every rank's records to rank 0. True on rank 0 once it has them all."""
        assert self._launch is not None
        from pytest_gpumem.plugin.torchrun import GatherError, gather_records, merge

        try:
            gathered = gather_records([record.to_dict() for record in self.gate.records.values()], self._launch)
        except GatherError as exc:
            self._error = (
                f"gpumem: the ranks' records could not be gathered ({exc}): "
                "the baseline file and the reports were not written"
            )
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            return False
        except KeyboardInterrupt:  # Ctrl-C while this rank waits for the others
            self._error = (
                "gpumem: interrupted while gathering the ranks' records: "
                "the baseline file and the reports were not written"
            )
            session.exitstatus = pytest.ExitCode.INTERRUPTED
            return False
        if gathered is None:
            return False
        self.gate.records = merge(gathered)
        return True

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", None) or {}
        self._collected.update(output.get("gpumem_collected", ()))
        self._skipped.update(output.get("gpumem_skipped", ()))
        if not output.get("gpumem_complete", False):
            self._collection_complete = False
        self._xdist = True

    def _whole_suite(self) -> bool:
        """True when this run collected the whole suite (no paths or node ids on the command line)."""
        source = getattr(self.config, "args_source", None)
        return source is None or source != pytest.Config.ArgsSource.ARGS

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.worker:
            return
        if self._launch is not None and self._launch.rank != 0 and self._error is None:
            terminalreporter.write_sep("=", "gpumem")
            terminalreporter.write_line(
                f"rank {self._launch.rank} of {self._launch.world_size}: records sent to rank 0, "
                "which writes the baselines and the reports"
            )
            return
        gate = self.gate
        update = self.settings.gate.update and self._error is None
        text = terminal_summary(
            list(gate.records.values()),
            stale=gate.stale,
            environments=gate.environments(),
            width=terminalreporter._tw.fullwidth,
            verbosity=int(self.config.getoption("verbose")),
            baselines=None if not update else (self.settings.gate.baselines, gate.written),
            pruning=self.settings.gate.prune,
        )
        if text is not None:
            terminalreporter.write_sep("=", "gpumem")
            # a node id from a file name that is not UTF-8 holds lone surrogates: escape them
            # (``\udcff``), as the baseline file does, or pytest prints the whole summary on one line
            terminalreporter.write_line(text.encode("utf-8", "backslashreplace").decode("utf-8"))
        if self._error:
            terminalreporter.write_line(self._error, red=True)
