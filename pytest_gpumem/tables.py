"""The one table engine: every table pytest-gpumem prints, fitted to a width in one place (no torch)."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = [
    "ELLIPSIS",
    "GROUP_INDENT",
    "SEP",
    "TIGHT_SEP",
    "Col",
    "Table",
    "elide_id",
    "elide_middle",
    "elide_span",
    "markdown_code",
    "markdown_table",
    "markdown_text",
    "plain",
    "short_id",
    "table",
    "visible",
    "wrap",
    "wrap_items",
]

GROUP_INDENT = "  "
#: Between two columns; :data:`TIGHT_SEP` where nothing else makes a table fit.
SEP = "  "
TIGHT_SEP = " "
#: Marks what elision left out.
ELLIPSIS = "…"


def file_of(nodeid: str) -> str:
    """The file part of a node id: the file ends at the first "::" after the last "/" before any "[" (folder names may
    hold "::", parameter ids "/" and "::")."""
    slash = nodeid.split("[", 1)[0].rfind("/")
    cut = nodeid.find("::", slash + 1)
    return nodeid if cut < 0 else nodeid[:cut]


def short_id(nodeid: str) -> str:
    """The node id without the folders of its file (parametrize ids may hold "/" too)."""
    path = file_of(nodeid)
    return path.rsplit("/", 1)[-1] + nodeid[len(path) :]


def elide_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: its start and end around "…"."""
    if len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[: max(width, 0)]
    keep = width - len(ELLIPSIS)
    tail = keep // 2
    return text[: keep - tail] + ELLIPSIS + text[len(text) - tail :]


#: The rank a span is measured on, at the end of its name: ``call@rank1-of-2``, ``rank1-of-2``,
#: ``rank0-of-2@rank1-of-2``.
RANK_RE = re.compile(r"(?:@?rank\d+-of-\d+)+$")


def span_floor(name: str) -> int:
    """The fewest characters :func:`elide_span` keeps of ``name``: its rank, whole."""
    match = RANK_RE.search(name)
    if match is None:
        return 0
    return len(name) if match.start() == 0 else min(len(name), len(ELLIPSIS) + len(match.group()))


def elide_span(name: str, width: int) -> str:
    """A span name in at most ``width`` characters, eliding what comes before its rank, never the rank."""
    if len(name) <= width:
        return name
    match = RANK_RE.search(name)
    if match is not None and match.start() > 0 and width - len(match.group()) >= len(ELLIPSIS):
        return elide_middle(name[: match.start()], width - len(match.group())) + match.group()
    return elide_middle(name, width)


def elide_id(nodeid: str, width: int) -> str:
    """A node id in at most ``width`` characters, keeping its function name and parametrize id (the part before the
    name is elided in its middle, then dropped; then the name itself is elided)."""
    if len(nodeid) <= width:
        return nodeid
    base, bracket, params = nodeid.partition("[")
    head, sep, function = base.rpartition("::")
    if not sep:
        return elide_middle(nodeid, width)
    name = function + bracket + params
    room = width - len(sep + name)
    if room >= len(ELLIPSIS):
        return elide_middle(head, room) + sep + name
    if width > len(name):
        return ELLIPSIS + name
    return elide_middle(name, width)


#: A size as :func:`~pytest_gpumem.units.format_size` writes it, for wrapping.
SIZE_RE = re.compile(r"(\d) ([KMGT]?i?B)\b")

#: Fewest characters a wrapped line keeps for its text; below, indents give way.
MIN_TEXT = 12


def plain(text: str) -> str:
    """``text`` with its no-break spaces (what wrapping keeps together) as spaces."""
    return text.replace("\xa0", " ")


def indents(width: int, first: str, rest: str) -> tuple[str, str]:
    """The indents of wrapped lines, or none where they would leave less than :data:`MIN_TEXT` for the text."""
    return (first, rest) if width - max(len(first), len(rest)) >= MIN_TEXT else ("", "")


def wrap(text: str, width: int | None, first: str = "", rest: str = "") -> list[str]:
    """``text`` wrapped to ``width`` (no limit when None), with indents that give way at tiny widths."""
    if width is None:
        return [plain(first + text)]
    first, rest = indents(width, first, rest)
    text = SIZE_RE.sub("\\1\xa0\\2", text)  # a size's number and unit stay on one line
    lines = textwrap.wrap(text, max(width, 1), initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)
    return [plain(line) for line in lines] or [first.rstrip()]


