"""The end of a run: the baseline file recorded and written once, the reports, the terminal
summary, and under ``torchrun`` every rank's records gathered to rank 0."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.baselines import BaselineFileError
from pytest_gpumem.judge.record import RecordStore
from pytest_gpumem.plugin.collection import CollectionBook
from pytest_gpumem.plugin.gate import Gate
from pytest_gpumem.plugin.options import Settings
from pytest_gpumem.plugin.torchrun import Launch
from pytest_gpumem.report.text import terminal_summary

if TYPE_CHECKING:
    pass

__all__ = ["RunEnd"]


class RunEnd(CollectionBook):
    """The end of the run, for :class:`~pytest_gpumem.plugin.manager.GpumemManager`."""

    settings: Settings
    gate: Gate
    worker: bool
    _error: str | None
    _launch: Launch | None

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
        self.gate.records = RecordStore(merge(gathered))
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
            list(gate.records.values()),
            stale=gate.stale,
            environments=gate.environments(),
            width=terminalreporter._tw.fullwidth,
            verbosity=int(self.config.getoption("verbose")),
            baselines=None if not update else (self.settings.gate.baselines, gate.written),
            pruning=self.settings.gate.prune and self.settings.gate.update,
            kept=gate.kept,
        )
        if text is not None:
            terminalreporter.write_sep("=", "gpumem")
            # a node id from a file name that is not UTF-8 holds lone surrogates: escape them
            # (``\udcff``), as the baseline file does, or pytest prints the whole summary on one line
            terminalreporter.write_line(text.encode("utf-8", "backslashreplace").decode("utf-8"))
        if self._error:
            terminalreporter.write_line(self._error, red=True)
