"""Sites in the reports: which lines made the bytes that grew (a baseline failure) or the most bytes (a limit), in the
terminal, the Markdown report and the HTML, all from :func:`site_tables`."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.site_figures import BEFORE, SiteFigures, SiteProfile
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.judge.site_changes import SiteDiff
from pytest_gpumem.report.html import html_text as _esc
from pytest_gpumem.tables import Col, Table, markdown_table, markdown_text, visible, wrap
from pytest_gpumem.units import format_delta, format_size

__all__ = [
    "PROFILE_HEADERS",
    "SITE_HEADERS",
    "SiteTable",
    "profile_rows",
    "site_diff_rows",
    "site_lines",
    "site_markdown",
    "site_section_html",
    "site_tables",
]

#: The columns of a stored profile (``baselines show --sites``).
PROFILE_HEADERS = ("site", "code", "category", "phase", "at peak", "at end", "tensors")

#: Rows shown by default; ``-v`` shows every one the record has, ``-q`` the first line only.
SHOWN = 5

SITE_HEADERS = ("change", "category", "phase", "site", "code", "tensors", "example", "note")

_COLS = (
    Col("change", right=True),  # "bytes" for a table of the largest sites
    Col("category"),
    Col("phase", optional=True),
    Col("site"),
    Col("code", elastic=True, min_width=12, optional=True, drop=2),
    Col("tensors", right=True, optional=True, drop=1),
    Col("example", elastic=True, min_width=8, optional=True, drop=1),
    Col("note", optional=True),
)

_MOMENT = {"peak": "peak", "reserved": "peak", "allocated": "end", "retained": "end"}
_AT = {"peak": "at the peak", "end": "at the end"}
_NOTES = {"new": "new since the baseline", "gone": "gone", "unlisted": "not among the baseline's listed sites"}


@dataclass(frozen=True)
class SiteTable:
    """One table of sites: its title, its rows (cells of :data:`SITE_HEADERS`), the line below it."""

    moment: str
    title: str
    rows: list[list[str]]
    footer: str
    second_run: str
    #: the rows are changes against a baseline (else the largest sites)
    changes: bool = True
    #: each row's bytes at the table's moment: (the baseline's, None without one; this run's)
    sizes: list[tuple[int | None, int]] = field(default_factory=list)


def _cells(figures: SiteFigures, change: str, note: str) -> list[str]:
    """A row of :data:`SITE_HEADERS`."""
    example = figures.examples[0] if figures.examples else ""
    site = [figures.site.where(), figures.site.code]
    return [change, figures.category or "-", figures.phase, *site, str(figures.count or ""), example, note]


_OPTION = re.compile(r" \(\w+=[^()]*\)$")


def held_by(figures: SiteFigures, delta: int) -> str:
    """``"held by Trainer.debug[…]"``: what keeps the row's growth of ``delta`` bytes alive, when a second run found it
    (the holders whose bytes are the growth exactly, else the largest two)."""
    holders = list(figures.holders)
    if not holders or delta <= 0:
        return ""
    exact = [
        chosen
        for size in range(1, min(len(holders), 3) + 1)
        for chosen in itertools.combinations(holders[:8], size)
        if sum(nbytes for _, nbytes in chosen) == delta
    ]
    optioned = [chosen for chosen in exact if all(_OPTION.search(name) for name, _ in chosen)]
    if len(exact) == 1 or len(optioned) == 1:
        names = [name for name, _ in (exact[0] if len(exact) == 1 else optioned[0])]
    else:
        names = [f"{name} ({format_size(nbytes)})" for name, nbytes in holders[:2]]
    return "held by " + ", ".join(names)


def _second_run(profile: SiteProfile | SiteDiff) -> str:
    if not profile.second_run:
        return ""
    return "sites from a second run" + (f"; {profile.note}" if profile.note else "")


def site_tables(record: TestRecord, *, error: bool = False) -> list[SiteTable]:
    """The tables of sites for what failed in ``record``, per span and moment; ``error``: its call's peak sites."""
    moments: dict[str, list[str]] = {"call": ["peak"]} if error else {}
    for finding in record.findings:
        moment = _MOMENT.get(finding.metric)
        if finding.failed and moment is not None and moment not in moments.setdefault(finding.span, []):
            moments[finding.span].append(moment)
    spans = {m.name: m for m in record.measurements}
    tables = [
        _table(span, moment, record.site_changes.get(span), spans.get(span))
        for span, wanted in moments.items()
        for moment in wanted
    ]
    return [table for table in tables if table is not None]