@dataclass(frozen=True)
class Col:
    """A column: its header, alignment, and how it gives way when the table is too wide."""

    header: str
    right: bool = False
    elastic: bool = False  # cells may be elided to fit
    min_width: int = 0  # narrowest an elastic column gets (never below its header)
    optional: bool = False  # left out when every cell is empty
    label: str | None = None  # its name in the one-record-per-block layout (None: the header)
    joins: bool = False  # block layout: in parentheses after the previous pair ("Δ +1.00 MiB (+3.1%)")
    drop: int = 0  # left out to fit a narrow width before falling back to blocks: 1 first, then 2; 0 never
    span: bool = False  # holds span names: elided by elide_span, never narrower than a rank


def fit(text: str, width: int, col: Col) -> str:
    if len(text) > width:
        text = elide_span(text, width) if col.span else elide_middle(text, width)
    return text.rjust(width) if col.right else text.ljust(width)


def natural_widths(cols: Sequence[Col], rows: Sequence[Sequence[str]]) -> list[int]:
    return [max([len(col.header), *(len(row[i]) for row in rows)]) for i, col in enumerate(cols)]


def column_widths(
    cols: Sequence[Col], rows: Sequence[Sequence[str]], width: int | None, sep: str = SEP
) -> list[int] | None:
    """Column widths that fit ``width``, elastic columns narrowed in order (not below ``min_width`` nor their
    header); None when impossible."""
    widths = natural_widths(cols, rows)
    excess = 0 if width is None else sum(widths) + len(sep) * (len(cols) - 1) - width
    for i, col in enumerate(cols):
        if col.elastic and excess > 0:
            floor = min(widths[i], max(col.min_width, len(col.header)))
            if col.span:
                floor = max([floor, *(span_floor(row[i]) for row in rows)])
            cut = min(excess, widths[i] - floor)
            widths[i] -= cut
            excess -= cut
    return widths if excess <= 0 else None


def lines_of(
    cols: Sequence[Col], rows: Sequence[Sequence[str]], widths: Sequence[int], indent: str = "", sep: str = SEP
) -> list[str]:
    def line(cells: Sequence[str]) -> str:
        return (indent + sep.join(fit(c, w, col) for c, w, col in zip(cells, widths, cols, strict=True))).rstrip()

    return [line([col.header for col in cols]), indent + sep.join("-" * w for w in widths), *(line(r) for r in rows)]


@dataclass
class Table:
    """Rows grouped by a title (a test id) or not; rendered to fit a width by :meth:`render`."""

    cols: Sequence[Col]
    groups: list[tuple[str, list[list[str]]]]
    title: Col | None = None  # the column the group titles fill in the flat layout (only when they fit whole)
    lead: int = 1  # block layout: how many cells name a record ("call peak")
    status: int | None = None  # block layout: the cell shown right after the name

    def _keep(self, keep: Sequence[int]) -> Table:
        """The table with only the columns at ``keep``; the naming columns and the status are always kept."""
        return replace(
            self,
            cols=[self.cols[i] for i in keep],
            groups=[(title, [[row[i] for i in keep] for row in group]) for title, group in self.groups],
            status=None if self.status is None else list(keep).index(self.status),
        )

    def render(self, width: int | None) -> list[str]:
        """The lines of the table in ``width``: test ids in a column or above their rows, fewer columns (named below),
        one space between columns, else one record per block."""
        rows = [row for _, group in self.groups for row in group]
        table = self._keep([i for i, col in enumerate(self.cols) if not col.optional or any(row[i] for row in rows)])
        if table.title is not None:
            flat_cols = [table.title, *table.cols]
            flat_rows = [[title, *row] for title, group in table.groups for row in group]
            widths = column_widths(flat_cols, flat_rows, width)
            if widths is not None:
                return lines_of(flat_cols, flat_rows, widths)
        levels = sorted({0, *(col.drop for col in table.cols)})
        for level, sep in [*((level, SEP) for level in levels), (levels[-1], TIGHT_SEP)]:
            keep = [i for i, col in enumerate(table.cols) if not 0 < col.drop <= level]
            lines = table._keep(keep)._grouped(width, sep)
            if lines is not None:
                left_out = [col.header for i, col in enumerate(table.cols) if i not in keep]
                if left_out:
                    lines += wrap(f"(left out to fit {width} columns: {', '.join(left_out)})", width)
                return lines
        return table._blocks(width)

    def _grouped(self, width: int | None, sep: str = SEP) -> list[str] | None:
        """One row per record under its group's title (without titles: a plain table); None when too wide."""
        rows = [row for _, group in self.groups for row in group]
        if self.title is None:
            widths = column_widths(self.cols, rows, width, sep)
            return None if widths is None else lines_of(self.cols, rows, widths, "", sep)
        widths = column_widths(self.cols, rows, None if width is None else width - len(GROUP_INDENT), sep)
        if widths is None:
            return None
        lines = lines_of(self.cols, [], widths, GROUP_INDENT, sep)
        for title, group in self.groups:
            lines.append(title if width is None else elide_id(title, width))
            lines += lines_of(self.cols, group, widths, GROUP_INDENT, sep)[2:]
        return lines

    def _blocks(self, width: int | None) -> list[str]:
        """One record per block: its name, then "label value" pairs, wrapped to ``width``."""
        lines: list[str] = []
        indent = GROUP_INDENT if self.title is not None else ""
        for title, rows in self.groups:
            if self.title is not None:
                lines.append(title if width is None else elide_id(title, width))
            for row in rows:
                name = " ".join(cell for cell in row[: self.lead] if cell)
                status = row[self.status] if self.status is not None else ""
                head = [f"{name}:" if name else "", f"{status};" if status else ""]
                pairs: list[str] = []
                for i, (col, cell) in enumerate(zip(self.cols, row, strict=True)):
                    if i < self.lead or i == self.status or not cell:
                        continue
                    if col.joins and pairs:
                        pairs[-1] += f" ({cell})"
                    else:
                        pairs.append(f"{col.header if col.label is None else col.label} {cell}".strip())
                items = [item for item in head if item] + [pair + "," for pair in pairs[:-1]] + pairs[-1:]
                if items and not pairs:
                    items[-1] = items[-1].rstrip(":;")
                lines += wrap_items(items, width, indent, indent + "    ")
        return lines


