"""The CPU engine: exact tensor-storage bytes from the storage tracker."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import torch

from pytest_gpumem.measurement import collector
from pytest_gpumem.measurement.engines.base import Categories, Reading
from pytest_gpumem.measurement.engines.snapshots import SnapshotRecorder, write_snapshot
from pytest_gpumem.measurement.engines.storages import Window, fakes_counted
from pytest_gpumem.measurement.engines.tracker import StorageTracker, TrackerSites

if TYPE_CHECKING:
    from pytest_gpumem.targets.allocator import CachingAllocatorModel

__all__ = ["CpuEngine"]


class CpuEngine:
    """Counts tensor storages on the CPU (``reserved`` is None); ``cuda_rounding``: in 512-byte blocks."""

    name = "cpu"
    exact = True
    predicts: str | None = None
    #: the allocator whose blocks a snapshot shows (None: every storage is a segment of its own)
    model: CachingAllocatorModel | None = None

    def __init__(self, *, cuda_rounding: bool = False, tracker: StorageTracker | None = None) -> None:
        self.device = torch.device("cpu")
        self.tracker: StorageTracker = tracker or StorageTracker(self.device, cuda_rounding=cuda_rounding)
        self.categories: Categories = self.tracker
        self.sites = TrackerSites(self.tracker) if self.tracker.observes == "operators" else None
        self._saved_tensors = True

    @property
    def cuda_rounding(self) -> bool:
        return self.tracker.cuda_rounding

    # -- readings -------------------------------------------------------------------

    def reading(self) -> AbstractContextManager[None]:
        return self.tracker.reading()

    def allocated(self) -> int:
        self.tracker.flush()
        return self.tracker.current

    def reserved(self) -> int | None:
        return None

    def take_window(self, *, defer: bool = False) -> Reading:
        return _reading(self.tracker.take_window(defer=defer))

    def resolve(self, token: int) -> tuple[Reading, int, int]:
        window, allocated, events = self.tracker.resolve(token)
        return _reading(window), allocated, events

    def saved_bytes(self) -> int | None:
        if not (self.tracker.active and self._saved_tensors):
            return None
        self.tracker.flush()
        return self.tracker.saved

    # -- actions --------------------------------------------------------------------

    def clean(self, *, empty_cache: bool = True) -> None:
        self._clean_count()
        self.tracker.take_window()

    def _clean_count(self) -> None:
        """Collect garbage and count what is alive afresh, each storage in no test's category."""
        self.settle()
        self.tracker.forget_categories()
        self.tracker.counts_fakes = fakes_counted()  # before the scan: a fake tensor is memory only in a fake run
        self.tracker.scan()

    def start(self, *, saved_tensors: bool = True, timeline: bool = False) -> None:
        self._saved_tensors = saved_tensors
        self.tracker.start(saved_tensors=saved_tensors, timeline=timeline)

    def stop(self) -> None:
        self.tracker.stop()
        self.tracker.record_sites(None)

    def settle(self) -> None:
        collector.collect()

    def empty_cache(self) -> None:
        """No caching allocator on the CPU engine."""

    def memory_limit(self) -> int | None:
        return self.tracker.limit

    @contextmanager
    def limit_memory(self, nbytes: int) -> Iterator[int]:
        """Refuse allocations, while the tracker runs, that would take its allocated bytes over ``nbytes``."""
        if self.tracker.observes != "operators":
            raise ValueError(
                "an emulated device limit needs observe='operators' on the CPU engine: allocations read "
                "from the profiler's reports are seen after they happen and cannot be refused"
            )
        previous = self.tracker.limit
        self.tracker.limit = nbytes
        try:
            yield nbytes
        finally:
            self.tracker.limit = previous

    @contextmanager
    def watching(self) -> Iterator[None]:
        if self.tracker.active:
            yield
            return
        self.clean()
        self.start(saved_tensors=False)
        try:
            yield
        finally:
            self.stop()

    @contextmanager
    def record_history(self, path: str) -> Iterator[str | None]:
        """Record the tracker's allocations and frees during the block and write a memory_viz snapshot to ``path``."""
        recorder = SnapshotRecorder(self.tracker, self.model)
        recorder.start()
        try:
            yield path
        finally:
            recorder.stop()
            write_snapshot(path, recorder.snapshot())


def _reading(window: Window) -> Reading:
    """A tracker's window as the engine reads it."""
    highest = {"saved_activations": window.saved_peak}
    return Reading(window.peak, window.breakdown, highest, pending=window.pending, sites=window.sites)
