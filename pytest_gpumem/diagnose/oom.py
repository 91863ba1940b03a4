"""Out of memory as a test outcome: recognising the error, describing it, letting go of it.

* :func:`is_oom` recognises an out-of-memory error (and :func:`requested_bytes`
  reads the failed request's size from its message).
* :class:`OomWatch` / :func:`oom_report` describe it: what was requested, what
  was allocated, the breakdown and phase, and the largest live tensors with
  where they are held (:mod:`pytest_gpumem.diagnose.census`).
* :func:`release_oom` lets go of what a failed step still holds through the
  exception's traceback, so that the next step (or test) starts clean.

Emulated device sizes, which make a step run out of memory on purpose, are
:func:`pytest_gpumem.measurement.devicelimit.device_limit`. Sizes are bytes throughout.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import torch

from pytest_gpumem.codec import Coded
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.diagnose.census import (
    TOP,
    LiveTensor,
    live_table,
    stack_frames,
    take_census,
    traceback_frames,
)
from pytest_gpumem.diagnose.holders import library_dirs
from pytest_gpumem.measurement import collector
from pytest_gpumem.tables import table
from pytest_gpumem.units import format_size

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines.base import Engine
    from pytest_gpumem.measurement.recorder import Recorder

__all__ = [
    "OomReport",
    "OomWatch",
    "is_oom",
    "oom_report",
    "release_oom",
    "requested_bytes",
]

#: Lower-case fragments of error messages that mean "out of memory" in exceptions
#: that are not :class:`torch.OutOfMemoryError` (old wrappers, the CPU allocator,
#: cuBLAS failing to allocate its workspace).
OOM_MESSAGES: tuple[str, ...] = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed")

_REQUEST_RE = re.compile(
    r"tried to allocate\s+([0-9]+(?:\.[0-9]+)?)\s*(bytes|b|kib|mib|gib|tib|kb|mb|gb|tb)\b", re.IGNORECASE
)
_REQUEST_UNITS = {"bytes": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` is an out-of-memory error.

    That is a :class:`torch.OutOfMemoryError` (``torch.cuda.OutOfMemoryError`` is
    the same class), or a :class:`RuntimeError` whose message contains one of
    :data:`OOM_MESSAGES` (old wrappers, the CPU allocator's "can't allocate
    memory"). An exception raised ``from`` such an error (its ``__cause__``)
    counts too; one merely raised while handling it (``__context__``) does not.
    """
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
    """The request size in an OOM message, and whether it is exact.

    Reads ``"Tried to allocate 20.00 MiB"`` (CUDA: rounded to 2 decimals, so not
    exact), ``"Tried to allocate 65536 bytes"`` (the CPU tracker: exact) and the
    CPU allocator's ``"you tried to allocate 100 bytes"``. None when absent.
    """
    match = _REQUEST_RE.search(message)
    if match is None:
        return None
    number, unit = match[1], match[2].lower()
    scale = _REQUEST_UNITS[unit] if unit in ("bytes", "b") else _REQUEST_UNITS[unit[0]]
    exact = scale == 1 and "." not in number
    return round(float(number) * scale), exact


# -- the report ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OomReport(Coded):
    """What the device held when an allocation failed. All sizes are bytes.

    Attributes:
        device: the device, e.g. ``"cuda:0"``.
        engine: ``"cpu"`` (the storage tracker) or ``"cuda"`` (the caching allocator).
        message: the first line of the error message.
        when: ``"at the failed allocation"`` (the CPU tracker reports the moment
            itself) or ``"when the error was caught"`` (CUDA: tensors that the
            failing frames held are still alive then, temporaries of the failing
            operator are not).
        requested: bytes the failed allocation asked for; None when unknown.
        requested_exact: False when ``requested`` was parsed from a message that
            rounds it (CUDA prints "20.00 MiB").
        allocated: allocated bytes at that moment (without the failed request).
        reserved: reserved bytes at that moment (CUDA); None on CPU.
        limit: the emulated device limit in force (see :func:`device_limit`);
            None when there is none.
        phase: "forward", "backward" or "optimizer" when the failure happened in
            a phase of a tracked model, else None.
        breakdown: allocated bytes by category at that moment (needs a tracker).
        largest: the largest live tensors, largest first.
        live_count: distinct live storages found from Python.
        live_bytes: their total bytes; ``allocated - live_bytes`` is held where
            Python cannot see it (autograd's saved tensors without the tracker,
            workspaces, allocator rounding).
        site: the line whose allocation failed, when sites were recorded (the CPU engine's
            tracker refuses it there); None otherwise.
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

    Call it while the failed step's tensors are still alive: before
    :func:`release_oom`, and before ``recorder.end()`` (which forgets the phase and
    the tracked objects). ``requested`` overrides the size parsed from ``exc``'s
    message. ``frames`` (innermost first) name tensors held by local variables;
    by default they are ``exc``'s traceback frames.
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
    live = take_census(engine.device, engine, objects, frames, top, counted_only=engine.exact)
    site = engine.site_here() if when == "at the failed allocation" else None
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
        breakdown=engine.breakdown() if recorder is None else recorder.categories(engine.breakdown()),
        largest=live.tensors,
        live_count=live.count,
        live_bytes=live.nbytes,
    )


class OomWatch:
    """Catch the moment of an out-of-memory error and describe it.

    On an engine with a storage tracker (the CPU engine) the watch installs
    itself as ``tracker.on_oom`` while entered, so the report is built *at* the
    refused allocation: the exact request, the breakdown and phase then, and the
    tensors the failing frames hold. Elsewhere (CUDA) nothing can be seen at that
    moment, so :meth:`report_for` builds the report when called: do it before
    the traceback is released. A previous ``on_oom`` callback is kept and called.

    Example::

        with OomWatch(engine, recorder) as watch:
            try:
                step()
            except Exception as exc:
                if not is_oom(exc):
                    raise
                report = watch.report_for(exc)
                release_oom(exc, engine)
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
        if self.engine.categorizes and not self._installed:
            self._previous = self.engine.swap_oom_callback(self._on_oom)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Restore the tracker's previous ``on_oom`` callback (idempotent)."""
        if self._installed:
            self.engine.swap_oom_callback(self._previous)
            self._installed = False
            self._previous = None

    def _on_oom(self, nbytes: int) -> None:
        if self._previous is not None:
            self._previous(nbytes)
        try:
            frames = list(stack_frames(sys._getframe(1)))
            self.report = oom_report(
                self.engine,
                recorder=self.recorder,
                requested=nbytes,
                frames=frames,
                top=self.top,
                when="at the failed allocation",
            )
        except Exception:  # a report must never replace the OutOfMemoryError
            self.report = None
        finally:
            frames = []

    def report_for(self, exc: BaseException) -> OomReport:
        """The report for ``exc``: the one built at its refused allocation when it is the
        tracker's error, else one built now (call it before :func:`release_oom`)."""
        report = self.report
        if report is not None and report.requested is not None:
            marker = f"Tried to allocate {report.requested} bytes with {report.allocated} bytes allocated"
            if marker in str(exc):
                return OomReport(**{**_fields(report), "message": _first_line(exc)})
        return oom_report(self.engine, recorder=self.recorder, exc=exc, top=self.top)


