"""Leak confirmation: is memory that a test left behind really leaked, and by what?

``retained`` (allocated at test end minus at its start, after ``gc.collect()``)
is a leak indicator; this module confirms it the way PyTorch's own
``CudaMemoryLeakCheck`` does (``torch/testing/_internal/common_utils.py``):
collect garbage, on CUDA synchronize, free cuBLAS workspaces and empty the
cache, then re-read allocated memory up to ``tries`` times; on CUDA a leak is
confirmed only when the driver (``mem_get_info``) sees the growth too. It then
names the culprits: the live tensors whose storages did not exist at the start
(found with :func:`snapshot_storages` taken at the start), with the name that
holds each one (``"tests.test_x.CACHE[3]"``).

Sizes are bytes throughout.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
from pytest_gpumem.units import format_delta, format_size

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines.base import Engine

__all__ = ["LeakCheck", "StorageSnapshot", "confirm_leak", "referrer_names", "snapshot_storages"]

#: Leaked tensors a :class:`LeakCheck` lists by default.
TOP = 20


@dataclass(frozen=True)
class StorageSnapshot:
    """The storages alive on a device at a moment (a test's start), and the readings then.

    Attributes:
        device: the device, e.g. ``"cpu"``.
        allocated: the engine's allocated bytes when the snapshot was taken.
        driver_used: device memory in use per the driver (``total - free`` from
            ``mem_get_info``, all processes) on CUDA-like devices; None on CPU.
    """

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
    """Remember the storages alive on ``engine``'s device now (weak references only).

    Call it at the test's start, after the engine's clean-state protocol, and only
    when a leak check is enabled: it walks the garbage collector's objects (tens
    of milliseconds in a large process). The snapshot keeps no storage alive.
    """
    engine.synchronize()
    groups = storage_groups(engine.device, engine)
    refs = {key: weakref.ref(group.storage) for key, group in groups.items()}
    del groups
    return StorageSnapshot(
        device=str(engine.device), allocated=engine.allocated(), driver_used=engine.device_used(), _refs=refs
    )


def _settle(engine: Engine) -> None:
    """Collect garbage, free library workspaces and empty the cache (PyTorch's leak-check protocol)."""
    engine.settle()
    engine.release_workspaces()
    engine.empty_cache()


@dataclass(frozen=True)
class LeakCheck(Coded):
    """The verdict of :func:`confirm_leak`. All sizes are bytes.

    Attributes:
        device: the device, e.g. ``"cuda:0"``.
        engine: ``"cpu"`` or ``"cuda"``.
        start: allocated bytes at the start, without the library workspaces the
            engine keeps (they are freed before each reading, as PyTorch's leak
            check does).
        readings: allocated bytes at each try (after garbage collection, the
            workspaces freed).
        retained: the last reading minus ``start``; may be negative.
        confirmed: a leak: allocated stayed above ``start`` at every try and, on
            CUDA, the driver saw device memory grow too.
        driver_retained: CUDA: driver-reported used memory now minus at the
            start (all processes: other processes move it); None on CPU or unknown.
        driver_confirmed: CUDA: ``driver_retained > 0``; None on CPU or unknown.
        leaked: the largest live tensors whose storages did not exist at the
            start, largest first; ``held_by`` names what holds each one.
        leaked_count: how many such storages there are.
        leaked_bytes: their total bytes. Less than ``retained`` when some
            retained bytes are held where Python cannot see them.
        listed: False when no snapshot was given, so tensors could not be listed.
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

    ``start_allocated`` was read after the engine's clean-state protocol, so it
    holds the library workspaces the engine keeps (:attr:`Engine.workspaces`).
    As PyTorch's ``CudaMemoryLeakCheck`` does, each of up to ``tries`` readings
    follows ``gc.collect()``, and on CUDA-like devices ``synchronize``, freeing the
    cuBLAS workspaces and ``empty_cache``; so the readings are compared with the
    start without its workspaces (:attr:`LeakCheck.start`). A reading at or below
    it ends the check: no leak. The workspaces are made again afterwards. On CUDA
    the driver's used memory (``mem_get_info``) is then compared with
    ``snapshot.driver_used``: the leak is confirmed only when the driver sees
    growth too (a small leak inside an already reserved segment is only
    ``suspected``). Without a snapshot on CUDA, the allocator alone decides.

    With a ``snapshot`` (from :func:`snapshot_storages` at the start) and a
    suspected leak, the live tensors whose storages are new are listed (the
    ``top`` largest), each named by what holds it (see :func:`referrer_names`).
    Costs a few garbage collections; walks the objects only when a leak is suspected.
    """
    if tries < 1:
        raise ValueError(f"confirm_leak: tries must be >= 1, got {tries}")
    start = start_allocated - (engine.workspaces or 0)
    readings: list[int] = []
    for _ in range(tries):
        _settle(engine)
        reading = engine.allocated()
        readings.append(reading)
        if reading <= start:
            break
    engine.warm_workspaces()  # back to the steady state the start reading saw
    engine.empty_cache()
    suspected = all(reading > start for reading in readings)
    driver_retained: int | None = None
    driver_confirmed: bool | None = None
    if snapshot is not None and snapshot.driver_used is not None:
        used = engine.device_used()
        if used is not None:
            driver_retained = used - snapshot.driver_used
            driver_confirmed = driver_retained > 0
    confirmed = suspected and driver_confirmed is not False
    leaked: tuple[LiveTensor, ...] = ()
    count = nbytes = 0
    if suspected and snapshot is not None:
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
    groups = storage_groups(engine.device, engine)
    new = [group for group in groups.values() if not snapshot.alive_at_start(group.storage)]
    del groups
    new.sort(key=lambda g: g.nbytes, reverse=True)
    chosen = new[:top]
    total = sum(g.nbytes for g in new)
    count = len(new)
    del new
    hints = holder_hints(chosen, module_level_names())
    named = {id(tensor): (name, None) for tensor, name in hints.values()}
    described = tuple(describe(group, named, engine) for group in chosen)
    del hints
    return described, count, total
