"""What the report's tables share: the record they read, the legends, and how a cell writes a cost, a note or a key."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby
from operator import itemgetter

from pytest_gpumem.data.metrics import METRIC_TABLE, metric_info

__all__ = [
    "COST_ONLY_METRICS",
    "LEGEND_COST",
    "LEGEND_COUNT",
    "LEGEND_DELTA",
    "LEGEND_SIGNED",
    "SIGNED_METRICS",
    "delta_text",
    "figure_text",
    "grouped",
    "one_line",
    "other_environments",
]

#: Metrics whose cost is a net change, shown signed (they can be negative): the metric table's.
SIGNED_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.signed)

#: Metrics without an absolute figure: the figure is already a difference (its cost): the metric table's.
COST_ONLY_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.whole_call)

LEGEND_COST = "cost = measured − the span's start: what limits and baselines compare"
LEGEND_DELTA = "Δ\xa0=\xa0cost\xa0−\xa0baseline"  # no-break spaces: wrapped whole (shown as spaces)
LEGEND_SIGNED = f"a negative {' or '.join(SIGNED_METRICS)} cost: the span freed more than it allocated"
LEGEND_COUNT = "×N: the phase ran N times in the span (e.g. a warm-up step and the measured step)"


def one_line(note: str) -> str:
    """A note's paragraphs on one line: the first, then the others separated by "; "."""
    first, *rest = note.split("\n")
    return first + (" " + "; ".join(rest) if rest else "")


def other_environments(detail: str) -> str:
    """A note on a finding's other environments, one paragraph per key (from "baselines only for: KEY; KEY")."""
    keys = detail.removeprefix("baselines only for: ").split("; ")
    return "\n".join(["no baseline in this environment; baselines only for:", *keys])


def grouped(pairs: Iterable[tuple[str, list[list[str]]]]) -> list[tuple[str, list[list[str]]]]:
    """Rows by title, consecutive rows with the same title in one group."""
    pairs = [(title, rows) for title, rows in pairs if rows]
    return [(title, [row for _, rows in group for row in rows]) for title, group in groupby(pairs, key=itemgetter(0))]


def figure_text(metric: str, value: int | None, exact: bool) -> str:
    """``value`` of ``metric`` as the command line and the history show it: in bytes when ``exact``."""
    return str(value) if exact and value is not None else metric_info(metric).format(value)


def delta_text(metric: str, delta: int, exact: bool) -> str:
    """A signed change of ``metric``, as :func:`figure_text` shows its values."""
    return f"{delta:+d}" if exact else metric_info(metric).format_delta(delta)
