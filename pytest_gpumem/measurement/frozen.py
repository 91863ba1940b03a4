"""The tensors among the garbage collector's frozen objects.

``gc.freeze()`` moves every object alive into a generation that collections and
``gc.get_objects()`` skip. The plugin's collector
(:class:`pytest_gpumem.measurement.collector.Collector`) freezes what exists before the
first measured test, so that each test's collections and scans cover only objects made
since, and freezes again between tests what the session imported or built since. The
tensors alive at each freeze are remembered here (weakly, a module's own through the module:
:func:`references`), so that a tracker made later and a census of live tensors still find
them without unfreezing. Naming what holds
a tensor needs the frozen objects themselves (:func:`~pytest_gpumem.measurement.collector.thaw`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pytest_gpumem.measurement import gcfunctions
from pytest_gpumem.measurement.engines.storages import Kinds, instances_among

__all__ = [
    "add",
    "forget",
    "give_back_theirs",
    "known",
    "references",
    "remember",
    "tensors",
    "theirs_given_back",
]

#: weak references to the frozen modules and to the frozen tensors no module holds
_refs: list[weakref.ref[Any]] = []
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


def _modules() -> Iterator[torch.nn.Module]:
    for ref in _refs:
        obj = ref()
        if obj is not None and _MODULE_KINDS[type(obj)]:
            yield obj


def references(objects: list[Any]) -> list[weakref.ref[Any]]:
    """Weak references to the modules among ``objects`` and to the tensors among them that no
    module holds (neither these nor one remembered), but for a tensor subclass without weak
    references.

    A module's parameters, their gradients and its buffers are reached through the module, never
    referenced weakly themselves: ``torch.utils.swap_tensors`` refuses a tensor with a weak
    reference, and torch swaps exactly those (``Module.to_empty`` and ``.to()`` of FSDP2's
    sharded or fake parameters, ``torch.__future__.set_swap_module_params_on_conversion``), so
    a weak reference of ours would make the user's code fail where it runs without the plugin.
    """
    found = instances_among(objects, _MODULE_OR_TENSOR_KINDS)  # one pass over many objects, then a few
    modules = [obj for obj in found if _MODULE_KINDS[type(obj)]]
    held = {id(tensor) for module in (*modules, *_modules()) for tensor in _held_by(module)}
    refs: list[weakref.ref[Any]] = [weakref.ref(module) for module in modules]
    for tensor in found:
        if _MODULE_KINDS[type(tensor)]:
            continue
        if id(tensor) in held:
            continue
        try:
            refs.append(weakref.ref(tensor))
        except TypeError:  # a tensor subclass without weak references
            continue
    return refs


def remember() -> None:
    """Remember every module and tensor the collector sees now (call just before ``gc.freeze()``)."""
    global _known
    _refs.clear()  # references() counts the tensors of the remembered modules as held: none yet
    _refs.extend(references(gcfunctions.get_objects()))
    _known = True


def add(found: Iterable[Any]) -> None:
    """Remember the modules and tensors among ``found`` not remembered yet (call just before a
    later ``gc.freeze()``)."""
    _refs[:] = [ref for ref in _refs if ref() is not None]
    known_ids = {id(ref()) for ref in _refs}
    _refs.extend(references([obj for obj in found if id(obj) not in known_ids]))


def forget() -> None:
    """The frozen objects went back to the collector (``gc.unfreeze()``): nothing to remember."""
    global _known
    _refs.clear()
    _known = False


def known() -> bool:
    """Whether the plugin froze objects and remembered their tensors, which :func:`tensors` yields
    (they may have been given back since: then the collector lists them too).

    Taken from the plugin's own flag, not ``gc.get_freeze_count()``: before Python 3.13 that
    walks every frozen object (about 25 ms with torch imported). If someone else unfreezes
    meanwhile, a scan lists those tensors twice (the collector's and these), which the
    tracker and the census count once.
    """
    return _known


def tensors() -> Iterator[torch.Tensor]:
    """The frozen tensors still alive (``gc.get_objects()`` does not list them): those remembered,
    and those the remembered modules hold now. A tensor may come more than once."""
    for ref in _refs:
        obj = ref()
        if obj is None:
            continue
        if _MODULE_KINDS[type(obj)]:
            yield from _held_by(obj)
        else:
            yield obj


def give_back_theirs() -> None:
    """Give back the objects someone else froze (a conftest's ``gc.freeze()``, an enclosing
    session's), for a census that must see every tensor: for good, since they cannot be told
    from what was made since. Noted, so that the run's collector may take over
    (:func:`theirs_given_back`)."""
    global _theirs_given_back
    gcfunctions.unfreeze()
    _theirs_given_back = True


def theirs_given_back() -> bool:
    """Whether :func:`give_back_theirs` gave objects back since the last call (and forget it)."""
    global _theirs_given_back
    given, _theirs_given_back = _theirs_given_back, False
    return given
