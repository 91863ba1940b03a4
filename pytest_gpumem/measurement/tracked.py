"""The modules and optimizers a recording tracks: categories, Ψ, and the hooks that mark the training step's phases
(torch's global ones, filtered by id, so nothing is stored on a user's module or optimizer)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from pytest_gpumem.budgets.formulas import tracked_psi
from pytest_gpumem.measurement.engines.base import Engine

__all__ = ["PhaseHost", "Tracked", "check_trackable"]

#: torch's warning about global module hooks at a compiled module's call (torch._dynamo.eval_frame)
_COMPILED_MODULE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def check_trackable(obj: Any) -> None:
    """Raise naming the type of ``obj`` unless ``gpumem.track()`` takes it (a module or an optimizer)."""
    if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        raise TypeError(
            f"gpumem.track() takes torch.nn.Module and torch.optim.Optimizer objects, got {type(obj).__name__}"
        )


class PhaseHost(Protocol):
    """What the tracked objects' hooks read and set (the recorder)."""

    engine: Engine
    active: bool
    phase: str | None
    external_phases: bool  #: a framework adapter marks the phases, not these hooks

    def set_phase(self, phase: str | None) -> None: ...


class Tracked:
    """The tracked modules and optimizers of one recording, and their hooks (removed by :meth:`clear`)."""

    def __init__(self, recorder: PhaseHost) -> None:
        self.recorder = recorder
        self.engine = recorder.engine
        self.objects: list[Any] = []
        self._modules: set[int] = set()
        self._optimizers: set[int] = set()
        self._handles: list[Any] = []
        self._depth = 0  # nested calls of tracked modules: the outermost one's start and end mark the forward phase
        #: the warnings filter that ignores torch's warning about global module hooks, while inserted
        self._quiet: tuple[Any, ...] | None = None

    def quiet(self) -> None:
        """Ignore torch's warning about global module hooks while they are installed (again at each span)."""
        if not self._modules or self._quiet in warnings.filters:  # None never is
            return
        warnings.filterwarnings("ignore", message=_COMPILED_MODULE_WARNING, category=UserWarning)
        self._quiet = warnings.filters[0]

    def _unquiet(self) -> None:
        quiet, self._quiet = self._quiet, None
        if quiet in warnings.filters:
            warnings.filters.remove(quiet)  # type: ignore[attr-defined]  # a list at run time
            mutated = getattr(warnings, "_filters_mutated", None)
            if mutated is not None:
                mutated()

    def add(self, *objects: Any) -> None:
        """Track modules and optimizers (again: harmless)."""
        for obj in objects:
            check_trackable(obj)
            if id(obj) in self._modules or id(obj) in self._optimizers:
                continue
            self.objects.append(obj)
            if isinstance(obj, torch.nn.Module):
                if not self._modules:
                    self._handles.append(register_module_forward_pre_hook(self._forward_pre))
                    self._handles.append(register_module_forward_hook(self._forward_post))
                self._modules.add(id(obj))
                self.quiet()
                if self.engine.categories is not None:
                    for param in obj.parameters():
                        if param.requires_grad:
                            self._handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))
            else:
                if not self._optimizers:
                    self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
                    self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))
                self._optimizers.add(id(obj))

    def clear(self) -> None:
        """Remove every hook and let go of the tracked objects."""
        self._unquiet()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.objects.clear()
        self._modules.clear()
        self._optimizers.clear()

    @property
    def psi(self) -> int | None:
        """Trainable parameter count of the tracked objects; None when nothing is tracked."""
        return tracked_psi(self.objects)

    def classify(self, objects: Iterable[Any] | None = None) -> None:
        """Give the tensors of the tracked objects (or of ``objects``) their categories."""
        categories = self.engine.categories
        if categories is None:
            return
        for obj in self.objects if objects is None else objects:
            if isinstance(obj, torch.nn.Module):
                params = list(obj.parameters())
            else:
                params = [p for group in obj.param_groups for p in group["params"]]
            categories.register(params, "parameters")
            categories.register([p.grad for p in params if p.grad is not None], "gradients")
            if isinstance(obj, torch.optim.Optimizer):
                # a sharding wrapper (ZeroRedundancyOptimizer) keeps the rank's state in the optimizer it wraps
                inner = getattr(obj, "optim", None)
                holders = [obj, inner] if isinstance(inner, torch.optim.Optimizer) else [obj]
                categories.register(
                    [
                        value
                        for holder in holders
                        for state in holder.state.values()
                        for value in state.values()
                        if isinstance(value, torch.Tensor)
                    ],
                    "optimizer_state",
                )

    # -- torch's hooks, filtered by id --------------------------------------------------

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        if id(module) not in self._modules:
            return
        if self._depth == 0 and not self.recorder.external_phases:
            self.recorder.set_phase("forward")
        self._depth += 1

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if id(module) not in self._modules:
            return
        self._depth -= 1
        if self._depth == 0 and self.recorder.active and torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.grad_fn is not None:
                    self._handles.append(tensor.grad_fn.register_prehook(self._backward_reached))

    def _backward_reached(self, grad_outputs: Any) -> None:
        if self.recorder.phase != "optimizer" and not self.recorder.external_phases:
            self.recorder.set_phase("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        if self.recorder.phase == "backward":
            self.recorder.set_phase(None)

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self._optimizers and not self.recorder.external_phases:
            self.recorder.set_phase("optimizer")

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self._optimizers:
            self.classify((optimizer,))
            if not self.recorder.external_phases:
                self.recorder.set_phase(None)

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self.recorder.active and param.grad is not None and self.engine.categories is not None:
            self.engine.categories.register((param.grad,), "gradients")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _tensors(getattr(value, name, None))
