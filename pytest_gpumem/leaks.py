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

import gc
import os
import sys
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import CellType, FrameType, ModuleType
from typing import TYPE_CHECKING, Any

import torch

import pytest_gpumem.census as _census
from pytest_gpumem import frozen
from pytest_gpumem.census import (
    LiveTensor,
    StorageGroup,
    describe,
    frame_locals,
    live_table,
    module_level_objects,
    storage_groups,
    tensor_names,
)
from pytest_gpumem.units import format_delta, format_size

if TYPE_CHECKING:
    from pytest_gpumem.engines.base import Engine

__all__ = ["LeakCheck", "StorageSnapshot", "confirm_leak", "referrer_names", "snapshot_storages"]

#: Leaked tensors a :class:`LeakCheck` lists by default.
TOP = 20

_THIS_FILES = (os.path.abspath(__file__), os.path.abspath(_census.__file__ or ""))


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
    groups = storage_groups(engine.device, engine.tracker)
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
class LeakCheck:
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
    listed: bool = False

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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "device": self.device,
            "engine": self.engine,
            "start": self.start,
            "readings": list(self.readings),
            "retained": self.retained,
            "confirmed": self.confirmed,
            "driver_retained": self.driver_retained,
            "driver_confirmed": self.driver_confirmed,
            "leaked": [t.to_dict() for t in self.leaked],
            "leaked_count": self.leaked_count,
            "leaked_bytes": self.leaked_bytes,
        }


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
    groups = storage_groups(engine.device, engine.tracker)
    new = [group for group in groups.values() if not snapshot.alive_at_start(group.storage)]
    del groups
    new.sort(key=lambda g: g.nbytes, reverse=True)
    chosen = new[:top]
    total = sum(g.nbytes for g in new)
    count = len(new)
    del new
    hints = _group_hints(chosen, _module_level_names())
    named = {id(tensor): (name, None) for tensor, name in hints.values()}
    described = tuple(describe(group, named, engine.tracker) for group in chosen)
    del hints
    return described, count, total


#: Tensors per leaked storage whose holders are looked for (the largest views first).
VIEWS_NAMED = 8


def _module_level_names() -> dict[int, str]:
    """Names of the tensors of modules and optimizers held at module level (``model.weight.grad``)."""
    held = module_level_objects()
    labels = {key: name for key, (name, _) in held.items()}
    return {key: name for key, (name, _) in tensor_names([obj for _, obj in held.values()], labels).items()}


def _group_hints(groups: list[StorageGroup], known: Mapping[int, str]) -> dict[int, tuple[torch.Tensor, str]]:
    """For each group (by index) with a nameable holder: the tensor so held and the name.

    A tensor of a module or optimizer that user code holds at module level is named as the
    code reads it (``known``: ``model.weight``, ``model.weight.grad``); the others by what
    refers to them. A leaked view often outlives the tensor it was cut from only in C++
    (its ``_base``): that base has no Python holder, so the largest *named* view is used.
    """
    hints: dict[int, tuple[torch.Tensor, str]] = {}
    for i, group in enumerate(groups):
        for tensor in group.tensors:
            if id(tensor) in known:
                hints[i] = (tensor, known[id(tensor)])
                break
    candidates = [
        [] if i in hints else sorted(group.tensors, key=lambda t: t.numel(), reverse=True)[:VIEWS_NAMED]
        for i, group in enumerate(groups)
    ]
    targets = [t for tensors in candidates for t in tensors]
    names = referrer_names(targets, ignore=[candidates, *candidates, groups, *(g.tensors for g in groups)])
    for i, tensors in enumerate(candidates):
        for tensor in tensors:
            if id(tensor) in names:
                hints[i] = (tensor, names[id(tensor)])
                break
    return hints


# -- naming what holds an object ----------------------------------------------------------------------


_DICT_OF = ".__dict__"


def _module_dicts() -> dict[int, str]:
    dicts: dict[int, str] = {}
    for name, module in list(sys.modules.items()):
        if isinstance(module, ModuleType):
            dicts[id(module.__dict__)] = name
    return dicts


def _own_frame(obj: object) -> bool:
    return isinstance(obj, FrameType) and os.path.abspath(obj.f_code.co_filename) in _THIS_FILES


def _attribute_of(holder: object, target: object) -> str | None:
    """The attribute name under which ``holder`` (an object with a ``__dict__``) holds ``target``."""
    try:
        attributes = vars(holder)
    except TypeError:
        return None
    for key, value in attributes.items():
        if value is target:
            return str(key)
    return None


def _links(holder: object, target: object, module_dicts: Mapping[int, str]) -> list[tuple[str, bool]]:
    """How ``holder`` refers to ``target``: ``(text, final)`` pairs.

    ``final`` texts are complete names (a module-level name, a frame's local);
    the others are accessors (``"[3]"``, ``".attr"``, ``"['key']"``) to append to
    the name of whatever holds ``holder``.
    """
    found: list[tuple[str, bool]] = []
    if isinstance(holder, dict):
        module = module_dicts.get(id(holder))
        for key, value in list(holder.items()):
            if value is target:
                found.append((f"{module}.{key}", True) if module is not None else (f"[{key!r}]", False))
    elif isinstance(holder, (list, tuple)):
        for index, value in enumerate(holder):
            if value is target:
                found.append((f"[{index}]", False))
    elif isinstance(holder, FrameType):
        where = f"{holder.f_code.co_name} ({os.path.basename(holder.f_code.co_filename)}:{holder.f_lineno})"
        for var, value in frame_locals(holder).items():
            if value is target:
                found.append((f"local '{var}' in {where}", True))
    elif isinstance(holder, CellType):
        found.append(("a closure variable", True))
    elif isinstance(holder, (set, frozenset)):
        found.append(("{…}", False))
    elif getattr(holder, "__dict__", None) is target:
        found.append((_DICT_OF, False))
    else:
        attribute = _attribute_of(holder, target)
        if attribute is not None:
            found.append((f".{attribute}", False))
    return found


