"""Findings and measurements → text: the terminal summary and the Markdown report; long details become numbered
notes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import Finding
from pytest_gpumem.data.metrics import COUNT_METRICS, METRICS, metric_info
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.cells import (
    COST_ONLY_METRICS,
    LEGEND_COST,
    LEGEND_DELTA,
    LEGEND_SIGNED,
    SIGNED_METRICS,
    grouped,
    one_line,
    other_environments,
)
from pytest_gpumem.report.details import detail_tables, test_id
from pytest_gpumem.report.site_tables import site_markdown
from pytest_gpumem.tables import Col, Table, markdown_code, markdown_text, plain, visible, wrap, wrap_items
from pytest_gpumem.units import SizeError, format_percent, format_size, parse_size

__all__ = [
    "markdown_report",
    "summary_rows",
    "summary_table",
    "terminal_summary",
    "worst_status",
]

#: Order of statuses in the summary: problems first. "unchecked": a figure no limit or baseline compared.
STATUS_ORDER = (
    "error",
    "exceeded",
    "regressed",
    "n/a",
    "stale",
    "improved",
    "new",
    "other-environment",
    "ok",
    "unchecked",
)


_RANK = {status: i for i, status in enumerate(STATUS_ORDER)}


def worst_status(findings: Iterable[Finding]) -> str:
    """The first of :data:`STATUS_ORDER` among ``findings``' statuses ("unchecked" when nothing judged the figure)."""
    return min((f.status for f in findings), key=lambda s: _RANK.get(s, len(_RANK)), default="unchecked")


#: What a status asks for, in the legend under the summary (only for statuses the table shows).
STATUS_TEXT = {
    "new": "new: no baseline yet (--gpumem-update-baselines records one)",
    "improved": "improved: update baselines (--gpumem-update-baselines)",
    "stale": "stale: recorded, not measured by this run (--gpumem-update-baselines records the test again)",
    "unchecked": "unchecked: no limit or baseline compared this figure",
}

#: The summary table's columns after the test id.
_COLS = (
    Col("span", elastic=True, min_width=8, span=True),
    Col("metric"),
    Col("measured", right=True),
    Col("cost", right=True),
    Col("limit", right=True, optional=True),
    Col("baseline", right=True, optional=True, drop=2),
    Col("Δ", right=True, optional=True),
    Col("Δ%", right=True, optional=True, joins=True, drop=1),
    Col("status", label=""),
)

#: Columns of :func:`summary_rows`, the summary table and the Markdown report.
SUMMARY_HEADERS = ("test", *(col.header for col in _COLS))

#: Index of each of a summary row's cells after the test id.
_CELL = {name: i for i, name in enumerate(SUMMARY_HEADERS[1:])}


class _Notes(dict[str, int]):
    """Numbered notes below a table, text → number; the same text gets the same number."""

    def ref(self, text: str) -> str:
        return f"[{self.setdefault(text, len(self) + 1)}]"

    def lines(self, width: int | None) -> list[str]:
        """``[n] text``, wrapped under its number, a line per paragraph; environment keys break only between " | "
        parts."""
        lines = []
        for text, number in self.items():
            mark = f"[{number}] "
            indent = " " * len(mark)
            first, *rest = text.split("\n")
            lines += wrap(mark + first, width, "", indent)
            for paragraph in rest:
                lines += wrap_items(_key_items(paragraph), width, indent, indent + "  ")
        return lines


def _limit_note(finding: Finding) -> str | None:
    """What the limit cell cannot say: a budget's expression and ratio, why a figure is n/a, where a limit came from."""
    info = metric_info(finding.metric)
    value = info.format(finding.reference)
    if finding.status == "n/a":
        return f"{finding.metric} {finding.kind} {value} cannot be checked: {finding.detail or 'figure unknown'}"
    if finding.kind == "budget":
        used = "" if finding.ratio is None else f", ×{finding.ratio:.3f} used"
        expression = f"{finding.detail} = " if finding.detail else ""
        return f"{finding.metric} budget {expression}{value}{used}"
    if finding.detail and finding.detail != value:
        try:
            parse_size(finding.detail)
        except SizeError:  # not a plain size: say where the limit came from
            return f"{finding.metric} limit {finding.detail}"
    return None


