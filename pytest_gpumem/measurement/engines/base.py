"""What every engine offers: readings of one device's memory, and the few actions on it
that the rest of the package needs (clean state, empty cache, emulated limits, history).

Nothing outside :mod:`pytest_gpumem.measurement.engines` asks which engine it has, nor reaches
its storage tracker: what differs between engines is a member of this protocol, and what the
recorder, the census, the leak check and the out-of-memory watch need of a tracker are the
members of :class:`TrackerMembers` (which every engine here gets from its tracker, or its absence).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pytest_gpumem.data.sites import Site, SiteConfig
from pytest_gpumem.measurement.engines.sites import Found, SiteRecorder, found_sites
from pytest_gpumem.measurement.engines.tracker import StorageTracker

__all__ = ["Engine", "Reading", "TrackerMembers"]


@dataclass
class Reading:
    """Figures of a window of time, all in bytes; None where the engine cannot know.

    ``peak`` is the highest allocated bytes in the window, ``breakdown`` the bytes
    by category at that moment (None without a tracker), ``reserved_peak`` and
    ``requested_peak`` the highest reserved / requested bytes (caching allocators),
    ``saved_peak`` the highest bytes held for backward at one time (needs saved-tensor hooks).

    ``pending``: the window could not be read when it closed (the CPU engine observing
    allocations, inside autograd's backward); the figures are those of
    :meth:`Engine.resolve` with this token, once the engine can read again.
    """

    peak: int
    breakdown: tuple[int, ...] | None = None
    reserved_peak: int | None = None
    requested_peak: int | None = None
    saved_peak: int | None = None
    pending: int | None = None
    #: bytes by site at the window's peak while sites are recorded (the engine's own form)
    sites: Any = None


class Engine(Protocol):
    """Reads the memory of one device, and acts on it where the rest of the package must.

    Peaks are read by windows: :meth:`take_window` returns the figures since the
    previous call and opens a new window, so nested spans and phases can all
    fold the same windows into their own peaks.
    """

    #: "cuda" (a caching allocator: CUDA, ROCm, XPU) or "cpu" (the storage tracker).
    name: str
    device: torch.device

    @property
    def exact(self) -> bool:
        """True when figures are exact counts of tensor storages (the CPU engine: its tracker
        *is* the engine, so allocations are seen only while it runs, and the device runs out
        of memory only at an emulated limit); False for readings of a device's allocator."""

    @property
    def cuda_rounding(self) -> bool:
        """True when the CPU engine counts every storage as the CUDA allocator's 512-byte blocks."""

    # -- what the storage tracker knows (TrackerMembers) -------------------------------

    @property
    def categorizes(self) -> bool:
        """True when a storage tracker watches this engine's device: breakdowns by category,
        timelines, the category of a storage, compiled frames and notes come from it."""

    @property
    def events(self) -> int:
        """Allocations and frees the tracker has seen (0 without one): the clock of timelines."""

    @property
    def compiled_frames(self) -> Sequence[tuple[bool, str]]:
        """Frames TorchDynamo ran eagerly under the tracker: (a library's, ``qualname (file:line)``)."""

    @property
    def notes(self) -> Sequence[str]:
        """What the tracker could not see (work on another thread, storages made outside operators)."""

    @property
    def sees_allocations(self) -> bool:
        """True while allocations are seen: always on an allocator's device; on the CPU engine
        only while its tracker runs."""

    def classify(self, tensors: Iterable[Any], category: str) -> None:
        """Count ``tensors``' storages as ``category`` from now on (a no-op without a tracker)."""

    def category_of(self, tensor: Any) -> str | None:
        """The category the tracker counts ``tensor``'s storage in; None when uncounted or untracked."""

    def breakdown(self) -> dict[str, int] | None:
        """Allocated bytes by category now; None without a tracker."""

    def timeline_samples(self, start_event: int) -> tuple[list[int], list[list[int]]] | None:
        """The tracker's samples from ``start_event`` on as columns (event indexes, then bytes by
        category); None when it keeps none."""

    def reading(self) -> AbstractContextManager[None]:
        """Readings taken inside the block are of one moment (one read when observing allocations)."""

    def scan(self, extra: Iterable[Any] = ()) -> int:
        """Count every tensor alive (and ``extra``) that the tracker had not seen; returns their
        bytes (0 without a tracker)."""

    def swap_oom_callback(self, callback: Callable[[int], None] | None) -> Callable[[int], None] | None:
        """Call ``callback(nbytes)`` at an allocation refused by an emulated limit (with a tracker);
        returns the previous callback."""

    # -- sites: where storages are made (only when asked) ---------------------------------

    @property
    def records_sites(self) -> bool:
        """True when :meth:`start_sites` can record sites on this engine."""

    def start_sites(self, config: SiteConfig | None) -> bool:
        """Record where each storage is made from now on (:mod:`pytest_gpumem.data.sites`; None: do
        nothing); False where this engine cannot (the CPU engine observing allocations)."""

    def site_phase(self, phase: str | None) -> None:
        """The phase running from now on, for the sites of what is made (None: outside phases)."""

    def sites_now(self) -> Any:
        """Bytes by site now (the engine's own form, for :meth:`site_figures`); None without sites."""

    def site_figures(self, peak: Any, end: Any) -> list[Found] | None:
        """The sites of a span from what :meth:`take_window` (at its peak) and :meth:`sites_now`
        (at its end) gave; None when ``end`` is (sites were not recorded)."""

    def site_of(self, tensor: Any) -> Site | None:
        """Where ``tensor``'s storage was made, when sites were recorded then; None otherwise."""

    def site_here(self) -> Site | None:
        """The site of the code running now, while sites are recorded; None otherwise."""

    @property
    def predicts(self) -> str | None:
        """The GPU whose figures this engine predicts from a CPU run (``"h100"``); None for an
        engine that reads the device it runs on."""

    @property
    def workspaces(self) -> int | None:
        """Bytes of the library workspaces the clean-state protocol keeps on the device (cuBLAS,
        per thread): part of every start reading, never a test's cost; None where there are none."""

    # -- readings -------------------------------------------------------------------

    def allocated(self) -> int:
        """Bytes allocated now."""

    def reserved(self) -> int | None:
        """Bytes the allocator holds from the driver now; None when not applicable."""

    def take_window(self, *, defer: bool = False) -> Reading:
        """Figures since the previous call; opens a new window. ``defer``: the caller can take
        the figures later (a phase boundary): an engine that reads in batches may return a
        pending reading (see :meth:`resolve`) rather than read now."""

    def resolve(self, token: int) -> tuple[Reading, int, int]:
        """A window that :meth:`take_window` returned as pending: its reading, the allocated
        bytes and the event count when it closed. Only valid after a reading that was not pending."""
        ...

    def counters(self) -> dict[str, int]:
        """Cumulative event counters (``num_alloc_retries``, ``num_ooms``) where known."""

    def driver(self) -> tuple[int | None, int | None]:
        """(device memory used by all processes, by this process) per NVML; None when unknown."""

    def device_used(self) -> int | None:
        """Device memory in use per the runtime (``total - free``, all processes); None on CPU."""

    def saved_bytes(self) -> int | None:
        """Bytes autograd holds for backward now (distinct storages, parameters excluded); None
        when they are not counted (the engine is not watching, or was asked not to)."""

    # -- actions --------------------------------------------------------------------

    def clean(self, *, empty_cache: bool = True) -> None:
        """Bring the device to a clean, comparable state before a start reading (its steady state:
        garbage collected, library workspaces created, peaks reset; the allocator's cache emptied
        with ``empty_cache``)."""

    def start(self, *, saved_tensors: bool = True, timeline: bool = False) -> None:
        """Begin watching: the storage tracker when there is one, and what autograd saves
        (unless ``saved_tensors`` is False); ``timeline`` keeps samples for plots (needs the tracker)."""

    def stop(self) -> None:
        """Stop watching (frees of what was counted are still seen), and recording sites."""

    def settle(self) -> None:
        """Collect garbage and wait for the device, so that a reading shows only what is alive."""

    def warm_workspaces(self) -> None:
        """Create the library workspaces a training step's threads get (a no-op where there are none)."""

    def release_workspaces(self) -> None:
        """Free what libraries keep per thread (cuBLAS workspaces); a no-op where there is none.
        Only the leak check does this: the next :meth:`clean` creates them again."""

    def synchronize(self) -> None:
        """Wait for the device's queued work; a no-op on CPU."""

    def empty_cache(self) -> None:
        """Return the allocator's cached, unused blocks to the driver; a no-op on CPU."""

    def memory_limit(self) -> int | None:
        """The emulated device size in force now, in bytes; None when there is none."""

    def limit_memory(self, nbytes: int) -> AbstractContextManager[int]:
        """Run a block as if the device had only ``nbytes`` bytes; restores the previous limit."""

    def watching(self) -> AbstractContextManager[None]:
        """Make sure allocations are seen during the block (the CPU engine starts its tracker if stopped)."""

    def record_history(self, path: str) -> AbstractContextManager[str | None]:
        """Record allocation history during the block and write a memory snapshot to ``path`` at its
        end; yields the path, or None (and writes nothing) where the engine keeps no history."""


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