def _table(span: str, moment: str, diff: SiteDiff | None, measurement: Measurement | None) -> SiteTable | None:
    where = "" if span == "call" else f"[{span}] "
    if diff is not None:
        rows, sizes = [], []
        changes = diff.at(moment)
        for change in changes:
            delta = change.delta(moment)
            text = format_delta(delta) if change.status != "unlisted" else f"({format_delta(delta)})"
            notes = [_NOTES.get(change.status, ""), held_by(change.figures, delta)]
            rows.append(_cells(change.figures, text, "; ".join(note for note in notes if note)))
            sizes.append(
                (change.before_peak, change.after_peak) if moment == "peak" else (change.before_end, change.after_end)
            )
        changed = len(rows)
        footer = (
            f"({changed} of {diff.compared} sites changed; the rest are as recorded)"
            if changed
            else f"(none of {diff.compared} sites changed {_AT[moment]}: the start or what the sites miss moved)"
        )
        title = f"{where}{_AT[moment]}, against the baseline (sites by growth):"
        return SiteTable(moment, title, rows, footer, _second_run(diff), sizes=sizes)
    if measurement is None or measurement.sites is None:
        return None
    profile = measurement.sites
    size = attrgetter(moment)  # a site's bytes at the moment
    largest = [(s, size(s)) for s in sorted(profile.sites, key=lambda s: -size(s)) if size(s) and s.site.key != BEFORE]
    rows = [_cells(figures, format_size(nbytes), held_by(figures, nbytes)) for figures, nbytes in largest]
    rest = getattr(profile, f"rest_{moment}")
    footer = f"({len(rows)} sites; {profile.rest_sites} more hold {format_size(rest)})" if profile.rest_sites else ""
    title = f"{where}{_AT[moment]}, the largest sites:"
    sizes = [(None, nbytes) for _, nbytes in largest]
    return SiteTable(moment, title, rows, footer, _second_run(profile), changes=False, sizes=sizes)


def site_lines(record: TestRecord, *, width: int | None = None, verbosity: int = 0, error: bool = False) -> list[str]:
    """The failure text's sites: :data:`SHOWN` rows a table at ``verbosity`` 0, every row above, the first line below;
    control characters shown as escapes."""
    lines: list[str] = []
    for table in site_tables(record, error=error):
        if verbosity < 0:
            if table.rows:  # change, category, phase and site of the first row
                text = f"{table.title.rstrip(':')}: {' '.join(table.rows[0][:4])}".replace("  ", " ")
                lines += wrap(text.strip(), width)
            continue
        rows = table.rows if verbosity > 0 else table.rows[:SHOWN]
        lines += wrap(table.title, width)
        if rows:
            cols = _COLS if table.changes else (Col("bytes", right=True), *_COLS[1:])
            rendered = Table(cols, [("", rows)]).render(None if width is None else width - 2)
            lines += ["  " + line for line in rendered]
        left = len(table.rows) - len(rows)
        footer = table.footer + (f" ({left} more with -v)" if left else "")
        for text in filter(None, (footer, table.second_run)):
            lines += wrap(text, width, "  ", "  ")
    return [visible(line) for line in lines]


