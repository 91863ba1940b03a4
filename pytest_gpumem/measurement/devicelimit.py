"""Emulated device sizes: run a block as if the device had less memory than it has.

A test that must fit a 24 GiB card can run on an 80 GiB one (or on the CPU engine)
with ``device_limit(engine, "24GiB")``: an allocation over the limit raises
:class:`torch.OutOfMemoryError`, as it would on the smaller card. Sizes are bytes.
"""

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
    """Run a block as if the device had only ``limit`` bytes; yields the limit in bytes.

    ``target`` is an engine (:func:`pytest_gpumem.make_engine`), a device name
    (``"cpu"``, ``"cuda:0"``, ``"auto"``: the engine measuring that device now,
    inside a measured test or a :func:`~pytest_gpumem.measurement.active.measure` block, else a new
    one; see :func:`~pytest_gpumem.measurement.active.engine_for`) or a bare
    :class:`~pytest_gpumem.measurement.engines.tracker.StorageTracker`; ``limit`` is bytes or
    a size string (``"8GB"``, see :func:`~pytest_gpumem.units.parse_size`).

    * CPU engine / tracker: an allocation that would take the tracker's
      *allocated* bytes over the limit raises :class:`torch.OutOfMemoryError`,
      but only while the tracker runs (it sees allocations only then; inside a
      measured test or a :func:`~pytest_gpumem.measurement.active.measure` block it does). Bytes
      already allocated never raise.
    * CUDA-like engine: the caching allocator is capped with
      ``set_per_process_memory_fraction(limit / total)``: its *reserved* memory
      (rounding and fragmentation count, the CUDA context does not). A limit
      above the card's memory is clamped to the whole card.

    The previous limit is restored on exit, whatever happens.
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
    if engine.exact and isinstance(target, (str, torch.device)) and not engine.sees_allocations:
        raise ValueError(
            f"device_limit({str(target)!r}, ...): the CPU engine sees allocations only while it measures; "
            "use it inside a measured test or a measure() block, or pass the engine"
        )
    with engine.limit_memory(nbytes) as value:
        yield value
