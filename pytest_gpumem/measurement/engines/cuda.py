"""The CUDA engine: the device's caching allocator (CUDA, ROCm, XPU) and the driver (NVML); it resets the peaks at
each window, so during a test ``torch.cuda.max_memory_allocated()`` reads a window's peak."""

from __future__ import annotations

import inspect
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

from pytest_gpumem.data.figures import OutputNotWritten
from pytest_gpumem.data.site_figures import Site, SiteConfig
from pytest_gpumem.files import move_file
from pytest_gpumem.measurement import collector
from pytest_gpumem.measurement.engines.base import Categories, Reading
from pytest_gpumem.measurement.engines.saved import SavedTensors
from pytest_gpumem.measurement.engines.site_tracking import Found, SiteFilter
from pytest_gpumem.measurement.engines.snapshots import SNAPSHOT_ENTRIES
from pytest_gpumem.measurement.engines.traces import merge_found, replay_trace
from pytest_gpumem.measurement.engines.tracker import StorageTracker

__all__ = ["CudaEngine", "cuda_available", "cuda_device_count", "nvml_memory"]


#: A ``torch.cuda`` function's name → (the function as last called, its answer): torch asks the driver at every call.
_answers: dict[str, tuple[Any, int]] = {}


def _asked_once(name: str) -> int:
    """``torch.cuda.<name>()``, asked once a process unless the function was replaced since (0 where it fails)."""
    function = getattr(torch.cuda, name)
    known = _answers.get(name)
    if known is None or known[0] is not function:
        try:
            found = int(function())
        except Exception:  # a broken driver must read as "no device", not crash collection
            found = 0
        known = _answers[name] = (function, found)
    return known[1]


def cuda_available() -> bool:
    """True when torch sees a CUDA (or ROCm) device; asked once a process (:func:`_asked_once`)."""
    return bool(_asked_once("is_available"))


def cuda_device_count() -> int:
    """The number of CUDA devices torch sees (0 where none), asked once a process as :func:`cuda_available`."""
    return _asked_once("device_count") if cuda_available() else 0


#: Entries of allocation history kept while sites are recorded: the ring drops its oldest, which a span's sites need.
SITE_ENTRIES = 2_000_000


def _backend(device: torch.device) -> Any:
    """``torch.cuda`` (CUDA and ROCm) or the module of another CUDA-like backend (``torch.xpu``)."""
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "synchronize"):
        raise NotImplementedError(f"pytest-gpumem cannot read the memory of {device.type!r} devices")
    return backend


def _initialize(device: torch.device) -> None:
    """Make sure the context, RNG and BLAS handle of ``device`` exist (their first use allocates)."""
    torch.empty(1, device=device)
    torch.cuda.current_blas_handle()


def _workspace_kernels(device: torch.device) -> None:
    """The kernels of :meth:`CudaEngine.warm_workspaces`, forward on this thread and backward on autograd's."""
    with torch.enable_grad():
        weight = torch.ones(16, 16, device=device, requires_grad=True)
        bias = torch.ones(16, device=device, requires_grad=True)
        total = torch.zeros((), device=device)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(16, 16, device=device, dtype=dtype)
            w, b = weight.to(dtype), bias.to(dtype)
            total = total + (x @ w).float().sum() + torch.nn.functional.linear(x, w, b).float().sum()
        total.backward()


def _memory_api() -> Any:
    accelerator = getattr(torch, "accelerator", None)
    memory = getattr(accelerator, "memory", None)
    if memory is not None and hasattr(memory, "memory_stats") and hasattr(memory, "reset_peak_memory_stats"):
        return memory
    return torch.cuda


