"""The metric table: every figure pytest-gpumem measures, limits, compares and shows, once (docs/architecture.md)."""

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
    "MEASURED_BASELINE_METRICS",
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
    """One figure: what it means, how it is compared (``higher_is_better`` flips every comparison) and how it is
    shown; :attr:`tolerance` and :attr:`tolerance_floor` are in the figure's own unit."""

    name: str
    higher_is_better: bool = False
    unit: Literal["bytes", "count"] = "bytes"
    #: what a limit on it bounds (the marker's help); "" for a figure the marker cannot limit
    meaning: str = ""
    #: what the figure is, in a few words (the HTML page's table of figures)
    about: str = ""
    #: the Measurement field holding the figure at its span's start (cost = figure minus it); "" to compare it as is
    cost: str = ""
    #: its cost is a net change, possibly negative (shown signed); other figures refuse a negative value in a file
    signed: bool = False
    #: the whole test's net change: no absolute figure, only the ``call`` span has it
    whole_call: bool = False
    #: only a caching allocator knows it: ``n/a`` on the CPU engine
    allocator: bool = False
    #: ``measure(name, <metric>=...)`` can limit it on a span (True: the marker can too)
    span_limit: bool = False
    #: which spans the baseline file keeps it for: ``"always"``, ``"measured"`` (a span that measured it) or ``""``
    baseline: Literal["always", "measured", ""] = ""
    #: drawn as a line across the HTML timeline when a limit, budget or baseline bounds it
    drawn: bool = False
    #: default baseline tolerance: (a fraction of the baseline, an absolute floor in its unit)
    tolerance: tuple[float, int] = (0.0, 0)
    #: the least absolute tolerance its baselines are compared with, whatever tolerance is set (in its unit)
    tolerance_floor: int = 0

    def format(self, value: int | None) -> str:
        """``value`` for people: ``"1.50 MiB"`` for bytes, ``"8"`` for counts, ``"n/a"`` for ``None``."""
        if value is None:
            return "n/a"
        return format_size(value) if self.unit == "bytes" else str(value)

    def format_pair(self, first: int | None, second: int | None) -> tuple[str, str]:
        """Two values read side by side: values that differ never read the same."""
        if self.unit != "bytes":
            return self.format(first), self.format(second)
        shown = format_sizes(first, second)
        return shown[0], shown[1]

    def format_delta(self, value: int | None) -> str:
        """A signed difference: ``"+1.50 MiB"`` for bytes, ``"-2"`` for counts."""
        if value is None:
            return "n/a"
        return format_delta(value) if self.unit == "bytes" else f"{value:+d}"

    def format_cost(self, value: int | None) -> str:
        """A cost (or a baseline, which is a recorded cost): signed for a net change (:attr:`signed`)."""
        return self.format_delta(value) if self.signed else self.format(value)


#: Every figure, in report order. ``peak`` and ``allocated`` are exact, so compared to the byte; ``reserved`` depends on
#: the cache's history: "2% or 1 MiB", never closer than one 20 MiB segment (docs/baselines.md, "Tolerance").
METRIC_TABLE: tuple[MetricInfo, ...] = (
    MetricInfo(
        "peak",
        meaning="limit on the highest allocated bytes during the call",
        about="highest allocated during the span",
        cost="start",
        span_limit=True,
        baseline="always",
        drawn=True,
    ),
    MetricInfo(
        "allocated",
        meaning="limit on the bytes allocated as the test function returns",
        about="allocated when the span ended",
        cost="start",
        signed=True,
        span_limit=True,
        baseline="always",
        drawn=True,
    ),
    MetricInfo(
        "reserved",
        meaning="limit on the highest bytes the caching allocator held (CUDA only)",
        about="highest held by the caching allocator",
        cost="start_reserved",
        allocator=True,
        span_limit=True,
        baseline="always",
        tolerance=(0.02, 2**20),
        tolerance_floor=20 * 2**20,
    ),
    MetricInfo(
        "retained",
        meaning="limit on what the test left allocated after it (a leak check: '0B')",
        about="allocated at test end minus at test start (leak indicator)",
        signed=True,
        whole_call=True,
    ),
    MetricInfo(
        "max_microbatch",
        higher_is_better=True,
        unit="count",
        about="the largest microbatch that fits",
        baseline="measured",
    ),
)

#: Metrics by name; any other name is bytes, lower is better (:func:`metric_info`).
METRIC_INFO: Mapping[str, MetricInfo] = {info.name: info for info in METRIC_TABLE}

#: Byte figures that limits and baselines can name (the marker's limit keywords, in order).
METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.unit == "bytes")
COUNT_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.unit == "count")
COST_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.cost)
SPAN_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.span_limit)
#: Figures every baseline keeps (``null`` where the engine cannot know them).
BASELINE_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.baseline == "always")
MEASURED_BASELINE_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.baseline == "measured")
DRAWN_METRICS: tuple[str, ...] = tuple(info.name for info in METRIC_TABLE if info.drawn)

#: Breakdown categories, in report order. They sum to the peak.
CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")

#: Phases of a training step, in order.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


def metric_info(metric: str) -> MetricInfo:
    """The :class:`MetricInfo` of ``metric`` (bytes, lower is better, when not in :data:`METRIC_INFO`)."""
    return METRIC_INFO.get(metric) or MetricInfo(metric)
