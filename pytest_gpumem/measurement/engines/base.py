"""What every engine offers: readings of one device's memory, and the few actions on it the package needs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pytest_gpumem.data.site_figures import Site, SiteConfig
from pytest_gpumem.measurement.engines.site_tracking import Found, SiteRecorder, found_sites
from pytest_gpumem.measurement.engines.tracker import StorageTracker

__all__ = ["Engine", "Reading", "TrackerMembers"]


@dataclass
class Reading:
    """Figures of a window of time, in bytes (None: unknown); ``pending``: a token for :meth:`Engine.resolve`."""

    peak: int
    breakdown: tuple[int, ...] | None = None
    reserved_peak: int | None = None
    requested_peak: int | None = None
    saved_peak: int | None = None
    pending: int | None = None
    sites: Any = None  #: bytes by site at the window's peak (the engine's own form)


class Engine(Protocol):
    """Reads the memory of one device, and acts on it where the package must; peaks are read by windows."""

    name: str  #: "cuda" (a caching allocator) or "cpu" (the storage tracker)
    device: torch.device

    @property
    def exact(self) -> bool:
        """True when figures are exact counts of tensor storages (the CPU engine), not an allocator's readings."""

    @property
    def cuda_rounding(self) -> bool:
        """True when the CPU engine counts storages as the CUDA allocator's 512-byte blocks."""

    # -- what the storage tracker knows (TrackerMembers) -------------------------------

    @property
    def categorizes(self) -> bool:
        """True when a storage tracker watches the device (breakdowns, timelines, categories)."""

    @property
    def events(self) -> int:
        """Allocations and frees the tracker has seen: the clock of timelines."""

    @property
    def compiled_frames(self) -> Sequence[tuple[bool, str]]:
        """Frames TorchDynamo ran eagerly under the tracker: (a library's, ``qualname (file:line)``)."""

    @property
    def notes(self) -> Sequence[str]:
        """What the tracker could not see (work on another thread)."""

    @property
    def sees_allocations(self) -> bool:
        """True while allocations are seen (on the CPU engine, only while its tracker runs)."""

    def classify(self, tensors: Iterable[Any], category: str) -> None:
        """Count ``tensors``' storages as ``category`` from now on."""

    def category_of(self, tensor: Any) -> str | None:
        """The category the tracker counts ``tensor``'s storage in; None when uncounted."""

    def breakdown(self) -> dict[str, int] | None:
        """Allocated bytes by category now; None without a tracker."""

    def timeline_samples(self, start_event: int) -> tuple[list[int], list[list[int]]] | None:
        """The tracker's samples from ``start_event`` on as columns; None when it keeps none."""

    def reading(self) -> AbstractContextManager[None]:
        """Readings taken inside the block are of one moment."""

    def scan(self, extra: Iterable[Any] = ()) -> int:
        """Count every tensor alive (and ``extra``) the tracker had not seen; returns their bytes."""

    def swap_oom_callback(self, callback: Callable[[int], None] | None) -> Callable[[int], None] | None:
        """Call ``callback(nbytes)`` at an allocation an emulated limit refuses; returns the previous one."""

    # -- sites: where storages are made ---------------------------------------------------

    @property
    def records_sites(self) -> bool:
        """True when :meth:`start_sites` can record sites on this engine."""

    def start_sites(self, config: SiteConfig | None) -> bool:
        """Record where each storage is made from now on; False where this engine cannot."""

    def site_phase(self, phase: str | None) -> None:
        """The phase running from now on, for the sites of what is made."""

    def sites_now(self) -> Any:
        """Bytes by site now (for :meth:`site_figures`); None without sites."""

    def site_figures(self, peak: Any, end: Any) -> list[Found] | None:
        """The sites of a span from its peak's and its end's bytes by site; None without sites."""

    def site_of(self, tensor: Any) -> Site | None:
        """Where ``tensor``'s storage was made, when sites were recorded then."""

    def site_here(self) -> Site | None:
        """The site of the code running now, while sites are recorded."""

    @property
    def predicts(self) -> str | None:
        """The GPU whose figures this engine predicts from a CPU run (``"h100"``), if any."""

    @property
    def workspaces(self) -> int | None:
        """Bytes of the library workspaces kept on the device (part of every start reading), if any."""

    # -- readings -------------------------------------------------------------------

    def allocated(self) -> int:
        """Bytes allocated now."""

    def reserved(self) -> int | None:
        """Bytes the allocator holds from the driver now, if any."""

    def take_window(self, *, defer: bool = False) -> Reading:
        """Figures since the previous call; opens a new window (``defer``: it may come back pending)."""

    def resolve(self, token: int) -> tuple[Reading, int, int]:
        """A pending window's reading, allocated bytes and event count when it closed."""
        ...

    def counters(self) -> dict[str, int]:
        """Cumulative event counters (``num_alloc_retries``, ``num_ooms``) where known."""

    def driver(self) -> tuple[int | None, int | None]:
        """(device memory used by all processes, by this process) per NVML."""

    def device_used(self) -> int | None:
        """Device memory in use per the runtime (all processes); None on CPU."""

    def saved_bytes(self) -> int | None:
        """Bytes autograd holds for backward now (parameters excluded); None when not counted."""

    # -- actions --------------------------------------------------------------------

    def clean(self, *, empty_cache: bool = True) -> None:
        """Bring the device to a clean, comparable state before a start reading."""

    def start(self, *, saved_tensors: bool = True, timeline: bool = False) -> None:
        """Begin watching: the storage tracker, if any, and what autograd saves (``saved_tensors``)."""

    def stop(self) -> None:
        """Stop watching, and recording sites."""

    def settle(self) -> None:
        """Collect garbage and wait for the device, so that a reading shows only what is alive."""

    def warm_workspaces(self) -> None:
        """Create the library workspaces a training step's threads get."""

    def release_workspaces(self) -> None:
        """Free what libraries keep per thread (cuBLAS workspaces), for the leak check."""

    def synchronize(self) -> None:
        """Wait for the device's queued work; a no-op on CPU."""

    def empty_cache(self) -> None:
        """Return the allocator's cached, unused blocks to the driver; a no-op on CPU."""

    def memory_limit(self) -> int | None:
        """The emulated device size in force now, in bytes, if any."""

    def limit_memory(self, nbytes: int) -> AbstractContextManager[int]:
        """Run a block as if the device had only ``nbytes`` bytes; restores the previous limit."""

    def watching(self) -> AbstractContextManager[None]:
        """Make sure allocations are seen during the block."""

    def record_history(self, path: str) -> AbstractContextManager[str | None]:
        """Record allocation history during the block and write a snapshot to ``path``; yields it, or None."""


