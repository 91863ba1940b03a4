"""Leak confirmation: is memory a test left behind really leaked, and by which tensors?

It follows PyTorch's ``CudaMemoryLeakCheck`` (collect, free workspaces, empty the cache, read again), and on CUDA
confirms a leak only when the driver sees it too.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pytest_gpumem.codec import Coded, coded
from pytest_gpumem.diagnose.census import (
    LiveTensor,
    describe,
    holder_hints,
    live_table,
    module_level_names,
    storage_groups,
)
from pytest_gpumem.diagnose.holders import referrer_names
from pytest_gpumem.measurement import collector
from pytest_gpumem.measurement.engines.base import Engine, Runtime, Workspaces
from pytest_gpumem.units import format_delta, format_size

__all__ = ["LeakCheck", "StorageSnapshot", "confirm_leak", "referrer_names", "snapshot_storages"]

#: Leaked tensors a :class:`LeakCheck` lists by default.
TOP = 20


@dataclass(frozen=True)
class StorageSnapshot:
    """The storages alive on a device at a test's start (weakly), with the allocated and driver-used bytes then."""

    device: str
    allocated: int
    driver_used: int | None
    _refs: Mapping[int, weakref.ref[torch.UntypedStorage]] = field(repr=False, compare=False, default_factory=dict)

    def __len__(self) -> int:
        return len(self._refs)

    def alive_at_start(self, storage: torch.UntypedStorage) -> bool:
        """True when ``storage`` is the very storage seen at the snapshot (not a new one at the same address)."""
        ref = self._refs.get(int(storage._cdata))
        return ref is not None and ref() is storage


def snapshot_storages(engine: Engine) -> StorageSnapshot:
    """Remember the storages alive on ``engine``'s device now (weak references only), only when a leak check is on."""
    runtime = engine if isinstance(engine, Runtime) else None
    if runtime is not None:
        runtime.synchronize()
    refs = {key: weakref.ref(group.storage) for key, group in storage_groups(engine.device, engine).items()}
    allocated, used = engine.allocated(), None if runtime is None else runtime.device_used()
    return StorageSnapshot(device=str(engine.device), allocated=allocated, driver_used=used, _refs=refs)


@dataclass(frozen=True)
class LeakCheck(Coded):
    """The verdict of :func:`confirm_leak`, in bytes.

    ``start`` and ``readings`` leave out the library workspaces; ``confirmed`` means allocated stayed above the start at
    every try and, on CUDA, the driver saw growth; ``leaked`` lists the largest new storages, named by holder
    (``listed`` False without a snapshot).
    """

    device: str
    engine: str
    start: int
    readings: tuple[int, ...]
    retained: int
    confirmed: bool
    driver_retained: int | None = None
    driver_confirmed: bool | None = None
    leaked: tuple[LiveTensor, ...] = ()
    leaked_count: int = 0
    leaked_bytes: int = 0
    listed: bool = field(default=False, metadata=coded(skip=True))

    @property
    def suspected(self) -> bool:
        """Allocated memory stayed above the start at every try (confirmed by the driver or not)."""
        return bool(self.readings) and all(reading > self.start for reading in self.readings)

    def format(self) -> str:
        """The verdict as text for a failure message, with a table of the leaked tensors."""
        if self.confirmed:
            head = f"memory leak confirmed on {self.device}: {format_size(self.retained)} ({self.retained} B) retained"
        elif self.suspected:
            head = (
                f"possible memory leak on {self.device}: {format_size(self.retained)} ({self.retained} B) "
                "retained, not confirmed by the driver"
            )
        else:
            head = f"no leak on {self.device}: retained {format_delta(self.retained)} after garbage collection"
        lines = [
            head,
            "  allocated at start: " + f"{self.start} B; after each try: " + ", ".join(map(str, self.readings)),
        ]
        if self.driver_retained is not None:
            lines.append(f"  driver: used memory {format_delta(self.driver_retained)} since the start (all processes)")
        text = "\n".join(lines)
        if self.leaked:
            unseen = max(0, self.retained - self.leaked_bytes)
            title = (
                f"tensors created during the test and still alive ({len(self.leaked)} of {self.leaked_count} "
                f"storages, {format_size(self.leaked_bytes)})"
            )
            if unseen:
                title += f"; {format_size(unseen)} retained is held by no Python-reachable tensor"
            text += f"\n\n{title}\n" + live_table(self.leaked)
        elif not self.listed and self.suspected:
            text += "\n  (take a snapshot_storages() at the start to list the leaked tensors)"
        return text


def confirm_leak(
    engine: Engine,
    start_allocated: int,
    *,
    tries: int = 3,
    snapshot: StorageSnapshot | None = None,
    top: int = TOP,
) -> LeakCheck:
    """Confirm (or dismiss) a leak: is allocated memory still above ``start_allocated``?

    Up to ``tries`` readings follow PyTorch's leak-check protocol and are compared with the start without its
    workspaces; on CUDA the driver's used memory must grow too (else only ``suspected``). With a ``snapshot`` the
    ``top`` largest new storages are listed, each named by what holds it.
    """
    if tries < 1:
        raise ValueError(f"confirm_leak: tries must be >= 1, got {tries}")
    spaces = engine if isinstance(engine, Workspaces) else None
    start = start_allocated - ((None if spaces is None else spaces.workspaces) or 0)
    readings: list[int] = []
    for _ in range(tries):  # PyTorch's leak-check protocol: collect, free library workspaces, empty the cache
        engine.settle()
        if spaces is not None:
            spaces.release_workspaces()
        engine.empty_cache()
        reading = engine.allocated()
        readings.append(reading)
        if reading <= start:
            break
    if spaces is not None:
        spaces.warm_workspaces()  # back to the steady state the start reading saw
    engine.empty_cache()
    suspected = all(reading > start for reading in readings)
    driver_retained: int | None = None
    if snapshot is not None and snapshot.driver_used is not None and isinstance(engine, Runtime):
        used = engine.device_used()
        driver_retained = None if used is None else used - snapshot.driver_used
    driver_confirmed = None if driver_retained is None else driver_retained > 0
    confirmed = suspected and driver_confirmed is not False
    leaked: tuple[LiveTensor, ...] = ()
    count = nbytes = 0
    if suspected and snapshot is not None:
        collector.give_back()  # the leaked tensors' holders may be among the frozen objects
        leaked, count, nbytes = _leaked_tensors(engine, snapshot, top)
    return LeakCheck(
        device=str(engine.device),
        engine=engine.name,
        start=start,
        readings=tuple(readings),
        retained=readings[-1] - start,
        confirmed=confirmed,
        driver_retained=driver_retained,
        driver_confirmed=driver_confirmed,
        leaked=leaked,
        leaked_count=count,
        leaked_bytes=nbytes,
        listed=snapshot is not None,
    )


def _leaked_tensors(engine: Engine, snapshot: StorageSnapshot, top: int) -> tuple[tuple[LiveTensor, ...], int, int]:
    groups = storage_groups(engine.device, engine).values()
    new = sorted((g for g in groups if not snapshot.alive_at_start(g.storage)), key=lambda g: g.nbytes, reverse=True)
    chosen, count, total = new[:top], len(new), sum(g.nbytes for g in new)
    del groups, new
    hints = holder_hints(chosen, module_level_names())
    named = {id(tensor): (name, None) for tensor, name in hints.values()}
    return tuple(describe(group, named, engine) for group in chosen), count, total
