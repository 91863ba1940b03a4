"""The tensors among the garbage collector's frozen objects, remembered weakly for the trackers (docs/figures.md)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pytest_gpumem.measurement import gcfunctions
from pytest_gpumem.measurement.engines.storages import Kinds, instances_among

__all__ = [
    "add",
    "adopt",
    "forget",
    "give_back_theirs",
    "known",
    "references",
    "remember",
    "tensors",
    "theirs_given_back",
]

_refs: list[weakref.ref[Any]] = []  #: weak references to the frozen modules and to the tensors no module holds
_known = False
_theirs_given_back = False
_MODULE_KINDS = Kinds(torch.nn.Module)
_MODULE_OR_TENSOR_KINDS = Kinds((torch.nn.Module, torch.Tensor))


def _held_by(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The tensors ``module`` holds itself: its parameters, their gradients and its buffers."""
    for param in getattr(module, "_parameters", {}).values():
        if param is not None:
            yield param
            if param.is_leaf and param.grad is not None:
                yield param.grad
    for buffer in getattr(module, "_buffers", {}).values():
        if buffer is not None:
            yield buffer


def _modules(refs: Iterable[weakref.ref[Any]] | None = None) -> Iterator[torch.nn.Module]:
    for ref in _refs if refs is None else refs:
        obj = ref()
        if obj is not None and _MODULE_KINDS[type(obj)]:
            yield obj


def references(objects: list[Any], remembered: list[weakref.ref[Any]] | None = None) -> list[weakref.ref[Any]]:
    """Weak references to the modules among ``objects`` and to the tensors no module holds (never a module's own),
    the modules of ``remembered`` (default: the plugin's) among the holders."""
    found = instances_among(objects, _MODULE_OR_TENSOR_KINDS)
    modules = [obj for obj in found if _MODULE_KINDS[type(obj)]]
    held = {id(tensor) for module in (*modules, *_modules(remembered)) for tensor in _held_by(module)}
    refs: list[weakref.ref[Any]] = [weakref.ref(module) for module in modules]
    for obj in found:
        if _MODULE_KINDS[type(obj)] or id(obj) in held:
            continue
        with contextlib.suppress(TypeError):  # a tensor subclass without weak references
            refs.append(weakref.ref(obj))
    return refs


def remember(objects: list[Any]) -> None:
    """Remember every module and tensor among ``objects`` (what the collector sees), just before ``gc.freeze()``."""
    adopt(references(objects))


def add(found: Iterable[Any]) -> None:
    """Remember the modules and tensors among ``found`` not remembered yet (just before a later ``gc.freeze()``)."""
    _refs[:] = [ref for ref in _refs if ref() is not None]
    known_ids = {id(ref()) for ref in _refs}
    _refs.extend(references([obj for obj in found if id(obj) not in known_ids]))


def adopt(refs: Iterable[weakref.ref[Any]]) -> None:
    """Remember ``refs`` (made by :func:`references` as someone else froze their objects) as the frozen
    modules and tensors, so that a census finds them without giving every frozen object back."""
    global _known
    _refs[:] = [ref for ref in refs if ref() is not None]
    _known = True


def forget() -> None:
    """The frozen objects went back to the collector (``gc.unfreeze()``): nothing to remember."""
    global _known
    _refs.clear()
    _known = False


def known() -> bool:
    """Whether the plugin froze objects and remembered their tensors (a flag: ``gc.get_freeze_count()`` walks them)."""
    return _known


def tensors() -> Iterator[torch.Tensor]:
    """The frozen tensors still alive, those the remembered modules hold included (a tensor may come twice)."""
    for ref in _refs:
        obj = ref()
        if obj is None:
            continue
        if _MODULE_KINDS[type(obj)]:
            yield from _held_by(obj)
        else:
            yield obj


def give_back_theirs() -> None:
    """Give back, for good, the objects someone else froze, for a census that must see every tensor."""
    global _theirs_given_back
    gcfunctions.unfreeze()
    _theirs_given_back = True


def theirs_given_back() -> bool:
    """Whether :func:`give_back_theirs` gave objects back since the last call."""
    global _theirs_given_back
    given, _theirs_given_back = _theirs_given_back, False
    return given
