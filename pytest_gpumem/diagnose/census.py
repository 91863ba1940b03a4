"""The live-tensor census: which tensors are alive on a device, their storages' bytes and what holds each one.

It walks the collector's objects (tens of milliseconds in a large process): for failures, not every test.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

import torch

from pytest_gpumem.codec import Coded
from pytest_gpumem.diagnose.holders import frame_locals, frame_where, module_level_objects, referrer_names
from pytest_gpumem.measurement import collector, frozen, gcfunctions
from pytest_gpumem.measurement.engines import Categories, Engine
from pytest_gpumem.measurement.engines.storages import _PLAIN, fakes_counted, is_fake
from pytest_gpumem.tables import table
from pytest_gpumem.units import cuda_rounded, format_size

__all__ = [
    "LiveTensor",
    "StorageGroup",
    "describe",
    "holder_hints",
    "live_table",
    "live_tensors",
    "module_level_names",
    "stack_frames",
    "storage_groups",
    "tensor_names",
    "traceback_frames",
]

#: Largest live tensors listed by default.
TOP = 10

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Frames whose locals never name a tensor in a report: this package's machinery (not the step driver, not user code).
_INTERNAL = tuple(
    os.path.join(_PACKAGE_DIR, *name.split("/"))
    for name in (
        "measurement/",
        "diagnose/census.py",
        "diagnose/oom.py",
        "diagnose/leaks.py",
        "diagnose/microbatch.py",
        "plugin/runner.py",
        "plugin/run_engines.py",
    )
)
#: The training-step driver (``gpumem.train_step``): its frames hold the user's model, optimizer and batch.
_STEPS = os.path.join(_PACKAGE_DIR, "measurement", "steps.py")
_FRAMEWORK_PARTS = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}")


@dataclass(frozen=True)
class LiveTensor(Coded):
    """One live storage on the device, described through a tensor that uses it.

    ``nbytes`` counts the storage once (rounded to 512-byte blocks where the allocator does); ``category``, ``held_by``
    and ``site`` are None when unknown.
    """

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    category: str | None = None
    held_by: str | None = None
    views: int = 1
    site: str | None = None
    _codec_order = ("site",)


def _on_device(device: torch.device) -> Callable[[torch.Tensor], bool]:
    if device.type == "cpu":
        return lambda t: t.device.type == "cpu" and t.layout == torch.strided
    index = device.index or 0
    return lambda t: t.device.type == device.type and t.get_device() == index


@dataclass(slots=True, eq=False)
class StorageGroup:
    """The live tensors sharing one storage."""

    storage: torch.UntypedStorage
    nbytes: int
    tensors: list[torch.Tensor] = field(default_factory=list)


def see_every_tensor() -> None:
    """Make every tensor visible to ``gc.get_objects()`` (frozen objects are not) before a census or a leak check's
    start: the plugin's frozen tensors are remembered, others' frozen objects given back to the collector."""
    if not frozen.known() and collector.others_frozen():
        frozen.give_back_theirs()


def storage_groups(
    device: torch.device, engine: Engine | None = None, *, counted_only: bool = False
) -> dict[int, StorageGroup]:
    """Every Python-reachable tensor on ``device``, grouped by storage; ``counted_only``: those ``engine`` counts."""
    on_device = _on_device(device)
    rounding = device.type != "cpu" or (engine is not None and engine.cuda_rounding)
    groups: dict[int, StorageGroup] = {}
    listed: set[int] = set()  # ids of the tensors grouped: a remembered frozen tensor someone else unfroze comes twice
    tensor_type = torch.Tensor
    see_every_tensor()
    objects: Iterable[Any] = (
        itertools.chain(gcfunctions.get_objects(), frozen.tensors()) if frozen.known() else gcfunctions.get_objects()
    )
    categories = None if engine is None else engine.categories
    # fake tensors are memory only during and after a measurement on fake tensors
    fakes = fakes_counted() or (categories is not None and categories.counts_fakes)
    with _reading(engine):  # one reading of the tracker's counts for every storage asked about
        for obj in objects:
            cls = type(obj)
            if not (cls is tensor_type or issubclass(cls, tensor_type)) or id(obj) in listed:
                continue
            if cls not in _PLAIN and not fakes and is_fake(obj):  # shapes only: no memory anywhere
                continue
            try:
                if not on_device(obj):
                    continue
                storage = obj.untyped_storage()
                key = int(storage._cdata)
            except (RuntimeError, NotImplementedError, TypeError):  # sparse, meta, wrapper subclasses
                continue
            group = groups.get(key)
            if group is None:
                nbytes = int(storage.nbytes())
                if nbytes == 0 or (counted_only and engine is not None and _category(categories, obj) is None):
                    continue
                group = groups[key] = StorageGroup(storage, cuda_rounded(nbytes) if rounding else nbytes)
            listed.add(id(obj))
            group.tensors.append(obj)
    return groups


def _category(categories: Categories | None, tensor: Any) -> str | None:
    return None if categories is None else categories.category_of(tensor)


def _reading(engine: Engine | None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if engine is None else engine.reading()


def tensor_names(objects: Iterable[Any], labels: Mapping[int, str] | None = None) -> dict[int, tuple[str, str | None]]:
    """Names of the tensors that tracked modules and optimizers hold, by ``id()``: ``(name, category)``.

    Named as code reads them (``model.0.weight.grad``), a holder by ``labels[id(obj)]`` else by its class name.
    """
    labels = labels or {}
    names: dict[int, tuple[str, str | None]] = {}
    param_names: dict[int, str] = {}

    def add_parameter(name: str, param: torch.Tensor) -> None:
        names.setdefault(id(param), (name, "parameters"))
        if param.grad is not None:
            names.setdefault(id(param.grad), (f"{name}.grad", "gradients"))

    objects = list(objects)
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            prefix = labels.get(id(obj)) or type(obj).__name__
            for name, param in obj.named_parameters():
                param_names.setdefault(id(param), f"{prefix}.{name}")
                add_parameter(f"{prefix}.{name}", param)
            for name, buffer in obj.named_buffers():
                names.setdefault(id(buffer), (f"{prefix}.{name}", None))
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            optimizer = labels.get(id(obj)) or type(obj).__name__
            for g, group in enumerate(obj.param_groups):
                for i, param in enumerate(group["params"]):
                    known = param_names.get(id(param))
                    add_parameter(known or f"{optimizer}.param_groups[{g}]['params'][{i}]", param)
                    for key, value in obj.state.get(param, {}).items():
                        if isinstance(value, torch.Tensor):
                            state = f"{optimizer}.state[{known or f'param {g}.{i}'}][{key!r}]"
                            names.setdefault(id(value), (state, "optimizer_state"))
    return names


def _user_frame(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    internal = filename.startswith((_TORCH_DIR, *_INTERNAL)) and filename != _STEPS
    return not internal and not any(part in filename for part in _FRAMEWORK_PARTS)


def _frame_names(
    frames: Iterable[FrameType], tracked: Iterable[Any]
) -> tuple[dict[int, tuple[str, str | None]], dict[int, str]]:
    """Names from the locals of user frames (innermost first): tensor names and tracked objects' labels, by ``id()``."""
    tracked_ids = {id(obj) for obj in tracked}
    names: dict[int, tuple[str, str | None]] = {}
    labels: dict[int, str] = {}
    for frame in itertools.islice(frames, 200):
        if not _user_frame(frame):
            continue
        for var, value in frame_locals(frame).items():
            if isinstance(value, torch.Tensor):
                names.setdefault(id(value), (f"local '{var}' in {frame_where(frame)}", None))
            elif id(value) in tracked_ids and not var.startswith("_") and var not in ("self", "cls"):
                labels.setdefault(id(value), var)
    return names, labels


