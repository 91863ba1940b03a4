"""Fake mode: a prediction with no tensor data (see docs/will-it-fit.md); :class:`FakeKernels` gives reduced losses
the storage their kernels keep, and small CPU integer ranges their values (a device mesh reads its rank map)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._pytree import tree_leaves

from pytest_gpumem.data.figures import notify
from pytest_gpumem.measurement.engines.compiled import PLUGIN_ROOT, TORCH_ROOT

__all__ = ["FakeKernels", "FakeModeError", "FakeTensorsDiffer", "fake_mode", "real_bookkeeping", "warn_tracing_paths"]

_aten = torch.ops.aten

#: operator → index of its ``reduction`` argument: kernels whose reduced output keeps the unreduced loss's storage
REDUCED_IN_PLACE: dict[Any, int] = {
    _aten.mse_loss.default: 2,
    _aten.smooth_l1_loss.default: 2,
    _aten.soft_margin_loss.default: 2,
    _aten.binary_cross_entropy.default: 3,
}


#: the largest integer range that keeps its values on fake tensors (a device mesh of this many ranks)
CONSTANT_RANGE = 1 << 16

_RANGES = frozenset({_aten.arange.default, _aten.arange.start, _aten.arange.start_step})

_INTEGERS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})

#: depth of :func:`real_bookkeeping` blocks running now
_bookkeeping = 0


@contextlib.contextmanager
def real_bookkeeping() -> Iterator[None]:
    """Run the block's integer CPU bookkeeping on real tensors (see the module's docstring)."""
    global _bookkeeping
    _bookkeeping += 1
    try:
        yield
    finally:
        _bookkeeping -= 1


def _real_bookkeeping(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func`` runs on real tensors inside :func:`real_bookkeeping`."""
    if func is _aten.empty.memory_format:
        device = (kwargs or {}).get("device")
        return (kwargs or {}).get("dtype") in _INTEGERS and (device is None or torch.device(device).type == "cpu")
    tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    return bool(tensors) and not any(isinstance(tensor, FakeTensor) for tensor in tensors)


class FakeModeError(RuntimeError):
    """The measured code cannot run on fake tensors (it needs a value, or a real tensor reached it)."""


class FakeTensorsDiffer(Warning):
    """Code measured on fake tensors may have run another path than on real ones (a library that checks for them)."""


#: libraries that check for fake tensors and run another path on them, and what changes
TRACING_PATHS = {
    "transformers": "it takes its tracing path on fake tensors (a materialised causal mask, "
    "repeat_kv for grouped-query attention), so the figures can differ from the eager run's",
}


def warn_tracing_paths(objects: Any, name: str) -> None:
    """Warn when a tracked module of ``objects`` comes from a library of :data:`TRACING_PATHS`."""
    for library, why in TRACING_PATHS.items():
        kinds = sorted(
            {
                type(obj).__name__
                for obj in objects
                if isinstance(obj, torch.nn.Module) and type(obj).__module__.split(".")[0] == library
            }
        )
        if kinds:
            notify(
                FakeTensorsDiffer(
                    f"{name}: {', '.join(kinds)} ran on fake tensors and {library} checks for them: {why} "
                    "(docs/will-it-fit.md)"
                ),
                stacklevel=3,
            )


def user_line() -> str:
    """``file:line`` of the innermost frame that is neither torch's nor the plugin's (the user's code)."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename  # "<string>": code made by exec, nobody's line
        if not name.startswith("<") and not os.path.abspath(name).startswith((TORCH_ROOT, PLUGIN_ROOT)):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "an unknown line"


class FakeKernels(FakeTensorMode):
    """``FakeTensorMode`` with the storage sizes of the kernels it stands for, and errors that name the user's line."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _bookkeeping and _real_bookkeeping(func, args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **(kwargs or {}))
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise FakeModeError(
                f"fake mode cannot run {user_line()}: {func} needs the values of a tensor (.item(), "
                "nonzero(), a shape that depends on data), and a fake tensor has none; measure this step "
                "without fake=True, or keep the value out of the measured code"
            ) from exc
        except AssertionError as exc:
            if "convert all Tensors to FakeTensors" not in str(exc):
                raise
            raise FakeModeError(
                f"fake mode cannot run {user_line()}: {func} got a real tensor; under fake=True the model, "
                "the optimizer and the batch must be made inside the measured code (a tensor made before "
                "it, or by a fixture, holds real data)"
            ) from exc
        if func in _RANGES and isinstance(out, torch.Tensor):
            return self._constant_range(func, args, kwargs, out)
        index = REDUCED_IN_PLACE.get(func)
        if index is not None:
            reduction = args[index] if len(args) > index else (kwargs or {}).get("reduction", 1)
            if reduction and isinstance(out, torch.Tensor):
                shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
                out.untyped_storage().resize_(shape.numel() * out.element_size())
        return out

    def may_turn_const(self, t: torch.Tensor) -> bool:
        """Besides one-element constants, small integer and boolean CPU tensors computed from constants keep values."""
        if super().may_turn_const(t):
            return True
        return not self.is_our_fake(t) and t.layout == torch.strided and _small_integers(t)

    def _constant_range(self, func: Any, args: Any, kwargs: Any, out: torch.Tensor) -> torch.Tensor:
        """``out`` with its values when it is a small integer range on the CPU (see the module's docstring)."""
        if not _small_integers(out):
            return out
        with unset_fake_temporarily():
            real = func(*args, **(kwargs or {}))
        return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)


def _small_integers(t: torch.Tensor) -> bool:
    """Whether ``t`` is an integer or boolean CPU tensor small enough to keep its values on fake tensors."""
    return t.device.type == "cpu" and not (t.is_floating_point() or t.is_complex()) and t.numel() <= CONSTANT_RANGE


def fake_mode() -> FakeKernels:
    """A mode to run a block on fake tensors in (see the module's docstring)."""
    return FakeKernels()
