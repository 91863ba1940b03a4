"""Findings and measurements → text: the terminal summary, the tables in failure messages, the reports.

Every table gives its columns one meaning:

- **measured**: the figure as the engine read it, absolute (everything alive on
  the device, including what was there when the span began);
- **cost**: the figure minus the span's start, what the span itself added. Limits
  and baselines compare costs. ``allocated`` and ``retained`` costs are net
  changes and signed (``+2.50 MiB``; ``-1.00 MiB`` when the span freed more than
  it allocated); ``retained`` has no absolute figure, only a cost;
- **limit**: the limit or budget the cost is compared with; **baseline**: the
  recorded cost; **Δ**: cost − baseline.

Terminal tables fit a given width (``width=None``: no limit). A table that is too
wide first elides long span names in the middle, then puts each test's id on a
line of its own above its rows (elided in the middle if it is wider than the
terminal, keeping its function name and parametrize id), then leaves out the
baseline and Δ% columns (saying so below it), then narrows the space between
columns, and at last shows one record per block. Long details (budget
expressions, the other environments, errors, why a figure is n/a) are numbered
notes below the table; a legend line explains what a table shows only when it
shows it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pytest_gpumem.data.figures import Measurement, Phase
from pytest_gpumem.data.findings import Finding, failure_message
from pytest_gpumem.data.metrics import CATEGORIES, COUNT_METRICS, METRICS, PHASES, metric_info
from pytest_gpumem.tables import (
    Col,
    Table,
    plain,
    short_id,
    wrap,
    wrap_items,
)
from pytest_gpumem.units import SizeError, format_percent, format_size, parse_size

__all__ = [
    "breakdown_rows",
    "environment_notes",
    "failure_text",
    "json_report",
    "markdown_report",
    "measurement_table",
    "summary_rows",
    "summary_table",
    "terminal_summary",
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

#: What a status asks for, in the legend under the summary (only for statuses the table shows).
STATUS_TEXT = {
    "new": "new: no baseline yet (--gpumem-update-baselines records one)",
    "improved": "improved: update baselines (--gpumem-update-baselines)",
    "unchecked": "unchecked: no limit or baseline compared this figure",
}

#: Columns of :func:`summary_rows`, the summary table and the Markdown report.
SUMMARY_HEADERS = ("test", "span", "metric", "measured", "cost", "limit", "baseline", "Δ", "Δ%", "status")

#: Index of each of a summary row's cells after the test id.
_CELL = {name: i for i, name in enumerate(SUMMARY_HEADERS[1:])}

#: Metrics whose cost is a net change, shown signed (they can be negative).
SIGNED_METRICS = ("allocated", "retained")

#: Metrics without an absolute figure: the figure is already a difference (its cost).
COST_ONLY_METRICS = ("retained",)

LEGEND_COST = "cost = measured − the span's start: what limits and baselines compare"
LEGEND_DELTA = "Δ\xa0=\xa0cost\xa0−\xa0baseline"  # no-break spaces: wrapped whole (shown as spaces)
LEGEND_SIGNED = "a negative allocated or retained cost: the span freed more than it allocated"
LEGEND_COUNT = "×N: the phase ran N times in the span (e.g. a warm-up step and the measured step)"


class RecordLike(Protocol):
    """What the reports read of a test's record (:class:`pytest_gpumem.judge.record.TestRecord`)."""

    nodeid: str
    measurements: list[Measurement]
    findings: list[Finding]
    errors: list[str]
    #: the test's own code passed (in every phase)
    passed: bool

    @property
    def failed(self) -> bool:
        """The test fails on memory (the one rule: :attr:`TestRecord.failed`)."""


