"""A measured test as one self-contained HTML page (inline SVG, no scripts, no network), fit for a CI artifact."""

from __future__ import annotations

import html
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from pytest_gpumem.data.figures import Measurement, Timeline
from pytest_gpumem.data.metrics import CATEGORIES, METRICS, metric_info
from pytest_gpumem.units import UNITS, format_delta, format_size

__all__ = ["html_page", "html_text", "render_html", "svg_number"]

#: Fill colour of each category (colour-blind-friendly Tableau 10 hues).
_COLOURS: Mapping[str, str] = MappingProxyType(
    {
        "parameters": "#4e79a7",
        "gradients": "#f28e2b",
        "optimizer_state": "#59a14f",
        "activations": "#e15759",
        "temporaries": "#b07aa1",
        "other": "#a0a0a0",
    }
)
_LINE_COLOURS = ("#b3261e", "#1f3a5f", "#6a3d9a", "#00796b", "#8d6e00")
_NO_LINES: Mapping[str, int] = MappingProxyType({})

# Chart geometry, in SVG user units (the chart scales to the page width).
_WIDTH, _HEIGHT = 1000, 470
_LEFT, _RIGHT, _TOP, _BOTTOM = 84, 780, 62, 410
_MAX_COLUMNS = 350  # samples drawn at most: one per ~2 horizontal units
_CHAR_WIDTH = 6.2  # rough width of one character of 11-unit text

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")

_CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
  color: #1d2330; background: #f6f7f9; margin: 0; }
