"""What the storage tracker keeps per storage and per window, and the words for what it missed."""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pytest_gpumem.units import format_size


@dataclass
class Window:
    """Highest allocated bytes since the window opened, the breakdown then, its event index and the saved peak."""

    peak: int
    breakdown: tuple[int, ...]
    event: int = 0
    saved_peak: int = 0
    #: set when the window is read later (see :meth:`AllocationTracker.take_window`)
    pending: int | None = None
    #: bytes by site at the peak, while sites are recorded (:meth:`SiteRecorder.snapshot`)
    sites: Any = None


class Entry(weakref.ref):  # type: ignore[type-arg]
    """One tracked storage: a weak reference to it (one object per allocation), with its counted bytes and category;
    ``prior`` is its category before it was saved for backward."""

    __slots__ = ("category", "key", "moved", "nbytes", "prior", "saves", "site")
    key: int
    nbytes: int
    category: int
    moved: int
    saves: int
    prior: int


class Block:
    """A tracked allocation no storage stands for (a profiler event, a predicted workspace), alive until freed."""

    __slots__ = Entry.__slots__  # set by StorageTracker._insert, as for the tracker's entries
    key: int
    nbytes: int
    category: int
    moved: int
    saves: int
    prior: int

    def __call__(self) -> Block:
        return self


def unseen_note(nbytes: int) -> str:
    """The note on figures that missed ``nbytes`` found alive later by a scan."""
    return (
        f"{format_size(nbytes)} alive at the end were allocated where the tensor tracker could not see them "
        "(on a thread started before the measurement, or outside PyTorch's operators): retained counts them, "
        "peak and allocated may miss them (not seen while they were made)"
    )


#: Tensor types that hold their own storage: every other tensor type is looked into (local_tensors).
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor, without importing their module."""
    module = sys.modules.get("torch._subclasses.fake_tensor")
    return module is not None and isinstance(tensor, module.FakeTensor)


def fakes_counted() -> bool:
    """Whether fake tensors are the memory counted now: a fake-tensor mode is active (outside, one is a shape)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class Kinds(dict):  # type: ignore[type-arg]
    """type → whether it is a subclass of ``base``, filled as types are met; looked up by ``map``, in C."""

    def __init__(self, base: type | tuple[type, ...]) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, kind: type) -> bool:
        found = self[kind] = issubclass(kind, self.base)
        return found


_TENSOR_KINDS = Kinds(torch.Tensor)


def instances_among(objects: list[Any], kinds: Kinds) -> list[Any]:
    """The instances of ``kinds.base`` among ``objects`` in order, by type in C (``isinstance`` reads ``__class__``)."""
    return list(itertools.compress(objects, map(kinds.__getitem__, map(type, objects))))


def tensors_among(objects: list[Any]) -> list[Any]:
    """The tensors (of any tensor type) among ``objects``, in order (:func:`instances_among`)."""
    return instances_among(objects, _TENSOR_KINDS)


def local_tensors(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors a wrapper subclass (a ``DTensor``) holds, which hold its bytes; None for a plain one."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return None
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    found: list[torch.Tensor] = []
    for name in names:
        inner = getattr(tensor, name)
        if not isinstance(inner, torch.Tensor):  # a DeviceMesh, a spec: not memory
            continue
        nested = local_tensors(inner) if type(inner) not in _PLAIN else None
        found.extend(nested if nested is not None else [inner])
    return found


def inner_tensors(tensor: torch.Tensor, counts_fakes: bool) -> list[torch.Tensor] | None:
    """What holds the bytes of a tensor that is not plain (nothing for an uncounted fake); None for a plain one."""
    if not counts_fakes and is_fake(tensor):
        return []
    return local_tensors(tensor)


def sort_scanned(tensors: Iterable[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """The parameters, their gradients and the other tensors among ``tensors`` (not fakes' constants)."""
    params: list[Any] = []
    grads: list[Any] = []
    others: list[Any] = []
    parameter_type = torch.nn.Parameter
    copies: set[int] = set()
    for tensor in tensors:
        kind = type(tensor)
        if kind is parameter_type:
            params.append(tensor)
            if tensor.grad is not None:
                grads.append(tensor.grad)
            continue
        others.append(tensor)
        if kind is not torch.Tensor and is_fake(tensor):
            constant = getattr(tensor, "constant", None)
            if isinstance(constant, torch.Tensor):
                copies.add(id(constant))
    if copies:
        others = [tensor for tensor in others if id(tensor) not in copies]
    return params, grads, others


class OutOfMemory(torch.OutOfMemoryError):
    """Raised by the tracker when an emulated device limit would be exceeded."""


class StorageObserver(Protocol):
    """Follows a tracker's count block by block (keys are storages' addresses, or a block's own)."""

    def allocated(self, key: int, nbytes: int) -> None:
        """A block of ``nbytes`` is counted under ``key``."""

    def freed(self, key: int) -> None:
        """The block under ``key`` is freed."""

    def resized(self, key: int, nbytes: int) -> None:
        """The block under ``key`` holds ``nbytes`` now (a storage resized in place)."""