def wrap_items(items: Sequence[str], width: int | None, first: str, rest: str) -> list[str]:
    """``items`` joined by spaces and wrapped to ``width`` between items (an item breaks only when it must)."""
    if width is None:
        return [plain(first + " ".join(items))]
    first, rest = indents(width, first, rest)
    lines: list[str] = []
    line = first
    for item in items:
        sep = " " if line.strip() else ""
        if len(line) + len(sep) + len(item) <= width:
            line += sep + item
        else:
            if line.strip():
                lines.append(line)
            *pieces, line = wrap(item, width, rest, rest)
            lines += pieces
    if line.strip():
        lines.append(line)
    return lines


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = (), width: int | None = None
) -> str:
    """A plain table: headers, a rule, the rows (``right`` columns right-aligned), fitted to ``width`` by eliding the
    widest columns first."""
    cols = [Col(header, right=i in right, elastic=True) for i, header in enumerate(headers)]
    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    widths = natural_widths(cols, cells)
    if width is not None:
        order = sorted(range(len(cols)), key=lambda i: -widths[i])  # the widest gives way first
        fitted = column_widths([cols[i] for i in order], [[row[i] for i in order] for row in cells], width)
        if fitted is not None:
            widths = [fitted[order.index(i)] for i in range(len(cols))]
    return "\n".join(lines_of(cols, cells, widths))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """A GitHub Markdown table of the same cells; a ``|`` is escaped and a line break becomes a space."""
    cells = [[markdown_text("" if cell is None else str(cell)) for cell in row] for row in rows]
    sizes = [max([len(header), 3, *(len(row[i]) for row in cells)]) for i, header in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        padded = (
            cell.rjust(n) if i in right else cell.ljust(n) for i, (cell, n) in enumerate(zip(row, sizes, strict=True))
        )
        return "| " + " | ".join(padded) + " |"

    rules = (("-" * (n + 1) + ":") if i in right else (":" + "-" * (n + 1)) for i, n in enumerate(sizes))
    return "\n".join([line(list(headers)), "|" + "|".join(rules) + "|", *(line(row) for row in cells)])


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """``text`` with its control characters written as Python escapes (``\\x1b``), so names read from a file reach a
    terminal as text; line breaks and tabs stay."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], text) if _CONTROL.search(text) else text


#: What GitHub Markdown would read as markup in a cell or list item: a backslash, code span, HTML, strikethrough,
#: entity, cell end, the ``](`` closing a link, an underscore outside a word, an asterisk not between spaces.
_MARKDOWN = re.compile(r"[\\`<~&|]|(?<!\s)\*|\*(?!\s)|\](?=\()|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def markdown_text(text: str, *, cell: bool = True) -> str:
    """``text`` as Markdown text in a cell or list item: one line, :func:`visible`, markup characters backslash-escaped
    (``|`` only in a ``cell``)."""
    text = visible(text).replace("\r", " ").replace("\n", " ")
    return _MARKDOWN.sub(lambda m: m.group() if m.group() == "|" and not cell else "\\" + m.group(), text)


def markdown_code(text: str) -> str:
    """``text`` as a Markdown code span on one line, fenced by more backticks than it holds in a row."""
    text = visible(text).replace("\r", " ").replace("\n", " ")
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