class _Notes:
    """Numbered notes below a table; the same text gets the same number."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}

    @property
    def texts(self) -> list[str]:
        return list(self.numbers)

    def ref(self, text: str) -> str:
        number = self.numbers.setdefault(text, len(self.numbers) + 1)
        return f"[{number}]"

    def lines(self, width: int | None) -> list[str]:
        """``[n] text``, wrapped under its number; a line of its own per paragraph ("\\n"), whose " | " parts
        (environment keys) break only between parts."""
        lines = []
        for number, text in enumerate(self.texts, 1):
            mark = f"[{number}] "
            indent = " " * len(mark)
            first, *rest = text.split("\n")
            lines += wrap(mark + first, width, "", indent)
            for paragraph in rest:
                lines += wrap_items(_key_items(paragraph), width, indent, indent + "  ")
        return lines


# --------------------------------------------------------------------------- cells


def _cost_text(metric: str, value: int | None) -> str:
    """A cost (or a baseline, which is a recorded cost): signed for net changes."""
    info = metric_info(metric)
    return info.format_delta(value) if metric in SIGNED_METRICS else info.format(value)


def _percent(delta: int, reference: int | None) -> str:
    """Δ as a percentage of the baseline's size: a cost that frees less than its baseline grew (+)."""
    return format_percent(delta, None if reference is None else abs(reference))


def _plain_size(text: str) -> bool:
    try:
        parse_size(text)
    except SizeError:
        return False
    return True


def _other_environments(detail: str) -> str:
    """A note on a finding's other environments: one paragraph per environment key.

    The finding's detail reads "baselines only for: KEY; KEY"; a detail without
    the prefix is taken as the keys alone.
    """
    prefix = "baselines only for: "
    keys = (detail[len(prefix) :] if detail.startswith(prefix) else detail).split("; ")
    return "\n".join(["no baseline in this environment; baselines only for:", *keys])


def _one_line(note: str) -> str:
    """A note's paragraphs on one line: the first, then the others separated by "; "."""
    first, *rest = note.split("\n")
    return first + (" " + "; ".join(rest) if rest else "")


def _limit_note(finding: Finding) -> str | None:
    """What the limit cell cannot say: a budget's expression and ratio, why a figure is n/a, where a limit came from."""
    info = metric_info(finding.metric)
    value = info.format(finding.reference)
    if finding.status == "n/a":
        return f"{finding.metric} {finding.kind} {value} cannot be checked: {finding.detail or 'figure unknown'}"
    if finding.kind == "budget":
        ratio = finding.ratio
        used = "" if ratio is None else f", ×{ratio:.3f} used"
        expression = f"{finding.detail} = " if finding.detail else ""
        return f"{finding.metric} budget {expression}{value}{used}"
    if finding.detail and not _plain_size(finding.detail) and finding.detail != value:
        return f"{finding.metric} limit {finding.detail}"
    return None


@dataclass
class _Row:
    """One row of the summary: a test, span and metric (or an error of the test)."""

    test: str
    failed: bool
    cells: list[str]  # SUMMARY_HEADERS[1:]
    notes: dict[int, str] = field(default_factory=dict)  # cell index → what moved below the table

    @property
    def status(self) -> str:
        return self.cells[_CELL["status"]]


def _status_of(findings: Sequence[Finding]) -> str:
    if not findings:
        return "unchecked"
    order = {status: i for i, status in enumerate(STATUS_ORDER)}
    return min((f.status for f in findings), key=lambda s: order.get(s, len(order)))


def _metric_row(
    test: str, measurement: Measurement, metric: str, findings: Sequence[Finding], verbosity: int
) -> _Row | None:
    value = measurement.figure(metric)
    if value is None and not findings:
        return None
    if metric == "retained" and not findings and not value and verbosity < 1:
        return None  # nothing retained and nothing asked: shown with -v
    info = metric_info(metric)
    limits = sorted((f for f in findings if f.kind in ("limit", "budget")), key=lambda f: not f.failed)
    limit = limits[0] if limits else None
    baseline = next((f for f in findings if f.kind == "baseline"), None)
    status = _status_of(findings)
    cells = [
        measurement.name,
        metric,
        "" if metric in COST_ONLY_METRICS else info.format(value),
        _cost_text(metric, measurement.cost(metric)),
        "" if limit is None else info.format(limit.reference),
        "" if baseline is None or baseline.reference is None else _cost_text(metric, baseline.reference),
        "" if baseline is None or baseline.delta is None else info.format_delta(baseline.delta),
        "" if baseline is None or baseline.delta is None else _percent(baseline.delta, baseline.reference),
        status,
    ]
    notes: dict[int, str] = {}
    note = None if limit is None else _limit_note(limit)
    cost = measurement.cost(metric)
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
    if measurement.notes and metric in ("peak", "allocated", "retained"):  # a partial figure says so
        notes[_CELL["measured"]] = "partial: " + "; ".join(measurement.notes)
    other = next((f for f in findings if f.status == "other-environment"), None)
    if other is not None:
        notes[_CELL["status"]] = _other_environments(other.detail)
    return _Row(test, any(f.failed for f in findings), cells, notes)