class CudaEngine:
    """Reads one CUDA-like device's caching allocator; an optional storage ``tracker`` gives the breakdown."""

    name = "cuda"
    exact = False
    cuda_rounding = False
    predicts: str | None = None

    def __init__(self, device: torch.device, tracker: StorageTracker | None = None) -> None:
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device(self.device.type, torch.cuda.current_device())
        self.tracker = tracker
        self.categories: Categories | None = tracker
        self._api = _memory_api()
        #: the allocator's history with Python stacks (CUDA; ROCm has it too)
        records = self.device.type == "cuda" and hasattr(torch._C, "_cuda_record_memory_history")
        self.sites = TraceSites(self.device, self._api) if records else None
        self._backend = _backend(self.device)
        self._saved = SavedTensors(self.device) if tracker is None else None
        self._count_saved = True
        #: bytes of the cuBLAS/cuBLASLt workspaces the clean-state protocol keeps (see docs/figures.md)
        self.workspaces: int | None = None
        #: per thread: whether this thread's context, BLAS handle and workspaces were made (``warm``)
        self._threads = threading.local()
        #: ``memory_stats()`` of this moment, inside :meth:`reading` (one read serves its figures)
        self._stats: dict[str, Any] | None = None
        self._in_reading = False

    # -- actions --------------------------------------------------------------------

    def clean(self, *, empty_cache: bool = True) -> None:
        """Bring the device to its steady state: settled, workspaces made (so no test pays for them), peaks reset."""
        with self._backend.device(self.device):
            self.settle()
            threads = self._threads
            # Inductor's CUDA graph trees, once imported, may have freed the cuBLAS workspaces
            if not getattr(threads, "warm", False) or "torch._inductor.cudagraph_trees" in sys.modules:
                _initialize(self.device)
                if self.workspaces is None:  # the first time: how many bytes they hold
                    self.release_workspaces()
                    before = self.allocated()
                    self.warm_workspaces()
                    self.workspaces = self.allocated() - before
                else:
                    self.warm_workspaces()
                threads.warm = True
            if empty_cache:
                self.empty_cache()
            self._api.reset_peak_memory_stats(self.device)
        if self.tracker is not None:
            self.tracker.forget_categories()
            self.tracker.scan()
            self.tracker.take_window()

    def warm_workspaces(self) -> None:
        """Create the workspaces cuBLAS and cuBLASLt keep per thread: this thread's and autograd's device thread's."""
        _workspace_kernels(self.device)
        self.synchronize()

    def start(self, *, saved_tensors: bool = True, timeline: bool = False) -> None:
        self._count_saved = saved_tensors
        if self.tracker is not None:
            self.tracker.start(saved_tensors=saved_tensors, timeline=timeline)
        elif saved_tensors and self._saved is not None:
            self._saved.start()

    def stop(self) -> None:
        if self.tracker is not None:
            self.tracker.stop()
            self.tracker.record_sites(None)
        elif self._saved is not None:
            self._saved.stop()
        if self.sites is not None:
            self.sites.stop()

    def saved_bytes(self) -> int | None:
        if not self._count_saved:
            return None
        if self.tracker is not None:
            return self.tracker.saved if self.tracker.active else None
        return self._saved.current if self._saved is not None and self._saved.active else None

    def settle(self) -> None:
        """Synchronize and collect garbage, so that a reading shows only what is alive."""
        self.synchronize()
        collector.collect()  # what is not frozen: see pytest_gpumem.measurement.collector
        self.synchronize()

    def release_workspaces(self) -> None:
        """Free the cuBLAS workspaces of every thread, as PyTorch's leak-check protocol does."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None and self.device.type == "cuda":
            with self._backend.device(self.device):
                clear()
            self.synchronize()

    def synchronize(self) -> None:
        self._backend.synchronize(self.device)

    def empty_cache(self) -> None:
        self.synchronize()
        self._backend.empty_cache()

    def device_used(self) -> int | None:
        try:
            free, total = self._backend.mem_get_info(self.device)
        except Exception:
            return None
        return int(total) - int(free)

    def memory_limit(self) -> int | None:
        fraction = self._memory_fraction()
        if fraction >= 1.0:
            return None
        return int(fraction * self._total_memory())

    @contextmanager
    def limit_memory(self, nbytes: int) -> Iterator[int]:
        """Cap the caching allocator's reserved memory with ``set_per_process_memory_fraction``, restored on exit."""
        fraction = min(1.0, nbytes / self._total_memory())
        previous = self._memory_fraction()
        self._backend.set_per_process_memory_fraction(fraction, self.device)
        try:
            yield nbytes
        finally:
            self._backend.set_per_process_memory_fraction(previous, self.device)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """The allocator sees every allocation: nothing to start."""
        yield

    @contextmanager
    def record_history(self, path: str) -> Iterator[str | None]:
        """Record allocation history (a user's own is left as it is) and dump a snapshot pickle to ``path`` at the
        end, whole or not at all (else an :class:`OutputNotWritten` warning)."""
        memory = torch.cuda.memory
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        users = bool(enabled()) if enabled is not None else False
        if not users:
            memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, stacks="python")
        try:
            yield path
        finally:
            temporary = f"{path}.{os.getpid()}.tmp"
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                memory._dump_snapshot(temporary)
                move_file(temporary, path)
            except OSError as exc:
                with suppress(OSError):
                    os.unlink(temporary)
                problem = f"could not write the memory snapshot {path}: {exc.strerror or exc}"
                warnings.warn(OutputNotWritten(problem), stacklevel=3)
            finally:
                if not users:
                    memory._record_memory_history(enabled=None)

    def _total_memory(self) -> int:
        return int(self._backend.get_device_properties(self.device).total_memory)

    def _memory_fraction(self) -> float:
        getter = getattr(self._backend, "get_per_process_memory_fraction", None)
        if getter is None:
            return 1.0  # torch < 2.8 has no getter: assume the default, no cap
        return float(getter(self.device))

    # -- readings -------------------------------------------------------------------

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Readings taken at one moment, served by one ``memory_stats()``."""
        if self._in_reading:
            yield
            return
        self._in_reading = True
        try:
            yield
        finally:
            self._in_reading, self._stats = False, None

    def allocated(self) -> int:
        if self._stats is not None:
            return int(self._stats.get("allocated_bytes.all.current", 0))
        return int(self._api.memory_allocated(self.device))

    def reserved(self) -> int | None:
        if self._stats is not None:
            return int(self._stats.get("reserved_bytes.all.current", 0))
        return int(self._api.memory_reserved(self.device))

    def stats(self) -> dict[str, Any]:
        """The allocator's raw ``memory_stats()`` for this device (inside :meth:`reading`: read once)."""
        if self._stats is not None:
            return self._stats
        stats = dict(self._api.memory_stats(self.device))
        if self._in_reading:
            self._stats = stats
        return stats

    def take_window(self, *, defer: bool = False) -> Reading:
        self._stats = None  # a window closes now: read it
        stats = self.stats()
        self._api.reset_peak_memory_stats(self.device)
        saved = None
        if self.tracker is None and self._saved is not None and self._count_saved:
            saved = self._saved.take_peak()
        reading = reading_from_stats(stats, self.tracker, saved_peak=saved)
        if self.sites is not None and self.sites.recording:
            reading.sites = ("window", self.sites.number)
            self.sites.next_stamp()
        return reading

    def resolve(self, token: int) -> tuple[Reading, int, int]:
        raise LookupError(f"no pending window {token}: the caching allocator's windows are read when they close")

    def counters(self) -> dict[str, int]:
        stats = self.stats()
        return {key: int(stats.get(key, 0)) for key in ("num_alloc_retries", "num_ooms")}

    def driver(self) -> tuple[int | None, int | None]:
        return nvml_memory(self.device)


