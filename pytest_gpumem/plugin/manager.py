"""The run's manager: owns the run's parts, sets up, starts and finishes each measured test's run, takes its record
from its report to the judge, and ends the run: the baseline file written once, the reports, the terminal summary;
ranks gathered to rank 0."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Generator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.baselines import BaselineFileError, Environment
from pytest_gpumem.data.figures import OutputNotWritten
from pytest_gpumem.data.metrics import METRICS
from pytest_gpumem.judge.limits import SpecError
from pytest_gpumem.judge.record import RecordStore, TestRecord
from pytest_gpumem.plugin.collection import (
    SPEC_ERROR_KEY,
    SPEC_KEY,
    CollectionBook,
    MarkerCheck,
    gpumem_marks,
    marker_spec,
    settle_spec,
    worker_index,
)
from pytest_gpumem.plugin.junit_html import add_html_extras, junit_failure
from pytest_gpumem.plugin.marker import GpumemSpec, late_marker_problems, parse_marker
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.plan import PlanError, plan_test, sites_mode
from pytest_gpumem.plugin.session import BaselineSession, file_problem
from pytest_gpumem.plugin.site_runs import (
    SECOND_RUN_KEY,
    SecondRun,
    no_second_run,
    no_sites_note,
    run_test,
    wants_sites,
    xfail_of,
)
from pytest_gpumem.plugin.torchrun import launch, rename
from pytest_gpumem.report.artifacts import write_artifacts, write_index
from pytest_gpumem.report.ci import (
    MAX_ANNOTATIONS,
    Annotation,
    failure_annotations,
    junit_properties,
    run_annotation,
    workspace,
)
from pytest_gpumem.report.details import error_section, failure_text
from pytest_gpumem.report.text import terminal_summary

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines import Engine
    from pytest_gpumem.plugin.run_engines import Engines, Freezer
    from pytest_gpumem.plugin.runner import TestRun

__all__ = ["RUN_KEY", "GpumemManager"]

RUN_KEY: pytest.StashKey[TestRun] = pytest.StashKey()
RECORD_KEY = pytest.StashKey[tuple[TestRecord, str]]()  #: the call's record, and as JSON text for its report
MARKS_KEY = pytest.StashKey[list[pytest.Mark]]()  #: the test's ``gpumem`` marks when its collection ended


def append_section(report: pytest.TestReport, title: str, text: str) -> None:
    """Add ``text`` to a failed report's message, keeping pytest's own rendering of its error."""
    addsection = getattr(report.longrepr, "addsection", None)
    if addsection is not None:
        addsection(title, text)
    else:
        report.longrepr = f"{report.longrepr}\n\n{text}"


class GpumemManager:
    """Owns the run: its settings, its parts, each test's run, the record on its way from its report to the judge, the
    run's end."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.worker = hasattr(config, "workerinput")  #: an xdist worker: it measures, its controller judges and writes
        try:
            self.launch = launch()  #: pytest started by torchrun: this process is one rank
        except ValueError as exc:
            raise pytest.UsageError(f"gpumem: {exc}") from None
        self.markers = MarkerCheck()
        self.book = CollectionBook(config)
        self.baselines = BaselineSession(settings.baselines)
        self.engines: Engines | None = None  #: made when the run loop starts with a measured test
        self.freezer: Freezer | None = None  #: the run's collector, started with the engines
        self._environments: dict[str, tuple[dict[str, Any], str]] = {}  # by engine, as the environment hook made them
        self._handoff: tuple[str, TestRecord] | None = None  # the call report's record, until it is logged
        #: what keeps the baseline file from being written: shown in red at the end
        self.error: str | None = None
        #: outputs that could not be written: warnings, shown in the summary
        self.problems: list[str] = []
        #: an :class:`OutputNotWritten` warning was made an error: the run fails
        self.escalated = False
        #: each judged test's JUnit properties, by node id, until its teardown report takes them
        self.properties: dict[str, list[tuple[str, str | int]]] = {}
        #: on GitHub Actions: the ``::error`` annotations of the tests that failed on memory
        self.annotations: list[Annotation] = []
        #: why the run fails where no test does (stale baselines in strict mode, a file not written)
        self.failures: list[str] = []
        self.pages: dict[str, str] = {}

    def register(self, pluginmanager: pytest.PytestPluginManager) -> None:
        pluginmanager.register(self, "gpumem-manager")
        for name in ("markers", "book"):
            pluginmanager.register(getattr(self, name), f"gpumem-{name}")

    def _read_baselines(self) -> None:
        """Read the baseline file now: a bad one stops the run before it starts."""
        try:
            self.baselines.store  # noqa: B018
        except BaselineFileError as exc:
            raise pytest.UsageError(file_problem(exc)) from None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """The final word on which tests are measured: the markers as they are after every conftest's changes."""
        for item in items:
            item.stash[MARKS_KEY] = marks = gpumem_marks(item)
            settle_spec(item, marks)
        if not self.worker and any(SPEC_KEY in item.stash for item in items):
            self._read_baselines()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """The xdist controller collects nothing: it reads an existing baseline file now, so a bad one stops the run."""
        controller = not self.worker and self.config.pluginmanager.getplugin("dsession") is not None
        if controller and self.settings.baselines.path.exists():
            self._read_baselines()

    # -- the test's run (in the process that runs the test) ------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        if any(SPEC_KEY in item.stash for item in session.items):
            from pytest_gpumem.plugin.run_engines import Engines, Freezer

            self.freezer = Freezer(self.config)
            self.freezer.start()
            self.engines = Engines(cuda_rounding=self.settings.cuda_rounding, freezer=self.freezer)
        try:
            return (yield)
        finally:
            if self.freezer is not None:
                self.freezer.stop()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        """A measured test that may want its sites runs through :func:`run_test`."""
        spec = item.stash.get(SPEC_KEY, None)
        if spec is None or sites_mode(spec, self.settings) != "rerun":
            return None
        return run_test(item, nextitem, self.freezer)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(SPEC_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)
        spec = item.stash.get(SPEC_KEY, None)
        if spec is not None:
            self._prepare(item, spec)

    def _prepare(self, item: pytest.Item, spec: GpumemSpec) -> None:
        """The test's run (``item.stash[RUN_KEY]``) from its plan; skips or fails the test that cannot run."""
        from pytest_gpumem.plugin.run_engines import Engines
        from pytest_gpumem.plugin.runner import TestRun

        gpu = worker_index()  # the GPU this process measures on: the xdist worker's, else torchrun's local rank
        if gpu is None and self.launch is not None:
            gpu = self.launch.local_rank
        try:
            plan = plan_test(item.nodeid, spec, self.settings, worker=gpu)
        except PlanError as exc:  # from None: pytest would print the PlanError too
            if exc.skip:
                raise pytest.skip.Exception(exc.reason) from None
            raise pytest.fail.Exception(exc.reason, pytrace=False) from None
        second = item.stash.get(SECOND_RUN_KEY, None)
        if second is not None and second.running:  # the reports stay the first run's
            plan = plan.second_run(self.settings.site_config)
        if self.engines is None:  # outside the run loop (pytester's inline runs)
            self.engines = Engines(cuda_rounding=self.settings.cuda_rounding)
        assert plan.device is not None
        engine = self.engines.get(plan.device, breakdown=plan.breakdown, observe=plan.observe, predict=plan.predict)
        environment, environment_key = self._environment(engine)
        # activations told apart where they are read: the breakdown, the fixture, a baseline
        uses_fixture = "gpumem" in getattr(item, "fixturenames", ())
        reads_saved = plan.breakdown or uses_fixture or self._baselined(item, environment_key)
        item.stash[RUN_KEY] = TestRun(plan, engine, environment=environment, saved_tensors=reads_saved)

    def _baselined(self, item: pytest.Item, environment_key: str) -> bool:
        """Whether the test's figures meet a baseline (then its activations are told apart, docs/figures.md)."""
        if self.baselines.options.update:
            return True
        try:
            store = self.baselines.store
        except BaselineFileError:
            return True  # the judge reports the file
        return bool(store.span_names(environment_key, item.nodeid))

    def _environment(self, engine: Engine) -> tuple[dict[str, Any], str]:
        key = f"{engine.name}:{engine.device}:{engine.cuda_rounding}:{engine.predicts}"
        if key not in self._environments:
            detected = Environment.detect(engine.name, engine.device, engine.cuda_rounding, predict=engine.predicts)
            try:
                adjusted = self.config.hook.pytest_gpumem_environment(config=self.config, environment=detected)
                if adjusted is not None and not isinstance(adjusted, Environment):
                    raise TypeError(f"expected an Environment or None, got {type(adjusted).__name__}")
                environment = adjusted or detected
                self._environments[key] = (environment.to_dict(), environment.key)
            except (TypeError, ValueError) as exc:
                raise pytest.fail.Exception(f"pytest_gpumem_environment hook: {exc}", pytrace=False) from None
        return self._environments[key]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        run = item.stash.get(RUN_KEY, None)
        if run is None:
            spec = _spec_now(item)  # a fixture may have marked the test
            if spec is None:
                result = yield
                if _spec_now(item) is not None:
                    pytest.fail(
                        f"{item.nodeid}: a gpumem marker added while the test ran is too late to measure it: "
                        "mark the test itself, or add the marker in a fixture or pytest_collection_modifyitems",
                        pytrace=False,
                    )
                return result
            self._prepare(item, spec)
            run = item.stash[RUN_KEY]
        from pytest_gpumem.measurement.returnwatch import ReturnWatchError

        try:
            run.start(getattr(item, "obj", None))
        except ReturnWatchError as exc:
            raise pytest.fail.Exception(f"{item.nodeid}: {exc}", pytrace=False) from None
        began = time.perf_counter()
        try:
            result = yield
        except BaseException as exc:
            self._keep(item, run, _finish(item, run, exc), exc, time.perf_counter() - began)
            raise
        self._keep(item, run, _finish(item, run, None), None, time.perf_counter() - began)
        return result

    def _keep(
        self, item: pytest.Item, run: TestRun, record: TestRecord, exc: BaseException | None, seconds: float
    ) -> None:
        """Keep the call's record for its report; a first run that failed on memory may ask for a second run."""
        second = item.stash.get(SECOND_RUN_KEY, None)
        if second is not None and second.running:
            second.record = record
            return
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        if not interrupted and wants_sites(item, run, record, exc, self.baselines):
            reason = no_second_run(item, record, seconds, self.settings)
            if reason is None and self.launch is not None:
                reason = "pytest runs under torchrun, whose ranks would not run it again together"
            if reason is not None:
                record = replace(record, reports=[*record.reports, no_sites_note(reason)])
            else:
                item.stash[SECOND_RUN_KEY] = SecondRun(record)
        if self.launch is not None:  # each rank's figures are its own spans
            record = rename(record, self.launch)
        item.stash[RECORD_KEY] = (record, record.to_json())

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
        kept = item.stash.get(RECORD_KEY, None)
        if report.when != "call" or kept is None:
            return report
        record, text = kept
        for measurement in record.measurements:
            prefix = "gpumem" if measurement.name == "call" else f"gpumem[{measurement.name}]"
            for metric in METRICS:
                value = measurement.figure(metric)
                if value is not None:
                    item.user_properties.append((f"{prefix}.{metric}", value))
        xfailed = xfail_of(item) if call.excinfo is None else None
        if xfailed is not None and xfailed.raises is None:  # a memory failure of this test is an expected failure
            report.gpumem_xfail = str(xfailed.reason)  # type: ignore[attr-defined]
        # as JSON text, which the garbage collector never traverses (reports live to the end of the run)
        report.gpumem = text  # type: ignore[attr-defined]
        if not self.worker:
            self._handoff = (text, record)
        return report

    # -- judging (in the process that owns the run) -------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return
        if report.when == "teardown":  # the judged figures, for pytest's JUnit XML
            report.user_properties.extend(self.properties.pop(report.nodeid, ()))
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
        expected = xfail is not None and record.passed and self.baselines.fails(record)
        if report.failed and record.passed:
            record = replace(record, passed=False)  # failed for pytest's reason (XPASS(strict)) or another plugin's
        record, problem = self.baselines.judged(record)
        if problem is not None:  # under xdist the controller reads the file at the first record
            self.error = file_problem(problem)
        if expected:  # reported as pytest reports an expected failure
            report.outcome = "skipped"
            report.wasxfail = str(xfail)
            report.longrepr = self._rendered(failure_text, record)
        elif report.passed and record.failed:  # the one place a test's outcome changes
            report.outcome = "failed"
            report.longrepr = self._rendered(failure_text, record)
        elif report.failed and record.reports:
            append_section(report, "gpumem", self._rendered(error_section, record))
        self.properties[report.nodeid] = junit_properties(record)
        # a failed report only: one whose memory failure was expected (xfail) is not annotated
        if record.failed and report.failed and os.environ.get("GITHUB_ACTIONS") == "true":
            file, line, _ = report.location
            location = (file, 0 if line is None else line + 1)
            self.annotations += failure_annotations(record, location, self.config.rootpath, workspace())
        self._artifacts(report, record)

    def _rendered(self, render: Callable[..., str], record: TestRecord) -> str:
        """``record``'s failure text, as wide as the terminal, at pytest's verbosity."""
        writer = getattr(self.config.pluginmanager.get_plugin("terminalreporter"), "_tw", None)
        width = int(writer.fullwidth) if writer is not None else shutil.get_terminal_size().columns
        return render(record, reports=record.reports, width=width, verbosity=int(self.config.option.verbose))

    def _artifacts(self, report: pytest.TestReport, record: TestRecord) -> None:
        """The test's artifact page (a failed test's, or every test's with ``--gpumem-artifacts-all``)."""
        page: str | None = None
        if report.failed or self.settings.artifacts_all:
            try:
                written = write_artifacts(record, self.settings.artifacts)
            except OSError as exc:
                said = f"gpumem artifacts: {exc.strerror or exc}"
                self._not_written(exc.strerror or str(exc))
            else:
                page = self.pages[record.nodeid] = written[0]
                said = "gpumem artifacts: " + ", ".join(written)
            if report.failed:
                append_section(report, "gpumem artifacts", said)
        elif record.snapshot:
            Path(record.snapshot).unlink(missing_ok=True)
        if self.config.pluginmanager.hasplugin("html"):
            add_html_extras(report, record, page, self.config.getoption("htmlpath", None))

    # -- the end of the run ---------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)  # before pytest's JUnit XML writes its file: the run's failure goes in it
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.worker:
            self.book.worker_output()
            return
        if self.launch is not None and not self._gather(session):
            if self.error is not None:  # the gather failed: nothing may be written but the reason, in the JUnit XML
                self._run_failures()
            return  # another rank writes, or the gather failed and nothing may be written
        if self.error is None:
            try:
                self.baselines.finish(self.book.collection())
            except (BaselineFileError, OSError) as exc:
                if session.exitstatus == pytest.ExitCode.OK:
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
                self.error = f"gpumem: could not write the baseline file: {exc}"
            else:
                if self.baselines.stale_failed and not self.settings.baselines.update:
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
        else:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        for problem in self.baselines.write_reports():
            self._not_written(problem)
        if self.pages:  # the run's index.html in the artifact folder, once a page was written
            try:
                write_index(self.baselines.records.decoded_all(), self.settings.artifacts, self.pages)
            except OSError as exc:
                self._not_written(exc.strerror or str(exc))
        if self.escalated and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        self._run_failures()

    def _run_failures(self) -> None:
        """Why the run fails where no test does, also as a failed test case ``gpumem::run`` in the JUnit XML."""
        stale = [f for f in self.baselines.stale if f.failed]
        if stale and not self.settings.baselines.update and self.error is None:
            tests = sorted({f.test for f in stale})
            self.failures.append(
                f"gpumem: the run fails: {len(tests)} stale baseline(s) with --gpumem-strict "
                f"(first: {tests[0]}): refresh the baseline file with --gpumem-update-baselines --gpumem-prune"
            )
        if self.error is not None:
            self.failures.append(self.error)
        if self.escalated:
            self.failures.append(
                "gpumem: the run fails: an output could not be written and -W error made the warning an error: "
                + "; ".join(self.problems)
            )
        if self.failures:
            junit_failure(self.config, "\n".join(self.failures), self.settings.baselines.path)

    def _not_written(self, problem: str) -> None:
        """An output that could not be written: an :class:`OutputNotWritten` warning; the run goes on."""
        self.problems.append(problem)
        try:
            warnings.warn(OutputNotWritten(problem), stacklevel=1)
        except OutputNotWritten:  # -W error::...OutputNotWritten
            self.escalated = True

    def _gather(self, session: pytest.Session) -> bool:
        """Under torchrun: every rank's records to rank 0. True on rank 0 once it has them all."""
        assert self.launch is not None
        from pytest_gpumem.plugin.torchrun import GatherError, gather_records, merge

        try:
            gathered = gather_records(
                [record.to_dict() for record in self.baselines.records.decoded_all()], self.launch
            )
        except (GatherError, KeyboardInterrupt) as exc:  # KeyboardInterrupt: Ctrl-C while waiting for the others
            interrupted = isinstance(exc, KeyboardInterrupt)
            why = f"the ranks' records could not be gathered ({exc})"
            if interrupted:
                why = "interrupted while gathering the ranks' records"
            self.error = f"gpumem: {why}: the baseline file and the reports were not written"
            session.exitstatus = pytest.ExitCode.INTERRUPTED if interrupted else pytest.ExitCode.TESTS_FAILED
            return False
        if gathered is None:
            return False
        self.baselines.records = RecordStore(merge(gathered).values())
        return True

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.worker:
            return
        if self.launch is not None and self.launch.rank != 0 and self.error is None:
            terminalreporter.write_sep("=", "gpumem")
            terminalreporter.write_line(
                f"rank {self.launch.rank} of {self.launch.world_size}: records sent to rank 0, "
                "which writes the baselines and the reports"
            )
            return
        baselines, options = self.baselines, self.settings.baselines
        update = options.update and self.error is None
        text = terminal_summary(
            baselines.records.decoded_all(),
            stale=baselines.stale,
            environments=baselines.environments(),
            width=terminalreporter._tw.fullwidth,
            verbosity=int(self.config.getoption("verbose")),
            baselines=None if not update else (options.path, baselines.written),
            pruning=options.prune and options.update,
            kept=baselines.kept,
        )
        if text is not None or self.problems:
            terminalreporter.write_sep("=", "gpumem")
        if text is not None:
            # a node id from a file name that is not UTF-8 holds lone surrogates: escape them
            terminalreporter.write_line(text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for problem in self.problems:
            terminalreporter.write_line(f"gpumem: {problem}", yellow=True)
        # the error alone where the run ended before the failures were gathered
        failures = self.failures or ([self.error] if self.error else [])
        if failures and text is None and not self.problems:
            terminalreporter.write_sep("=", "gpumem")
        for failure in failures:
            terminalreporter.write_line(failure, red=True)
        if os.environ.get("GITHUB_ACTIONS") == "true":  # the tests that failed on memory, then the run's failures
            where = options.path if options.path.is_file() else None
            found = [*self.annotations, *(run_annotation(failure, where, workspace()) for failure in self.failures)]
            for annotation in found[:MAX_ANNOTATIONS]:
                terminalreporter.write_line(annotation.command())
            if len(found) > MAX_ANNOTATIONS:
                terminalreporter.write_line(f"gpumem: {len(found) - MAX_ANNOTATIONS} more failure(s) not annotated")


def _spec_now(item: pytest.Item) -> GpumemSpec | None:
    """The item's marker as it is now; a bad one fails the test."""
    try:
        return marker_spec(item)
    except SpecError as exc:
        raise pytest.fail.Exception(f"invalid gpumem marker on {item.nodeid}: {exc}", pytrace=False) from None


def _finish(item: pytest.Item, run: TestRun, exc: BaseException | None) -> TestRecord:
    """``run.finish(exc)`` with the markers as they are now: what a late marker can no longer change is an error."""
    collected = item.stash.get(MARKS_KEY, None)
    marks = gpumem_marks(item)
    late = [collected is not None and not any(mark is other for other in collected) for mark in marks]
    problems: list[str] = []
    if any(late):
        markers = [(mark.args, mark.kwargs) for mark in marks]
        try:
            now = parse_marker(markers)
        except SpecError as error:
            problems.append(f"invalid gpumem marker added after collection: {error}")
        else:
            problems = late_marker_problems(markers, late, run.plan.spec, now)
            run.plan = run.plan.with_marker(now)
    record = run.finish(exc)
    if not problems:
        return record
    return replace(record, errors=[*record.errors, *(f"{item.nodeid}: {problem}" for problem in problems)])
