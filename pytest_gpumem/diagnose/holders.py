"""What holds an object: the names a report gives to live tensors.

User code's module-level modules and optimizers name their tensors as the code reads them (``model.weight.grad``);
anything else is named through the collector's referrers, on failures only.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Mapping
from types import CellType, FrameType, ModuleType
from typing import Any

import torch

from pytest_gpumem.measurement import collector, gcfunctions
from pytest_gpumem.measurement.engines.compiled import TORCH_ROOT

__all__ = ["frame_locals", "frame_where", "library_dirs", "module_level_objects", "referrer_names"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The naming machinery's own frames (and the reports'), never a holder's name.
_THIS_FILES = tuple(
    os.path.join(_PACKAGE_DIR, "diagnose", name) for name in ("holders.py", "census.py", "leaks.py", "oom.py")
)


# -- the user's module-level modules and optimizers ---------------------------------------------------


def library_dirs() -> tuple[str, ...]:
    """The folders of code that is not the user's: the standard library, site-packages, torch and this package."""
    paths = sysconfig.get_paths()
    found = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    return (*(os.path.abspath(path) + os.sep for path in sorted(found)), TORCH_ROOT, _PACKAGE_DIR + os.sep)


def module_level_objects() -> dict[int, tuple[str, Any]]:
    """The modules and optimizers that user code holds in module-level names, by ``id()``: ``(name, object)``."""
    libraries = library_dirs()
    found: dict[int, tuple[str, Any]] = {}
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        if not isinstance(module, ModuleType) or not filename:
            continue
        if os.path.abspath(filename).startswith(libraries):
            continue
        for key, value in list(vars(module).items()):
            if key.startswith("__") or issubclass(type(value), (ModuleType, type)):
                continue
            for name, obj in _one_level(key, value):
                found.setdefault(id(obj), (name, obj))
    return found


_HOLDS = (torch.nn.Module, torch.optim.Optimizer)


def _one_level(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``value`` if it is a module or optimizer, else those it holds directly (dict values, items, attributes)."""
    kind = type(value)  # type(): isinstance would ask a proxy for its __class__
    if issubclass(kind, _HOLDS):
        yield name, value
        return
    if issubclass(kind, dict):
        items: Iterable[tuple[str, Any]] = ((f"{name}[{k!r}]", v) for k, v in list(value.items())[:_FANOUT])
    elif issubclass(kind, (list, tuple)):
        items = ((f"{name}[{i}]", v) for i, v in enumerate(value[:_FANOUT]))
    else:
        try:
            attributes = vars(value)
        except Exception:  # no __dict__, or one that raises
            return
        if not isinstance(attributes, dict):
            return
        items = ((f"{name}.{k}", v) for k, v in list(attributes.items())[:_FANOUT])
    for label, obj in items:
        if issubclass(type(obj), _HOLDS):
            yield label, obj


#: Entries of a module-level container looked at for modules and optimizers.
_FANOUT = 64


# -- a frame's locals, without keeping them --------------------------------------------------------


def frame_locals(frame: FrameType) -> dict[str, Any]:
    """A copy of ``frame``'s local variables that leaves no reference behind.

    Before Python 3.13, ``frame.f_locals`` stores a snapshot on the frame that keeps every local alive; it is emptied
    after copying.
    """
    try:
        snapshot = frame.f_locals
        values = dict(snapshot)
    except Exception:  # pragma: no cover - exotic frames
        return {}
    if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED and isinstance(snapshot, dict):
        snapshot.clear()
    return values


def frame_where(frame: FrameType) -> str:
    """``function (file.py:line)``: where a frame is, as a report names it."""
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


# -- naming what holds an object, through the collector's referrers ---------------------------------------


_DICT_OF = ".__dict__"


def _module_dicts() -> dict[int, str]:
    return {id(module.__dict__): name for name, module in list(sys.modules.items()) if isinstance(module, ModuleType)}


def _own_frame(obj: object) -> bool:
    return isinstance(obj, FrameType) and os.path.abspath(obj.f_code.co_filename) in _THIS_FILES


def _links(holder: object, target: object, module_dicts: Mapping[int, str]) -> list[tuple[str, bool]]:
    """How ``holder`` refers to ``target``: ``(text, final)`` pairs, final texts complete names, others accessors."""
    if isinstance(holder, dict):
        module = module_dicts.get(id(holder))
        keys = [key for key, value in list(holder.items()) if value is target]
        return [(f"{module}.{key}", True) if module is not None else (f"[{key!r}]", False) for key in keys]
    if isinstance(holder, (list, tuple)):
        return [(f"[{index}]", False) for index, value in enumerate(holder) if value is target]
    if isinstance(holder, FrameType):
        local_vars = [var for var, value in frame_locals(holder).items() if value is target]
        return [(f"local '{var}' in {frame_where(holder)}", True) for var in local_vars]
    if isinstance(holder, CellType):
        return [("a closure variable", True)]
    if isinstance(holder, (set, frozenset)):
        return [("{…}", False)]
    if getattr(holder, "__dict__", None) is target:
        return [(_DICT_OF, False)]
    with contextlib.suppress(TypeError):  # an object without a __dict__
        return [(f".{key}", False) for key, value in vars(holder).items() if value is target][:1]
    return []


def _container_name(container: object) -> str:
    name = type(container).__name__
    return "saved for backward" if name == "Released" else name


def referrer_names(objects: Iterable[object], *, ignore: Iterable[object] = (), thaw: bool = True) -> dict[int, str]:
    """A name for what holds each of ``objects``, by ``id()``; objects nothing names are left out.

    Two ``gc.get_referrers`` passes in all look two levels up (``tests.test_x.CACHE[3]``, an attribute, a frame's
    local), skipping ``ignore``. ``thaw`` gives the plugin's frozen objects back to the collector for good, so their
    references are seen too; without it they are found only as module-level names.
    """
    targets = list(objects)
    if not targets:
        return {}
    if thaw:  # the referrers of a test's tensors may be among the objects frozen before the first test
        collector.thaw()
    ignore = [objects, *ignore]
    module_dicts = _module_dicts()
    names: dict[int, str] = {}
    pending: dict[int, list[tuple[int, str]]] = {}  # id(container) -> [(id(target), accessor)]
    containers: list[object] = []
    ignored = {id(obj) for obj in ignore} | {id(targets), id(containers)}
    referrers = gcfunctions.get_referrers(*targets)
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
    # an object whose attribute holds a target is one level further up, through its materialised __dict__
    owners: list[object] = []
    weak: list[tuple[int, str]] = []  # names through an anonymous container: kept if nothing better
    referrers = gcfunctions.get_referrers(*containers)
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
    # a module-level name names a holder better than an anonymous dict or list that also refers to it
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
    """Name what a module-level name holds directly, for containers the collector did not name (frozen globals)."""
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