class TraceSites:
    """The CUDA engine's :class:`~pytest_gpumem.measurement.engines.base.SiteRecording`: the allocator's history while
    sites are recorded, its events stamped with window numbers, replayed (measurement/engines/traces.py)."""

    recordings = itertools.count(1)

    def __init__(self, device: torch.device, api: Any) -> None:
        self._device, self._api = device, api
        self.memory = torch.cuda.memory
        self.filter: SiteFilter | None = None  #: the user's frames, while sites are recorded
        self.start_bytes = 0
        self.prefix = ""
        self.number = 0
        self.phase = ""
        self.phases: dict[int, str] = {}

    @property
    def recording(self) -> bool:
        return self.filter is not None

    def start(self, config: SiteConfig) -> None:
        sites = SiteFilter(config)  # before the history: a bad include raises with nothing to turn off
        start = int(self._api.memory_allocated(self._device))  # the engine's allocated(), outside a reading
        self.start_bytes = start
        self.prefix = f"gpumem{next(self.recordings)}:"
        self.number, self.phase, self.phases = 0, "", {}
        record = self.memory._record_memory_history
        options: dict[str, Any] = {"context": "alloc", "stacks": "python", "max_entries": SITE_ENTRIES}
        if "clear_history" in inspect.signature(record).parameters:
            options["clear_history"] = True  # the trace holds this recording's events only
        record(enabled="all", **options)
        self.filter = sites  # recording once the history is: stop() then turns it off
        self.next_stamp()

    def next_stamp(self) -> int:
        """Stamp the events from now on with a new window's number; returns it."""
        setter = getattr(self.memory, "_set_memory_metadata", None)
        if setter is not None:
            self.number += 1
            setter(f"{self.prefix}{self.number}")
        self.phases[self.number] = self.phase
        return self.number

    def set_phase(self, phase: str | None) -> None:
        if self.recording:
            self.phase = self.phases[self.number] = phase or ""

    def now(self) -> Any:
        return ("end", self.next_stamp()) if self.recording else None

    def figures(self, peak: Any, end: Any) -> list[Found] | None:
        if self.filter is None or end is None:
            return None
        snapshot = self.memory._snapshot()
        traces = snapshot.get("device_traces") or []
        index = self._device.index or 0
        events = traces[index] if index < len(traces) else []
        first = next((i for i, e in enumerate(events) if str(e.get("user_metadata", "")).startswith(self.prefix)), 0)
        events = events[first:]  # without clear_history: older recordings' events before ours
        window = peak is not None and peak[0] == "window"
        at_peak, at_end = replay_trace(
            events,
            self.filter.file,
            start=self.start_bytes,
            windows=[peak[1]] if window else [],
            ends=[end[1]] if window else [end[1], peak[1]],
            prefix=self.prefix,
            phases=self.phases,
        )
        found_peak = at_peak.get(peak[1], []) if window else at_end[peak[1]]  # no window: its peak was as it opened
        return merge_found(found_peak, at_end[end[1]])

    def site_of(self, tensor: Any) -> Site | None:
        return None

    def here(self) -> Site | None:
        return None

    def stop(self) -> None:
        if self.filter is not None:
            setter = getattr(self.memory, "_set_memory_metadata", None)
            if setter is not None:
                setter("")
            self.memory._record_memory_history(enabled=None)
            self.filter = None


