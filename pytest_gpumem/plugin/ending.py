"""The end of a run: the baseline file recorded and written once, the reports, the terminal
summary, and under ``torchrun`` every rank's records gathered to rank 0."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.baselines import BaselineFileError
from pytest_gpumem.data.figures import OutputNotWritten
from pytest_gpumem.judge.record import RecordStore, TestRecord
from pytest_gpumem.plugin.collection import CollectionBook
from pytest_gpumem.plugin.gate import Gate
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.torchrun import Launch
from pytest_gpumem.report.artifacts import write_artifacts
from pytest_gpumem.report.text import terminal_summary

__all__ = ["RunEnd", "append_section"]


def append_section(report: pytest.TestReport, title: str, text: str) -> None:
    """Add ``text`` to a failed report's message, keeping pytest's own rendering of its error."""
    addsection = getattr(report.longrepr, "addsection", None)
    if addsection is not None:
        addsection(title, text)
    else:
        report.longrepr = f"{report.longrepr}\n\n{text}"


class RunEnd(CollectionBook):
    """The end of the run, for :class:`~pytest_gpumem.plugin.manager.GpumemManager`."""

    settings: Settings
    gate: Gate
    worker: bool
    _error: str | None
    _launch: Launch | None
    #: outputs that could not be written (reports, pages, snapshots): warnings, shown in the summary
    _problems: list[str]
    #: an :class:`OutputNotWritten` warning was made an error (``-W error``): the run fails
    _escalated: bool

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.worker:
            self._worker_output()
            return
        if self._launch is not None and not self._gather(session):
            return  # another rank writes, or the gather failed and nothing may be written
        if self._error is None:
            try:
                self.gate.finish(self._collection())
            except (BaselineFileError, OSError) as exc:
                # asked to record baselines and could not: the run fails, the file is as it was
                if session.exitstatus == pytest.ExitCode.OK:
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
                self._error = f"gpumem: could not write the baseline file: {exc}"
            else:
                if self.gate.stale_failed and not self.settings.gate.update:
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
        else:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        for problem in self.gate.write_reports():
            self._not_written(problem)
        if self._escalated and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _artifacts(self, report: pytest.TestReport, record: TestRecord) -> None:
        """The test's artifact page (a failed test's, or every test's with ``--gpumem-artifacts-all``),
        named in its failure report; a page that cannot be written is a warning, never the run's end."""
        if report.failed or self.settings.artifacts_all:
            try:
                said = "gpumem artifacts: " + ", ".join(write_artifacts(record, self.settings.artifacts))
            except OSError as exc:
                said = f"gpumem artifacts: {exc.strerror or exc}"
                self._not_written(exc.strerror or str(exc))
            if report.failed:
                append_section(report, "gpumem artifacts", said)
        elif record.snapshot:
            Path(record.snapshot).unlink(missing_ok=True)

    def _not_written(self, problem: str) -> None:
        """A report, page or snapshot that could not be written: an :class:`OutputNotWritten` warning
        (and a line of the gpumem section); the run goes on. A warning made an error fails the run."""
        self._problems.append(problem)
        try:
            warnings.warn(OutputNotWritten(problem), stacklevel=1)
        except OutputNotWritten:  # -W error::...OutputNotWritten
            self._escalated = True

    def _gather(self, session: pytest.Session) -> bool:
        """Under torchrun: every rank's records to rank 0. True on rank 0 once it has them all."""
        assert self._launch is not None
        from pytest_gpumem.plugin.torchrun import GatherError, gather_records, merge

        try:
            gathered = gather_records([record.to_dict() for record in self.gate.records.decoded_all()], self._launch)
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
        self.gate.records = RecordStore(merge(gathered).values())
        return True

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
            gate.records.decoded_all(),
            stale=gate.stale,
            environments=gate.environments(),
            width=terminalreporter._tw.fullwidth,
            verbosity=int(self.config.getoption("verbose")),
            baselines=None if not update else (self.settings.gate.baselines, gate.written),
            pruning=self.settings.gate.prune and self.settings.gate.update,
            kept=gate.kept,
        )
        if text is not None or self._problems:
            terminalreporter.write_sep("=", "gpumem")
        if text is not None:
            # a node id from a file name that is not UTF-8 holds lone surrogates: escape them
            # (``\udcff``), as the baseline file does, or pytest prints the whole summary on one line
            terminalreporter.write_line(text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for problem in self._problems:
            terminalreporter.write_line(f"gpumem: {problem}", yellow=True)
        if self._error:
            terminalreporter.write_line(self._error, red=True)