@dataclass
class _Row:
    """One row of the summary: a test, span and metric (or an error of the test)."""

    test: str
    failed: bool
    cells: list[str]  # SUMMARY_HEADERS[1:]
    notes: dict[int, str] = field(default_factory=dict)  # cell index → what moved below the table


def _percent(baseline: Finding) -> str:
    """Δ as a percentage of the baseline's size: a cost that frees less than its baseline grew (+)."""
    return format_percent(baseline.delta, None if baseline.reference is None else abs(baseline.reference))


def _metric_row(
    test: str, measurement: Measurement, metric: str, findings: Sequence[Finding], verbosity: int
) -> _Row | None:
    info, value = metric_info(metric), measurement.figure(metric)
    if not findings and (value is None or (info.whole_call and not value and verbosity < 1)):
        return None  # nothing to show (nothing retained and nothing asked: shown with -v)
    limit = min((f for f in findings if f.kind in ("limit", "budget")), key=lambda f: not f.failed, default=None)
    baseline = next((f for f in findings if f.kind == "baseline"), None)
    status = worst_status(findings)
    cost = measurement.cost(metric)
    cells = [
        measurement.name,
        metric,
        "" if metric in COST_ONLY_METRICS else info.format(value),
        info.format_cost(cost),
        "" if limit is None else info.format(limit.reference),
        "" if baseline is None or baseline.reference is None else info.format_cost(baseline.reference),
        "" if baseline is None or baseline.delta is None else info.format_delta(baseline.delta),
        "" if baseline is None or baseline.delta is None else _percent(baseline),
        status,
    ]
    notes: dict[int, str] = {}
    note = None if limit is None else _limit_note(limit)
    bound = None if limit is None else limit.reference
    # a measured figure above a limit that passed reads like a breach: say what the limit compared
    if bound is not None and value is not None and cost is not None and value > bound >= cost:
        compared = (
            f"the {metric} limit {info.format(bound)} bounds the cost, {info.format(cost)}; "
            f"the measured {info.format(value)} includes the {info.format(value - cost)} there at the span's start"
        )
        note = compared if not note else f"{note}; {compared}"
    if note:
        notes[_CELL["limit"]] = note
    if measurement.notes and info.unit == "bytes" and not info.allocator:  # a partial figure (the tracker's) says so
        notes[_CELL["measured"]] = "partial: " + "; ".join(measurement.notes)
    other = next((f for f in findings if f.status == "other-environment"), None)
    if other is not None:
        notes[_CELL["status"]] = other_environments(other.detail)
    return _Row(test, any(f.failed for f in findings), cells, notes)


def _status_row(test: str, failed: bool, span: str, status: str, note: str) -> _Row:
    """A row of a span and a status alone, the note below the table: an error, or a span recorded, not measured."""
    return _Row(test, failed, [span, *[""] * (len(_CELL) - 2), status], {_CELL["status"]: note})


def _rows(records: Iterable[TestRecord], *, only_problems: bool, verbosity: int) -> list[_Row]:
    """The summary's rows: tests with a problem first, and in each test its problem rows first."""
    tests: list[list[_Row]] = []
    for record in records:
        rows = [_status_row(record.nodeid, True, "", "error", text) for text in record.errors]
        for measurement in record.measurements:
            for metric in METRICS + COUNT_METRICS:
                findings = [f for f in record.findings if (f.span, f.metric) == (measurement.name, metric)]
                row = _metric_row(record.nodeid, measurement, metric, findings, verbosity)
                if row is not None:
                    rows.append(row)
        spans = {measurement.name for measurement in record.measurements} | {"*"}
        unmeasured = "the span was recorded, not measured by this run"  # a renamed or removed measure() block
        rows += [
            _status_row(record.nodeid, f.failed, f.span, f.status, unmeasured)
            for f in record.findings
            if f.span not in spans
        ]
        if only_problems or verbosity < 0:
            rows = [row for row in rows if row.failed]
        rows.sort(key=lambda row: not row.failed)  # stable: the order of spans and metrics stays
        if rows:
            tests.append(rows)
    tests.sort(key=lambda rows: not rows[0].failed)  # a test's failed rows come first
    return [row for rows in tests for row in rows]


