"""The end of a run: the baseline file written once, the reports, the terminal summary; ranks gathered to rank 0."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.baselines import BaselineFileError
from pytest_gpumem.data.figures import OutputNotWritten
from pytest_gpumem.judge.record import RecordStore, TestRecord
from pytest_gpumem.plugin.collection import CollectionBook
from pytest_gpumem.plugin.junit_html import add_html_extras, junit_failure
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.session import BaselineSession
from pytest_gpumem.plugin.torchrun import Launch
from pytest_gpumem.report.artifacts import write_artifacts, write_index
from pytest_gpumem.report.ci import (
    MAX_ANNOTATIONS,
    Annotation,
    failure_annotations,
    junit_properties,
    run_annotation,
    workspace,
)
from pytest_gpumem.report.text import terminal_summary

__all__ = ["RunEnd", "append_section"]


def append_section(report: pytest.TestReport, title: str, text: str) -> None:
    """Add ``text`` to a failed report's message, keeping pytest's own rendering of its error."""
    addsection = getattr(report.longrepr, "addsection", None)
    if addsection is not None:
        addsection(title, text)
    else:
        report.longrepr = f"{report.longrepr}\n\n{text}"


class RunEnd:
    """The end of the run: the baseline file, the reports, the artifact pages, and what could not be written."""

    def __init__(
        self,
        config: pytest.Config,
        settings: Settings,
        baselines: BaselineSession,
        book: CollectionBook,
        *,
        worker: bool,
        launch: Launch | None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.baselines = baselines
        self.book = book
        self.worker = worker
        self.launch = launch
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

    def judged(self, report: pytest.TestReport, record: TestRecord) -> None:
        """A judged test: its JUnit properties, and on GitHub Actions a failure's annotation."""
        self.properties[report.nodeid] = junit_properties(record)
        # a failed report only: one whose memory failure was expected (xfail) is not annotated
        if record.failed and report.failed and os.environ.get("GITHUB_ACTIONS") == "true":
            file, line, _ = report.location
            location = (file, 0 if line is None else line + 1)
            self.annotations += failure_annotations(record, location, self.config.rootpath, workspace())

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
        self.write_index()
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

    def artifacts(self, report: pytest.TestReport, record: TestRecord) -> None:
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

    def write_index(self) -> None:
        """The run's ``index.html`` in the artifact folder, once a page was written."""
        if not self.pages:
            return
        try:
            write_index(self.baselines.records.decoded_all(), self.settings.artifacts, self.pages)
        except OSError as exc:
            self._not_written(exc.strerror or str(exc))

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
        except GatherError as exc:
            self.error = (
                f"gpumem: the ranks' records could not be gathered ({exc}): "
                "the baseline file and the reports were not written"
            )
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            return False
        except KeyboardInterrupt:  # Ctrl-C while this rank waits for the others
            self.error = (
                "gpumem: interrupted while gathering the ranks' records: "
                "the baseline file and the reports were not written"
            )
            session.exitstatus = pytest.ExitCode.INTERRUPTED
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
        if os.environ.get("GITHUB_ACTIONS") == "true":
            self._annotate(terminalreporter)

    def _annotate(self, terminalreporter: Any) -> None:
        """GitHub Actions' ``::error`` workflow commands: the tests that failed on memory, then the run's failures."""
        found = list(self.annotations)
        where = self.settings.baselines.path
        found += [run_annotation(failure, where if where.is_file() else None, workspace()) for failure in self.failures]
        for annotation in found[:MAX_ANNOTATIONS]:
            terminalreporter.write_line(annotation.command())
        if len(found) > MAX_ANNOTATIONS:
            terminalreporter.write_line(f"gpumem: {len(found) - MAX_ANNOTATIONS} more failure(s) not annotated")