def _container_name(container: object) -> str:
    name = type(container).__name__
    return "saved for backward" if name == "Released" else name


def referrer_names(objects: Iterable[object], *, ignore: Iterable[object] = ()) -> dict[int, str]:
    """A name for what holds each of ``objects``, by ``id()``; objects nothing names are left out.

    Looks two levels up with two ``gc.get_referrers`` passes in all, so the cost
    does not grow with the number of objects: a module-level name
    (``"tests.test_x.CACHE"``), an element of a module-level list or dict
    (``"tests.test_x.CACHE[3]"``), an attribute (``"Holder.cache"`` then
    ``"tests.test_x.HOLDER.cache"``), a local variable of a live frame. Objects
    in ``ignore`` (the caller's own lists) and this module's frames are skipped.
    Only the first name found for each object is kept.
    """
    targets = list(objects)
    if not targets:
        return {}
    frozen.thaw()  # the referrers of a test's tensors may be among the objects frozen before the first test
    ignore = [objects, *ignore]
    module_dicts = _module_dicts()
    names: dict[int, str] = {}
    pending: dict[int, list[tuple[int, str]]] = {}  # id(container) -> [(id(target), accessor)]
    containers: list[object] = []
    ignored = {id(obj) for obj in ignore} | {id(targets), id(containers)}
    referrers = gc.get_referrers(*targets)
    ignored.add(id(referrers))
    for holder in referrers:
        if id(holder) in ignored or _own_frame(holder):
            continue
        for target in targets:
            if id(target) in names:
                continue
            for text, final in _links(holder, target, module_dicts):
                if final:
                    names[id(target)] = text
                    break
                if id(holder) not in pending:
                    pending[id(holder)] = []
                    containers.append(holder)
                pending[id(holder)].append((id(target), text))
    del referrers
    if not containers or len(names) == len(targets):
        return names
    # an object whose attribute holds a target: through its materialised __dict__, the owner
    # is one level further up; named by a module-level name if it has one (below)
    owners: list[object] = []
    weak: list[tuple[int, str]] = []  # names through an anonymous container: kept if nothing better
    referrers = gc.get_referrers(*containers)
    ignored.add(id(referrers))
    for holder in referrers:
        if id(holder) in ignored or _own_frame(holder):
            continue
        for container in containers:
            links = _links(holder, container, module_dicts)
            if not links:
                continue
            text, final = links[0]
            if text == _DICT_OF and not final and id(holder) not in pending:
                pending[id(holder)] = [(t, _join(_DICT_OF, accessor)) for t, accessor in pending[id(container)]]
                owners.append(holder)
                continue
            if final:
                for target_id, accessor in pending[id(container)]:
                    names.setdefault(target_id, _join(text, accessor))
            else:  # a plain loop: a comprehension would hold ``holder`` in a closure cell, a referrer
                prefix = _container_name(holder) + text
                for target_id, accessor in pending[id(container)]:
                    weak.append((target_id, _join(prefix, accessor)))
    del referrers
    # a module-level name (frozen globals included) names a holder better than an anonymous
    # dict or list that also refers to it (a frame's materialised locals, a cache)
    _name_by_module_globals([*containers, *owners], pending, names)
    for target_id, text in weak:
        names.setdefault(target_id, text)
    for container in [*owners, *containers]:  # held by nothing nameable: name the container by its type
        for target_id, accessor in pending[id(container)]:
            names.setdefault(target_id, _join(_container_name(container), accessor))
    return names


def _name_by_module_globals(
    containers: list[object], pending: dict[int, list[tuple[int, str]]], names: dict[int, str]
) -> None:
    """Name what a module-level name holds directly, for containers the collector did not name.

    ``gc.get_referrers`` sees only objects in the collector's generations: a module's
    globals frozen out of them (the plugin freezes what exists between measured tests)
    are not found that way, so such holders are looked up in the modules themselves.
    """
    unnamed = {
        id(container): container
        for container in containers
        if any(target_id not in names for target_id, _ in pending[id(container)])
    }
    if not unnamed:
        return
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType):
            continue
        for key, value in list(vars(module).items()):
            container = unnamed.get(id(value))
            if container is not None and value is container:
                for target_id, accessor in pending[id(container)]:
                    names.setdefault(target_id, _join(f"{module_name}.{key}", accessor))


def _join(prefix: str, accessor: str) -> str:
    """``prefix`` (what holds a container) followed by ``accessor`` (how the container holds the object)."""
    if prefix.endswith(_DICT_OF):  # the container is an object's materialised __dict__: ['x'] reads .x
        owner = prefix.removesuffix(_DICT_OF)
        if accessor.startswith("['") and accessor.endswith("']"):
            return f"{owner}.{accessor[2:-2]}"
        return owner + accessor
    if prefix.startswith("local '"):
        var, _, where = prefix.partition("' in ")
        return f"{var}{accessor}' in {where}"
    return prefix + accessor