def _rows(records: Iterable[RecordLike], *, only_problems: bool, verbosity: int) -> list[_Row]:
    """The summary's rows: tests with a problem first, and in each test its problem rows first."""
    tests: list[tuple[bool, list[_Row]]] = []
    for record in records:
        error = [""] * (len(_CELL) - 1) + ["error"]
        rows = [_Row(record.nodeid, True, list(error), {_CELL["status"]: text}) for text in record.errors]
        for measurement in record.measurements:
            findings = [f for f in record.findings if f.span == measurement.name]
            for metric in METRICS + COUNT_METRICS:
                row = _metric_row(
                    record.nodeid, measurement, metric, [f for f in findings if f.metric == metric], verbosity
                )
                if row is not None:
                    rows.append(row)
        if only_problems or verbosity < 0:
            rows = [row for row in rows if row.failed]
        rows.sort(key=lambda row: not row.failed)  # stable: the order of spans and metrics stays
        if rows:
            tests.append((any(row.failed for row in rows), rows))
    tests.sort(key=lambda item: not item[0])
    return [row for _, rows in tests for row in rows]


def _test_id(nodeid: str, verbosity: int) -> str:
    return nodeid if verbosity > 0 else short_id(nodeid)


def summary_rows(records: Iterable[RecordLike], *, only_problems: bool = False, verbosity: int = 0) -> list[list[str]]:
    """The summary's rows as text, one per test, span and metric, in :data:`SUMMARY_HEADERS` order.

    Cells: ``measured`` (absolute figure; empty for ``retained``, which is
    already a difference), ``cost`` (figure − the span's start; signed for
    ``allocated`` and ``retained``), ``limit``, ``baseline`` (the recorded cost),
    ``Δ``, ``Δ%``, ``status`` (``unchecked`` when nothing compared the figure).
    What the summary table puts in notes (a budget's expression, the other
    environments, an error's text) follows its cell in parentheses here.

    Tests with a problem come first, and in each test its failing rows; a zero
    ``retained`` that nothing checked is left out unless ``verbosity`` > 0,
    which also gives full node ids (else without the file's folders).
    ``only_problems`` (or ``verbosity`` < 0) keeps only failing rows and errors.
    """
    table = []
    for row in _rows(records, only_problems=only_problems, verbosity=verbosity):
        cells = [cell + (f" ({_one_line(row.notes[i])})" if i in row.notes else "") for i, cell in enumerate(row.cells)]
        table.append([_test_id(row.test, verbosity), *cells])
    return table


def _legend(rows: Sequence[_Row]) -> list[str]:
    if not rows:
        return []
    lines = [LEGEND_COST]
    if any(row.cells[_CELL["Δ"]] for row in rows):
        lines[0] += "; " + LEGEND_DELTA
    signed = (_CELL["cost"], _CELL["baseline"])
    if any(
        row.cells[_CELL["metric"]] in SIGNED_METRICS and any(row.cells[i].startswith("-") for i in signed)
        for row in rows
    ):
        lines.append(LEGEND_SIGNED)
    shown = {row.status for row in rows}
    lines += [text for status, text in STATUS_TEXT.items() if status in shown]
    return lines


