"""Out of memory as a test outcome: recognising the error, describing it (:class:`OomReport`), letting go of it."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

import torch

from pytest_gpumem.codec import Coded
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.diagnose.census import TOP, LiveTensor, live_table, live_tensors, stack_frames, traceback_frames
from pytest_gpumem.diagnose.holders import library_dirs
from pytest_gpumem.measurement import collector
from pytest_gpumem.tables import table
from pytest_gpumem.units import format_size

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines.base import Engine
    from pytest_gpumem.measurement.recorder import Recorder

__all__ = ["OomReport", "OomWatch", "is_oom", "oom_report", "release_oom", "requested_bytes"]

#: Lower-case fragments of messages that mean "out of memory" in exceptions that are not
#: :class:`torch.OutOfMemoryError`.
OOM_MESSAGES: tuple[str, ...] = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed")

_REQUEST_RE = re.compile(
    r"tried to allocate\s+([0-9]+(?:\.[0-9]+)?)\s*(bytes|b|kib|mib|gib|tib|kb|mb|gb|tb)\b", re.IGNORECASE
)
_REQUEST_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}  # by the unit's first letter

_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` is an out-of-memory error, or was raised ``from`` one (``__cause__``, not ``__context__``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError):
            return True
        if isinstance(current, RuntimeError):
            message = str(current).lower()
            if any(fragment in message for fragment in OOM_MESSAGES):
                return True
        current = current.__cause__
    return False


def requested_bytes(message: str) -> tuple[int, bool] | None:
    """The request size in an OOM message and whether it is exact (CUDA rounds to 2 decimals); None when absent."""
    match = _REQUEST_RE.search(message)
    if match is None:
        return None
    number, scale = match[1], _REQUEST_UNITS[match[2][0].lower()]
    return round(float(number) * scale), scale == 1 and "." not in number


# -- the report ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OomReport(Coded):
    """What the device held when an allocation failed, in bytes.

    ``when`` says whether it was seen at the failed allocation (the CPU tracker) or when the error was caught (CUDA: the
    failing operator's temporaries are gone); ``live_bytes`` is what Python can see of ``allocated``.
    """

    device: str
    engine: str
    message: str
    when: str
    requested: int | None
    requested_exact: bool
    allocated: int
    reserved: int | None
    limit: int | None
    phase: str | None
    breakdown: Mapping[str, int] | None
    largest: tuple[LiveTensor, ...] = ()
    live_count: int = 0
    live_bytes: int = 0
    site: str | None = None

    @property
    def unreachable(self) -> int:
        """Allocated bytes that no Python-reachable tensor accounts for (never negative)."""
        return max(0, self.allocated - self.live_bytes)

    def format(self) -> str:
        """The report as text for a failure message (with its tables)."""
        head = f"out of memory on {self.device}"
        if self.phase is not None:
            head += f" during {self.phase}"
        lines = [head + f" ({self.when})", f"  error: {self.message}"]
        if self.site is not None:
            lines.append(f"  at:        {self.site}")
        if self.requested is not None:
            approx = "" if self.requested_exact else "~"
            lines.append(f"  requested: {approx}{format_size(self.requested)} ({approx}{self.requested} B)")
        else:
            lines.append("  requested: unknown")
        lines.append(f"  allocated: {format_size(self.allocated)} ({self.allocated} B)")
        lines.append(f"  reserved:  {format_size(self.reserved)}")
        if self.limit is not None:
            lines.append(f"  limit:     {format_size(self.limit)} ({self.limit} B)")
        text = "\n".join(lines)
        if self.breakdown is not None:
            rows = [[category, format_size(self.breakdown.get(category))] for category in CATEGORIES]
            text += "\n\nallocated by category\n" + table(("category", "bytes"), rows)
        if self.largest:
            title = (
                f"largest live tensors ({len(self.largest)} of {self.live_count} storages, "
                f"{format_size(self.live_bytes)} in all; {format_size(self.unreachable)} allocated "
                "but held by no Python-reachable tensor)"
            )
            text += f"\n\n{title}\n" + live_table(self.largest)
        return text


def _first_line(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def oom_report(
    engine: Engine,
    *,
    recorder: Recorder | None = None,
    exc: BaseException | None = None,
    requested: int | None = None,
    frames: Iterable[FrameType] | None = None,
    top: int = TOP,
    when: str = "when the error was caught",
) -> OomReport:
    """Describe the device now, as an out-of-memory report.

    Call it while the failed step's tensors are alive: before :func:`release_oom` and ``recorder.end()``. ``frames``
    (innermost first, default ``exc``'s traceback) name tensors held by local variables.
    """
    exact = requested is not None
    if requested is None and exc is not None:
        parsed = requested_bytes(str(exc))
        if parsed is not None:
            requested, exact = parsed
    if frames is None:
        frames = traceback_frames(exc.__traceback__) if exc is not None else ()
    objects = list(recorder.tracked) if recorder is not None else []
    if recorder is not None:
        recorder.reclassify()
    largest, count, nbytes = live_tensors(
        engine.device, engine=engine, objects=objects, frames=frames, top=top, counted_only=engine.exact
    )
    site = engine.sites.here() if engine.sites is not None and when == "at the failed allocation" else None
    breakdown = None if engine.categories is None else engine.categories.breakdown()
    return OomReport(
        site=None if site is None else site.where(),
        device=str(engine.device),
        engine=engine.name,
        message=_first_line(exc),
        when=when,
        requested=requested,
        requested_exact=exact,
        allocated=engine.allocated(),
        reserved=engine.reserved(),
        limit=engine.memory_limit(),
        phase=recorder.phase if recorder is not None else None,
        breakdown=breakdown if recorder is None else recorder.categories(breakdown),
        largest=largest,
        live_count=count,
        live_bytes=nbytes,
    )


class OomWatch:
    """Catch the moment of an out-of-memory error and describe it (:meth:`report_for`).

    With a storage tracker (the CPU engine) the report is built at the refused allocation, through ``on_oom`` (a
    previous callback is kept and called); elsewhere :meth:`report_for` builds it, before the traceback is released.
    """

    def __init__(self, engine: Engine, recorder: Recorder | None = None, *, top: int = TOP) -> None:
        self.engine = engine
        self.recorder = recorder
        self.top = top
        #: the report built at the last refused allocation (CPU), if any.
        self.report: OomReport | None = None
        self._previous: Callable[[int], None] | None = None
        self._installed = False

    def __enter__(self) -> OomWatch:
        categories = self.engine.categories
        if categories is not None and not self._installed:
            self._previous, categories.on_oom = categories.on_oom, self._on_oom
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Restore the tracker's previous ``on_oom`` callback (idempotent)."""
        if self._installed and self.engine.categories is not None:
            self.engine.categories.on_oom = self._previous
            self._installed = False
            self._previous = None

    def _on_oom(self, nbytes: int) -> None:
        if self._previous is not None:
            self._previous(nbytes)
        try:
            self.report = oom_report(
                self.engine,
                recorder=self.recorder,
                requested=nbytes,
                frames=list(stack_frames(sys._getframe(1))),
                top=self.top,
                when="at the failed allocation",
            )
        except Exception:  # a report must never replace the OutOfMemoryError
            self.report = None

    def report_for(self, exc: BaseException) -> OomReport:
        """The report for ``exc``: the one built at its refused allocation, else one built now."""
        report = self.report
        if report is not None and report.requested is not None:
            marker = f"Tried to allocate {report.requested} bytes with {report.allocated} bytes allocated"
            if marker in str(exc):
                return dataclasses.replace(report, message=_first_line(exc))
        return oom_report(self.engine, recorder=self.recorder, exc=exc, top=self.top)


# -- releasing what a failed step holds ---------------------------------------------------------------


def _user_traceback(exc: BaseException) -> TracebackType | None:
    """``exc``'s traceback from its first to its last frame of user code; None when it has none.

    Cut at the user's last frame, GPU and CPU engine errors read alike, and the library frames below (whose closures can
    hold the step's tensors) go.
    """
    libraries = library_dirs()
    user: list[TracebackType] = []
    tb = exc.__traceback__
    while tb is not None:
        if not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(libraries):
            user.append(tb)
        tb = tb.tb_next
    if not user:
        return None
    user[-1].tb_next = None
    # from the first user frame on: the frames above (a test runner's) still run, so their locals cannot be cleared
    return user[0]


def release_oom(exc: BaseException, engine: Engine | None = None, *, collect: bool = True) -> None:
    """Let go of what a failed step holds through ``exc``, then collect garbage (unless ``collect=False``).

    Clears the locals of the finished frames in ``exc``'s traceback chain (cut to its user frames, sparing generator
    frames) and, on a CUDA-like engine, empties the caching allocator's cache. The exception keeps its message and user
    frames; the caller drops its own references (outputs, gradients).
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = _user_traceback(current)
        for frame, _ in traceback.walk_tb(current.__traceback__):
            # a generator's frame in a traceback caught the error and is suspended or running: clearing would close it
            if not frame.f_code.co_flags & _GENERATOR_FLAGS:
                with contextlib.suppress(RuntimeError):  # still executing: the frame that caught the error
                    frame.clear()
        pending.extend(linked for linked in (current.__cause__, current.__context__) if linked is not None)
    if collect:
        collector.collect()
    if engine is not None:
        engine.empty_cache()
