"""The tensors among the garbage collector's frozen objects.

``gc.freeze()`` moves every object alive into a generation that collections and
``gc.get_objects()`` skip. The plugin's collector
(:class:`pytest_gpumem.measurement.collector.Collector`) freezes what exists before the
first measured test, so that each test's collections and scans cover only objects made
since, and freezes again between tests what the session imported or built since. The
tensors alive at each freeze are remembered here (weakly), so that a tracker made later
and a census of live tensors still find them without unfreezing. Naming what holds
a tensor needs the frozen objects themselves (:func:`thaw`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Iterator

import torch

from pytest_gpumem.measurement.engines.storages import tensors_among

__all__ = ["add", "forget", "known", "references", "remember", "tensors", "thaw"]

_tensors: list[weakref.ref[torch.Tensor]] = []
_known = False


def references(found: Iterable[torch.Tensor]) -> list[weakref.ref[torch.Tensor]]:
    """Weak references to the tensors of ``found``, but for a tensor subclass without weak references."""
    refs = []
    for tensor in found:
        try:
            refs.append(weakref.ref(tensor))
        except TypeError:  # a tensor subclass without weak references
            continue
    return refs


def remember() -> None:
    """Remember every tensor the collector sees now (call just before ``gc.freeze()``)."""
    global _known
    _tensors[:] = references(tensors_among(gc.get_objects()))
    _known = True


def add(found: Iterable[torch.Tensor]) -> None:
    """Remember the tensors among ``found`` not remembered yet (call just before a later ``gc.freeze()``)."""
    known_ids = {id(tensor) for tensor in tensors()}
    _tensors[:] = [ref for ref in _tensors if ref() is not None]
    _tensors.extend(references(obj for obj in found if id(obj) not in known_ids))


def forget() -> None:
    """The frozen objects went back to the collector (``gc.unfreeze()``): nothing to remember."""
    global _known
    _tensors.clear()
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
    """The frozen tensors still alive (``gc.get_objects()`` does not list them)."""
    for ref in _tensors:
        tensor = ref()
        if tensor is not None:
            yield tensor


def thaw() -> None:
    """Give the plugin's frozen objects back to the collector, so that ``gc.get_referrers``
    sees them (naming what holds a leaked tensor); only failures' reports need it. The
    running collector freezes again between tests (its :meth:`compact`); without one (objects
    remembered by hand), they are given back for good."""
    from pytest_gpumem.measurement.collector import running

    collector = running()
    if collector is not None:
        collector.give_back()
        return
    if known():
        gc.unfreeze()
    forget()