def stack_frames(start: FrameType | None) -> Iterator[FrameType]:
    frame = start
    while frame is not None:
        yield frame
        frame = frame.f_back


def traceback_frames(tb: TracebackType | None) -> list[FrameType]:
    """The frames of a traceback, innermost first."""
    return [frame for frame, _ in traceback.walk_tb(tb)][::-1]


def describe(
    group: StorageGroup,
    names: Mapping[int, tuple[str, str | None]],
    engine: Engine | None,
) -> LiveTensor:
    """A :class:`LiveTensor` for ``group``: a named tensor if any, else its largest view."""
    named = [t for t in group.tensors if id(t) in names]
    chosen = named[0] if named else max(group.tensors, key=lambda t: t.numel())
    name, name_category = names.get(id(chosen), (None, None))
    categories, sites = (None, None) if engine is None else (engine.categories, engine.sites)
    category = _category(categories, chosen)
    site = None if sites is None else sites.site_of(chosen)
    return LiveTensor(
        site=None if site is None else site.where(),
        nbytes=group.nbytes,
        shape=tuple(int(n) for n in chosen.shape),
        dtype=str(chosen.dtype).removeprefix("torch."),
        category=category or name_category,
        held_by=name,
        views=len(group.tensors),
    )


#: Tensors per storage whose holders are looked for (the largest views first).
VIEWS_NAMED = 8