def reading_from_stats(
    stats: dict[str, Any], tracker: StorageTracker | None = None, *, saved_peak: int | None = None
) -> Reading:
    """A window's :class:`Reading` from a ``memory_stats()`` dict read at its end."""
    peak = int(stats.get("allocated_bytes.all.peak", 0))
    breakdown: tuple[int, ...] | None = None
    if tracker is not None:
        window = tracker.take_window()
        parts = list(window.breakdown)
        parts[-1] += max(0, peak - sum(parts))
        breakdown = tuple(parts)
        saved_peak = window.saved_peak
    highest = {"reserved": int(stats.get("reserved_bytes.all.peak", 0))}
    if "requested_bytes.all.peak" in stats:
        highest["requested_peak"] = int(stats["requested_bytes.all.peak"])
    if saved_peak is not None:
        highest["saved_activations"] = saved_peak
    return Reading(peak=peak, breakdown=breakdown, highest=highest)


_nvml_state: dict[str, Any] = {}


def nvml_memory(device: torch.device) -> tuple[int | None, int | None]:
    """Device memory used (all processes) and by this process, per NVML; None where unknown."""
    try:
        import pynvml

        if not _nvml_state.get("initialised"):
            pynvml.nvmlInit()
            _nvml_state["initialised"] = True
        handles = _nvml_state.setdefault("handles", {})
        handle = handles.get(device)
        if handle is None:  # found once per device: the UUID's lookup asks the driver
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = handles[device] = pynvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith("GPU-") else "GPU-" + uuid
            )
        used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        return None, None
    mine: int | None = None
    try:
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                mine = int(process.usedGpuMemory)
    except Exception:
        mine = None
    return used, mine
