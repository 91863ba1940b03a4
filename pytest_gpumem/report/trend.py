"""The memory trend across commits: the baseline file's history as tables, sparklines, an HTML page and CI exports.

Every function takes a :class:`~pytest_gpumem.baselines.history.History` and the series to show; figures are the
baselines' costs.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence

from pytest_gpumem.baselines.history import Commit, History, Version
from pytest_gpumem.data.metrics import BASELINE_METRICS, METRICS, metric_info
from pytest_gpumem.report.cells import delta_text, figure_text
from pytest_gpumem.report.html import html_page, html_text
from pytest_gpumem.report.html import svg_number as _n
from pytest_gpumem.tables import markdown_table, table
from pytest_gpumem.units import format_size

__all__ = [
    "Series",
    "github_benchmark_json",
    "history_html",
    "history_table",
    "metrics_of",
    "openmetrics",
    "select",
    "sparklines",
]

#: One series: (environment key, test node id, span).
Series = tuple[str, str, str]

_BARS = "▁▂▃▄▅▆▇█"
_COLOURS = {"peak": "#b3261e", "allocated": "#1f3a5f", "reserved": "#00796b", "retained": "#8d6e00"}
_OTHER_COLOURS = ("#6a3d9a", "#e15759", "#4e79a7", "#59a14f")


def select(history: History, tests: Sequence[str] = (), environment: str | None = None) -> list[Series]:
    """The series of ``history`` whose node id contains one of ``tests`` and whose key contains ``environment``."""
    return [
        (env, test, span)
        for env, test, span in history.series()
        if (not tests or any(text in test for text in tests))
        and (environment is None or environment.casefold() in env.casefold())
    ]


def metrics_of(history: History, series: Sequence[Series], wanted: Sequence[str] = ()) -> list[str]:
    """``wanted``, or the metrics the series hold a figure for (the baseline metrics first)."""
    if wanted:
        return list(wanted)
    held = {
        metric
        for version in history.versions
        for key in series
        for metric, value in version.figures.get(key, {}).items()
        if value is not None
    }
    known = [m for m in (*BASELINE_METRICS, *METRICS) if m in held]
    return list(dict.fromkeys(known)) + sorted(held.difference(known))


def _points(history: History, series: Series, metric: str) -> list[tuple[int, Commit, int | None]]:
    """(version index, commit, value) of each version that holds ``series``."""
    return [
        (index, version.commit, version.figures[series].get(metric))
        for index, version in enumerate(history.versions)
        if series in version.figures
    ]


def _delta(metric: str, before: int | None, after: int | None, exact: bool) -> str:
    if before is None or after is None:
        return f"{figure_text(metric, before, exact)} → {figure_text(metric, after, exact)}"
    return delta_text(metric, after - before, exact)


def _changes(before: Version | None, after: Version, series: Series, metrics: Sequence[str], exact: bool) -> str:
    """What changed in ``series`` from ``before`` to ``after``: ``peak +1.00 KiB``; ``recorded`` when new."""
    if before is None or series not in before.figures:
        return "recorded"
    old, new = before.figures[series], after.figures[series]
    return ", ".join(
        f"{metric} {_delta(metric, old.get(metric), new.get(metric), exact)}"
        for metric in metrics
        if old.get(metric) != new.get(metric)
    )


def _per_environment(
    series: Sequence[Series],
    headers: list[str],
    right: Sequence[int],
    markdown: bool,
    rows_of: Callable[[Series], list[list[str]]],
) -> str:
    """One table per environment of ``series``, with ``rows_of`` each series."""
    blocks = []
    for environment in dict.fromkeys(env for env, _, _ in series):
        rows = [row for key in series if key[0] == environment for row in rows_of(key)]
        if markdown:
            blocks.append(f"### `{environment}`\n\n{markdown_table(headers, rows, right=right)}")
        else:
            blocks.append(f"{environment}\n{table(headers, rows, right=right)}")
    return "\n\n".join(blocks)


def history_table(
    history: History, series: Sequence[Series], metrics: Sequence[str], *, exact: bool = False, markdown: bool = False
) -> str:
    """One table per environment: a row per commit that holds a span, with its figures and what changed."""

    def rows_of(key: Series) -> list[list[str]]:
        rows = []
        previous: Version | None = None
        for version in history.versions:
            commit = version.commit
            cells = [key[1], key[2], commit.short, commit.day, commit.subject]
            if key in version.figures:
                figures = version.figures[key]
                cells += [figure_text(metric, figures.get(metric), exact) for metric in metrics]
                rows.append([*cells, _changes(previous, version, key, metrics, exact)])
            elif previous is not None and key in previous.figures:
                rows.append([*cells, *[""] * len(metrics), "removed"])
            previous = version
        return rows

    headers = ["test", "span", "commit", "date", "subject", *metrics, "change"]
    return _per_environment(series, headers, range(5, 5 + len(metrics)), markdown, rows_of)


def sparkline(values: Sequence[int | None]) -> str:
    """One character per value, ``▁`` (lowest) to ``█`` (highest); a space for n/a."""
    known = [v for v in values if v is not None]
    if not known:
        return " " * len(values)
    low, high = min(known), max(known)
    if low == high:
        return "".join(" " if v is None else _BARS[3] for v in values)
    return "".join(" " if v is None else _BARS[round((v - low) / (high - low) * (len(_BARS) - 1))] for v in values)


def sparklines(
    history: History, series: Sequence[Series], metrics: Sequence[str], *, exact: bool = False, markdown: bool = False
) -> str:
    """One row per test, span and metric: its sparkline over the commits (oldest left), first and last value and change;
    one table per environment."""

    def rows_of(key: Series) -> list[list[str]]:
        rows = []
        for metric in metrics:
            values = [value for _, _, value in _points(history, key, metric)]
            if all(value is None for value in values):
                continue
            first, last = values[0], values[-1]
            changes = sum(1 for a, b in itertools.pairwise(values) if a != b)
            shown = [figure_text(metric, first, exact), figure_text(metric, last, exact)]
            change = _delta(metric, first, last, exact) if first != last else ""
            rows.append([key[1], key[2], metric, sparkline(values), *shown, change, f"{len(values)} / {changes}"])
        return rows

    headers = ["test", "span", "metric", "trend", "first", "last", "change", "commits / changes"]
    return _per_environment(series, headers, (4, 5, 6, 7), markdown, rows_of)


def _latest(history: History, series: Sequence[Series], metrics: Sequence[str]) -> Iterator[tuple[Series, str, int]]:
    """(series, metric, value) of each known figure of the newest commit."""
    latest = history.latest
    if latest is None:
        return
    for key in series:
        figures = latest.figures.get(key, {})
        for metric in metrics:
            value = figures.get(metric)
            if value is not None:
                yield key, metric, value


def github_benchmark_json(history: History, series: Sequence[Series], metrics: Sequence[str]) -> str:
    """github-action-benchmark's ``customSmallerIsBetter`` JSON: the newest commit, an entry per test, span and metric.

    n/a figures and ``max_microbatch`` are left out. Raises ``ValueError`` when the series span several environments
    (the names would collide): choose one with ``--env``.
    """
    environments = sorted({env for env, _, _ in series})
    if len(environments) > 1:
        raise ValueError(
            f"the history holds {len(environments)} environments ({'; '.join(environments)}): "
            "choose one with --env for github-benchmark (one benchmark name per test, span and metric)"
        )
    if history.latest is None:
        return "[]\n"
    commit = history.latest.commit
    entries = [
        {
            "name": f"{key[1]} [{key[2]}] {metric}",
            "unit": "bytes" if metric_info(metric).unit == "bytes" else "count",
            "value": value,
            "extra": f"commit {commit.short} ({commit.day}); environment {key[0]}",
        }
        for key, metric, value in _latest(history, series, metrics)
        if not metric_info(metric).higher_is_better
    ]
    return json.dumps(entries, indent=2, ensure_ascii=False) + "\n"


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def openmetrics(history: History, series: Sequence[Series], metrics: Sequence[str]) -> str:
    """OpenMetrics text of the newest commit's figures (``gpumem_cost_bytes``, ``gpumem_cost``) ending in ``# EOF``."""
    families: dict[str, list[str]] = {"gpumem_cost_bytes": [], "gpumem_cost": []}
    for key, metric, value in _latest(history, series, metrics):
        family = "gpumem_cost_bytes" if metric_info(metric).unit == "bytes" else "gpumem_cost"
        labels = ",".join(
            f'{name}="{_label_value(text)}"'
            for name, text in (("test", key[1]), ("span", key[2]), ("metric", metric), ("environment", key[0]))
        )
        families[family].append(f"{family}{{{labels}}} {value}")
    lines = []
    for family, samples in families.items():
        if not samples:
            continue
        lines.append(f"# TYPE {family} gauge")
        if family.endswith("_bytes"):
            lines.append(f"# UNIT {family} bytes")
        lines.append(f"# HELP {family} pytest-gpumem baseline cost, newest commit of the baseline file")
        lines += samples
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the HTML page

