"""The baseline gate: judging records against the baseline file, recording them, and the run's outputs.

This runs in the process that owns the run (the only one without xdist, the
controller with it). A :class:`Gate` loads the baseline file the first time it is
needed, compares each arriving :class:`~pytest_gpumem.judge.record.TestRecord` with its
baselines, and at the end finds stale baselines, records what passed (with
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
    BASELINE_METRICS,
    BaselineEntry,
    BaselineFileError,
    BaselineStore,
    Environment,
    load,
    save,
)
from pytest_gpumem.baselines.canonical import json_bytes
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.judge.verdict import (
    Finding,
    Tolerance,
    compare_baseline,
    default_tolerance,
    failure_message,
    stale_findings,
)
from pytest_gpumem.report.artifacts import artifact_path, render_html, write_html
from pytest_gpumem.report.text import json_report, markdown_report

__all__ = [
    "RESERVED_TOLERANCE_FLOOR",
    "Gate",
    "GateOptions",
    "baseline_metrics",
    "metric_tolerances",
    "write_artifacts",
]


#: The least tolerance a ``reserved`` baseline is compared with: one of the caching allocator's
#: 20 MiB segments (the segment size of requests between 1 and 10 MiB). What the cache holds
#: depends on the process's allocation history (segments that hold a live block cannot be
#: returned), so the same step twice in one process can reserve a segment more or less
#: (seen on an H100: 622,854,144 vs 639,631,360 B, 16 MiB apart).
RESERVED_TOLERANCE_FLOOR = 20 * 2**20


def metric_tolerances(metrics: Iterable[str], tolerance: Tolerance | None) -> dict[str, Tolerance]:
    """The tolerance of each metric's baseline comparison: ``tolerance`` for bytes, at least
    :data:`RESERVED_TOLERANCE_FLOOR` for ``reserved``, only its relative part for a count
    (``max_microbatch``: its absolute floor is bytes). ``None`` (nothing set one): each
    metric's :func:`~pytest_gpumem.judge.verdict.default_tolerance`, with the same floor for ``reserved``."""
    per_metric = {}
    for metric in metrics:
        if tolerance is None:
            per_metric[metric] = _floored(metric, default_tolerance(metric))
        elif metric == "reserved":
            per_metric[metric] = _floored(metric, tolerance)
        elif metric in BASELINE_METRICS:
            per_metric[metric] = tolerance
        else:
            per_metric[metric] = Tolerance(tolerance.relative, 0)
    return per_metric


def _floored(metric: str, tolerance: Tolerance) -> Tolerance:
    if metric != "reserved":
        return tolerance
    return Tolerance(tolerance.relative, max(tolerance.absolute, RESERVED_TOLERANCE_FLOOR))


def baseline_metrics(measurement: Measurement) -> tuple[str, ...]:
    """The figures a baseline keeps: the byte costs, and the largest microbatch when the test searched it."""
    return BASELINE_METRICS + (("max_microbatch",) if measurement.max_microbatch is not None else ())


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
        """Compare ``record`` with its baselines; adds the findings to it and returns them.

        Nothing is compared for a test whose own code failed, that did not measure,
        or when baselines are being updated. Each span's tolerance is its own, else
        the marker's, else the run's (per metric: :func:`metric_tolerances`).
        """
        self.records[record.nodeid] = record
        if not record.passed or record.environment is None or self.options.update:
            return []
        store = self.store
        env = Environment.from_dict(record.environment)
        others = store.environments_with(record.nodeid, exclude=env.key)
        findings: list[Finding] = []
        for measurement in record.measurements:
            tolerance = record.tolerance(measurement.name) or self.options.tolerance
            metrics = baseline_metrics(measurement)
            per_metric = metric_tolerances(metrics, tolerance)
            findings.extend(
                compare_baseline(
                    record.nodeid,
                    measurement,
                    store.entry(env.key, record.nodeid, measurement.name),
                    per_metric,
                    other_environments=others,
                    strict=self.options.strict,
                    metrics=metrics,
                )
            )
        record.findings.extend(findings)
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
        if finding.span != call.name or finding.reference is None or finding.metric not in ("peak", "allocated"):
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
