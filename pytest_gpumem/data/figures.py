"""The figures of one measured span: the :class:`Measurement` dataclass.

Every figure is a count of bytes on the measured device. Figures are absolute:
they include ``start``, the bytes already allocated when the span began. What the
span itself added is its *cost*: a figure minus ``start`` (see
:meth:`Measurement.cost`). A figure the engine cannot know is ``None`` (shown as
"n/a"), never 0.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_gpumem.codec import Coded, coded, from_data
from pytest_gpumem.data.metrics import CATEGORIES, COUNT_METRICS, METRICS, metric_info
from pytest_gpumem.data.sites import SiteProfile

__all__ = [
    "CompiledCodeNotMeasured",
    "Measurement",
    "OutputNotWritten",
    "PartialFigures",
    "Phase",
    "Timeline",
]


class CompiledCodeNotMeasured(Warning):
    """A span's figures are those of the eager program, not of the ``torch.compile``'d code
    that would run without the measurement: TorchDynamo runs compiled frames eagerly while
    the tensor tracker (the CPU engine, or ``--gpumem-breakdown`` on CUDA) watches operators.
    Make it an error with ``-W error::pytest_gpumem.CompiledCodeNotMeasured``. It is not a
    ``UserWarning``: suites that silence torch's user warnings still see it."""


class PartialFigures(Warning):
    """A span's figures miss memory the engine could not see (work on a thread it could not
    watch, storages made outside PyTorch's operators); the notes of its :class:`Measurement`
    say what. Make it an error with ``-W error::pytest_gpumem.data.figures.PartialFigures``."""


def notify(warning: Warning, stacklevel: int = 1) -> None:
    """Warn about figures (:class:`PartialFigures`, :class:`CompiledCodeNotMeasured`, ...) so that a
    filter naming the warning's class applies as given (``-W error::pytest_gpumem.PartialFigures``
    fails the test), while a blanket one (``-W error``, ``filterwarnings = error``) does not turn it
    into the test's failure: the warning is then shown in pytest's summary, and the reports say the
    same. A blanket ``ignore`` silences it."""
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
    """A report, an artifact page or a memory snapshot the run was asked for could not be written
    (the message names the path and the reason: a folder at its name, a full disk, permissions).
    The run goes on and its exit status is what its tests say; make it an error with
    ``-W error::pytest_gpumem.data.figures.OutputNotWritten`` to fail the run instead."""


def _categories(breakdown: Mapping[str, int] | None) -> dict[str, int] | None:
    """The categories ``breakdown`` has, in report order (activations are absent where they were
    not told apart from temporaries)."""
    return None if breakdown is None else {c: int(breakdown[c]) for c in CATEGORIES if c in breakdown}


@dataclass(frozen=True)
class Phase(Coded):
    """One phase of a training step inside a span (bytes, absolute).

    ``start`` is allocated when the phase was first entered, ``peak`` the highest
    allocated while in it, ``end`` allocated when it was last left; ``count`` is
    how many times the span entered it (2 for a span holding a warm-up step and a
    measured step: its figures then cover both).
    """

    name: str = field(metadata=coded(skip=True))  # the key it is written under
    start: int
    peak: int
    end: int
    count: int = 1