def summary_rows(records: Iterable[TestRecord], *, only_problems: bool = False, verbosity: int = 0) -> list[list[str]]:
    """The summary's rows as text in :data:`SUMMARY_HEADERS` order, what the table puts in notes in parentheses after
    its cell."""
    table = []
    for row in _rows(records, only_problems=only_problems, verbosity=verbosity):
        cells = [cell + (f" ({one_line(row.notes[i])})" if i in row.notes else "") for i, cell in enumerate(row.cells)]
        table.append([test_id(row.test, verbosity), *cells])
    return table


def _legend(rows: Sequence[_Row]) -> list[str]:
    if not rows:
        return []
    lines = [LEGEND_COST]
    if any(row.cells[_CELL["Δ"]] for row in rows):
        lines[0] += "; " + LEGEND_DELTA
    negative = [row for row in rows if any(row.cells[_CELL[name]].startswith("-") for name in ("cost", "baseline"))]
    if any(row.cells[_CELL["metric"]] in SIGNED_METRICS for row in negative):
        lines.append(LEGEND_SIGNED)
    shown = {row.cells[_CELL["status"]] for row in rows}
    lines += [text for status, text in STATUS_TEXT.items() if status in shown]
    return lines


def _summary_table(rows: Sequence[_Row], notes: _Notes, verbosity: int) -> Table:
    groups = grouped(
        (
            visible(test_id(row.test, verbosity)),
            [
                [
                    visible(cell) + (f" {notes.ref(visible(row.notes[i]))}" if i in row.notes else "")
                    for i, cell in enumerate(row.cells)
                ]
            ],
        )
        for row in rows
    )
    return Table(_COLS, groups, Col("test"), lead=2, status=_CELL["status"])


def summary_table(
    records: Iterable[TestRecord],
    *,
    only_problems: bool = False,
    width: int | None = None,
    verbosity: int = 0,
    environments: Sequence[str] = (),
) -> str:
    """The terminal summary: one row per test, span and metric, notes and a legend below, every line in ``width``;
    ``verbosity`` is pytest's (above 0: full ids, every ``retained`` row, the breakdown and phases)."""
    records = list(records)
    lines = _environment_lines(environments, width)
    rows = _rows(records, only_problems=only_problems, verbosity=verbosity)
    if not rows:
        return "\n".join(lines)
    notes = _Notes()
    lines += _summary_table(rows, notes, verbosity).render(width)
    below = notes.lines(width)
    for text in _legend(rows):
        below += wrap(text, width, "", "  ")
    if below:
        lines += ["", *below]
    if verbosity > 0 and not only_problems:
        lines += detail_tables([(r.nodeid, m) for r in records for m in r.measurements], width)
    return "\n".join(lines)


def _key_items(key: str) -> list[str]:
    """An environment key's parts, for wrapping between them."""
    parts = key.split(" | ")
    return [part + " |" for part in parts[:-1]] + parts[-1:]


