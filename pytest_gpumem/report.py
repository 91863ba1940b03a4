"""Findings and measurements → text: the terminal summary and the tables in failure messages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from tabulate import tabulate

from pytest_gpumem.figures import CATEGORIES, METRICS, PHASES, Measurement
from pytest_gpumem.units import format_delta, format_percent, format_size
from pytest_gpumem.verdict import Finding, Tolerance

__all__ = [
    "breakdown_rows",
    "finding_from_dict",
    "finding_to_dict",
    "json_report",
    "markdown_report",
    "measurement_table",
    "summary_rows",
    "summary_table",
]

#: Order of statuses in the summary: problems first.
STATUS_ORDER = ("exceeded", "regressed", "n/a", "stale", "improved", "new", "other-environment", "ok", "")

#: How a status reads in the summary, where it asks for something.
STATUS_TEXT = {"improved": "improved: update baselines", "new": "new: no baseline yet"}

SUMMARY_HEADERS = ("test", "span", "metric", "measured", "cost", "baseline", "Δ", "Δ%", "limit / budget", "status")


class RecordLike(Protocol):
    nodeid: str
    measurements: list[Measurement]
    findings: list[Finding]
    errors: list[str]


def _short(nodeid: str) -> str:
    """The node id without the folders of its file (parametrize ids may hold "/" too)."""
    path, sep, rest = nodeid.partition("::")
    return path.rsplit("/", 1)[-1] + sep + rest


def _limit_text(finding: Finding) -> str:
    text = format_size(finding.reference)
    if finding.kind == "budget":
        ratio = finding.ratio
        ratio_text = "" if ratio is None else f", ×{ratio:.3f}"
        return f"{finding.detail or ''} = {text}{ratio_text}".strip()
    return text


def summary_rows(records: Iterable[RecordLike], *, only_problems: bool = False) -> list[list[str]]:
    """One row per test, span and metric: figures, baseline comparison, limit, status.

    Failing rows come first, the rest in test order. ``only_problems`` keeps only
    failing rows (and errors).
    """
    rows: list[tuple[int, list[str]]] = []
    for record in records:
        test = _short(record.nodeid)
        for error in record.errors:
            rows.append((0, [test, "", "", "", "", "", "", "", error, "error"]))
        for measurement in record.measurements:
            findings = [f for f in record.findings if f.span == measurement.name]
            for metric in METRICS:
                value = measurement.figure(metric)
                metric_findings = [f for f in findings if f.metric == metric]
                if value is None and not metric_findings:
                    continue
                limit = next((f for f in metric_findings if f.kind in ("limit", "budget")), None)
                baseline = next((f for f in metric_findings if f.kind == "baseline"), None)
                statuses = [f.status for f in metric_findings]
                status = min(statuses, key=STATUS_ORDER.index) if statuses else ""
                failed = any(f.failed for f in metric_findings)
                if only_problems and not failed:
                    continue
                cost = None if metric == "retained" else measurement.cost(metric)
                rows.append(
                    (
                        0 if failed else 1,
                        [
                            test,
                            measurement.name,
                            metric,
                            format_size(value),
                            "" if metric == "retained" else format_size(cost),
                            "" if baseline is None or baseline.reference is None else format_size(baseline.reference),
                            "" if baseline is None or baseline.delta is None else format_delta(baseline.delta),
                            ""
                            if baseline is None or baseline.delta is None
                            else format_percent(baseline.delta, baseline.reference),
                            "" if limit is None else _limit_text(limit),
                            STATUS_TEXT.get(status, status),
                        ],
                    )
                )
    rows.sort(key=lambda pair: pair[0])
    return [row for _, row in rows]


def breakdown_rows(measurements: Sequence[tuple[str, Measurement]]) -> list[list[str]]:
    """One row per (test, span) with a breakdown: bytes by category at the peak, phases' peaks."""
    rows = []
    for test, measurement in measurements:
        if measurement.breakdown is None and not measurement.phases:
            continue
        breakdown = measurement.breakdown or {}
        phases = measurement.phases
        rows.append(
            [
                _short(test),
                measurement.name,
                *(format_size(breakdown.get(c)) if measurement.breakdown is not None else "n/a" for c in CATEGORIES),
                *(format_size(phases[p].peak) if p in phases else "" for p in PHASES),
                format_size(measurement.saved_activations),
                "" if measurement.psi is None else f"{measurement.psi:,}",
            ]
        )
    return rows


BREAKDOWN_HEADERS = (
    "test",
    "span",
    *CATEGORIES,
    *(f"{phase} peak" for phase in PHASES),
    "saved for backward",
    "Ψ",
)


def environment_notes(records: Iterable[RecordLike]) -> list[str]:
    """One line per test whose baselines exist only for other environments, naming them."""
    notes = []
    for record in records:
        other = next((f for f in record.findings if f.status == "other-environment"), None)
        if other is not None:
            notes.append(
                f"{_short(record.nodeid)}: no baseline in this environment; baselines only for: {other.detail}"
            )
    return notes