main { max-width: 1080px; margin: 0 auto; padding: 20px 24px 32px; }
h1 { font-size: 20px; margin: 0 0 4px; word-break: break-all; }
h2 { font-size: 15px; margin: 0 0 8px; }
.meta { color: #5b6474; margin: 0 0 14px; }
.meta b { color: #1d2330; font-weight: 600; }
.card { background: #fff; border: 1px solid #dde1e7; border-radius: 8px; padding: 14px 16px; margin: 0 0 14px;
  overflow-x: auto; }
figure { margin: 0; }
figure svg { display: block; width: 100%; height: auto; }
figcaption { color: #5b6474; font-size: 12px; margin-top: 4px; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(500px, 1fr)); gap: 14px; }
.grid .card { margin: 0; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eceff3; text-align: left; vertical-align: top; }
th { font-weight: 600; color: #5b6474; font-size: 12px; }
td.num, th.num { text-align: right; white-space: nowrap; }
td.note { color: #5b6474; font-size: 12px; }
.sites td.where { overflow-wrap: anywhere; }
.sites td code { white-space: pre-wrap; overflow-wrap: anywhere; font-size: 12px; }
.sites td.note { overflow-wrap: anywhere; min-width: 8em; }
tr.total td { font-weight: 600; border-bottom: none; }
.na { color: #98a0ad; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
pre { margin: 0; white-space: pre-wrap; word-break: break-word; font: 12.5px/1.45 ui-monospace, SFMono-Regular,
  Menlo, Consolas, "Liberation Mono", monospace; background: #fff8e6; border-left: 3px solid #e0a100;
  padding: 10px 12px; border-radius: 4px; }
footer { color: #98a0ad; font-size: 12px; text-align: center; padding-bottom: 16px; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; font-size: 11px;
  fill: #3b4352; }
svg .tick { font-variant-numeric: tabular-nums; }
svg .axis-title { font-size: 12px; fill: #5b6474; }
svg .grid-line { stroke: #e6e9ee; stroke-width: 1; }
svg .axis { stroke: #8a93a3; stroke-width: 1; }
svg .phase line { stroke: #3b4352; stroke-width: 1; stroke-dasharray: 3 3; }
svg .phase text { font-weight: 600; }
svg .ref line { stroke-width: 1.6; stroke-dasharray: 7 4; }
svg .band { fill-opacity: 0.88; }
svg .band:hover { fill-opacity: 1; }
svg .empty { font-size: 13px; fill: #98a0ad; }
"""


def render_html(
    *,
    title: str,
    measurement: Measurement,
    timeline: Timeline,
    lines: Mapping[str, int] = _NO_LINES,
    details: Sequence[str] = (),
    sections: Sequence[str] = (),
) -> str:
    """One self-contained HTML page showing ``measurement`` and ``timeline``.

    The SVG chart stacks allocated bytes by category over events (at most 350 columns, each its highest sample), with
    phase boundaries, one horizontal line per entry of ``lines`` and the peak marked; below it come ``details``, the
    figures, the breakdown and the phases. Every user string is escaped, and a Content-Security-Policy forbids fetching
    anything.
    """
    chart = _Chart(timeline, measurement, lines)
    parts = [
        f"<h1>{html_text(title)}</h1>",
        f'<p class="meta">{_meta_line(measurement)}</p>',
    ]
    if details:  # browsers drop a newline right after <pre>: the one written here, not the first line's
        parts += [
            '<section class="card details">',
            "<h2>Details</h2>",
            f"<pre>\n{html_text(chr(10).join(details))}</pre>",
            "</section>",
        ]
    parts += [
        '<section class="card">',
        "<h2>Allocated memory over the span</h2>",
        "<figure>",
        chart.svg(),
        f"<figcaption>{html_text(chart.caption())}</figcaption>",
        "</figure>",
        "</section>",
        *sections,  # HTML of its own: the sites, the baseline run's beside this run's (report/site_tables.py)
        _figures_table(measurement),
        '<div class="grid">',
        _breakdown_table(measurement, chart.peak),
        _phases_table(measurement),
        "</div>",
    ]
    footer = "<footer>pytest-gpumem · self-contained page: no scripts, no network</footer>"
    return html_page(f"{title} · pytest-gpumem", _CSS, parts, footer=[footer])


@dataclass(frozen=True)
class _Sample:
    """The bytes of each category, held from event ``start`` until ``end`` (exclusive)."""

    start: int
    end: int
    values: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.values)


def _samples(timeline: Timeline) -> list[_Sample]:
    """The timeline as steps sorted by event; missing or short series read 0."""
    columns = [tuple(timeline.series.get(category, ())) for category in CATEGORIES]
    rows = sorted(
        (
            (int(event), tuple(max(0, int(column[i])) if i < len(column) else 0 for column in columns))
            for i, event in enumerate(timeline.events)
        ),
        key=lambda row: row[0],
    )
    return [
        _Sample(event, rows[i + 1][0] if i + 1 < len(rows) else event + 1, values)
        for i, (event, values) in enumerate(rows)
    ]


def _downsample(samples: list[_Sample], lo: float, hi: float, columns: int) -> list[_Sample]:
    """At most ``columns`` steps: per column of the x range, its highest sample, spanning the column."""
    if len(samples) <= columns:
        return samples
    width = (hi - lo) / columns
    buckets = itertools.groupby(samples, key=lambda sample: min(columns - 1, int((sample.start - lo) / width)))
    return [_merge(list(bucket)) for _, bucket in buckets]


def _merge(bucket: list[_Sample]) -> _Sample:
    highest = max(bucket, key=lambda s: s.total)
    return _Sample(bucket[0].start, bucket[-1].end, highest.values)


def _group(name: str, items: list[str]) -> list[str]:
    return [f'<g class="{name}">', *items, "</g>"] if items else []


class _Chart:
    """The chart of one span: its samples, and scales from events ``x_lo..x_hi`` and bytes ``0..y_top``."""

    def __init__(self, timeline: Timeline, measurement: Measurement, lines: Mapping[str, int]) -> None:
        self.timeline, self.measurement = timeline, measurement
        self.samples = samples = _samples(timeline)
        self.peak = max(samples, key=lambda s: s.total) if samples else None
        xs = [float(s.start) for s in samples] + [float(s.end) for s in samples]
        xs += [float(event) for event, _ in timeline.marks]
        self.x_lo, self.x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
        if self.x_hi <= self.x_lo:
            self.x_hi = self.x_lo + 1.0
        self.lines = [(str(name), max(0, int(value))) for name, value in lines.items()]
        self.marks = sorted(((int(event), str(label)) for event, label in timeline.marks), key=lambda mark: mark[0])
        highest = max([measurement.peak, *(s.total for s in samples), 1])  # the data: a limit above is a marker
        self.y_step = 1
        while self.y_step * 5 < highest:
            self.y_step <<= 1
        self.y_top = self.y_step * math.ceil(highest * 1.06 / self.y_step)
        self.drawn = _downsample(samples, self.x_lo, self.x_hi, _MAX_COLUMNS)

    def x(self, event: float) -> float:
        return _LEFT + (event - self.x_lo) / (self.x_hi - self.x_lo) * (_RIGHT - _LEFT)

    def y(self, nbytes: float) -> float:
        return _BOTTOM - max(0.0, nbytes) / self.y_top * (_BOTTOM - _TOP)

    def caption(self) -> str:
        count = len(self.samples)
        if not count:
            return "No timeline samples were recorded for this span; the chart shows the measured peak only."
        first, last = min(self.timeline.events), max(self.timeline.events)
        where = f"at event {first:,}" if first == last else f"over events {first:,}–{last:,}"
        text = (
            f"{count:,} sample{'s' if count != 1 else ''} {where}"
            " (x: allocation/free event index; each sample holds until the next)."
        )
        if len(self.drawn) < count:
            text += f" Drawn as {len(self.drawn)} columns, each showing its highest sample."
        return text + " Hover an area for its figures."

    def svg(self) -> str:
        out = [
            f'<svg viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" aria-label="allocated bytes by category over the span">',
            *_group("legend", self._legend()),
            *_group("axes", self._axes()),
            *_group("bands", self._bands()),
            *_group("phases", self._phases()),
            *_group("refs", self._references()),
            self._peak(),
            "</svg>",
        ]
        return "\n".join(out)

    def _legend(self) -> list[str]:
        out = []
        x = float(_LEFT)
        for category in CATEGORIES:
            label = _label(category)
            out.append(
                f'<g data-legend="{category}"><title>{label}</title>'
                f'<rect x="{_n(x)}" y="16" width="12" height="12" rx="2" fill="{_COLOURS[category]}"/>'
                f'<text x="{_n(x + 17)}" y="26.5">{label}</text></g>'
            )
            x += 17 + len(label) * _CHAR_WIDTH + 18
        return out

    def _axes(self) -> list[str]:
        out = []
        for tick in range(0, self.y_top + 1, self.y_step):
            y = _n(self.y(tick))
            out.append(f'<line class="grid-line" x1="{_LEFT}" y1="{y}" x2="{_RIGHT}" y2="{y}"/>')
            label_y = _n(self.y(tick) + 4)
            out.append(f'<text class="tick" x="{_LEFT - 8}" y="{label_y}" text-anchor="end">{_tick_label(tick)}</text>')
        for tick in _event_ticks(self.x_lo, self.x_hi):
            x = _n(self.x(tick))
            out.append(f'<line class="axis" x1="{x}" y1="{_BOTTOM}" x2="{x}" y2="{_BOTTOM + 5}"/>')
            out.append(f'<text class="tick" x="{x}" y="{_BOTTOM + 19}" text-anchor="middle">{tick:,}</text>')
        return [
            *out,
            f'<line class="axis" x1="{_LEFT}" y1="{_BOTTOM}" x2="{_RIGHT}" y2="{_BOTTOM}"/>',
            f'<line class="axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_BOTTOM}"/>',
            f'<text class="axis-title" x="{(_LEFT + _RIGHT) // 2}" y="{_BOTTOM + 44}" text-anchor="middle">'
            "allocation / free event</text>",
            f'<text class="axis-title" x="18" y="{(_TOP + _BOTTOM) // 2}" text-anchor="middle" '
            f'transform="rotate(-90 18 {(_TOP + _BOTTOM) // 2})">allocated</text>',
        ]

    def _bands(self) -> list[str]:
        measurement = self.measurement
        at_peak = _breakdown_at_peak(measurement, self.peak)
        out = []
        for k, category in enumerate(CATEGORIES):
            top: list[tuple[float, float]] = []
            bottom: list[tuple[float, float]] = []
            for sample in self.drawn:
                below = sum(sample.values[:k])
                x0, x1 = self.x(sample.start), self.x(sample.end)
                y_lo, y_hi = self.y(below), self.y(below + sample.values[k])
                top += [(x0, y_hi), (x1, y_hi)]
                bottom += [(x0, y_lo), (x1, y_lo)]
            highest = max((s.values[k] for s in self.samples), default=0)
            share = f" ({100 * at_peak[k] / measurement.peak:.1f}% of peak)" if at_peak and measurement.peak else ""
            hover = f"{_label(category)}: {format_size(at_peak[k]) if at_peak else 'n/a'} at peak{share}"
            hover += f"; highest {format_size(highest)}" if self.samples else ""
            out.append(
                f'<path class="band" data-category="{category}" fill="{_COLOURS[category]}" '
                f'd="{_path(top + bottom[::-1])}"><title>{html_text(hover)}</title></path>'
            )
        if not self.samples:
            out.append(
                f'<text class="empty" x="{(_LEFT + _RIGHT) // 2}" y="{_BOTTOM - 24}" text-anchor="middle">'
                "no timeline samples</text>"
            )
        return out

    def _phases(self) -> list[str]:
        out = []
        rows: list[float] = []  # right end of the last label in each row of labels
        for event, label in self.marks:
            x = self.x(event)
            text = _truncate(label, 24)
            width = len(text) * _CHAR_WIDTH + 8
            row = next((i for i, end in enumerate(rows) if end < x), len(rows))
            if row == len(rows):
                rows.append(0.0)
            rows[row] = x + 4 + width
            out.append(
                f'<g class="phase"><title>{html_text(label)} begins at event {event:,}</title>'
                f'<line data-phase="{html_text(label)}" data-event="{event}" x1="{_n(x)}" y1="{_TOP}" x2="{_n(x)}" '
                f'y2="{_BOTTOM}"/>'
                f'<text x="{_n(x + 4)}" y="{_TOP + 12 + 13 * row}" paint-order="stroke" stroke="#fff" '
                f'stroke-width="3">{html_text(text)}</text></g>'
            )
        return out

    def _references(self) -> list[str]:
        out = []
        heights = [max(_TOP, self.y(value)) for _, value in self.lines]
        placed = _spread([y + 4 for y in heights], gap=13, lo=_TOP + 4, hi=_BOTTOM + 4)
        for i, ((name, value), height, label_y) in enumerate(zip(self.lines, heights, placed, strict=True)):
            colour = _LINE_COLOURS[i % len(_LINE_COLOURS)]
            y = _n(height)
            if value > self.y_top:  # above the data: a marker at the top edge, with its value
                text = f"↑ {_truncate(name, 20)} {format_size(value)}"
                out.append(
                    f'<g class="ref above"><title>{html_text(name)}: {format_size(value)} ({value:,} B), above '
                    f"the chart's top ({format_size(self.y_top)})</title>"
                    f'<line data-line="{html_text(name)}" data-bytes="{value}" data-above="true" x1="{_RIGHT - 60}" '
                    f'y1="{y}" x2="{_RIGHT}" y2="{y}" stroke="{colour}"/>'
                    f'<path d="M{_n(_RIGHT - 5)},{_n(height + 1)}L{_RIGHT},{_n(height - 7)}L{_n(_RIGHT + 5)},'
                    f'{_n(height + 1)}Z" fill="{colour}"/>'
                    f'<text x="{_RIGHT + 8}" y="{_n(label_y)}" fill="{colour}">{html_text(text)}</text></g>'
                )
                continue
            text = f"{_truncate(name, 22)} {format_size(value)}"
            out.append(
                f'<g class="ref"><title>{html_text(name)}: {format_size(value)} ({value:,} B)</title>'
                f'<line data-line="{html_text(name)}" data-bytes="{value}" x1="{_LEFT}" y1="{y}" x2="{_RIGHT}" '
                f'y2="{y}" stroke="{colour}"/>'
                f'<text x="{_RIGHT + 6}" y="{_n(label_y)}" fill="{colour}">{html_text(text)}</text></g>'
            )
        return out

    def _peak(self) -> str:
        peak, measured = self.peak, self.measurement.peak
        if peak is None:
            level, label = _n(self.y(measured)), _n(self.y(measured) - 5)
            return (
                f'<g class="peak"><title>measured peak: {format_size(measured)}</title>'
                f'<line data-peak="{measured}" x1="{_LEFT}" y1="{level}" x2="{_RIGHT}" y2="{level}" '
                'stroke="#1d2330" stroke-width="1.2" stroke-dasharray="2 3"/>'
                f'<text x="{_LEFT + 6}" y="{label}">peak {format_size(measured)}</text></g>'
            )
        x, y = self.x((peak.start + peak.end) / 2), self.y(peak.total)
        text = f"peak {format_size(peak.total)} @ event {peak.start:,}"
        right = x + 8 + len(text) * _CHAR_WIDTH < _RIGHT
        label_x = x + 8 if right else x - 8
        label_y = y - 8 if y - 8 > _TOP + 30 else y + 16
        return (
            f'<g class="peak"><title>highest sample: {format_size(peak.total)} ({peak.total:,} B) at event '
            f"{peak.start:,}</title>"
            f'<circle data-peak="{peak.total}" cx="{_n(x)}" cy="{_n(y)}" r="4.5" fill="#fff" stroke="#1d2330" '
            'stroke-width="2"/>'
            f'<text x="{_n(label_x)}" y="{_n(label_y)}" text-anchor="{"start" if right else "end"}" '
            f'font-weight="600" paint-order="stroke" stroke="#fff" stroke-width="3">{text}</text></g>'
        )


def _meta_line(m: Measurement) -> str:
    items = [
        f"span <b>{html_text(m.name)}</b>",
        f"engine <b>{html_text(m.engine)}</b>",
        f"device <b>{html_text(m.device)}</b>",
    ]
    if m.psi is not None:
        items.append(f"Ψ <b>{m.psi:,}</b> trainable parameters")
    if m.cuda_rounding:
        items.append("sizes rounded to CUDA's 512 B blocks")
    return " · ".join(items)


def _figures_table(m: Measurement) -> str:
    rows = [
        '<section class="card"><h2>Figures</h2><table>',
        '<tr><th>figure</th><th class="num">value</th><th class="num">cost</th><th>meaning</th></tr>',
        f'<tr><td>start</td><td class="num">{_size(m.start)}</td><td class="num"></td>',
        '<td class="note">allocated when the span began</td></tr>',
    ]
    for metric in METRICS:  # every byte figure of the metric table
        info = metric_info(metric)
        if info.whole_call:  # a difference already: no absolute figure
            value, cost = _cell(format_delta(m.figure(metric))), ""
        else:
            value, cost = _size(m.figure(metric)), _cell(format_delta(m.cost(metric)))
        rows.append(f'<tr><td>{metric}</td><td class="num">{value}</td><td class="num">{cost}</td>')
        rows.append(f'<td class="note">{html_text(info.about)}</td></tr>')
    extras = (
        ("requested peak", m.requested_peak, "highest bytes the code asked for"),
        ("saved activations", m.saved_activations, "storages saved for backward"),
        ("driver used", m.driver_used, "device memory in use, all processes (NVML)"),
        ("driver, this process", m.driver_process, "device memory of this process (NVML)"),
    )
    for name, figure, meaning in extras:
        if figure is not None:
            rows.append(f'<tr><td>{name}</td><td class="num">{_size(figure)}</td><td></td>')
            rows.append(f'<td class="note">{meaning}</td></tr>')
    for name, count in (("alloc retries", m.num_alloc_retries), ("out-of-memory errors", m.num_ooms)):
        if count is not None:
            rows.append(f'<tr><td>{name}</td><td class="num">{count:,}</td><td></td><td></td></tr>')
    rows.append("</table></section>")
    return "".join(rows)


def _breakdown_at_peak(m: Measurement, peak: _Sample | None) -> tuple[int, ...] | None:
    if m.breakdown is not None:
        return tuple(int(m.breakdown.get(category, 0)) for category in CATEGORIES)
    return None if peak is None else peak.values


def _breakdown_table(m: Measurement, peak: _Sample | None) -> str:
    rows = ['<section class="card"><h2>Breakdown at peak</h2>']
    values = _breakdown_at_peak(m, peak)
    if values is None:
        return rows[0] + '<p class="na">not measured (n/a)</p></section>'
    if m.breakdown is None:
        rows.append('<p class="na">from the highest timeline sample</p>')
    total = sum(values)
    rows.append('<table><tr><th>category</th><th class="num">bytes</th><th class="num">share</th></tr>')
    for category, value in zip(CATEGORIES, values, strict=True):
        share = f"{100 * value / total:.1f}%" if total else _cell("n/a")
        rows.append(
            f'<tr data-category="{category}"><td><span class="swatch" style="background:{_COLOURS[category]}"></span>'
            f'{_label(category)}</td><td class="num">{_size(value)}</td><td class="num">{share}</td></tr>'
        )
    rows.append(f'<tr class="total"><td>total</td><td class="num">{_size(total)}</td><td></td></tr></table></section>')
    return "".join(rows)


def _phases_table(m: Measurement) -> str:
    rows = ['<section class="card"><h2>Phases</h2>']
    if not m.phases:
        return rows[0] + '<p class="na">no phases recorded</p></section>'
    rows.append(
        '<table><tr><th>phase</th><th class="num">start</th><th class="num">peak</th><th class="num">end</th>'
        '<th class="num">peak − start</th></tr>'
    )
    for name, phase in m.phases.items():
        times = f" ×{phase.count}" if phase.count > 1 else ""  # ran N times in the span, as the terminal says
        rows.append(
            f'<tr data-phase="{html_text(name)}"><td>{html_text(name)}{times}</td>'
            f'<td class="num">{_size(phase.start)}</td>'
            f'<td class="num">{_size(phase.peak)}</td><td class="num">{_size(phase.end)}</td>'
            f'<td class="num">{_cell(format_delta(phase.peak - phase.start))}</td></tr>'
        )
    rows.append("</table></section>")
    return "".join(rows)


def html_page(title: str, css: str, body: Sequence[str], *, footer: Sequence[str] = ()) -> str:
    """A self-contained page: UTF-8, a fetch-nothing CSP, ``title`` and ``css``; ``body`` in ``<main>``, a line each."""
    lines = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html_text(title)}</title>",
        f"<style>{css}</style>",
        "</head>",
        "<body>",
        "<main>",
        *body,
        "</main>",
        *footer,
        "</body>",
        "</html>",
        "",
    ]
    return "\n".join(lines)


def html_text(text: object) -> str:
    """``text`` as HTML text or attribute value: escaped, control characters and lone surrogates replaced."""
    return html.escape(_CONTROL.sub("\ufffd", str(text)), quote=True)


def _cell(text: str) -> str:
    return '<span class="na">n/a</span>' if text == "n/a" else html_text(text)


def _size(nbytes: int | None) -> str:
    return _cell("n/a") if nbytes is None else f'<span title="{nbytes:,} B">{format_size(nbytes)}</span>'


def _label(category: str) -> str:
    return category.replace("_", " ")


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def svg_number(value: float) -> str:
    """A coordinate with one decimal, without a trailing ``.0``."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


_n = svg_number  # short, for the chart's f-strings


def _path(points: list[tuple[float, float]]) -> str:
    """SVG path data for a closed ring through ``points``: H/V where possible, collinear points dropped."""
    rounded = [point for point, _ in itertools.groupby((_n(x), _n(y)) for x, y in points)]
    kept: list[tuple[str, str]] = []
    for i, point in enumerate(rounded):
        if 0 < i < len(rounded) - 1:
            before, after = rounded[i - 1], rounded[i + 1]
            if before[0] == point[0] == after[0] or before[1] == point[1] == after[1]:
                continue
        kept.append(point)
    if not kept:
        return ""
    commands = [f"M{kept[0][0]},{kept[0][1]}"]
    for (x0, y0), (x1, y1) in itertools.pairwise(kept):
        commands.append(f"H{x1}" if y0 == y1 else f"V{y1}" if x0 == x1 else f"L{x1},{y1}")
    return "".join(commands) + "Z"


def _spread(positions: list[float], *, gap: float, lo: float, hi: float) -> list[float]:
    """``positions`` moved apart so that no two are closer than ``gap``, kept within ``lo..hi`` where possible."""
    order = sorted(range(len(positions)), key=lambda i: positions[i])
    placed = [positions[i] for i in order]
    for j in range(len(placed)):
        placed[j] = max(placed[j], lo if j == 0 else placed[j - 1] + gap)
    overflow = placed[-1] - hi if placed else 0.0
    if overflow > 0:
        placed[-1] -= overflow
        for j in range(len(placed) - 2, -1, -1):
            placed[j] = min(placed[j], placed[j + 1] - gap)
    where = dict(zip(order, placed, strict=True))
    return [where[i] for i in range(len(positions))]


def _tick_label(nbytes: int) -> str:
    """``format_size`` with the fewest decimals that still show ``nbytes`` exactly (up to 3)."""
    unit = max((u for u in UNITS.values() if u <= nbytes), default=1)
    for precision in range(3):
        if round(nbytes / unit, precision) * unit == nbytes:
            return format_size(nbytes, precision)
    return format_size(nbytes, 3)


def _event_ticks(lo: float, hi: float) -> list[int]:
    """Round event indexes (1, 2 or 5 times a power of ten apart) between ``lo`` and ``hi``."""
    raw = (hi - lo) / 6
    magnitude = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return list(range(int(first), math.floor(hi) + 1, int(step)))