def terminal_summary(
    records: Sequence[TestRecord],
    *,
    stale: Sequence[Finding] = (),
    environments: Mapping[str, int | None] | None = None,
    width: int | None = None,
    verbosity: int = 0,
    baselines: tuple[Path, bool] | None = None,
    pruning: bool = False,
    kept: Mapping[str, int] | None = None,
) -> str | None:
    """The gpumem section at the end of a run (None: nothing to say); ``environments``: each key's library workspace
    bytes, ``baselines``: ``(path, written)``, ``kept``: tests whose baselines the run could not judge, by why."""
    quiet = verbosity < 0
    problems = any(record.failed for record in records) or any(f.failed for f in stale)
    if (not records and not stale and baselines is None) or (quiet and not problems):
        return None
    keys = [
        key if held is None else f"{key} (library workspaces kept on the device: {format_size(held)})"
        for key, held in (environments or {}).items()
    ]
    lines = [summary_table(records, only_problems=quiet, width=width, verbosity=verbosity, environments=keys)]
    shown = [f for f in stale if f.failed or not quiet]
    if shown:
        prune = "" if pruning else " (remove them with --gpumem-update-baselines --gpumem-prune)"
        lines += wrap(f"stale baselines, their tests no longer exist{prune}:", width)
        lines += [f"  {visible(f.test)}  [{visible(f.detail)}]" for f in shown]  # ids and paths are never broken
    if kept and (pruning or verbosity > 0) and not quiet:
        total = sum(kept.values())
        reasons = "; ".join(f"{count} {why}" for why, count in sorted(kept.items(), key=lambda item: -item[1]))
        noun = "test" if total == 1 else "tests"
        lines += wrap(f"kept the baselines of {total} {noun} this run could not judge: {reasons}", width)
    if baselines is not None:
        path, written = baselines
        lines.append(f"baselines {'written to' if written else 'unchanged in'} {path}")
        skipped = [visible(r.nodeid) for r in records if not r.passed or r.failed]
        if skipped:
            lines += wrap(f"not recorded, the test or its memory check failed: {', '.join(skipped)}", width)
    return "\n".join(line for line in lines if line)


def _environment_lines(keys: Sequence[str], width: int | None) -> list[str]:
    if len(keys) == 1:
        return wrap_items(["environment:", *_key_items(keys[0])], width, "", "  ")
    lines = ["environments:"] if keys else []
    for key in keys:
        lines += wrap_items(_key_items(key), width, "  ", "    ")
    return lines


def markdown_report(
    records: Iterable[TestRecord],
    *,
    header: str = "",
    extra_findings: Sequence[Finding] = (),
    fold_passing: bool = False,
) -> str:
    """A GitHub-flavoured Markdown report of the summary; ``fold_passing`` folds the passing tests' rows away."""
    records = list(records)
    rows = _rows(records, only_problems=False, verbosity=0)
    failed = sum(1 for record in records if record.failed)
    lines = ["## gpumem", ""]
    if header:
        lines += [f"Environment: {markdown_code(header)}", ""]
    lines.append(f"{len(records)} measured test(s), {failed} failing on memory.")
    notes = _Notes()
    tables = [rows]
    if fold_passing:
        failing = {row.test for row in rows if row.failed}
        tables = [[row for row in rows if row.test in failing], [row for row in rows if row.test not in failing]]
    for index, shown in enumerate(tables):
        if not shown and (index or len(tables) > 1):
            continue
        lines.append("")
        if index:
            passing = len({row.test for row in shown})
            lines += [f"<details><summary>{passing} test(s) passing on memory</summary>", ""]
        lines += ["| " + " | ".join(SUMMARY_HEADERS) + " |", "|" + "---|" * len(SUMMARY_HEADERS)]
        for title, cells in _summary_table(shown, notes, 1).groups:  # full ids
            lines += ["| " + " | ".join(markdown_text(cell) for cell in [title, *row]) + " |" for row in cells]
        if index:
            lines += ["", "</details>"]
    below = [f"- [{number}] {markdown_text(one_line(text), cell=False)}" for text, number in notes.items()]
    below += [f"- {plain(text)}" for text in _legend(rows)]
    if below:
        lines += ["", *below]
    stale = [f for f in extra_findings if f.status == "stale"]
    if stale:
        lines += ["", "Stale baselines (their tests no longer exist):", ""]
        lines += [f"- {markdown_code(f.test)}" for f in stale]
    sites = site_markdown(records)
    if sites:
        lines += ["", sites.rstrip("\n")]
    return "\n".join(lines) + "\n"