_W, _H = 960, 310
_LEFT, _RIGHT, _TOP, _BOTTOM = 90, 820, 44, 260
_LABEL_GAP = 52  # the narrowest distance between two commit labels in one row

_CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; color: #1d2330;
  background: #f6f7f9; margin: 0; }
main { max-width: 1080px; margin: 0 auto; padding: 20px 24px 32px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 22px 0 8px; word-break: break-all; }
h3 { font-size: 14px; margin: 0 0 6px; word-break: break-all; }
.meta { color: #5b6474; margin: 0 0 14px; }
.card { background: #fff; border: 1px solid #dde1e7; border-radius: 8px; padding: 14px 16px; margin: 0 0 14px;
  overflow-x: auto; }
svg { display: block; width: 100%; height: auto; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; font-size: 11px;
  fill: #3b4352; }
svg .grid-line { stroke: #e6e9ee; } svg .axis { stroke: #8a93a3; }
svg .change line { stroke: #3b4352; stroke-dasharray: 3 3; } svg .change text { font-weight: 600; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eceff3; text-align: left; vertical-align: top; }
th { font-weight: 600; color: #5b6474; font-size: 12px; }
td.num { text-align: right; white-space: nowrap; } code { font-size: 12px; }
.skipped { color: #8a4b00; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin: 0 4px 0 10px; }
"""


def _colour(metric: str, index: int) -> str:
    return _COLOURS.get(metric, _OTHER_COLOURS[index % len(_OTHER_COLOURS)])


def _ticks(high: int) -> list[int]:
    """Round sizes from 0 to at least ``high``, a power of two apart (four to eight steps)."""
    if high <= 0:
        return [0, 1]
    step = 1 << max(0, math.ceil(math.log2(high / 4)) - 1) if high >= 8 else 1
    while high / step > 8:
        step *= 2
    return [step * i for i in range(math.ceil(high / step) + 1)]


def _chart(history: History, key: Series, metrics: Sequence[str]) -> tuple[str, list[tuple[int, Commit, str]]]:
    """The SVG chart of one series and its changes: (version index, commit, what changed) of each commit that changed a
    figure or recorded it."""
    count = len(history.versions)
    known = [(m, [(i, c, v) for i, c, v in _points(history, key, m) if v is not None]) for m in metrics]
    drawn = [(metric, points) for metric, points in known if points]
    ticks = _ticks(max((v for _, points in drawn for _, _, v in points), default=0))
    high = ticks[-1] or 1
    span = max(count - 1, 1)

    def x(index: int) -> float:
        return _LEFT + (_RIGHT - _LEFT) * (index / span if count > 1 else 0.5)

    def y(value: int) -> float:
        return _BOTTOM - (_BOTTOM - _TOP) * value / high

    parts = [f'<svg viewBox="0 0 {_W} {_H}" role="img" aria-label="{html_text(key[1])} {html_text(key[2])}">']
    for tick in ticks:
        parts.append(
            f'<line class="grid-line" x1="{_LEFT}" x2="{_RIGHT}" y1="{_n(y(tick))}" y2="{_n(y(tick))}"/>'
            f'<text x="{_LEFT - 6}" y="{_n(y(tick) + 4)}" text-anchor="end">{html_text(format_size(tick))}</text>'
        )
    parts.append(f'<line class="axis" x1="{_LEFT}" x2="{_RIGHT}" y1="{_BOTTOM}" y2="{_BOTTOM}"/>')
    # changes: a commit where any drawn figure differs from the version before (or the span appears)
    changes: list[tuple[int, Commit, str]] = []
    for index, version in enumerate(history.versions):
        previous = history.versions[index - 1] if index else None
        text = _changes(previous, version, key, [m for m, _ in drawn], exact=False) if key in version.figures else ""
        if text:
            changes.append((index, version.commit, text))
    last_label = [-1e9, -1e9]  # x of the last label in each of the two rows above the chart
    for index, commit, text in changes:
        position = x(index)
        row = 0 if position - last_label[0] >= _LABEL_GAP else 1
        label = ""
        if position - last_label[row] >= _LABEL_GAP:  # else too close to its neighbours: the tooltip names it
            last_label[row] = position
            label = (
                f'<text x="{_n(position)}" y="{_TOP - 10 - 13 * row}" text-anchor="middle">'
                f"{html_text(commit.short[:7])}</text>"
            )
        parts.append(
            f'<g class="change" data-commit="{html_text(commit.sha)}">'
            f"<title>{html_text(commit.short)} {html_text(commit.day)} "
            f"{html_text(commit.subject)}: {html_text(text)}</title>"
            f'<line x1="{_n(position)}" x2="{_n(position)}" y1="{_TOP - 4}" y2="{_BOTTOM}"/>{label}</g>'
        )
    for position, (metric, points) in enumerate(drawn):
        colour = _colour(metric, position)
        # a line through each run of consecutive commits (a gap: the span was not in the file, or n/a)
        for _, run in itertools.groupby(enumerate(points), key=lambda item: item[1][0] - item[0]):
            segment = [f"{_n(x(index))},{_n(y(value))}" for _, (index, _, value) in run]
            if len(segment) > 1:
                parts.append(
                    f'<polyline data-metric="{html_text(metric)}" points="{" ".join(segment)}" fill="none" '
                    f'stroke="{colour}" stroke-width="2"/>'
                )
        for index, commit, value in points:
            parts.append(
                f'<circle data-metric="{html_text(metric)}" cx="{_n(x(index))}" cy="{_n(y(value))}" r="3.5" '
                f'fill="{colour}"><title>{html_text(metric)} {html_text(format_size(value))} ({value:,} B) at '
                f"{html_text(commit.short)} {html_text(commit.day)}: {html_text(commit.subject)}</title></circle>"
            )
        last = points[-1][2]
        parts.append(
            f'<text x="{_RIGHT + 8}" y="{_n(y(last) + 4)}" fill="{colour}" style="fill:{colour}">'
            f"{html_text(metric)} {html_text(format_size(last))}</text>"
        )
    first, last_version = history.versions[0].commit, history.versions[-1].commit
    parts.append(f'<text x="{_LEFT}" y="{_BOTTOM + 18}">{html_text(first.short[:7])} {html_text(first.day)}</text>')
    if count > 1:
        parts.append(
            f'<text x="{_RIGHT}" y="{_BOTTOM + 18}" text-anchor="end">'
            f"{html_text(last_version.short[:7])} {html_text(last_version.day)}</text>"
        )
    parts.append(
        f'<text x="{(_LEFT + _RIGHT) / 2}" y="{_BOTTOM + 36}" text-anchor="middle">'
        f"commits of the baseline file, oldest on the left ({count})</text>"
    )
    parts.append("</svg>")
    return "".join(parts), changes


def history_html(history: History, series: Sequence[Series], metrics: Sequence[str], *, title: str = "") -> str:
    """One self-contained page: a chart per test and span of ``metrics`` over the commits, and a table of changes."""
    heading = title or f"Memory trend of {history.file.name}"
    versions = history.versions
    parts = [f"<h1>{html_text(heading)}</h1>"]
    if versions:
        parts.append(
            f'<p class="meta">{len(versions)} commits of <code>{html_text(history.file)}</code>, from '
            f"{html_text(versions[0].commit.short)} ({html_text(versions[0].commit.day)}) to "
            f"{html_text(versions[-1].commit.short)} ({html_text(versions[-1].commit.day)}). Costs: a figure minus "
            "its span's start.</p>"
        )
    notes = [v for v in versions if v.note]
    if history.skipped or notes:
        items = [
            f"<li>{html_text(s.commit.short)} {html_text(s.commit.subject)}: skipped, {html_text(s.reason)}</li>"
            for s in history.skipped
        ]
        items += [f"<li>{html_text(v.commit.short)}: {html_text(v.note)}</li>" for v in notes]
        parts.append(f'<div class="card skipped"><ul>{"".join(items)}</ul></div>')
    legend = "".join(
        f'<span class="swatch" style="background:{_colour(m, i)}"></span>{html_text(m)}' for i, m in enumerate(metrics)
    )
    if not series:
        parts.append('<div class="card">No test matches.</div>')
    for environment in dict.fromkeys(env for env, _, _ in series):
        parts.append(f"<h2>{html_text(environment)}</h2>")
        for key in (s for s in series if s[0] == environment):
            chart, changes = _chart(history, key, metrics)
            rows = "".join(
                f"<tr><td><code>{html_text(commit.short)}</code></td><td>{html_text(commit.day)}</td>"
                f"<td>{html_text(commit.subject)}</td><td>{html_text(text)}</td></tr>"
                for _, commit, text in changes
            )
            parts.append(
                f'<section class="card" data-test="{html_text(key[1])}" data-span="{html_text(key[2])}">'
                f'<h3>{html_text(key[1])} <span class="meta">[{html_text(key[2])}]</span></h3>'
                f'<p class="meta">{legend}</p>{chart}'
                f"<table><tr><th>commit</th><th>date</th><th>subject</th><th>change</th></tr>{rows}</table></section>"
            )
    return html_page(f"{heading} · pytest-gpumem", _CSS, parts)