def _summary_table(rows: Sequence[_Row], notes: _Notes, verbosity: int, *, markdown: bool = False) -> Table:
    groups = _grouped(
        (
            row.test if markdown else _test_id(row.test, verbosity),
            [[cell + (f" {notes.ref(row.notes[i])}" if i in row.notes else "") for i, cell in enumerate(row.cells)]],
        )
        for row in rows
    )
    span, metric, measured, cost, limit, baseline, delta, percent, status = SUMMARY_HEADERS[1:]
    cols = (
        Col(span, elastic=True, min_width=8, span=True),
        Col(metric),
        Col(measured, right=True),
        Col(cost, right=True),
        Col(limit, right=True, optional=True),
        Col(baseline, right=True, optional=True, drop=2),
        Col(delta, right=True, optional=True),
        Col(percent, right=True, optional=True, joins=True, drop=1),
        Col(status, label=""),
    )
    test = Col(SUMMARY_HEADERS[0])
    return Table(cols, groups, test, lead=2, status=_CELL["status"])


def summary_table(
    records: Iterable[RecordLike],
    *,
    only_problems: bool = False,
    width: int | None = None,
    verbosity: int = 0,
    environments: Sequence[str] = (),
) -> str:
    """The terminal summary: one row per test, span and metric, notes and a legend below.

    ``width`` is the terminal's width (pytest's ``terminalreporter._tw.fullwidth``):
    every line fits in it (``None``: no limit). ``verbosity`` is pytest's
    (``config.get_verbosity()``): below 0 only failing rows and errors (as
    ``only_problems``); 0 the compact table; above 0 full node ids, every
    ``retained`` row, then the breakdown at the peak and the phases of each span.
    ``environments`` (their keys) head the summary, each key broken only between
    its " | " parts. "" when there is nothing to show.
    """
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
    if verbosity > 0 and not (only_problems or verbosity < 0):
        measurements = [(record.nodeid, m) for record in records for m in record.measurements]
        lines += _detail_tables(measurements, width, verbosity)
    return "\n".join(lines)


def _key_items(key: str) -> list[str]:
    """An environment key's parts, for wrapping between them."""
    parts = key.split(" | ")
    return [part + " |" for part in parts[:-1]] + parts[-1:]


def terminal_summary(
    records: Sequence[RecordLike],
    *,
    stale: Sequence[Finding] = (),
    environments: Mapping[str, int | None] | None = None,
    width: int | None = None,
    verbosity: int = 0,
    baselines: tuple[Path, bool] | None = None,
    pruning: bool = False,
) -> str | None:
    """The gpumem section at the end of a run; None when there is nothing to say.

    ``environments`` maps each key to the bytes of library workspaces its device kept
    (None where there are none); ``baselines`` is ``(path, written)`` when the run
    recorded baselines; ``pruning`` whether it removes stale ones. Below verbosity 0
    only problems are shown, and nothing when there is none.
    """
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
        lines += [f"  {finding.test}  [{finding.detail}]" for finding in shown]  # ids and paths are never broken
    if baselines is not None:
        path, written = baselines
        lines.append(f"baselines {'written to' if written else 'unchanged in'} {path}")
        skipped = [r.nodeid for r in records if not r.passed or r.failed]
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


# --------------------------------------------------------------------------- breakdown and phases


def _phase_name(phase: Phase) -> str:
    return phase.name if phase.count == 1 else f"{phase.name} ×{phase.count}"


def _phase_peak(phase: Phase) -> str:
    return format_size(phase.peak) if phase.count == 1 else f"{format_size(phase.peak)} ×{phase.count}"


def _psi(measurement: Measurement) -> str:
    return "" if measurement.psi is None else f"{measurement.psi:,}"


def _categories(measurement: Measurement) -> list[str]:
    breakdown = measurement.breakdown
    return [format_size(breakdown.get(c)) if breakdown is not None else "n/a" for c in CATEGORIES]


