"""The CPU engine: exact tensor-storage bytes from the storage tracker."""

from __future__ import annotations

import gc

import torch

from pytest_gpumem.engines.base import Reading
from pytest_gpumem.engines.tracker import StorageTracker

__all__ = ["CpuEngine"]


class CpuEngine:
    """Counts tensor storages on the CPU (see :mod:`pytest_gpumem.engines.tracker`).

    ``cuda_rounding`` rounds every storage up to the CUDA caching allocator's
    512-byte blocks, so that figures compare with CUDA's allocated bytes.
    There is no caching allocator, so ``reserved`` is None (n/a).
    """

    name = "cpu"

    def __init__(self, *, cuda_rounding: bool = False, tracker: StorageTracker | None = None) -> None:
        self.device = torch.device("cpu")
        self.tracker: StorageTracker = tracker or StorageTracker(self.device, cuda_rounding=cuda_rounding)

    @property
    def cuda_rounding(self) -> bool:
        return self.tracker.cuda_rounding

    def clean(self) -> None:
        self.settle()
        self.tracker.scan()
        self.tracker.take_window()

    def settle(self) -> None:
        gc.collect()

    def allocated(self) -> int:
        return self.tracker.current

    def reserved(self) -> int | None:
        return None

    def take_window(self) -> Reading:
        window = self.tracker.take_window()
        return Reading(peak=window.peak, breakdown=window.breakdown)

    def counters(self) -> dict[str, int]:
        return {}

    def driver(self) -> tuple[int | None, int | None]:
        return None, None