@dataclass(frozen=True)
class Timeline(Coded):
    """Allocated bytes by category over a span, for plots.

    ``events`` are the indexes of allocation/free events (monotonic, starting at
    0 at the span's start) at which a sample was kept; ``series`` maps each of
    :data:`CATEGORIES` to the bytes of that category at each kept event (same
    length as ``events``); summed over categories a sample is the allocated bytes
    at that event. ``marks`` are ``(event, label)`` pairs for phase boundaries
    (``"forward"``, ``"backward"``, ``"optimizer"``: the phase that begins there).
    Long spans are downsampled; the samples of the highest event always stay.
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
        """JSON-ready data that :meth:`from_dict` reads back; with ``samples``, thinned to at most
        that many samples, each stretch of events keeping its highest total."""
        if samples is None or len(self.events) <= samples:
            return super().to_dict()
        totals = self.totals()
        size = -(-len(self.events) // samples)
        keep = [max(range(i, min(i + size, len(totals))), key=totals.__getitem__) for i in range(0, len(totals), size)]
        series = {c: tuple(self.series[c][i] for i in keep) for c in CATEGORIES}
        return replace(self, events=tuple(self.events[i] for i in keep), series=series).to_dict()

    @classmethod
    def empty(cls) -> Timeline:
        """A timeline without samples."""
        return cls((), {c: () for c in CATEGORIES})


@dataclass(frozen=True)
class Measurement(Coded):
    """What one span cost on its device. All sizes are bytes.

    Attributes:
        name: ``"call"`` for a whole test call, else the span's name.
        engine: where bytes were read: ``"cuda"`` (the device's caching
            allocator: CUDA, ROCm, XPU through ``torch.accelerator``) or ``"cpu"``
            (the exact tensor-storage tracker).
        device: the measured ``torch.device`` as a string, e.g. ``"cuda:0"``.
        start: allocated bytes when the span began.
        peak: highest allocated bytes during the span (everything alive on the
            device, not only what the span created).
        allocated: allocated bytes when the span ended.
        reserved: highest bytes the caching allocator held from the driver
            during the span; ``None`` on the CPU engine.
        start_reserved: reserved bytes when the span began; ``None`` on CPU.
        retained: allocated at the end of the test minus at its start, after
            garbage collection (a leak indicator); only for the ``"call"`` span.
        requested_peak: highest bytes the code asked for (before the allocator
            rounded them); CUDA only.
        num_alloc_retries: cudaMalloc retries after freeing cached blocks
            during the span; CUDA only.
        num_ooms: out-of-memory errors the allocator raised during the span.
        driver_used: device memory in use according to the driver (NVML) at the
            end of the span, all processes; ``None`` when unknown.
        driver_process: device memory NVML attributes to this process at the
            end of the span; ``None`` when NVML cannot attribute it (containers).
        breakdown: bytes by category (:data:`CATEGORIES`) at the moment of the
            peak; they sum to ``peak``. ``None`` when not measured.
        allocated_breakdown: bytes by category when ``allocated`` was read; they
            sum to ``allocated`` (CPU engine; on CUDA what the tracker cannot see
            is "other"). ``None`` when not measured.
        phases: forward / backward / optimizer figures, in the order they ran;
            empty when the span ran no tracked module or optimizer.
        saved_activations: the most bytes that autograd held for backward at
            one time during the span (distinct storages, parameters and their
            views excluded; what was held when the span began counts, as in
            ``peak``); ``None`` when not measured.
        psi: trainable parameter count of the objects tracked when the span
            ended (shared parameters once); ``None`` when nothing was tracked.
        cuda_rounding: True when the CPU engine rounded each storage up to the
            CUDA caching allocator's 512-byte blocks.
        max_microbatch: the largest microbatch size whose step fits the device
            (or the emulated device limit), when the test searched for it with
            ``gpumem.max_microbatch()``; a count, not bytes.
        notes: what the figures miss, one sentence each (work on threads the engine could
            not watch, storages found alive later that it did not see made); empty when they
            are complete.
        sites: where the bytes alive at the peak and at the end were made
            (:class:`~pytest_gpumem.data.sites.SiteProfile`); ``None`` when sites were not
            recorded (they are only on a baseline update, a failing test's second run, or
            ``--gpumem-sites=always``).
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
        """What the span itself added to ``metric``: the figure minus its value when the span began,
        the field the metric table names (:attr:`MetricInfo.cost <pytest_gpumem.data.metrics.MetricInfo.cost>`):
        ``peak`` and ``allocated`` subtract ``start``, ``reserved`` subtracts ``start_reserved``;
        ``retained`` is already a difference and ``max_microbatch`` a count. ``None`` when the
        figure, or its start, is unknown.
        """
        value = self.figure(metric)
        start_field = metric_info(metric).cost
        if value is None or not start_field:
            return value
        start: int | None = getattr(self, start_field)
        return None if start is None else value - start
