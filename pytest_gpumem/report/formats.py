"""The run's reports as files: the JSON report and the atomic writer it shares with the Markdown report."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines.canonical import json_bytes
from pytest_gpumem.data.findings import Finding
from pytest_gpumem.files import temporary_pid, write_file
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.ci import STEP_SUMMARY_LIMIT, capped_summary
from pytest_gpumem.report.text import markdown_report

__all__ = ["REPORT_SCHEMA", "json_report", "write_reports"]

#: Version of the JSON report's layout (see README, "Reports").
REPORT_SCHEMA = 1


def json_report(
    records: Iterable[TestRecord],
    *,
    environments: Sequence[dict[str, object]],
    extra_findings: Sequence[Finding] = (),
    generator: str = "",
) -> dict[str, object]:
    """The JSON report: environments (with their ``key``), every measurement, every verdict, and ``extra_findings`` that
    belong to no test that ran (stale baselines)."""
    tests = []
    counts = dict.fromkeys(("tests", "failed", "exceeded", "regressed", "improved", "new", "n/a"), 0)
    for record in records:
        changes = record.site_changes
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
                # for a record whose sites were compared with its baselines'
                **({"site_changes": {span: diff.to_dict() for span, diff in changes.items()}} if changes else {}),
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


def write_reports(
    records: Sequence[TestRecord],
    stale: Sequence[Finding],
    *,
    json_path: Path | None,
    markdown_path: Path | None,
    step_summary: str | None,
    generator: str = "",
) -> list[str]:
    """Write the JSON report, the Markdown report and the GitHub step summary (passing rows folded, capped under 1 MiB).

    One that cannot be written does not stop the others; returns a line per failed report naming it, its path and the
    reason, and a failed write leaves the previous file as it was.
    """
    if not records and not stale:
        return []
    problems: list[str] = []
    environments: list[dict[str, Any]] = []
    for record in records:
        if record.environment is not None and record.environment_key not in [e["key"] for e in environments]:
            environments.append({"key": record.environment_key, **record.environment})
    if json_path is not None:
        data = json_report(records, environments=environments, extra_findings=stale, generator=generator)
        problems += _report("JSON", json_path, json_bytes(json.dumps(data, indent=2, ensure_ascii=False) + "\n"))
    keys = sorted({record.environment_key for record in records if record.environment_key is not None})
    markdown = markdown_report(records, header=", ".join(keys), extra_findings=stale)
    if markdown_path is not None:
        problems += _report("Markdown", markdown_path, markdown.encode("utf-8", "backslashreplace"))
    if step_summary:
        folded = markdown_report(records, header=", ".join(keys), extra_findings=stale, fold_passing=True)
        try:
            _append_summary(Path(step_summary), folded)
        except OSError as exc:
            problems.append(f"could not append to $GITHUB_STEP_SUMMARY ({step_summary}): {exc.strerror or exc}")
    return problems


def _append_summary(path: Path, markdown: str) -> None:
    """Append ``markdown`` to the step summary file, cut so that the file stays under GitHub's limit."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = 0
    data, _ = capped_summary(markdown, STEP_SUMMARY_LIMIT - size)
    if not data:
        raise OSError(0, f"the file already holds {size:,} bytes of GitHub's {STEP_SUMMARY_LIMIT:,}: no room")
    _append(path, data)


def _append(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` whole or not at all (a failed write is cut back): no half report in the summary."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_BINARY", 0) | os.O_CLOEXEC, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):  # the file could be grown but not cut back
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def _report(kind: str, path: Path, data: bytes) -> list[str]:
    """Write a report with :func:`~pytest_gpumem.files.write_file`; the line saying what could not be written (none
    when it was)."""
    try:
        write_file(path, data)
    except OSError as exc:
        name = str(exc.filename or "")
        temporary = temporary_pid(path, Path(name).name) is not None  # write_file's own file beside it
        where = f" ({name})" if name and name != str(path) and not temporary else ""
        return [f"could not write the {kind} report {path}: {exc.strerror or exc}{where}"]
    return []
