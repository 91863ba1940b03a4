"""An emulated device limit refuses an allocation before the host pays for it, sized by the operator's meta kernel
(without one, or for data-dependent sizes, it is refused only after the kernel ran)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["output_storages"]

#: The most operator signatures :func:`output_storages` remembers (then it starts afresh).
CACHE_LIMIT = 8192

_UNKNOWN = object()
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
#: (id of the operator, its arguments' signatures) → the bytes of each storage it makes (torch's operators live on)
_cache: dict[Any, tuple[int, ...] | None] = {}
_returns_tensors: dict[int, bool] = {}


def output_storages(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[int, ...] | None:
    """The bytes of each storage ``func(*args, **kwargs)`` will make on ``device``, per its meta kernel."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return None  # fake tensors: the host allocates nothing
    if not _makes_tensors(func):
        return None
    try:
        scalars = not any(isinstance(value, torch.Tensor) for value in args)  # a factory's floats may be sizes
        named = (*kwargs, *_signature(kwargs.values(), scalars)) if kwargs else ()
        key = (id(func), _signature(args, scalars), named)
        cached = _cache.get(key, _UNKNOWN)
    except (TypeError, RuntimeError, _Unsized):
        return None
    if cached is not _UNKNOWN:
        return cached  # type: ignore[return-value]
    sizes = _run_meta(func, args, kwargs, device)
    if len(_cache) >= CACHE_LIMIT:
        _cache.clear()
    _cache[key] = sizes
    return sizes


class _Unsized(Exception):
    """An argument whose meta copy would not stand for it (a tensor subclass)."""


def _signature(values: Any, scalars: bool = True) -> tuple[Any, ...]:
    """What of an operator's arguments decides its outputs' sizes, hashable (a float by tensors is no size)."""
    parts: list[Any] = []
    for value in values:
        kind = type(value)
        if kind is _TENSOR or kind is _PARAMETER:
            parts.append((value.dtype, value.shape, value.stride(), value.device))
        elif kind is list or kind is tuple:
            parts.append(_signature(value))
        elif kind is float and not scalars:
            parts.append(float)
        elif isinstance(value, torch.Tensor):
            raise _Unsized
        else:
            parts.append(value)
    return tuple(parts)


def _makes_tensors(func: Any) -> bool:
    """Whether ``func`` returns tensors (the profiler's record-function operators return none)."""
    known = _returns_tensors.get(id(func))
    if known is None:
        try:
            known = any("Tensor" in str(result.type) for result in func._schema.returns)
        except AttributeError:
            known = False
        _returns_tensors[id(func)] = known
    return known


def _run_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> tuple[int, ...] | None:
    tensors = [value for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor)]
    where = kwargs.get("device")
    target = torch.device(where) if where is not None else tensors[0].device if tensors else torch.device("cpu")
    if target.type != device.type or (target.index or 0) != (device.index or 0):
        return ()  # made on another device: nothing this tracker counts
    if any(tensor.layout != torch.strided for tensor in tensors):
        return None
    meta: Callable[[Any], Any] = _meta_copy
    try:
        with torch._C._DisableTorchDispatch():  # the meta kernel itself: no dispatch mode sees it
            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    except Exception:  # no meta kernel, a size that depends on the data: counted after the kernel
        return None
    storages: dict[int, int] = {}
    for value in tree_flatten(out)[0]:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            storage = value.untyped_storage()
            storages[storage._cdata] = int(storage.nbytes())
    return tuple(storages.values())


def _meta_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value