def site_markdown(records: Sequence[TestRecord]) -> str:
    """The Markdown report's section: each failed test's tables of sites ("" when none)."""
    parts = []
    for record in records:
        for table in site_tables(record):
            parts.append(f"**{markdown_text(record.nodeid, cell=False)}** {markdown_text(table.title, cell=False)}")
            parts.append(markdown_table(SITE_HEADERS, table.rows, right=(0, 5)))
            parts += [markdown_text(text, cell=False) for text in (table.footer, table.second_run) if text]
    return "\n\n".join(["### Sites", *parts]) + "\n" if parts else ""


#: The widest bar of the HTML card (pixels): two of them and the other columns fit a 1024-pixel window.
_BAR = 120


def _bar(nbytes: int, scale: int, colour: str) -> str:
    width = 0 if scale <= 0 else max(1, round(_BAR * nbytes / scale)) if nbytes else 0
    return f'<svg width="{width + 2}" height="10" role="img"><rect width="{width}" height="10" fill="{colour}"/></svg>'


def site_section_html(record: TestRecord) -> str:
    """The HTML artifact's card: the baseline's bytes beside this run's as two bars per site; "" when no sites."""
    cards = []
    for table in site_tables(record):
        scale = max([1, *(max(before or 0, after) for before, after in table.sizes)])
        body = []
        for row, (before, after) in zip(table.rows, table.sizes, strict=True):
            baseline = "" if before is None else f"{_bar(before, scale, '#a0a0a0')} {_esc(format_size(before))}"
            body.append(
                f'<tr data-site="{_esc(row[3])}"><td class="num">{_esc(row[0])}</td><td>{_esc(row[1])}</td>'
                f"<td>{_esc(row[2])}</td><td class='where'>{_esc(row[3])}<br><code>{_esc(row[4])}</code></td>"
                f'<td class="num">{baseline}</td><td class="num">{_bar(after, scale, "#e15759")} '
                f"{_esc(format_size(after))}</td><td class='note'>{_esc(row[7] or row[6])}</td></tr>"
            )
        notes = "".join(f'<p class="meta">{_esc(text)}</p>' for text in (table.footer, table.second_run) if text)
        cards.append(
            f'<section class="card sites" data-moment="{table.moment}"><h2>Sites {_esc(table.title.rstrip(":"))}</h2>'
            "<table><tr><th class='num'>change</th><th>category</th><th>phase</th><th>site</th>"
            "<th class='num'>baseline run</th><th class='num'>this run</th><th>note</th></tr>"
            + "".join(body)
            + f"</table>{notes}</section>"
        )
    return "\n".join(cards)


def _bytes(nbytes: int, exact: bool, *, signed: bool = False) -> str:
    if exact:
        return f"{nbytes:+d}" if signed else str(nbytes)
    return format_delta(nbytes) if signed else format_size(nbytes)


def profile_rows(profile: SiteProfile, *, exact: bool = False) -> list[list[str]]:
    """A stored profile's sites as rows of :data:`PROFILE_HEADERS` (the others summed last)."""
    rows = [
        [s.site.key, s.site.code, s.category, s.phase, _bytes(s.peak, exact), _bytes(s.end, exact), str(s.count)]
        for s in profile.sites
    ]
    if profile.rest_sites:
        rest = f"({profile.rest_sites} other sites)"
        rows.append([rest, "", "", "", _bytes(profile.rest_peak, exact), _bytes(profile.rest_end, exact), ""])
    return rows


def site_diff_rows(diff: SiteDiff, *, exact: bool = False) -> list[list[str]]:
    """The sites that changed between two stored profiles: site, code, status, Δ at the peak, Δ at the end."""
    order = {id(c): i for i, c in enumerate(diff.at("peak") + [c for c in diff.at("end") if not c.delta("peak")])}
    changes = sorted(diff.changes, key=lambda c: order.get(id(c), len(order)))
    rows = []
    for c in changes:
        deltas = [_bytes(c.delta(moment), exact, signed=True) for moment in ("peak", "end")]
        rows.append([c.figures.site.key, c.figures.site.code, _NOTES.get(c.status, "changed"), *deltas])
    return rows
