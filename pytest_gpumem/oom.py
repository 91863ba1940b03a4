"""Emulated device limits and out-of-memory reports.

Three pieces, each usable on its own (no pytest needed):

* :func:`device_limit` runs a block as if the device had only ``limit`` bytes:
  the CPU storage tracker refuses allocations over the limit, CUDA's caching
  allocator is capped with ``set_per_process_memory_fraction``. Either way an
  allocation over the limit raises :class:`torch.OutOfMemoryError`.
* :class:`OomWatch` / :func:`oom_report` describe an out-of-memory error: what
  was requested, what was allocated, the breakdown and phase, and the largest
  live tensors with where they are held.
* :func:`release_oom` lets go of what a failed step still holds through the
  exception's traceback, so that the next step (or test) starts clean.

Sizes are bytes throughout.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import torch
from tabulate import tabulate

from pytest_gpumem.engines.tracker import StorageTracker, cuda_rounded
from pytest_gpumem.figures import CATEGORIES
from pytest_gpumem.units import format_size, parse_size

if TYPE_CHECKING:
    from pytest_gpumem.engines.base import Engine
    from pytest_gpumem.measure import Recorder

__all__ = [
    "LiveTensor",
    "OomReport",
    "OomWatch",
    "device_limit",
    "frame_locals",
    "is_oom",
    "live_tensors",
    "oom_report",
    "release_oom",
    "requested_bytes",
    "tensor_names",
]

#: Largest live tensors an :class:`OomReport` lists by default.
TOP = 10

#: Lower-case fragments of error messages that mean "out of memory" in exceptions
#: that are not :class:`torch.OutOfMemoryError` (old wrappers, the CPU allocator,
#: cuBLAS failing to allocate its workspace).
OOM_MESSAGES: tuple[str, ...] = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed")

_REQUEST_RE = re.compile(
    r"tried to allocate\s+([0-9]+(?:\.[0-9]+)?)\s*(bytes|b|kib|mib|gib|tib|kb|mb|gb|tb)\b", re.IGNORECASE
)
_REQUEST_UNITS = {"bytes": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

_CO_OPTIMIZED = 0x1
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: Frames whose locals never name a tensor in a report: this package's machinery (the tracker's
#: dispatch, the reports themselves). Frames of ``fixture.run_step`` and of user code do.
_INTERNAL = (
    os.path.join(_PACKAGE_DIR, "engines") + os.sep,
    *(os.path.join(_PACKAGE_DIR, name) for name in ("oom.py", "leaks.py", "microbatch.py", "measure.py")),
)
_FRAMEWORK_PARTS = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}")


# -- emulated device limits ---------------------------------------------------------------------------


def _limit_target(target: Engine | StorageTracker) -> tuple[StorageTracker | None, torch.device]:
    """The tracker to limit (CPU), or None and the device whose allocator to cap (CUDA-like)."""
    if isinstance(target, StorageTracker):
        return target, target.device
    if target.name == "cpu":
        if target.tracker is None:  # pragma: no cover - the CPU engine always has one
            raise TypeError("the CPU engine has no storage tracker to limit")
        return target.tracker, target.device
    return None, target.device


def _backend(device: torch.device) -> Any:
    """``torch.cuda`` (CUDA and ROCm) or the module of another CUDA-like backend (``torch.xpu``)."""
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "set_per_process_memory_fraction"):
        raise NotImplementedError(f"device_limit: torch cannot cap the memory of {device.type!r} devices")
    return backend


def _memory_fraction(backend: Any, device: torch.device) -> float:
    """The per-process memory fraction now set on ``device`` (1.0 when torch has no getter)."""
    getter = getattr(backend, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0  # torch < 2.8 has no getter: assume the default, no cap
    return float(getter(device))


@contextmanager
def device_limit(target: Engine | StorageTracker, limit: int | str) -> Iterator[int]:
    """Run a block as if the device had only ``limit`` bytes; yields the limit in bytes.

    ``target`` is an engine (:func:`pytest_gpumem.measure.make_engine`) or a bare
    :class:`~pytest_gpumem.engines.tracker.StorageTracker`; ``limit`` is bytes or
    a size string (``"8GB"``, see :func:`~pytest_gpumem.units.parse_size`).

    * CPU engine / tracker: sets ``tracker.limit``. An allocation that would take
      the tracker's *allocated* bytes over the limit raises
      :class:`torch.OutOfMemoryError`, but only while the tracker is started (it
      sees allocations only then). Bytes already allocated never raise.
    * CUDA-like engine: calls ``set_per_process_memory_fraction(limit / total,
      device)``. The fraction caps the *reserved* memory of the caching
      allocator (segments it gets from the driver, so rounding and fragmentation
      count against it, and memory outside PyTorch, such as the CUDA context,
      does not). Under pressure the allocator frees its cached blocks before it
      raises. A limit above the card's memory is clamped to the whole card.

    The previous limit is restored on exit, whatever happens. On CUDA the
    previous fraction is read with ``get_per_process_memory_fraction`` (torch
    2.8 and later); on older torch it is assumed to be 1.0 (no cap). The CUDA
    path is not exercised by the CPU-only test suite.
    """
    nbytes = parse_size(limit)
    tracker, device = _limit_target(target)
    if tracker is not None:
        previous = tracker.limit
        tracker.limit = nbytes
        try:
            yield nbytes
        finally:
            tracker.limit = previous
        return
    # CUDA-like: not testable without a device.
    backend = _backend(device)
    total = int(backend.get_device_properties(device).total_memory)
    fraction = min(1.0, nbytes / total)
    previous_fraction = _memory_fraction(backend, device)
    backend.set_per_process_memory_fraction(fraction, device)
    try:
        yield nbytes
    finally:
        backend.set_per_process_memory_fraction(previous_fraction, device)


def _current_limit(engine: Engine) -> int | None:
    """The emulated limit in force on ``engine`` now, in bytes; None when there is none."""
    if engine.name == "cpu":
        return None if engine.tracker is None else engine.tracker.limit
    try:  # CUDA-like, best effort
        backend = _backend(engine.device)
        fraction = _memory_fraction(backend, engine.device)
        if fraction >= 1.0:
            return None
        return int(fraction * int(backend.get_device_properties(engine.device).total_memory))
    except Exception:
        return None


# -- recognising an OOM -------------------------------------------------------------------------------


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


# -- live tensors -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveTensor:
    """One live storage on the device, described through a tensor that uses it.

    Attributes:
        nbytes: the storage's bytes, counted once however many tensors view it
            (rounded up to 512-byte blocks on CUDA-like devices and on the CPU
            engine with ``cuda_rounding``, as the allocator counts them).
        shape: the shape of the tensor chosen to describe it (a named one, else
            the largest view).
        dtype: its dtype without the ``torch.`` prefix, e.g. ``"float32"``.
        category: the breakdown category of the storage (:data:`CATEGORIES`),
            from the storage tracker or else from the name; None when unknown.
        held_by: where the tensor is held: a tracked module's parameter or
            buffer (``"Sequential.0.weight"``), its gradient, an optimizer state,
            a local variable of a frame, a module-level name; None when unknown.
            Creation sites are not recorded.
        views: how many live tensors share the storage.
    """

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    category: str | None = None
    held_by: str | None = None
    views: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "nbytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "category": self.category,
            "held_by": self.held_by,
            "views": self.views,
        }


def _on_device(device: torch.device) -> Callable[[torch.Tensor], bool]:
    if device.type == "cpu":
        return lambda t: t.device.type == "cpu" and t.layout == torch.strided
    index = device.index or 0
    return lambda t: t.device.type == device.type and t.get_device() == index


class _Group:
    """The live tensors sharing one storage."""

    __slots__ = ("nbytes", "storage", "tensors")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        self.storage = storage
        self.nbytes = nbytes
        self.tensors: list[torch.Tensor] = []


def _storage_groups(
    device: torch.device, tracker: StorageTracker | None = None, *, counted_only: bool = False
) -> dict[int, _Group]:
    """Every Python-reachable tensor on ``device``, grouped by storage (the storage's C pointer).

    ``counted_only``: keep only storages that ``tracker`` counts.
    """
    on_device = _on_device(device)
    rounding = device.type != "cpu" or (tracker is not None and tracker.cuda_rounding)
    groups: dict[int, _Group] = {}
    tensor_type = torch.Tensor
    # The plugin freezes the collector's older objects between tests (cheap collections);
    # frozen objects are invisible to gc.get_objects(), so let them go back first. The
    # next measured test freezes again.
    if gc.get_freeze_count():
        gc.unfreeze()
    for obj in gc.get_objects():
        cls = type(obj)
        if not (cls is tensor_type or issubclass(cls, tensor_type)):
            continue
        try:
            if not on_device(obj):
                continue
            storage = obj.untyped_storage()
            key = int(storage._cdata)
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, meta, wrapper subclasses
            continue
        group = groups.get(key)
        if group is None:
            nbytes = int(storage.nbytes())
            if nbytes == 0 or (counted_only and tracker is not None and tracker.category_of(obj) is None):
                continue
            group = groups[key] = _Group(storage, cuda_rounded(nbytes) if rounding else nbytes)
        group.tensors.append(obj)
    return groups


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_NAME_CATEGORIES = {"parameter": "parameters", "grad": "gradients", "optimizer": "optimizer_state"}


def _label(module: Any, labels: Mapping[int, str]) -> str:
    return labels.get(id(module)) or type(module).__name__


def tensor_names(objects: Iterable[Any], labels: Mapping[int, str] | None = None) -> dict[int, tuple[str, str | None]]:
    """Names of the tensors that tracked modules and optimizers hold, by ``id()`` of the tensor.

    Each value is ``(name, category)``: ``("Sequential.0.weight", "parameters")``,
    ``("grad of Sequential.0.weight", "gradients")``, ``("Sequential.bn.running_mean",
    None)`` for a buffer, ``("optimizer state exp_avg of Sequential.0.weight",
    "optimizer_state")``. A module is named by ``labels[id(module)]`` when given
    (e.g. the variable that holds it), else by its class name.
    """
    labels = labels or {}
    names: dict[int, tuple[str, str | None]] = {}
    param_names: dict[int, str] = {}
    objects = list(objects)
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            prefix = _label(obj, labels)
            for name, param in obj.named_parameters():
                full = f"{prefix}.{name}"
                param_names.setdefault(id(param), full)
                names.setdefault(id(param), (full, "parameters"))
                if param.grad is not None:
                    names.setdefault(id(param.grad), (f"grad of {full}", "gradients"))
            for name, buffer in obj.named_buffers():
                names.setdefault(id(buffer), (f"{prefix}.{name}", None))
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            for g, group in enumerate(obj.param_groups):
                for i, param in enumerate(group["params"]):
                    pname = param_names.get(id(param)) or f"param {g}.{i} {tuple(param.shape)}"
                    names.setdefault(id(param), (pname, "parameters"))
                    if param.grad is not None:
                        names.setdefault(id(param.grad), (f"grad of {pname}", "gradients"))
                    for key, value in obj.state.get(param, {}).items():
                        if isinstance(value, torch.Tensor):
                            names.setdefault(id(value), (f"optimizer state {key} of {pname}", "optimizer_state"))
    return names


def _user_frame(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith((_TORCH_DIR, *_INTERNAL)):
        return False
    return not any(part in filename for part in _FRAMEWORK_PARTS)


def frame_locals(frame: FrameType) -> dict[str, Any]:
    """A copy of ``frame``'s local variables that leaves no reference behind.

    On Python < 3.13, reading ``frame.f_locals`` of a function frame stores a
    snapshot dict on the frame that keeps every local's value alive until the
    frame ends, even after the function deletes the variable: a report built
    mid-test would then hold the test's tensors. The snapshot is emptied after
    copying (the frame's real locals are untouched; only function frames, whose
    ``f_locals`` is a snapshot, never a module's namespace).
    """
    try:
        snapshot = frame.f_locals
        values = dict(snapshot)
    except Exception:  # pragma: no cover - exotic frames
        return {}
    if sys.version_info < (3, 13) and frame.f_code.co_flags & _CO_OPTIMIZED and isinstance(snapshot, dict):
        snapshot.clear()
    return values


def _frame_where(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def _frame_names(
    frames: Iterable[FrameType], tracked: Iterable[Any]
) -> tuple[dict[int, tuple[str, str | None]], dict[int, str]]:
    """Names from the local variables of user frames (innermost first).

    Returns (tensor names by ``id()``, labels of tracked objects by ``id()``): a
    tensor held by a local ``h`` is ``"local 'h' in forward (model.py:12)"``; a
    tracked module held by a local ``model`` is labelled ``"model"``.
    """
    tracked_ids = {id(obj) for obj in tracked}
    names: dict[int, tuple[str, str | None]] = {}
    labels: dict[int, str] = {}
    for count, frame in enumerate(frames):
        if count >= 200:
            break
        if not _user_frame(frame):
            continue
        local_vars = frame_locals(frame)
        for var, value in local_vars.items():
            if isinstance(value, torch.Tensor):
                names.setdefault(id(value), (f"local '{var}' in {_frame_where(frame)}", None))
            elif id(value) in tracked_ids and not var.startswith("_") and var not in ("self", "cls"):
                labels.setdefault(id(value), var)
        del local_vars
    return names, labels


def _stack_frames(start: FrameType | None) -> Iterator[FrameType]:
    frame = start
    while frame is not None:
        yield frame
        frame = frame.f_back


def _traceback_frames(tb: TracebackType | None) -> list[FrameType]:
    """The frames of a traceback, innermost first."""
    frames: list[FrameType] = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    frames.reverse()
    return frames


def _describe(
    group: _Group,
    names: Mapping[int, tuple[str, str | None]],
    tracker: StorageTracker | None,
    hint: str | None = None,
) -> LiveTensor:
    """A :class:`LiveTensor` for ``group``: a named tensor if any, else its largest view."""
    named = [t for t in group.tensors if id(t) in names]
    chosen = named[0] if named else max(group.tensors, key=lambda t: t.numel())
    name, name_category = names.get(id(chosen), (hint, None))
    category = tracker.category_of(chosen) if tracker is not None else None
    return LiveTensor(
        nbytes=group.nbytes,
        shape=tuple(int(n) for n in chosen.shape),
        dtype=_dtype_name(chosen.dtype),
        category=category or name_category,
        held_by=name,
        views=len(group.tensors),
    )


@dataclass(frozen=True)
class _Live:
    tensors: tuple[LiveTensor, ...]
    count: int
    nbytes: int


def live_tensors(
    device: torch.device | str,
    *,
    tracker: StorageTracker | None = None,
    objects: Iterable[Any] = (),
    frames: Iterable[FrameType] = (),
    top: int | None = TOP,
) -> tuple[tuple[LiveTensor, ...], int, int]:
    """The largest live tensors on ``device``, by storage, largest first.

    Walks the garbage collector's objects (costly: call it on failures, not on
    every test). Returns ``(tensors, storages, bytes)``: the ``top`` largest (all
    when None), how many distinct storages were found and their total bytes.
    Tensors that only C++ holds (saved for backward without the storage tracker,
    kernel workspaces) are not found. Names come from ``objects`` (tracked
    modules and optimizers, see :func:`tensor_names`) and from the local
    variables of ``frames``.
    """
    live = _live(torch.device(device), tracker, list(objects), list(frames), top, counted_only=False)
    return live.tensors, live.count, live.nbytes


def _live(
    device: torch.device,
    tracker: StorageTracker | None,
    objects: list[Any],
    frames: list[FrameType],
    top: int | None,
    *,
    counted_only: bool,
) -> _Live:
    local_names, labels = _frame_names(frames, objects)
    names = tensor_names(objects, labels)
    for key, value in local_names.items():
        names.setdefault(key, value)
    groups = _storage_groups(device, tracker, counted_only=counted_only)
    ordered = sorted(groups.values(), key=lambda g: g.nbytes, reverse=True)
    chosen = ordered if top is None else ordered[:top]
    tensors = tuple(_describe(group, names, tracker) for group in chosen)
    return _Live(tensors, len(ordered), sum(g.nbytes for g in ordered))


def live_table(tensors: Iterable[LiveTensor]) -> str:
    """A tabulate table of ``tensors``: bytes, shape, dtype, category, held by."""
    rows = [
        [
            format_size(t.nbytes),
            "×".join(str(n) for n in t.shape) if t.shape else "scalar",
            t.dtype,
            t.category or "unknown",
            t.held_by or "unknown",
        ]
        for t in tensors
    ]
    return tabulate(rows, headers=("bytes", "shape", "dtype", "category", "held by"), disable_numparse=True)


# -- the report ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OomReport:
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

    @property
    def unreachable(self) -> int:
        """Allocated bytes that no Python-reachable tensor accounts for (never negative)."""
        return max(0, self.allocated - self.live_bytes)

    def format(self) -> str:
        """The report as text for a failure message (tabulate tables)."""
        head = f"out of memory on {self.device}"
        if self.phase is not None:
            head += f" during {self.phase}"
        lines = [head + f" ({self.when})", f"  error: {self.message}"]
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
            rows = [[category, format_size(self.breakdown.get(category, 0))] for category in CATEGORIES]
            text += "\n\nallocated by category\n" + tabulate(rows, headers=("category", "bytes"), disable_numparse=True)
        if self.largest:
            title = (
                f"largest live tensors ({len(self.largest)} of {self.live_count} storages, "
                f"{format_size(self.live_bytes)} in all; {format_size(self.unreachable)} allocated "
                "but held by no Python-reachable tensor)"
            )
            text += f"\n\n{title}\n" + live_table(self.largest)
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "device": self.device,
            "engine": self.engine,
            "message": self.message,
            "when": self.when,
            "requested": self.requested,
            "requested_exact": self.requested_exact,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "limit": self.limit,
            "phase": self.phase,
            "breakdown": None if self.breakdown is None else dict(self.breakdown),
            "largest": [t.to_dict() for t in self.largest],
            "live_count": self.live_count,
            "live_bytes": self.live_bytes,
        }


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
    tracker = engine.tracker
    exact = requested is not None
    if requested is None and exc is not None:
        parsed = requested_bytes(str(exc))
        if parsed is not None:
            requested, exact = parsed
    if frames is None:
        frames = _traceback_frames(exc.__traceback__) if exc is not None else ()
    objects = list(recorder.tracked) if recorder is not None else []
    counted_only = engine.name == "cpu" and tracker is not None
    live = _live(engine.device, tracker, objects, list(frames), top, counted_only=counted_only)
    return OomReport(
        device=str(engine.device),
        engine=engine.name,
        message=_first_line(exc),
        when=when,
        requested=requested,
        requested_exact=exact,
        allocated=engine.allocated(),
        reserved=engine.reserved(),
        limit=_current_limit(engine),
        phase=recorder._phase if recorder is not None else None,
        breakdown=None if tracker is None else tracker.breakdown(),
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
        tracker = self.engine.tracker
        if tracker is not None and not self._installed:
            self._previous = tracker.on_oom
            tracker.on_oom = self._on_oom
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Restore the tracker's previous ``on_oom`` callback (idempotent)."""
        tracker = self.engine.tracker
        if tracker is not None and self._installed:
            tracker.on_oom = self._previous
            self._installed = False
            self._previous = None

    def _on_oom(self, nbytes: int) -> None:
        if self._previous is not None:
            self._previous(nbytes)
        try:
            frames = list(_stack_frames(sys._getframe(1)))
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
    clearing would close), sets their ``__traceback__`` to None, runs
    ``gc.collect()`` and, on a CUDA-like engine, synchronizes and empties the
    caching allocator's cache. The exception object itself stays usable (its
    message and type); frames that are still executing keep their locals.
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
        _clear_traceback(current.__traceback__)
        current.__traceback__ = None
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
    if collect:
        gc.collect()
    if engine is not None and engine.name != "cpu":
        _empty_cache(engine.device)


def _empty_cache(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    if backend is None:  # pragma: no cover
        return
    synchronize = getattr(backend, "synchronize", None)
    if synchronize is not None:
        synchronize(device)
    empty_cache = getattr(backend, "empty_cache", None)
    if empty_cache is not None:
        empty_cache()