def summary_table(records: Iterable[RecordLike], *, only_problems: bool = False) -> str:
    """The terminal summary: figures and verdicts, then (unless ``only_problems``) breakdowns."""
    records = list(records)
    text = tabulate(summary_rows(records, only_problems=only_problems), headers=SUMMARY_HEADERS, disable_numparse=True)
    notes = environment_notes(records)
    if notes:
        text += "\n\n" + "\n".join(notes)
    if only_problems:
        return text
    rows = breakdown_rows([(record.nodeid, m) for record in records for m in record.measurements])
    if rows:
        text += "\n\nbreakdown at peak, and phase peaks\n"
        text += tabulate(rows, headers=BREAKDOWN_HEADERS, disable_numparse=True)
    return text


def measurement_table(measurements: Sequence[Measurement]) -> str:
    """Figures, breakdown at peak and phases of one test's spans: for failure messages."""
    figures = [
        [
            m.name,
            m.engine,
            format_size(m.start),
            format_size(m.peak),
            format_size(m.allocated),
            format_size(m.reserved),
            format_size(m.retained),
            format_size(m.saved_activations),
        ]
        for m in measurements
    ]
    text = tabulate(
        figures,
        headers=("span", "engine", "start", "peak", "allocated", "reserved", "retained", "saved for backward"),
        disable_numparse=True,
    )
    with_breakdown = [m for m in measurements if m.breakdown is not None]
    if with_breakdown:
        rows = [[m.name, *(format_size((m.breakdown or {}).get(c)) for c in CATEGORIES)] for m in with_breakdown]
        text += "\n\nbreakdown at peak\n" + tabulate(rows, headers=("span", *CATEGORIES), disable_numparse=True)
    phase_rows = [
        [m.name, name, format_size(phase.start), format_size(phase.peak), format_size(phase.end)]
        for m in measurements
        for name, phase in m.phases.items()
    ]
    if phase_rows:
        text += "\n\nphases\n" + tabulate(
            phase_rows, headers=("span", "phase", "start", "peak", "end"), disable_numparse=True
        )
    return text


#: Version of the JSON report's layout (see README, "Reports").
REPORT_SCHEMA = 1


def finding_to_dict(finding: Finding) -> dict[str, object]:
    """A finding as JSON-ready data (sizes in bytes)."""
    return {
        "test": finding.test,
        "span": finding.span,
        "metric": finding.metric,
        "kind": finding.kind,
        "status": finding.status,
        "failed": finding.failed,
        "measured": finding.measured,
        "reference": finding.reference,
        "delta": finding.delta,
        "delta_pct": None if finding.delta_pct is None else round(finding.delta_pct, 4),
        "ratio": None if finding.ratio is None else round(finding.ratio, 6),
        "tolerance": None
        if finding.tolerance is None
        else {"relative": finding.tolerance.relative, "absolute": finding.tolerance.absolute},
        "tolerance_text": None if finding.tolerance is None else str(finding.tolerance),
        "grown": dict(finding.grown),
        "detail": finding.detail,
        "strict": finding.strict,
    }


def finding_from_dict(data: Mapping[str, Any]) -> Finding:
    """Rebuild a finding written by :func:`finding_to_dict`."""
    tolerance = data.get("tolerance")
    return Finding(
        test=str(data["test"]),
        span=str(data["span"]),
        metric=str(data["metric"]),
        kind=data["kind"],
        status=data["status"],
        measured=data.get("measured"),
        reference=data.get("reference"),
        tolerance=None if tolerance is None else Tolerance(float(tolerance["relative"]), int(tolerance["absolute"])),
        grown={str(k): int(v) for k, v in (data.get("grown") or {}).items()},
        detail=str(data.get("detail", "")),
        strict=bool(data.get("strict", False)),
    )


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
        counts["failed"] += int(bool(record.errors) or any(f.failed for f in record.findings))
        for finding in record.findings:
            if finding.status in counts:
                counts[finding.status] += 1
        tests.append(
            {
                "nodeid": record.nodeid,
                "environment": getattr(record, "environment", None),
                "measurements": [m.to_dict() for m in record.measurements],
                "findings": [finding_to_dict(f) for f in record.findings],
                "errors": list(record.errors),
            }
        )
    counts["stale"] = sum(1 for f in extra_findings if f.status == "stale")
    return {
        "schema": REPORT_SCHEMA,
        "generator": generator,
        "environments": list(environments),
        "tests": tests,
        "other_findings": [finding_to_dict(f) for f in extra_findings],
        "summary": counts,
    }


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_report(
    records: Iterable[RecordLike],
    *,
    header: str = "",
    extra_findings: Sequence[Finding] = (),
) -> str:
    """A GitHub-flavoured Markdown report: a heading, the environment, one table."""
    records = list(records)
    rows = summary_rows(records)
    failed = sum(1 for record in records if record.errors or any(f.failed for f in record.findings))
    lines = ["## gpumem", ""]
    if header:
        lines += [f"Environment: `{header}`", ""]
    lines.append(f"{len(records)} measured test(s), {failed} failing on memory.")
    lines.append("")
    lines.append("| " + " | ".join(SUMMARY_HEADERS) + " |")
    lines.append("|" + "---|" * len(SUMMARY_HEADERS))
    for row in rows:
        lines.append("| " + " | ".join(_md(cell) for cell in row) + " |")
    notes = environment_notes(records)
    if notes:
        lines += ["", *(f"- {_md(note)}" for note in notes)]
    stale = [f for f in extra_findings if f.status == "stale"]
    if stale:
        lines += ["", "Stale baselines (their tests no longer exist):", ""]
        lines += [f"- `{_md(f.test)}`" for f in stale]
    return "\n".join(lines) + "\n"
