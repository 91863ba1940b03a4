"""What every engine offers: readings of one device's memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from pytest_gpumem.engines.tracker import StorageTracker

__all__ = ["Engine", "Reading"]


@dataclass
class Reading:
    """Figures of a window of time, all in bytes; None where the engine cannot know.

    ``peak`` is the highest allocated bytes in the window, ``breakdown`` the bytes
    by category at that moment (None without a tracker), ``reserved_peak`` and
    ``requested_peak`` the highest reserved / requested bytes (caching allocators).
    """

    peak: int
    breakdown: tuple[int, ...] | None = None
    reserved_peak: int | None = None
    requested_peak: int | None = None
    counters: dict[str, int] = field(default_factory=dict)


class Engine(Protocol):
    """Reads memory of one device.

    Peaks are read by windows: :meth:`take_window` returns the figures since the
    previous call and opens a new window, so nested spans and phases can all
    fold the same windows into their own peaks.
    """

    #: "cuda" (a caching allocator: CUDA, ROCm, XPU) or "cpu" (the storage tracker).
    name: str
    device: torch.device

    @property
    def tracker(self) -> StorageTracker | None:
        """The storage tracker giving breakdowns, activations and timelines, if any."""

    def clean(self) -> None:
        """Bring the device to a clean, comparable state before a start reading."""

    def settle(self) -> None:
        """Drop what only garbage and library caches hold (for end-of-test readings)."""

    def allocated(self) -> int:
        """Bytes allocated now."""

    def reserved(self) -> int | None:
        """Bytes the allocator holds from the driver now; None when not applicable."""

    def take_window(self) -> Reading:
        """Figures since the previous call; opens a new window."""

    def counters(self) -> dict[str, int]:
        """Cumulative event counters (``num_alloc_retries``, ``num_ooms``) where known."""

    def driver(self) -> tuple[int | None, int | None]:
        """(device memory used by all processes, by this process) per the driver; None when unknown."""
