"""The figures of one measured span: the :class:`Measurement` dataclass.

Figures are absolute bytes on the measured device, ``start`` included; a span's *cost* is a figure minus its start. A
figure the engine cannot know is ``None`` ("n/a"), never 0.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_gpumem.codec import Coded, coded, from_data
from pytest_gpumem.data.metrics import CATEGORIES, COUNT_METRICS, METRICS, metric_info
from pytest_gpumem.data.site_figures import SiteProfile

__all__ = [
    "CompiledCodeNotMeasured",
    "Measurement",
    "OutputNotWritten",
    "PartialFigures",
    "Phase",
    "Timeline",
]


class CompiledCodeNotMeasured(Warning):
    """A span's figures are the eager program's, not the ``torch.compile``'d code's (TorchDynamo runs compiled frames
    eagerly while the tensor tracker watches); not a ``UserWarning``, so suites silencing those still see it."""


class PartialFigures(Warning):
    """A span's figures miss memory the engine could not see; its :class:`Measurement`'s notes say what."""


def notify(warning: Warning, stacklevel: int = 1) -> None:
    """Warn about figures so that a filter naming the warning's class applies as given, while a blanket ``-W error``
    does not fail the test (the warning shows in pytest's summary; a blanket ``ignore`` silences it)."""
    kind = type(warning)
    text = str(warning)
    for action, message, category, _module, _line in warnings.filters:
        if not issubclass(kind, category) or (message is not None and not message.match(text)):
            continue
        if category not in (Warning, UserWarning):  # the user named this warning: as given
            break
        if action == "ignore":
            return
        with warnings.catch_warnings():
            warnings.simplefilter("always", kind)
            warnings.warn(warning, stacklevel=stacklevel + 2)
        return
    warnings.warn(warning, stacklevel=stacklevel + 1)


class OutputNotWritten(Warning):
    """A report, artifact page or memory snapshot the run was asked for could not be written; the run goes on."""


def _categories(breakdown: Mapping[str, int] | None) -> dict[str, int] | None:
    """The categories ``breakdown`` has, in report order."""
    return None if breakdown is None else {c: int(breakdown[c]) for c in CATEGORIES if c in breakdown}


@dataclass(frozen=True)
class Phase(Coded):
    """One phase of a training step inside a span: allocated bytes at first entry, highest while in it, at last exit,
    and how many times the span entered it."""

    name: str = field(metadata=coded(skip=True))  # the key it is written under
    start: int
    peak: int
    end: int
    count: int = 1


@dataclass(frozen=True)
class Timeline(Coded):
    """Allocated bytes by category over a span, for plots.

    ``events`` are the kept events' indexes from the span's start, ``series`` each category's bytes at them and
    ``marks`` the ``(event, phase)`` boundaries; downsampling always keeps the highest event's samples.
    """

    events: tuple[int, ...] = field(metadata=coded(write=list))
    series: Mapping[str, tuple[int, ...]] = field(metadata=coded(write=lambda s: {c: list(s[c]) for c in CATEGORIES}))
    marks: tuple[tuple[int, str], ...] = ()

    def totals(self) -> tuple[int, ...]:
        """Allocated bytes at each kept event (the sum over categories)."""
        if not self.events:
            return ()
        return tuple(sum(values) for values in zip(*(self.series[c] for c in CATEGORIES), strict=True))

    def to_dict(self, samples: int | None = None) -> dict[str, Any]:
        """JSON-ready data that :meth:`from_dict` reads back, thinned to ``samples`` (each stretch keeps its
        highest)."""
        if samples is None or len(self.events) <= samples:
            return super().to_dict()
        totals = self.totals()
        size = -(-len(self.events) // samples)
        keep = [max(range(i, min(i + size, len(totals))), key=totals.__getitem__) for i in range(0, len(totals), size)]
        series = {c: tuple(self.series[c][i] for i in keep) for c in CATEGORIES}
        return replace(self, events=tuple(self.events[i] for i in keep), series=series).to_dict()


@dataclass(frozen=True)
class Measurement(Coded):
    """What one span cost on its device, in bytes (the fields are described in docs/figures.md).

    ``engine`` is ``"cuda"`` (a caching allocator) or ``"cpu"`` (the storage tracker); CUDA-only figures are ``None`` on
    the CPU engine. ``breakdown`` sums to ``peak`` and ``allocated_breakdown`` to ``allocated``; ``retained`` exists
    only for the ``"call"`` span; ``max_microbatch`` is a count; ``notes`` say what the figures miss; ``sites`` is
    ``None`` unless sites were recorded.
    """

    name: str
    engine: str
    device: str
    start: int
    peak: int
    allocated: int
    reserved: int | None = None
    start_reserved: int | None = None
    retained: int | None = None
    requested_peak: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    driver_used: int | None = None
    driver_process: int | None = None
    breakdown: Mapping[str, int] | None = field(default=None, metadata=coded(write=_categories))
    allocated_breakdown: Mapping[str, int] | None = field(default=None, metadata=coded(write=_categories))
    phases: Mapping[str, Phase] = field(
        default_factory=dict,
        metadata=coded(read=lambda data: {str(k): from_data(Phase, {**v, "name": k}) for k, v in data.items()}),
    )
    saved_activations: int | None = None
    psi: int | None = None
    cuda_rounding: bool = False
    max_microbatch: int | None = None
    notes: tuple[str, ...] = ()
    sites: SiteProfile | None = field(default=None, metadata=coded(omit=True))

    def figure(self, metric: str) -> int | None:
        """The absolute figure named ``metric`` (one of :data:`METRICS` or :data:`COUNT_METRICS`)."""
        if metric not in METRICS and metric not in COUNT_METRICS:
            raise KeyError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS + COUNT_METRICS)}")
        value: int | None = getattr(self, metric)
        return value

    def cost(self, metric: str) -> int | None:
        """What the span itself added to ``metric``: the figure minus the metric's start field; ``None`` when
        unknown."""
        value = self.figure(metric)
        start_field = metric_info(metric).cost
        if value is None or not start_field:
            return value
        start: int | None = getattr(self, start_field)
        return None if start is None else value - start
