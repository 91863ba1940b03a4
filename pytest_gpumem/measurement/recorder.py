"""Spans, phases and breakdowns: turning engine readings into :class:`Measurement` objects."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_gpumem.data.figures import CompiledCodeNotMeasured, Measurement, PartialFigures, Phase, Timeline, notify
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.data.site_figures import SiteConfig, build_profile
from pytest_gpumem.judge.limits import LimitSpec, parse_span_limits
from pytest_gpumem.measurement.engines import describe_compiled
from pytest_gpumem.measurement.engines.base import Engine, Reading, Runtime
from pytest_gpumem.measurement.engines.savedhooks import STEPPED_ASIDE_NOTE
from pytest_gpumem.measurement.tracked import Tracked

__all__ = ["Recorder", "Span"]


@dataclass
class _SpanState:
    name: str
    start: int
    start_reserved: int | None
    counters: dict[str, int]
    start_event: int
    peak: int
    breakdown: tuple[int, ...] | None = None
    highest: dict[str, int] = field(default_factory=dict)  #: the engine's other figures (:attr:`Reading.highest`)
    sites: Any = None
    compiled_from: int = 0
    notes_from: int = 0
    phases: dict[str, Phase] = field(default_factory=dict)

    def absorb(self, reading: Reading, phase: str | None) -> None:
        if reading.peak > self.peak or (reading.peak == self.peak and self.breakdown is None):
            self.peak = reading.peak
            self.breakdown = reading.breakdown
            self.sites = reading.sites
        for figure, value in reading.highest.items():
            self.highest[figure] = max(self.highest.get(figure, 0), value)
        if phase is not None and phase in self.phases:
            state = self.phases[phase]
            self.phases[phase] = replace(state, peak=max(state.peak, reading.peak))


class Recorder:
    """Measures spans on one engine; one per test. ``saved_tensors``: tell activations apart from temporaries."""

    def __init__(
        self,
        engine: Engine,
        *,
        timeline: bool = False,
        saved_tensors: bool = True,
        fake: bool = False,
        label: str = "a measurement",
        sites: SiteConfig | None = None,
    ) -> None:
        self.engine = engine
        self.sites, self._end_sites = sites, _sites_now(engine)
        self.timeline = timeline and engine.categories is not None
        self.saved_tensors = saved_tensors
        self._open: list[_SpanState] = []
        self.phase: str | None = None  #: the training step's phase now ("forward", "backward", "optimizer")
        self.external_phases = False  #: phases are marked by a framework adapter (:meth:`mark_phase`)
        self._marks: list[tuple[int, str]] = []
        #: windows and phase changes the engine reads later: (kind, token, phase, new phase)
        self._deferred: list[tuple[str, int, str | None, str | None]] = []
        self.active = False
        self.spans: list[Span] = []  #: the spans closed so far, in order
        self.ranks_measured = False  #: the marker's limits apply to every rank's span
        self.device_limit: int | None = None  #: the emulated device size in bytes, if any
        self.reserved = False  #: a limit or budget needs ``reserved`` from an empty cache
        self.driver = False  #: read the driver's figures (NVML) at a span's end
        self.max_microbatch: int | None = None  #: found by ``gpumem.max_microbatch()``
        self.returned: tuple[int, dict[str, int] | None] | None = None  #: :meth:`read_return`'s reading
        self.fake = fake
        self.label = label
        self._faked = contextlib.ExitStack()  # the fake tensors' mode, below the tracker's dispatch mode
        self._tracked = Tracked(self)

    # -- life cycle ------------------------------------------------------------

    def begin(self) -> None:
        """Clean the device and start watching."""
        if self.fake:
            from pytest_gpumem.measurement.engines.fake import fake_mode

            self._faked.enter_context(fake_mode())
        try:
            self.engine.clean(empty_cache=self.reserved or self.device_limit is not None)
            self.engine.start(saved_tensors=self.saved_tensors, timeline=self.timeline)
            if self.sites is not None and self.engine.sites is not None:  # not on every engine: observe="allocations"
                self.engine.sites.start(self.sites)
        except BaseException:
            self._faked.close()
            raise
        self._tracked.classify()
        self._tracked.quiet()
        self.active = True

    def end(self) -> None:
        """Stop watching; remove this recorder's hooks and let go of tracked objects."""
        self.active = False
        self.engine.stop()
        self.phase = None
        self.external_phases = False
        if self.fake:
            from pytest_gpumem.measurement.engines.fake import warn_tracing_paths

            warn_tracing_paths(self.tracked, self.label)
        self._faked.close()
        self._tracked.clear()

    # -- tracked objects -------------------------------------------------------

    @property
    def tracked(self) -> list[Any]:
        return self._tracked.objects

    def track(self, *objects: Any) -> None:
        """Register modules and optimizers for the breakdown, phases and Ψ (twice is harmless)."""
        self._tracked.add(*objects)
        if self.active:
            self._tracked.classify()

    def reclassify(self) -> None:
        """Give the tracked objects' tensors their categories now (an out-of-memory report)."""
        self._tracked.classify()

    @property
    def psi(self) -> int | None:
        """Trainable parameter count of the tracked objects (None: nothing tracked)."""
        return self._tracked.psi

    # -- phases ------------------------------------------------------------------

    def mark_phase(self, phase: str | None) -> None:
        """Enter ``phase`` as a framework's hooks tell it, and from now on only they do (Lightning's closures)."""
        self.external_phases = True
        self.set_phase(phase)

    def set_phase(self, phase: str | None) -> None:
        """Enter ``phase`` ("forward", "backward", "optimizer") or leave phases (None)."""
        if phase == self.phase or not self.active:
            return
        token = self._fold(defer=True)
        old, self.phase = self.phase, phase
        if self.engine.sites is not None:
            self.engine.sites.set_phase(phase)
        if token is not None:  # the engine reads this moment later: so is the transition
            self._deferred.append(("phase", token, old, phase))
            return
        categories = self.engine.categories
        self._transition(old, phase, self.engine.allocated(), 0 if categories is None else categories.events)

    def _transition(self, old: str | None, new: str | None, now: int, events: int) -> None:
        if old is not None:
            for span in self._open:
                if old in span.phases:
                    span.phases[old] = replace(span.phases[old], end=now)
        if new is not None:
            for span in self._open:
                state = span.phases.get(new)
                if state is None:
                    span.phases[new] = Phase(new, now, now, now)
                else:
                    span.phases[new] = replace(state, peak=max(state.peak, now), count=state.count + 1)
            if self.engine.categories is not None:
                self._marks.append((events, new))

    # -- spans -----------------------------------------------------------------

    def _fold(self, *, defer: bool = False) -> int | None:
        """Close the engine's window and give it to the open spans; returns its token when the engine reads it later."""
        reading = self.engine.take_window(defer=defer)
        if reading.pending is not None:
            self._deferred.append(("fold", reading.pending, self.phase, None))
            return reading.pending
        if self._deferred:  # earlier windows, read by this reading's flush: theirs come first
            deferred, self._deferred = self._deferred, []
            for kind, token, phase, new in deferred:
                earlier, now, events = self.engine.resolve(token)
                if kind == "fold":
                    for span in self._open:
                        span.absorb(earlier, phase)
                else:
                    self._transition(phase, new, now, events)
        for span in self._open:
            span.absorb(reading, self.phase)
        return None

    def open(self, name: str) -> _SpanState:
        """Open a span; returns its state for :meth:`close`."""
        if not self.active:
            raise RuntimeError(f"cannot open span {name!r}: the recorder is not active")
        engine, categories = self.engine, self.engine.categories
        with engine.reading():
            self._fold()
            now = engine.allocated()
            breakdown = None if categories is None else categories.breakdown()
            saved = engine.saved_bytes()
            state = _SpanState(
                name=name,
                start=now,
                start_reserved=engine.reserved(),
                counters=_counters(engine),
                start_event=0 if categories is None else categories.events,
                peak=now,
                breakdown=None if breakdown is None else tuple(breakdown.values()),
                highest={} if saved is None else {"saved_activations": saved},
                sites=_sites_now(engine),
                compiled_from=0 if categories is None else len(categories.compiled_frames),
                notes_from=0 if categories is None else len(categories.notes),
                phases={} if self.phase is None else {self.phase: Phase(self.phase, now, now, now)},
            )
            self._open.append(state)
            return state

    def allocated_now(self) -> tuple[int, dict[str, int] | None]:
        """Allocated bytes now and, with a tracker, their breakdown."""
        with self.engine.reading():  # inside a span's end reading, the same one (readings nest)
            self._end_sites = _sites_now(self.engine)
            now = self.engine.allocated()
            if self.engine.categories is None:
                return now, None
            parts = self.engine.categories.breakdown()
        parts["other"] += max(0, now - sum(parts.values()))
        return now, self.categories(parts)

    def read_return(self) -> None:
        """Read allocated bytes now, as the measured function returns (:attr:`returned`)."""
        self.returned = self.allocated_now()

    def categories(self, parts: dict[str, int] | None) -> dict[str, int] | None:
        """``parts`` as a figure shows them: without ``activations`` when ``saved_tensors`` is False."""
        if parts is not None and not self.saved_tensors:
            parts.pop("activations", None)
        return parts

    def close(self, state: _SpanState, *, allocated: tuple[int, dict[str, int] | None] | None = None) -> Measurement:
        """Close a span opened by :meth:`open` and return its figures; ``allocated``: an earlier end reading."""
        with self.engine.reading():
            self._fold()
            now = self.engine.allocated()
            if self.phase is not None and self.phase in state.phases:
                state.phases[self.phase] = replace(state.phases[self.phase], end=now)
            self._open.remove(state)
            counters = _counters(self.engine)
            used, mine = self.engine.driver() if self.driver and isinstance(self.engine, Runtime) else (None, None)
            end, end_breakdown = self.allocated_now() if allocated is None else allocated
        breakdown = None if state.breakdown is None else dict(zip(CATEGORIES, state.breakdown, strict=True))
        breakdown = self.categories(breakdown)
        self._warn_compiled(state)
        categories = self.engine.categories
        notes = () if categories is None else tuple(dict.fromkeys(categories.notes[state.notes_from :]))
        for note in notes:
            if note != STEPPED_ASIDE_NOTE:  # torch's own refusal: said in the reports, never raised (-W error)
                notify(PartialFigures(f"span {state.name!r}: {note}"), stacklevel=2)
        sites = self.engine.sites
        highest: dict[str, Any] = dict(state.highest)
        if not self.saved_tensors:
            highest.pop("saved_activations", None)
        return Measurement(
            name=state.name,
            engine=self.engine.name,
            device=str(self.engine.device),
            start=state.start,
            peak=state.peak,
            allocated=end,
            start_reserved=state.start_reserved,
            num_alloc_retries=_diff(counters, state.counters, "num_alloc_retries"),
            num_ooms=_diff(counters, state.counters, "num_ooms"),
            driver_used=used,
            driver_process=mine,
            breakdown=breakdown,
            allocated_breakdown=end_breakdown,
            phases=dict(state.phases),
            psi=self.psi,
            cuda_rounding=self.engine.cuda_rounding,
            notes=notes,
            sites=build_profile(None if sites is None else sites.figures(state.sites, self._end_sites)),
            **highest,
        )

    def _warn_compiled(self, state: _SpanState) -> None:
        frames = () if self.engine.categories is None else self.engine.categories.compiled_frames
        if len(frames) <= state.compiled_from:
            return
        shown = describe_compiled(list(frames[state.compiled_from :]))
        notify(
            CompiledCodeNotMeasured(
                f"span {state.name!r} measured the eager program, not the torch.compile'd one: "
                f"TorchDynamo ran {shown} eagerly because the {self.engine.name} engine's tensor tracker "
                "watches operators (it compiles that code again after the measurement); compiled code's "
                "memory can differ (fusion, recomputation): measure it with observe='allocations' "
                "(CPU engine) or on CUDA without the breakdown"
            ),
            stacklevel=2,
        )

    def timeline_since(self, start_event: int) -> Timeline | None:
        """The tracker's samples from ``start_event`` on, as a :class:`Timeline`."""
        categories = self.engine.categories
        if categories is None:
            return None
        columns = categories.timeline_columns(start_event)
        now = categories.breakdown()
        if columns is None:
            return None
        events, parts = columns
        if not events or events[-1] != categories.events:
            events.append(categories.events)
            for column, value in zip(parts, now.values(), strict=True):
                column.append(value)
        events = [event - start_event for event in events]
        series = {category: tuple(column) for category, column in zip(CATEGORIES, parts, strict=True)}
        marks = tuple((event - start_event, label) for event, label in self._marks if event >= start_event)
        return Timeline(events=tuple(events), series=series, marks=marks)

    def span(self, name: str, **limits: Any) -> Span:
        """A ``with`` block measured as a span named ``name``."""
        return Span(self, name, limits)

    @property
    def span_names(self) -> list[str]:
        """Names of the spans opened so far, in order."""
        return [span.name for span in self.spans] + [state.name for state in self._open]


