"""The run's reports as files: the JSON report (every measurement, every finding) and the
atomic writer that the JSON and Markdown reports share."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines.canonical import json_bytes
from pytest_gpumem.data.findings import Finding
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.cells import RecordLike
from pytest_gpumem.report.text import markdown_report

__all__ = ["REPORT_SCHEMA", "json_report", "write_reports"]

# --------------------------------------------------------------------------- JSON

#: Version of the JSON report's layout (see README, "Reports").
REPORT_SCHEMA = 1


def json_report(
    records: Iterable[RecordLike],
    *,
    environments: Sequence[dict[str, object]],
    extra_findings: Sequence[Finding] = (),
    generator: str = "",
) -> dict[str, object]:
    """The JSON report: environments, every measurement, every verdict.

    ``environments`` are the environments' ``to_dict()`` with their ``key``;
    ``extra_findings`` are findings that belong to no test that ran (stale
    baselines).
    """
    tests = []
    counts = dict.fromkeys(("tests", "failed", "exceeded", "regressed", "improved", "new", "n/a"), 0)
    for record in records:
        counts["tests"] += 1
        counts["failed"] += int(record.failed)
        for finding in record.findings:
            if finding.status in counts:
                counts[finding.status] += 1
        tests.append(
            {
                "nodeid": record.nodeid,
                "environment": getattr(record, "environment", None),
                "measurements": [m.to_dict() for m in record.measurements],
                "findings": [f.to_dict() for f in record.findings],
                "errors": list(record.errors),
                **_site_changes(record),
            }
        )
    counts["stale"] = sum(1 for f in extra_findings if f.status == "stale")
    return {
        "schema": REPORT_SCHEMA,
        "generator": generator,
        "environments": list(environments),
        "tests": tests,
        "other_findings": [f.to_dict() for f in extra_findings],
        "summary": counts,
    }


def _site_changes(record: RecordLike) -> dict[str, object]:
    """``{"site_changes": {span: ...}}`` for a record whose sites were compared with its baselines', else nothing."""
    changes = getattr(record, "site_changes", None)
    return {"site_changes": {span: diff.to_dict() for span, diff in changes.items()}} if changes else {}


def write_reports(
    records: Sequence[TestRecord],
    stale: Sequence[Finding],
    *,
    json_path: Path | None,
    markdown_path: Path | None,
    step_summary: str | None,
    generator: str = "",
) -> None:
    """Write the run's reports: the JSON report at ``json_path``, the Markdown report at
    ``markdown_path`` (each atomically, when given) and the Markdown appended to the GitHub
    step summary file ``step_summary``. Nothing when there is nothing to report. Raises
    ``OSError`` naming the report and the path it could not write."""
    if not records and not stale:
        return
    environments: list[dict[str, Any]] = []
    for record in records:
        if record.environment is not None and record.environment_key not in [e["key"] for e in environments]:
            environments.append({"key": record.environment_key, **record.environment})
    if json_path is not None:
        data = json_report(records, environments=environments, extra_findings=stale, generator=generator)
        _report("JSON", json_path, json_bytes(json.dumps(data, indent=2, ensure_ascii=False) + "\n"))
    keys = sorted({record.environment_key for record in records if record.environment_key is not None})
    markdown = markdown_report(records, header=", ".join(keys), extra_findings=stale)
    if markdown_path is not None:
        _report("Markdown", markdown_path, markdown.encode("utf-8", "backslashreplace"))
    if step_summary:
        try:
            with open(step_summary, "a", encoding="utf-8", errors="backslashreplace") as handle:
                handle.write(markdown)
        except OSError as exc:
            raise OSError(
                exc.errno, f"could not append to $GITHUB_STEP_SUMMARY ({step_summary}): {exc.strerror}"
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
