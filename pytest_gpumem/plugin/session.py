"""The run's baseline session: the baseline file, the records judged with it, the reports. No pytest."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace
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
from pytest_gpumem.data.site_figures import SITES_BUDGET
from pytest_gpumem.judge.judgement import JudgeOptions, baseline_metrics, decide, judge
from pytest_gpumem.judge.record import RecordStore, TestRecord
from pytest_gpumem.judge.verdict import stale_findings
from pytest_gpumem.report.formats import write_reports

__all__ = ["BaselineOptions", "BaselineSession", "file_problem"]


def file_problem(exc: BaselineFileError) -> str:
    """How the run says that the baseline file cannot be read or written."""
    return f"gpumem baselines: {exc}"


@dataclass(frozen=True)
class BaselineOptions:
    """The run's baseline and report options (see the plugin's ``--gpumem-*`` options)."""

    path: Path
    #: None: each metric's default
    tolerance: Tolerance | None
    update: bool = False
    strict: bool = False
    prune: bool = False
    json_path: Path | None = None
    markdown_path: Path | None = None
    step_summary: bool = True
    generator: str = ""


class BaselineSession:
    """Judges each record against the baseline file, keeps the judged records, and at the end writes the file once."""

    def __init__(self, options: BaselineOptions) -> None:
        self.options = options
        self.judging = JudgeOptions(options.tolerance, strict=options.strict, update=options.update)
        #: the judged records, by node id (handed out as copies)
        self.records = RecordStore()
        self.stale: list[Finding] = []
        #: the baselines the run could not judge stale, by why
        self.kept: Counter[str] = Counter()
        self._store: BaselineStore | None = None
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
        """The findings of ``record`` judged and kept; a file it cannot read raises after the limits."""
        judged, problem = self.judged(record)
        if problem is not None:
            raise problem
        return judged.findings

    def _store_for(self, record: TestRecord) -> tuple[BaselineStore | None, BaselineFileError | None]:
        """The baseline file ``record`` is compared with (None: none, or it cannot be read, and why)."""
        if not record.passed or record.environment is None or self.options.update:
            return None, None
        try:
            return self.store, None
        except BaselineFileError as exc:
            return None, exc

    def judged(self, record: TestRecord) -> tuple[TestRecord, BaselineFileError | None]:
        """``record`` judged with the baseline file and kept, and why the file could not be read (None: it could)."""
        store, problem = self._store_for(record)
        judged = judge(record, store, self.judging)
        if problem is not None:
            judged = replace(judged, errors=[*judged.errors, file_problem(problem)])
        self.records.put(judged)  # with its findings
        return judged, problem

    def fails(self, record: TestRecord) -> bool:
        """Whether the judge fails the passed ``record``, decided without changing or keeping it."""
        return decide(record, self._store_for(record)[0], self.judging).fails(record)  # judged() reports a bad file

    def finish(self, collection: Collection | None) -> None:
        """End of the run: stale baselines (none looked for without ``collection``), pruning, recording, saving."""
        if not self.records and not self.loaded:
            return  # nothing was measured: the file is neither read nor written
        store = self.store
        if collection is not None:
            stale = []
            for key in sorted(self.environments()):
                found = find_stale(store, collection, key)
                stale += found.stale
                self.kept.update(found.kept)
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
                    environment = Environment.from_dict(record.environment)
                    try:
                        store.record(environment, record.nodeid, entries)
                    except ValueError as exc:  # a figure the file could not be loaded with
                        raise BaselineFileError(
                            self.options.path, f"{exc} (the file would not load again; left as it was)"
                        ) from None
            self.written = save(store, self.options.path)

    @property
    def stale_failed(self) -> bool:  # strict mode
        return any(f.failed for f in self.stale)

    def environments(self) -> dict[str, int | None]:
        """The environment keys of the records, sorted, each with the workspace bytes its device held."""
        return self.records.environments()

    def write_reports(self) -> list[str]:
        """The reports the options ask for; one line per report that could not be written."""
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