def breakdown_rows(measurements: Sequence[tuple[str, Measurement]], *, phases: bool = True) -> list[list[str]]:
    """One row per (test, span) with a breakdown or phases, in ``BREAKDOWN_HEADERS`` order.

    Bytes by category at the peak, each phase's peak (``"19.05 MiB ×2"`` when the
    phase ran twice in the span), saved for backward, Ψ. ``phases=False`` leaves
    the phase columns out (``BREAKDOWN_HEADERS`` without them).
    """
    rows = []
    for test, measurement in measurements:
        if measurement.breakdown is None and not measurement.phases:
            continue
        peaks = [_phase_peak(measurement.phases[p]) if p in measurement.phases else "" for p in PHASES]
        rows.append(
            [
                short_id(test),
                measurement.name,
                *_categories(measurement),
                *(peaks if phases else ()),
                format_size(measurement.saved_activations),
                _psi(measurement),
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

_BREAKDOWN_COLS = (
    Col("span", elastic=True, min_width=8, span=True),
    *(Col(c, right=True) for c in CATEGORIES),
    Col("saved for backward", right=True),
    Col("Ψ", right=True, optional=True),
)
_PHASE_COLS = (
    Col("span", elastic=True, min_width=8, span=True),
    Col("phase"),
    Col("start", right=True),
    Col("peak", right=True),
    Col("end", right=True),
)


def _phase_cells(measurement: Measurement) -> list[list[str]]:
    return [
        [measurement.name, _phase_name(p), format_size(p.start), format_size(p.peak), format_size(p.end)]
        for p in measurement.phases.values()
    ]


def _grouped(pairs: Iterable[tuple[str, list[list[str]]]]) -> list[tuple[str, list[list[str]]]]:
    """Rows by title, consecutive rows with the same title in one group."""
    groups: list[tuple[str, list[list[str]]]] = []
    for title, rows in pairs:
        if not rows:
            continue
        if groups and groups[-1][0] == title:
            groups[-1][1].extend(rows)
        else:
            groups.append((title, list(rows)))
    return groups


def _breakdown_cells(measurement: Measurement) -> list[list[str]]:
    if measurement.breakdown is None:
        return []
    saved = format_size(measurement.saved_activations)
    return [[measurement.name, *_categories(measurement), saved, _psi(measurement)]]


def _count_legend(measurements: Iterable[Measurement], width: int | None) -> list[str]:
    if any(phase.count > 1 for m in measurements for phase in m.phases.values()):
        return wrap(LEGEND_COUNT, width, "", "  ")
    return []


def _detail_tables(measurements: Sequence[tuple[str, Measurement]], width: int | None, verbosity: int) -> list[str]:
    """``-v``: the breakdown at the peak and the phases of every span, by test."""
    breakdown = _grouped((_test_id(test, verbosity), _breakdown_cells(m)) for test, m in measurements)
    phases = _grouped((_test_id(test, verbosity), _phase_cells(m)) for test, m in measurements)
    id_col = Col("test")
    lines: list[str] = []
    if breakdown:
        lines += ["", *wrap("breakdown at peak", width), *Table(_BREAKDOWN_COLS, breakdown, id_col).render(width)]
    if phases:
        lines += ["", *wrap("phases", width), *Table(_PHASE_COLS, phases, id_col, lead=2).render(width)]
        lines += _count_legend((m for _, m in measurements), width)
    return lines


def environment_notes(records: Iterable[RecordLike]) -> list[str]:
    """One line per test whose baselines exist only for other environments, naming them."""
    notes = []
    for record in records:
        other = next((f for f in record.findings if f.status == "other-environment"), None)
        if other is not None:
            notes.append(f"{short_id(record.nodeid)}: {_one_line(_other_environments(other.detail))}")
    return notes


# --------------------------------------------------------------------------- failure messages

_FIGURE_COLS = (
    Col("span", elastic=True, min_width=8, span=True),
    Col("metric"),
    Col("start", right=True),
    Col("measured", right=True),
    Col("cost", right=True),
)


def _figure_rows(measurement: Measurement) -> list[list[str]]:
    """Span, metric, start, measured, cost: one row per known figure (a difference or a count has no start)."""
    rows = []
    for metric in METRICS + COUNT_METRICS:
        value = measurement.figure(metric)
        if value is None:
            continue
        start = measurement.start_reserved if metric == "reserved" else measurement.start
        rows.append(
            [
                measurement.name,
                metric,
                "" if metric in COST_ONLY_METRICS or metric in COUNT_METRICS else format_size(start),
                "" if metric in COST_ONLY_METRICS else metric_info(metric).format(value),
                _cost_text(metric, measurement.cost(metric)),
            ]
        )
    return rows


def measurement_table(measurements: Sequence[Measurement], *, width: int | None = None) -> str:
    """The figures of one test's spans, for its failure message.

    One row per span and figure: ``start`` (what the span began with),
    ``measured`` (absolute) and ``cost`` (their difference, signed for
    ``allocated`` and ``retained``); then the breakdown at the peak with saved
    for backward and Ψ, and the phases (``forward ×2``: entered twice in the
    span). Every line fits in ``width`` (``None``: no limit).
    """
    engines = sorted({f"{m.device} ({m.engine} engine)" for m in measurements})
    lines = wrap(f"figures on {', '.join(engines)}", width) if engines else []
    lines += Table(_FIGURE_COLS, [("", [row for m in measurements for row in _figure_rows(m)])], lead=2).render(width)
    unknown = [  # retained is the whole call's only: a test's named spans have none
        metric
        for metric in METRICS
        if metric not in COST_ONLY_METRICS and measurements and all(m.figure(metric) is None for m in measurements)
    ]
    legend = [LEGEND_COST]
    if any((m.cost(metric) or 0) < 0 for m in measurements for metric in SIGNED_METRICS):
        legend.append(LEGEND_SIGNED)
    if unknown:
        legend.append(f"not known on this engine: {', '.join(unknown)}")
    legend += [f"partial figures of {m.name}: {note}" for m in measurements for note in m.notes]
    for text in legend:
        lines += wrap(text, width, "", "  ")
    breakdown = [row for m in measurements for row in _breakdown_cells(m)]
    if breakdown:
        lines += ["", *wrap("breakdown at peak", width), *Table(_BREAKDOWN_COLS, [("", breakdown)]).render(width)]
    phases = [row for m in measurements for row in _phase_cells(m)]
    if phases:
        lines += ["", *wrap("phases", width), *Table(_PHASE_COLS, [("", phases)], lead=2).render(width)]
        lines += _count_legend(measurements, width)
    return "\n".join(lines)


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


# --------------------------------------------------------------------------- Markdown


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_report(
    records: Iterable[RecordLike],
    *,
    header: str = "",
    extra_findings: Sequence[Finding] = (),
) -> str:
    """A GitHub-flavoured Markdown report: a heading, the environment, the summary as one table.

    The columns, notes and legend are the terminal summary's (full node ids, no
    width limit).
    """
    records = list(records)
    rows = _rows(records, only_problems=False, verbosity=0)
    failed = sum(1 for record in records if record.failed)
    lines = ["## gpumem", ""]
    if header:
        lines += [f"Environment: `{header}`", ""]
    lines.append(f"{len(records)} measured test(s), {failed} failing on memory.")
    lines.append("")
    lines.append("| " + " | ".join(SUMMARY_HEADERS) + " |")
    lines.append("|" + "---|" * len(SUMMARY_HEADERS))
    notes = _Notes()
    for title, cells in _summary_table(rows, notes, 0, markdown=True).groups:
        for row in cells:
            lines.append("| " + " | ".join(_md(cell) for cell in [title, *row]) + " |")
    below = [f"- [{number}] {_one_line(text)}" for number, text in enumerate(notes.texts, 1)]
    below += [f"- {plain(text)}" for text in _legend(rows)]
    if below:
        lines += ["", *below]
    stale = [f for f in extra_findings if f.status == "stale"]
    if stale:
        lines += ["", "Stale baselines (their tests no longer exist):", ""]
        lines += [f"- `{_md(f.test)}`" for f in stale]
    return "\n".join(lines) + "\n"


def failure_text(record: RecordLike, *, reports: Sequence[str] = (), width: int | None = None) -> str:
    """The text of a test that failed on memory: its errors, the broken checks, ``reports``
    (the out-of-memory report, the leaked tensors), then its figures."""
    parts = [f"gpumem: {error}" for error in record.errors]
    broken = [finding for finding in record.findings if finding.failed]
    if broken:
        parts.append(failure_message(broken))
    parts.extend(reports)
    if record.measurements:
        parts.append(measurement_table(record.measurements, width=width))
    return "\n\n".join(parts)
