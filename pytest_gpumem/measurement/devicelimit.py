"""Emulated device sizes: run a block as if the device had less memory than it has."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pytest_gpumem.measurement.active import engine_for
from pytest_gpumem.measurement.engines import Engine, StorageTracker
from pytest_gpumem.units import parse_size

__all__ = ["device_limit"]


@contextmanager
def device_limit(target: Engine | StorageTracker | str | torch.device, limit: int | str) -> Iterator[int]:
    """Run a block as if the device had only ``limit`` bytes (or a size such as ``"8GB"``); yields the limit in bytes.

    ``target`` is an engine, a device name (the engine measuring it now) or a ``StorageTracker``; on CUDA the
    allocator's reserved memory is capped (see docs/oom-and-leaks.md).
    """
    nbytes = parse_size(limit)
    if isinstance(target, StorageTracker):
        previous = target.limit
        target.limit = nbytes
        try:
            yield nbytes
        finally:
            target.limit = previous
        return
    engine = engine_for(target)
    watching = engine.categories is None or engine.categories.active
    if engine.exact and isinstance(target, (str, torch.device)) and not watching:
        raise ValueError(
            f"device_limit({str(target)!r}, ...): the CPU engine sees allocations only while it measures; "
            "use it inside a measured test or a measure() block, or pass the engine"
        )
    with engine.limit_memory(nbytes) as value:
        yield value