def _diff(now: Mapping[str, int], before: Mapping[str, int], key: str) -> int | None:
    return now[key] - before[key] if key in now and key in before else None


class Span:
    """A measured ``with`` block: after it, ``span.measurement`` and its shortcuts; its limits are judged later."""

    def __init__(self, recorder: Recorder, name: str, limits: Mapping[str, Any]) -> None:
        self.recorder = recorder
        self.name = name
        self.limits, self.tolerance = parse_span_limits(name, limits)
        self._state: _SpanState | None = None
        self._measurement: Measurement | None = None
        self.timeline: Timeline | None = None

    def __enter__(self) -> Span:
        if self._state is not None or self._measurement is not None:
            raise RuntimeError(f"span {self.name!r} cannot be entered twice")
        self._state = self.recorder.open(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._state is not None
        start_event = self._state.start_event
        self._measurement = self.recorder.close(self._state)
        self.timeline = self.recorder.timeline_since(start_event) if self.recorder.timeline else None
        self._state = None
        self.recorder.spans.append(self)

    @classmethod
    def finished(cls, recorder: Recorder, name: str, measurement: Measurement, limits: Iterable[LimitSpec]) -> Span:
        """A span measured elsewhere (a rank process)."""
        span = cls(recorder, name, {})
        span.limits = tuple(limits)
        span._measurement = measurement
        return span

    @property
    def measurement(self) -> Measurement:
        """The span's figures; raises if the block has not finished."""
        if self._measurement is None:
            raise RuntimeError(f"span {self.name!r} has no figures until its with-block ends")
        return self._measurement

    @property
    def start(self) -> int:
        return self.measurement.start

    @property
    def peak(self) -> int:
        return self.measurement.peak

    @property
    def allocated(self) -> int:
        return self.measurement.allocated

    @property
    def reserved(self) -> int | None:
        return self.measurement.reserved

    @property
    def breakdown(self) -> Mapping[str, int] | None:
        return self.measurement.breakdown

    @property
    def phases(self) -> Mapping[str, Phase]:
        return self.measurement.phases

    @property
    def saved_activations(self) -> int | None:
        return self.measurement.saved_activations

    @property
    def allocated_breakdown(self) -> Mapping[str, int] | None:
        return self.measurement.allocated_breakdown

    @property
    def psi(self) -> int | None:
        return self.measurement.psi

    def cost(self, metric: str) -> int | None:
        """What the span added to ``metric`` (figure minus start)."""
        return self.measurement.cost(metric)

    def __repr__(self) -> str:
        state = "open" if self._measurement is None else f"peak={self._measurement.peak}"
        return f"<Span {self.name!r} {state}>"


def _counters(engine: Engine) -> dict[str, int]:
    return engine.counters() if isinstance(engine, Runtime) else {}


def _sites_now(engine: Engine) -> Any:
    """``engine``'s bytes by site now; None without sites."""
    return None if engine.sites is None else engine.sites.now()