def module_level_names() -> dict[int, str]:
    """Names of the tensors of modules and optimizers held at module level (``model.weight.grad``)."""
    held = module_level_objects()
    labels = {key: name for key, (name, _) in held.items()}
    return {key: name for key, (name, _) in tensor_names([obj for _, obj in held.values()], labels).items()}


def holder_hints(
    groups: list[StorageGroup], known: Mapping[int, str], *, thaw: bool = True
) -> dict[int, tuple[torch.Tensor, str]]:
    """For each group (by index) with a nameable holder: the tensor so held and its name.

    Names in ``known`` are kept, others come from referrers; a view's C++-only base has no holder, so the largest named
    view is used.
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
    names = referrer_names(targets, ignore=[candidates, *candidates, groups, *(g.tensors for g in groups)], thaw=thaw)
    for i, tensors in enumerate(candidates):
        for tensor in tensors:
            if id(tensor) in names:
                hints[i] = (tensor, names[id(tensor)])
                break
    return hints


def live_tensors(
    device: torch.device | str,
    *,
    engine: Engine | None = None,
    objects: Iterable[Any] = (),
    frames: Iterable[FrameType] = (),
    top: int | None = TOP,
    counted_only: bool = False,
    thaw_for: Callable[[StorageGroup], bool] | None = None,
) -> tuple[tuple[LiveTensor, ...], int, int]:
    """The ``top`` largest live tensors on ``device``, by storage, and how many storages there are and their bytes.

    Tensors only C++ holds (saved for backward without the tracker, workspaces) are not found; names come from
    ``objects`` and the locals of ``frames``. ``counted_only`` keeps only storages ``engine``'s tracker counts; the
    frozen objects are given back to name a holder only when a group left unnamed is one ``thaw_for`` wants.
    """
    device = torch.device(device)
    frames = list(frames)
    held = module_level_objects()
    tracked = [*objects, *(obj for _, obj in held.values())]
    local_names, labels = _frame_names(frames, tracked)
    for key, (name, _) in held.items():
        labels.setdefault(key, name)
    names = local_names | tensor_names(tracked, labels)  # the tracked objects' names first
    groups = storage_groups(device, engine, counted_only=counted_only)
    ordered = sorted(groups.values(), key=lambda g: g.nbytes, reverse=True)
    chosen = ordered if top is None else ordered[:top]
    unnamed = [group for group in chosen if not any(id(t) in names for t in group.tensors)]
    if unnamed:  # what else holds them: a cache, a compiler's graph, a global container
        hints = holder_hints(unnamed, {}, thaw=False)
        rest = [i for i in range(len(unnamed)) if i not in hints]
        if rest and (thaw_for is None or any(thaw_for(unnamed[i]) for i in rest)) and collector.thaw():
            # held by objects the plugin froze (an earlier test's leftovers in a cache): given back until the next test
            found = holder_hints([unnamed[i] for i in rest], {}, thaw=False)
            hints.update({rest[j]: hint for j, hint in found.items()})
        for tensor, name in hints.values():
            names[id(tensor)] = (name, None)
    with _reading(engine):
        tensors = tuple(describe(group, names, engine) for group in chosen)
    return tensors, len(ordered), sum(g.nbytes for g in ordered)


def live_table(tensors: Iterable[LiveTensor]) -> str:
    """A table of ``tensors``: bytes, shape, dtype, category, held by, and where each was made (with sites)."""
    tensors = list(tensors)
    sites = any(t.site for t in tensors)
    rows = [
        [
            format_size(t.nbytes),
            "×".join(str(n) for n in t.shape) if t.shape else "scalar",
            t.dtype,
            t.category or "unknown",
            t.held_by or "unknown",
            *([t.site or "unknown"] if sites else []),
        ]
        for t in tensors
    ]
    return table(("bytes", "shape", "dtype", "category", "held by", *(["made at"] if sites else [])), rows)
