"""The baseline gate: the baseline file through a run, the records judged with it, and the run's outputs.

This runs in the process that owns the run (the only one without xdist, the
controller with it). A :class:`Gate` loads the baseline file the first time it is
needed, has each arriving :class:`~pytest_gpumem.judge.record.TestRecord` judged with it
(:func:`~pytest_gpumem.judge.judgement.judge`), and at the end finds stale baselines, records what passed (with
``--gpumem-update-baselines``), writes the file once, and writes the JSON and
Markdown reports. No pytest, no torch.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines import (
    BaselineEntry,
    BaselineFileError,
    BaselineStore,
    Environment,
    load,
    save,
)
from pytest_gpumem.baselines.canonical import json_bytes
from pytest_gpumem.data.findings import Finding, Tolerance, failure_message
from pytest_gpumem.data.metrics import DRAWN_METRICS
from pytest_gpumem.judge.judgement import JudgeOptions, baseline_metrics, judge
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.judge.verdict import stale_findings
from pytest_gpumem.report.artifacts import artifact_path, render_html, write_html
from pytest_gpumem.report.text import json_report, markdown_report

__all__ = ["Gate", "GateOptions", "write_artifacts"]


@dataclass(frozen=True)
class GateOptions:
    """The run's baseline and report options (see the plugin's ``--gpumem-*`` options)."""

    baselines: Path
    #: the run's tolerance (``--gpumem-tolerance``); None: each metric's default
    tolerance: Tolerance | None
    update: bool = False
    strict: bool = False
    prune: bool = False
    json_path: Path | None = None
    markdown_path: Path | None = None
    step_summary: bool = True
    generator: str = ""


class Gate:
    """Judges records against the baseline file; records and writes it at the end."""

    def __init__(self, options: GateOptions) -> None:
        self.options = options
        self.records: dict[str, TestRecord] = {}
        self.stale: list[Finding] = []
        self._store: BaselineStore | None = None
        #: whether :meth:`finish` wrote the baseline file
        self.written = False

    @property
    def store(self) -> BaselineStore:
        """The baseline file, loaded on first use; raises :class:`BaselineFileError` when it cannot be read."""
        if self._store is None:
            self._store = load(self.options.baselines)
        return self._store

    @property
    def loaded(self) -> bool:
        return self._store is not None

    def judge(self, record: TestRecord) -> list[Finding]:
        """Judge ``record`` (:func:`~pytest_gpumem.judge.judgement.judge`) with the baseline file;
        keeps it for the end of the run and returns its findings.

        The file is read only when a comparison needs it; when it cannot be read, the record's
        limits are still judged and :class:`BaselineFileError` is raised after.
        """
        self.records[record.nodeid] = record
        options = self.options
        store: BaselineStore | None = None
        problem: BaselineFileError | None = None
        if record.passed and record.environment is not None and not options.update:
            try:
                store = self.store
            except BaselineFileError as exc:
                problem = exc
        findings = judge(record, store, JudgeOptions(options.tolerance, strict=options.strict, update=options.update))
        if problem is not None:
            raise problem
        return findings

    def finish(self, collected: Iterable[str] | None, *, skipped: Iterable[str] = ()) -> None:
        """End of the run: stale baselines (``collected``: every node id of a whole-suite
        collection, None when the run collected only part of it; ``skipped``: node ids of
        collectors skipped at collection, whose tests are never stale), pruning, recording, saving.

        Raises :class:`BaselineFileError` or ``OSError`` when the file cannot be written.
        """
        if not self.records and not self.loaded:
            return  # nothing was measured: the file is neither read nor written
        store = self.store
        env_keys = self.environment_keys()
        ids = set(collected) if collected is not None else set()
        if ids:
            stale = [entry for key in env_keys for entry in store.stale(ids, key, skipped=skipped)]
            self.stale = stale_findings(stale, strict=self.options.strict)
            if self.options.update and self.options.prune and stale:
                store.prune(stale)
        if self.options.update:
            for record in self.records.values():
                if record.recordable:
                    assert record.environment is not None
                    entries = {
                        m.name: BaselineEntry.from_measurement(m, baseline_metrics(m)) for m in record.measurements
                    }
                    store.record(Environment.from_dict(record.environment), record.nodeid, entries)
            self.written = save(store, self.options.baselines)

    @property
    def stale_failed(self) -> bool:
        """Stale baselines fail the run (strict mode)."""
        return any(f.failed for f in self.stale)

    def environment_keys(self) -> list[str]:
        return sorted(self.environments())

    def environments(self) -> dict[str, int | None]:
        """The environment keys of the records, sorted, each with the workspace bytes its device held."""
        found: dict[str, int | None] = {}
        for record in self.records.values():
            key = record.environment_key
            if key is not None and found.get(key) is None:
                found[key] = record.workspaces
        return dict(sorted(found.items()))

    def write_reports(self) -> None:
        """The JSON report, the Markdown report, and the GitHub step summary, as the options ask."""
        records = list(self.records.values())
        if not records and not self.stale:
            return
        environments: list[dict[str, Any]] = []
        for record in records:
            if record.environment is not None and record.environment_key not in [e["key"] for e in environments]:
                environments.append({"key": record.environment_key, **record.environment})
        options = self.options
        if options.json_path is not None:
            data = json_report(
                records, environments=environments, extra_findings=self.stale, generator=options.generator
            )
            _report("JSON", options.json_path, json_bytes(json.dumps(data, indent=2, ensure_ascii=False) + "\n"))
        markdown = markdown_report(records, header=", ".join(self.environment_keys()), extra_findings=self.stale)
        if options.markdown_path is not None:
            _report("Markdown", options.markdown_path, markdown.encode("utf-8", "backslashreplace"))
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and options.step_summary:
            try:
                with open(summary, "a", encoding="utf-8", errors="backslashreplace") as handle:
                    handle.write(markdown)
            except OSError as exc:
                raise OSError(
                    exc.errno, f"could not append to $GITHUB_STEP_SUMMARY ({summary}): {exc.strerror}"
                ) from exc


def _report(kind: str, path: Path, data: bytes) -> None:
    """:func:`_replace`, whose error names the report and the path it could not write."""
    try:
        _replace(path, data)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise OSError(exc.errno, f"could not write the {kind} report {path}: {exc.strerror or exc}{where}") from exc


def _replace(path: Path, data: bytes) -> None:
    """Write a report atomically: a temporary file beside ``path`` replaces it once complete, so a
    failure leaves the previous report (or none), never an empty or partial one.

    Node ids from file names that are not UTF-8 hold lone surrogates: the reports write them
    escaped (``\\udcff``), as the baseline file does (see :func:`~pytest_gpumem.baselines.canonical.json_bytes`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name[:100]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_artifacts(record: TestRecord, directory: Path) -> list[str]:
    """Write the HTML memory timeline of ``record``'s call; returns the artifact paths (with its snapshot).

    Lines drawn across the chart (absolute, as the chart is): the emulated device
    limit, and the call's limits, budgets and baselines on ``peak`` and ``allocated``
    (they bound costs: drawn at the call's start plus the bound).
    """
    call = record.measurements[0]
    lines: dict[str, int] = {} if record.device_limit is None else {"device limit": record.device_limit}
    for finding in record.findings:
        if finding.span != call.name or finding.reference is None or finding.metric not in DRAWN_METRICS:
            continue
        lines[f"{finding.kind} {finding.metric}"] = finding.reference + call.start
    details = [failure_message([f for f in record.findings if f.failed])] if record.failed else []
    details += record.reports
    # under torchrun the call is the rank's (call@rank1-of-2): each rank writes a page of its own
    path = artifact_path(directory, record.nodeid if call.name == "call" else f"{record.nodeid}@{call.name}", ".html")
    page = render_html(
        title=record.nodeid, measurement=call, timeline=record.timeline_of_call(), lines=lines, details=details
    )
    write_html(path, page)
    return [str(path)] + ([record.snapshot] if record.snapshot else [])


__all__ += ["BaselineFileError"]
