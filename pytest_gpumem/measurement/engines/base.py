"""What every engine offers (readings of one device's memory, the few actions on it the package needs), and the
capabilities an engine may offer besides: a storage tracker's :class:`Categories` and :class:`SiteRecording` (its
attributes, None when absent), a :class:`Runtime` and :class:`Workspaces` (protocols it implements, or not)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from pytest_gpumem.data.site_figures import Site, SiteConfig
from pytest_gpumem.measurement.engines.site_tracking import Found

__all__ = ["Categories", "Engine", "Reading", "Runtime", "SiteRecording", "Workspaces"]


@dataclass
class Reading:
    """Figures of a window of time, in bytes: the allocated ``peak`` and its ``breakdown``, and ``highest``, each other
    figure's highest value keyed by its :class:`~pytest_gpumem.data.figures.Measurement` field (absent: unknown);
    ``pending``: a token for :meth:`Engine.resolve`."""

    peak: int
    breakdown: tuple[int, ...] | None = None
    highest: dict[str, int] = field(default_factory=dict)
    pending: int | None = None
    sites: Any = None  #: bytes by site at the window's peak (the engine's own form)


class Engine(Protocol):
    """Reads the memory of one device, and acts on it where the package must; peaks are read by windows."""

    name: str  #: "cuda" (a caching allocator), "cpu" (the storage tracker) or "predict" (a tracker and a model)
    device: torch.device

    @property
    def categories(self) -> Categories | None:
        """The storage tracker watching the device (breakdowns, timelines, categories), if any."""

    @property
    def sites(self) -> SiteRecording | None:
        """Where storages are made, where this engine can record it."""

    @property
    def exact(self) -> bool:
        """True when figures are exact counts of tensor storages (the CPU engine), not an allocator's readings."""

    @property
    def cuda_rounding(self) -> bool:
        """True when the CPU engine counts storages as the CUDA allocator's 512-byte blocks."""

    @property
    def predicts(self) -> str | None:
        """The GPU whose figures this engine predicts from a CPU run (``"h100"``), if any."""

    # -- readings -------------------------------------------------------------------

    def allocated(self) -> int:
        """Bytes allocated now."""

    def reserved(self) -> int | None:
        """Bytes the allocator holds from the driver now, if any."""

    def reading(self) -> AbstractContextManager[None]:
        """Readings taken inside the block are of one moment; a block inside another is part of it (``Recorder.close``
        reads ``allocated_now`` inside its own)."""

    def take_window(self, *, defer: bool = False) -> Reading:
        """Figures since the previous call; opens a new window (``defer``: it may come back pending)."""

    def resolve(self, token: int) -> tuple[Reading, int, int]:
        """A pending window's reading, allocated bytes and event count when it closed."""

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


@runtime_checkable
class Runtime(Protocol):
    """A device runtime beside the allocator (the CUDA engine's): its queue, its counters, the driver's figures."""

    def synchronize(self) -> None:
        """Wait for the device's queued work."""

    def counters(self) -> dict[str, int]:
        """Cumulative event counters (``num_alloc_retries``, ``num_ooms``)."""

    def driver(self) -> tuple[int | None, int | None]:
        """(device memory used by all processes, by this process) per NVML."""

    def device_used(self) -> int | None:
        """Device memory in use per the runtime (all processes)."""


@runtime_checkable
class Workspaces(Protocol):
    """Library workspaces an engine keeps on the device (cuBLAS's), made by its clean state and part of every start."""

    @property
    def workspaces(self) -> int | None:
        """Their bytes, once the first clean state made them."""

    def warm_workspaces(self) -> None:
        """Create the workspaces a training step's threads get."""

    def release_workspaces(self) -> None:
        """Free them (what libraries keep per thread), for the leak check."""


class Categories(Protocol):
    """What a storage tracker knows of the device: each storage's category, the breakdown, the timeline."""

    on_oom: Callable[[int], None] | None  #: called with the request size at an allocation an emulated limit refuses

    @property
    def events(self) -> int:
        """Allocations and frees seen: the clock of timelines."""

    @property
    def active(self) -> bool:
        """True while the tracker runs (it sees allocations)."""

    @property
    def counts_fakes(self) -> bool:
        """True when fake tensors are memory (a measurement on fake tensors)."""

    @property
    def compiled_frames(self) -> Sequence[tuple[bool, str]]:
        """Frames TorchDynamo ran eagerly under the tracker: (a library's, ``qualname (file:line)``)."""

    @property
    def notes(self) -> Sequence[str]:
        """What the tracker could not see (work on another thread)."""

    def register(self, tensors: Iterable[torch.Tensor], category: str | None = None) -> None:
        """Count ``tensors``' storages, as ``category`` from now on."""

    def category_of(self, tensor: torch.Tensor) -> str | None:
        """The category ``tensor``'s storage is counted in; None when uncounted."""

    def breakdown(self) -> dict[str, int]:
        """Allocated bytes by category now."""

    def timeline_columns(self, start_event: int) -> tuple[list[int], list[list[int]]] | None:
        """The samples from ``start_event`` on as columns: event indexes, then bytes by category; None without."""

    def scan(self, extra: Iterable[object] = ()) -> int:
        """Count every tensor alive (and ``extra``) not seen yet; returns their bytes."""


class SiteRecording(Protocol):
    """Where storages are made (sites), recorded from :meth:`start` until the engine stops."""

    def start(self, config: SiteConfig) -> None:
        """Record where each storage is made from now on."""

    def set_phase(self, phase: str | None) -> None:
        """The phase running from now on, for the sites of what is made."""

    def now(self) -> Any:
        """Bytes by site now (for :meth:`figures`); None while not recording."""

    def figures(self, peak: Any, end: Any) -> list[Found] | None:
        """The sites of a span from its peak's and its end's bytes by site; None without them."""

    def site_of(self, tensor: Any) -> Site | None:
        """Where ``tensor``'s storage was made, when sites were recorded then."""

    def here(self) -> Site | None:
        """The site of the code running now, while sites are recorded."""