class TrackerMembers:
    """The :class:`Engine` members that come from an optional storage tracker (``self.tracker``)."""

    tracker: StorageTracker | None

    @property
    def categorizes(self) -> bool:
        return self.tracker is not None

    @property
    def events(self) -> int:
        return 0 if self.tracker is None else self.tracker.events

    @property
    def compiled_frames(self) -> Sequence[tuple[bool, str]]:
        return () if self.tracker is None else self.tracker.compiled_frames

    @property
    def notes(self) -> Sequence[str]:
        return () if self.tracker is None else self.tracker.notes

    @property
    def sees_allocations(self) -> bool:
        return self.tracker is None or self.tracker.active

    def classify(self, tensors: Iterable[Any], category: str) -> None:
        if self.tracker is not None:
            self.tracker.register(tensors, category)

    def category_of(self, tensor: Any) -> str | None:
        return None if self.tracker is None else self.tracker.category_of(tensor)

    def breakdown(self) -> dict[str, int] | None:
        return None if self.tracker is None else self.tracker.breakdown()

    def timeline_samples(self, start_event: int) -> tuple[list[int], list[list[int]]] | None:
        return None if self.tracker is None else self.tracker.timeline_columns(start_event)

    def reading(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext() if self.tracker is None else self.tracker.reading()

    def scan(self, extra: Iterable[Any] = ()) -> int:
        return 0 if self.tracker is None else self.tracker.scan(extra=extra)

    def swap_oom_callback(self, callback: Callable[[int], None] | None) -> Callable[[int], None] | None:
        if self.tracker is None:
            return None
        previous, self.tracker.on_oom = self.tracker.on_oom, callback
        return previous

    @property
    def records_sites(self) -> bool:
        return self.tracker is not None and self.tracker.observes == "operators"

    def start_sites(self, config: SiteConfig | None) -> bool:
        if config is None or not self.records_sites or self.tracker is None:
            return False
        self.tracker.record_sites(SiteRecorder(config))
        return True

    def site_phase(self, phase: str | None) -> None:
        if self.tracker is not None and self.tracker.sites is not None:
            self.tracker.sites.phase = phase or ""

    def sites_now(self) -> Any:
        return None if self.tracker is None else self.tracker.site_snapshot()

    def site_figures(self, peak: Any, end: Any) -> list[Found] | None:
        return None if end is None else found_sites(peak, end)

    def site_of(self, tensor: Any) -> Site | None:
        state = None if self.tracker is None else self.tracker.site_of(tensor)
        return None if state is None else state.site()

    def site_here(self) -> Site | None:
        sites = None if self.tracker is None else self.tracker.sites
        return None if sites is None else sites.site_here()