def _fields(report: OomReport) -> dict[str, Any]:
    return {name: getattr(report, name) for name in report.__dataclass_fields__}


# -- releasing what a failed step holds ---------------------------------------------------------------


def _user_traceback(exc: BaseException) -> TracebackType | None:
    """``exc``'s traceback from its first to its last frame of user code; None when it has none.

    User code is what is not the standard library, an installed package, torch or this
    package. On a GPU the allocator raises from C++ and the traceback ends in torch's
    Python frames, or at the user's line; the CPU engine refuses an emulated
    ``device_limit`` from its dispatch mode, below torch's. Cut at the user's last frame,
    both read alike (pytest shows the test's line and its helpers'), and the library frames
    below, whose closures can hold the step's tensors after their frames are cleared, go.
    """
    libraries = library_dirs()
    first_user: TracebackType | None = None
    last_user: TracebackType | None = None
    tb = exc.__traceback__
    while tb is not None:
        if not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(libraries):
            first_user = first_user or tb
            last_user = tb
        tb = tb.tb_next
    if first_user is None or last_user is None:
        return None
    last_user.tb_next = None
    # from the first frame of user code on: the frames above it (a test runner's) are still
    # running, so their locals cannot be cleared, and the traceback would keep them afterwards
    return first_user


def _clear_traceback(tb: TracebackType | None) -> None:
    while tb is not None:
        frame = tb.tb_frame
        # A generator's frame in a traceback is one that caught the error and is
        # suspended or running (pluggy's wrappers): clearing it would close it.
        if not frame.f_code.co_flags & _GENERATOR_FLAGS:
            with contextlib.suppress(RuntimeError):  # still executing: the frame that caught the error
                frame.clear()
        tb = tb.tb_next


def release_oom(exc: BaseException, engine: Engine | None = None, *, collect: bool = True) -> None:
    """Let go of what a failed step holds through ``exc``, then collect garbage.

    Clears the local variables of every finished frame in the tracebacks of
    ``exc`` and of its ``__cause__`` / ``__context__`` chain (``frame.clear()``,
    as :func:`traceback.clear_frames` does, but sparing generator frames, which
    clearing would close), runs ``gc.collect()`` and, on a CUDA-like engine,
    synchronizes and empties the caching allocator's cache. The exception stays
    usable: its message, its type, and its traceback from the first to the last
    frame of user code (the frames of libraries below go: a closure of theirs can
    hold the step's tensors after its frame is cleared; those of a test runner
    above go: they are still running, so their locals stay), whose frames still name their
    files, functions and lines (pytest shows the user's line that allocated),
    only without their local variables. A traceback with no user frame goes
    whole. Frames that are still executing keep their locals.
    ``collect=False`` skips ``gc.collect()`` (a full collection costs ~0.1 s in a
    large process; clearing the frames already frees what only they held).

    The caller's own references are its business: drop the failed step's
    outputs, and ``optimizer.zero_grad(set_to_none=True)`` if gradients of a
    partial backward should not count against the next step.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = _user_traceback(current)
        _clear_traceback(current.__traceback__)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
    if collect:
        collector.collect()
    if engine is not None:
        engine.empty_cache()
