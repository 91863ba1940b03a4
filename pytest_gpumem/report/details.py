"""One test's figures as tables: the breakdown and phases (``-v``), and the text of a test that failed on memory."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pytest_gpumem.data.figures import Measurement, Phase
from pytest_gpumem.data.findings import Finding, failure_message
from pytest_gpumem.data.metrics import CATEGORIES, COUNT_METRICS, METRICS, PHASES, metric_info
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.cells import (
    COST_ONLY_METRICS,
    LEGEND_COST,
    LEGEND_COUNT,
    LEGEND_SIGNED,
    SIGNED_METRICS,
    grouped,
    one_line,
    other_environments,
)
from pytest_gpumem.report.site_tables import site_lines
from pytest_gpumem.tables import Col, Table, short_id, wrap
from pytest_gpumem.units import format_size

__all__ = [
    "breakdown_rows",
    "detail_tables",
    "environment_notes",
    "error_section",
    "failure_text",
    "measurement_table",
    "test_id",
]


def test_id(nodeid: str, verbosity: int) -> str:
    return nodeid if verbosity > 0 else short_id(nodeid)


def _times(text: str, phase: Phase) -> str:
    """``text`` with how many times ``phase`` ran, when more than once."""
    return text if phase.count == 1 else f"{text} ×{phase.count}"


def _saved(m: Measurement) -> list[str]:
    """Its bytes saved for backward and its Ψ."""
    return [format_size(m.saved_activations), "" if m.psi is None else f"{m.psi:,}"]


def _categories(measurement: Measurement) -> list[str]:
    breakdown = measurement.breakdown
    return [format_size(breakdown.get(c)) if breakdown is not None else "n/a" for c in CATEGORIES]


def breakdown_rows(measurements: Sequence[tuple[str, Measurement]]) -> list[list[str]]:
    """One row per (test, span) with a breakdown or phases: test, span, categories, phase peaks, saved for backward,
    Ψ."""
    rows = []
    for test, m in measurements:
        if m.breakdown is not None or m.phases:
            peaks = [_times(format_size(m.phases[p].peak), m.phases[p]) if p in m.phases else "" for p in PHASES]
            rows.append([short_id(test), m.name, *_categories(m), *peaks, *_saved(m)])
    return rows


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
        [measurement.name, _times(p.name, p), format_size(p.start), format_size(p.peak), format_size(p.end)]
        for p in measurement.phases.values()
    ]


def _breakdown_cells(m: Measurement) -> list[list[str]]:
    return [] if m.breakdown is None else [[m.name, *_categories(m), *_saved(m)]]


def detail_tables(
    measurements: Sequence[tuple[str, Measurement]], width: int | None, *, failure: bool = False
) -> list[str]:
    """The breakdown at the peak and the phases of every span, by test id (``-v``); ``failure``: one test's, for its
    failure message (no test column)."""
    breakdown = grouped((test, _breakdown_cells(m)) for test, m in measurements)
    phases = grouped((test, _phase_cells(m)) for test, m in measurements)
    title = None if failure else Col("test")
    lines: list[str] = []
    if breakdown:
        lines += ["", *wrap("breakdown at peak", width), *Table(_BREAKDOWN_COLS, breakdown, title).render(width)]
        if failure and any(m.breakdown is not None and "activations" not in m.breakdown for _, m in measurements):
            lines += wrap(LEGEND_ACTIVATIONS, width, "", "  ")
    if phases:
        lines += ["", *wrap("phases", width), *Table(_PHASE_COLS, phases, title, lead=2).render(width)]
        if any(phase.count > 1 for _, m in measurements for phase in m.phases.values()):
            lines += wrap(LEGEND_COUNT, width, "", "  ")
    return lines


def environment_notes(records: Iterable[TestRecord]) -> list[str]:
    """One line per test whose baselines exist only for other environments, naming them."""
    others = [(r, next((f for f in r.findings if f.status == "other-environment"), None)) for r in records]
    return [f"{short_id(r.nodeid)}: {one_line(other_environments(f.detail))}" for r, f in others if f is not None]


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
        info, value = metric_info(metric), measurement.figure(metric)
        if value is not None:
            start = info.format(getattr(measurement, info.cost)) if info.cost else ""
            measured = "" if info.whole_call else info.format(value)
            rows.append([measurement.name, metric, start, measured, info.format_cost(measurement.cost(metric))])
    return rows


def measurement_table(measurements: Sequence[Measurement], *, width: int | None = None) -> str:
    """The figures of one test's spans for its failure message: start, measured and cost per figure, then the breakdown
    and the phases; every line fits in ``width``."""
    engines = sorted({f"{m.device} ({m.engine} engine)" for m in measurements})
    lines = wrap(f"figures on {', '.join(engines)}", width) if engines else []
    lines += Table(_FIGURE_COLS, [("", [row for m in measurements for row in _figure_rows(m)])], lead=2).render(width)
    unknown = [  # a whole call's figure (retained): a test's named spans have none
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
    lines += detail_tables([("", m) for m in measurements], width, failure=True)
    return "\n".join(lines)


def failure_text(
    record: TestRecord, *, reports: Sequence[str] = (), width: int | None = None, verbosity: int = 0
) -> str:
    """The text of a test that failed on memory: its errors, the broken checks with the sites that grew, ``reports``,
    then its figures."""
    parts = [f"gpumem: {error}" for error in record.errors]
    broken = [finding for finding in record.findings if finding.failed]
    if broken:
        sites = site_lines(record, width=width, verbosity=verbosity)
        parts.append("\n".join([failure_message(broken), *_beyond_model_states(record, broken), *sites]))
    parts.extend(reports)
    if record.measurements:
        parts.append(measurement_table(record.measurements, width=width))
    return "\n\n".join(parts)


def error_section(
    record: TestRecord, *, reports: Sequence[str] = (), width: int | None = None, verbosity: int = 0
) -> str:
    """What a test that failed for its own reason (an OOM) adds to pytest's report: ``reports``, then its peak's
    sites."""
    sites = "\n".join(site_lines(record, width=width, verbosity=verbosity, error=True))
    return "\n\n".join(part for part in (*reports, sites) if part)


#: The categories a budget of model states counts (``16Ψ``): what the others hold is named apart.
_MODEL_STATES = ("parameters", "gradients", "optimizer_state")

#: Under the breakdown of a span whose activations were not told apart from temporaries.
LEGEND_ACTIVATIONS = (
    "activations n/a: counted among temporaries in this test; breakdown=True (or a baseline) tells them apart"
)


#: The breakdown that explains a broken limit on a figure, and when it was taken.
_BREAKDOWN_OF = {"peak": ("breakdown", "at the peak"), "allocated": ("allocated_breakdown", "at the return")}


def _beyond_model_states(record: TestRecord, broken: Sequence[Finding]) -> list[str]:
    """For each broken limit or budget on ``peak`` or ``allocated``: the bytes held beyond the model states
    (activations, temporaries, other), what most often goes over a budget."""
    lines: list[str] = []
    spans = {measurement.name: measurement for measurement in record.measurements}
    for finding in broken:
        measurement = spans.get(finding.span)
        exceeded = finding.kind in ("limit", "budget") and finding.status == "exceeded"
        if not exceeded or measurement is None or finding.metric not in _BREAKDOWN_OF:
            continue
        attribute, when = _BREAKDOWN_OF[finding.metric]
        categories: Mapping[str, int] | None = getattr(measurement, attribute)
        if not categories:
            continue
        # temporaries that include the activations say so
        temporaries = "temporaries" if "activations" in categories else "temporaries (activations among them)"
        beyond = [
            f"{temporaries if name == 'temporaries' else name} {format_size(size)}"
            for name, size in categories.items()
            if name not in _MODEL_STATES and size
        ]
        where = "" if finding.span == "call" else f"[{finding.span}] "
        if beyond:
            lines.append(f"{where}{finding.metric} {when} beyond the model states: {', '.join(beyond)}")
        else:
            states = ", ".join(f"{name} {format_size(categories.get(name, 0))}" for name in _MODEL_STATES)
            lines.append(f"{where}{finding.metric} {when}: nothing beyond the model states ({states})")
    return lines
