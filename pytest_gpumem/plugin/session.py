"""The run's baseline session: the baseline file through a run, the records judged with it, and
the run's reports.

This runs in the process that owns the run (the only one without xdist, the
controller with it). A :class:`BaselineSession` loads the baseline file the first time it is
needed, has each arriving :class:`~pytest_gpumem.judge.record.TestRecord` judged with it
(:func:`~pytest_gpumem.judge.judgement.judge`), and at the end finds stale baselines, records what passed (with
``--gpumem-update-baselines``), writes the file once, and writes the JSON and
Markdown reports. No pytest, no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pytest_gpumem.baselines import (
    BaselineEntry,
    BaselineFileError,
    BaselineStore,
    Environment,
    load,
    save,
)
from pytest_gpumem.baselines.staleness import Collection, find_stale
from pytest_gpumem.data.findings import Finding, Tolerance
from pytest_gpumem.data.sites import SITES_BUDGET
from pytest_gpumem.judge.judgement import JudgeOptions, baseline_metrics, judge
from pytest_gpumem.judge.record import RecordStore, TestRecord
from pytest_gpumem.judge.verdict import stale_findings
from pytest_gpumem.report.formats import write_reports

__all__ = ["BaselineOptions", "BaselineSession"]


@dataclass(frozen=True)
class BaselineOptions:
    """The run's baseline and report options (see the plugin's ``--gpumem-*`` options)."""

    #: the baseline file (``--gpumem-baselines``)
    path: Path
    #: the run's tolerance (``--gpumem-tolerance``); None: each metric's default
    tolerance: Tolerance | None
    update: bool = False
    strict: bool = False
    prune: bool = False
    json_path: Path | None = None
    markdown_path: Path | None = None
    step_summary: bool = True
    generator: str = ""


class BaselineSession:
    """The run's baseline-and-report session: judges each record against the baseline file, keeps
    the judged records, and at the end records and writes the file once, with the reports."""

    def __init__(self, options: BaselineOptions) -> None:
        self.options = options
        #: the judged records, by node id (kept as text, handed out as copies: see :class:`RecordStore`)
        self.records = RecordStore()
        self.stale: list[Finding] = []
        #: the baselines the run could not judge stale, by why: tests kept (see :func:`find_stale`)
        self.kept: dict[str, int] = {}
        self._store: BaselineStore | None = None
        #: whether :meth:`finish` wrote the baseline file
        self.written = False

    @property
    def store(self) -> BaselineStore:
        """The baseline file, loaded on first use; raises :class:`BaselineFileError` when it cannot be read."""
        if self._store is None:
            self._store = load(self.options.path)
        return self._store

    @property
    def loaded(self) -> bool:
        return self._store is not None

    def judge(self, record: TestRecord) -> list[Finding]:
        """Judge ``record`` (:func:`~pytest_gpumem.judge.judgement.judge`) with the baseline file;
        keeps it for the end of the run (:meth:`RecordStore.put`) and returns its findings.

        The file is read only when a comparison needs it; when it cannot be read, the record's
        limits are still judged and :class:`BaselineFileError` is raised after.
        """
        options = self.options
        store: BaselineStore | None = None
        problem: BaselineFileError | None = None
        if record.passed and record.environment is not None and not options.update:
            try:
                store = self.store
            except BaselineFileError as exc:
                problem = exc
        findings = judge(record, store, JudgeOptions(options.tolerance, strict=options.strict, update=options.update))
        self.records.put(record)  # judged: with its findings
        if problem is not None:
            raise problem
        return findings

    def finish(self, collection: Collection | None) -> None:
        """End of the run: stale baselines (``collection``: what the run collected, None to look for
        none), pruning, recording, saving.

        Raises :class:`BaselineFileError` or ``OSError`` when the file cannot be written.
        """
        if not self.records and not self.loaded:
            return  # nothing was measured: the file is neither read nor written
        store = self.store
        if collection is not None:
            stale = []
            for key in self.environment_keys():
                found = find_stale(store, collection, key)
                stale += found.stale
                for why, count in found.kept.items():
                    self.kept[why] = self.kept.get(why, 0) + count
            self.stale = stale_findings(stale, strict=self.options.strict)
            if self.options.update and self.options.prune and stale:
                store.prune(stale)
        if self.options.update:
            for record in self.records.decoded_all():
                if record.recordable:
                    assert record.environment is not None
                    budget = SITES_BUDGET // max(1, sum(m.sites is not None for m in record.measurements))
                    entries = {
                        m.name: BaselineEntry.from_measurement(m, baseline_metrics(m), sites_budget=budget)
                        for m in record.measurements
                    }
                    store.record(Environment.from_dict(record.environment), record.nodeid, entries)
            self.written = save(store, self.options.path)

    @property
    def stale_failed(self) -> bool:
        """Stale baselines fail the run (strict mode)."""
        return any(f.failed for f in self.stale)

    def environment_keys(self) -> list[str]:
        return sorted(self.environments())

    def environments(self) -> dict[str, int | None]:
        """The environment keys of the records, sorted, each with the workspace bytes its device held."""
        return self.records.environments()

    def write_reports(self) -> list[str]:
        """The JSON report, the Markdown report, and the GitHub step summary, as the options ask; one
        line per report that could not be written (naming its path and the reason)."""
        options = self.options
        step_summary = os.environ.get("GITHUB_STEP_SUMMARY") if options.step_summary else None
        if options.json_path is None and options.markdown_path is None and not step_summary:
            return []  # no report asked for: the records are not decoded
        return write_reports(
            self.records.decoded_all(),
            self.stale,
            json_path=options.json_path,
            markdown_path=options.markdown_path,
            step_summary=step_summary,
            generator=options.generator,
        )
