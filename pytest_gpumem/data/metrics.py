"""The metric table: every figure pytest-gpumem measures, limits, compares and shows, once.

Each :class:`MetricInfo` row says what a figure means, its unit, which way is better,
whether limits and baselines compare its *cost* (the figure minus its span's start),
where it can be limited (the marker, a span), whether the baseline file keeps it, and
the tolerance it is compared with when nothing sets one. Every module reads the names
it needs from here (the tuples below are views of the table); adding a figure is a row
here and its reading in the engines (see docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pytest_gpumem.units import format_delta, format_size, format_sizes

__all__ = [
    "BASELINE_METRICS",
    "CATEGORIES",
    "COST_METRICS",
    "COUNT_METRICS",
    "DRAWN_METRICS",
    "METRICS",
    "METRIC_INFO",
    "METRIC_TABLE",
    "PHASES",
    "SPAN_METRICS",
    "MetricInfo",
    "metric_info",
]


@dataclass(frozen=True)
class MetricInfo:
    """One figure: how it is compared and shown.

    ``higher_is_better`` flips every comparison: a limit becomes a minimum and
    a regression is the value dropping (e.g. the largest microbatch that fits).
    ``unit`` is ``"bytes"`` (shown with :func:`~pytest_gpumem.units.format_size`)
    or ``"count"`` (shown as a plain integer); a tolerance's absolute floor is in
    this unit.
    """

    name: str
    higher_is_better: bool = False
    unit: Literal["bytes", "count"] = "bytes"
    #: what a limit on it bounds (the marker's help); "" for a figure the marker cannot limit
    meaning: str = ""
    #: limits and baselines compare the figure minus its span's start (False: it is already a difference, or a count)
    cost: bool = False
    #: ``measure(name, <metric>=...)`` can limit it on a span (True: the marker can too)
    span_limit: bool = False
    #: the baseline file always keeps it (a count is kept only when the test measured it)
    baseline: bool = False
    #: drawn as a line across the HTML timeline when a limit, budget or baseline bounds it
    drawn: bool = False
    #: default baseline tolerance: (a fraction of the baseline, an absolute floor in the unit)
    tolerance: tuple[float, int] = (0.0, 0)
    #: its cost can be below 0: a span that frees what was alive at its start (a baseline file
    #: holding a negative value for any other figure is refused)
    signed: bool = False

    def format(self, value: int | None) -> str:
        """``value`` for people: ``"1.50 MiB"`` for bytes, ``"8"`` for counts, ``"n/a"`` for ``None``."""
        if value is None:
            return "n/a"
        return format_size(value) if self.unit == "bytes" else str(value)

    def format_pair(self, first: int | None, second: int | None) -> tuple[str, str]:
        """Two values read side by side (a figure and its limit or baseline): values that differ never
        read the same (:func:`~pytest_gpumem.units.format_sizes`)."""
        if self.unit != "bytes":
            return self.format(first), self.format(second)
        shown = format_sizes(first, second)
        return shown[0], shown[1]

    def format_delta(self, value: int | None) -> str:
        """A signed difference: ``"+1.50 MiB"`` for bytes, ``"-2"`` for counts."""
        if value is None:
            return "n/a"
        return format_delta(value) if self.unit == "bytes" else f"{value:+d}"


#: Every figure, in report order. ``peak`` and ``allocated`` are exact on every engine (the CPU
#: tracker counts storages; on CUDA the caching allocator's counters gave identical bytes for
#: identical steps on an H100), so their baselines are exact: any change is a change in what the
#: code allocates, and a percentage would hide a real regression at every scale (2% of a 12 MiB
#: step let a +476 KiB float64 loss through; 2% of a 20 GiB step is a 400 MiB activation copy).
#: ``reserved`` depends on the cache's history and keeps "2% or 1 MiB" (and at least one 20 MiB
#: segment: :data:`~pytest_gpumem.judge.judgement.RESERVED_TOLERANCE_FLOOR`).
METRIC_TABLE: tuple[MetricInfo, ...] = (
    MetricInfo(
        "peak",
        meaning="limit on the highest allocated bytes during the call",
        cost=True,
        span_limit=True,
        baseline=True,
        drawn=True,
    ),
    MetricInfo(
        "allocated",
        meaning="limit on the bytes allocated as the test function returns",
        cost=True,
        span_limit=True,
        baseline=True,
        drawn=True,
        signed=True,
    ),
    MetricInfo(
        "reserved",
        meaning="limit on the highest bytes the caching allocator held (CUDA only)",
        cost=True,
        span_limit=True,
        baseline=True,
        tolerance=(0.02, 2**20),
    ),
    MetricInfo("retained", meaning="limit on what the test left allocated after it (a leak check: '0B')", signed=True),
    MetricInfo("max_microbatch", higher_is_better=True, unit="count"),
)

#: Metrics by name; any other name is bytes, lower is better (:func:`metric_info`).
METRIC_INFO: Mapping[str, MetricInfo] = {info.name: info for info in METRIC_TABLE}

#: Byte figures that limits and baselines can name (the marker's limit keywords, in order).
METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.unit == "bytes")
#: Figures that are not bytes: the largest microbatch that fits (a count; higher is better).
COUNT_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.unit == "count")
#: Figures whose limits and baselines compare the cost (figure minus the span's start).
COST_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.cost)
#: Figures a named span can limit (``measure(name, peak=...)``).
SPAN_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.span_limit)
#: Byte figures every baseline keeps.
BASELINE_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.baseline)
#: Figures drawn across the HTML timeline when a limit, budget or baseline bounds them.
DRAWN_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.drawn)

#: Breakdown categories, in report order. They sum to the peak.
CATEGORIES: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "other",
)

#: Phases of a training step, in order.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


def metric_info(metric: str) -> MetricInfo:
    """The :class:`MetricInfo` of ``metric`` (bytes, lower is better, when not in :data:`METRIC_INFO`)."""
    return METRIC_INFO.get(metric) or MetricInfo(metric)
