"""The storage tracker's dispatch mode: every operator's outputs, seen as they are made."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
)

try:
    from torch._ops import OpOverload
except ImportError:  # pragma: no cover - torch moved it
    OpOverload = None  # type: ignore[assignment,misc]

try:  # TorchDynamo's frame hook, a C function of torch itself: importing it does not import TorchDynamo
    from torch._C._dynamo.eval_frame import set_eval_frame
except ImportError:  # pragma: no cover - torch moved it: the mode keeps torch's own wrapper
    set_eval_frame = None  # type: ignore[assignment]

from pytest_gpumem.measurement.engines.compiled import skipped_frame
from pytest_gpumem.measurement.engines.sizing import Limited, refuse_early
from pytest_gpumem.measurement.engines.storages import (
    FRESH,
    operator_of,
)


class Dispatched(Limited, Protocol):
    """What a storage tracker offers its dispatch mode."""

    _operators: dict[int, tuple[Callable[..., Any], int, Callable[[tuple[Any, ...]], None] | None, Any]]
    operator_hooks: dict[str, Callable[[tuple[Any, ...]], None]]
    _lock: threading.RLock
    compiled_frames: list[tuple[bool, str]]
    skipped_codes: set[Any]

    def _output(self, out: torch.Tensor, fresh: bool) -> None: ...

    def _fresh(self, out: torch.Tensor) -> None: ...

    def _outputs(self, out: Any, fresh: bool) -> None: ...


__all__ = ["TrackerMode"]

_TENSOR = torch.Tensor


class TrackerMode(TorchDispatchMode):
    """Sees each operator's outputs and reports new storages to the tracker (once per operator)."""

    def __init__(self, tracker: Dispatched) -> None:
        super().__init__()
        self.tracker = tracker
        self.operators = tracker._operators
        self.hooks = tracker.operator_hooks
        # bound once: this runs once per operator
        self.acquire, self.release = tracker._lock.acquire, tracker._lock.release
        self.output, self.outputs, self.fresh = tracker._output, tracker._outputs, tracker._fresh
        self.armed = False  #: on the stack: from then on only TorchDynamo asks :meth:`ignore_compile_internals`

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: :meth:`__torch_dispatch__` turns TorchDynamo's frame hook off itself, without importing it."""
        return set_eval_frame is None

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        """False: TorchDynamo runs a compiled frame eagerly, which the tracker sees, and the frame is reported."""
        if self.armed:  # TorchDynamo asks: it is imported
            _never_traced()
            frame = skipped_frame()
            if frame is not None:
                code, library, text = frame
                self.tracker.compiled_frames.append((library, text))
                if code is not None:
                    self.tracker.skipped_codes.add(code)
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # TorchDynamo's frame hook must not compile the mode's own frames (see _should_skip_dynamo)
        prior = set_eval_frame(None) if set_eval_frame is not None else None
        try:
            # by identity (an operator's __hash__ is Python); the entry holds the operator, so its id is not reused
            operator = self.operators.get(id(func))
            if operator is None:
                hook = self.hooks.get(func._overloadpacket.__name__)
                operator = self.operators[id(func)] = (*operator_of(func), hook, func)
            call, kind, hook, _ = operator
            if kind == FRESH and self.tracker.limit is not None:
                refuse_early(self.tracker, func, args, kwargs)
            if hook is not None:
                self.acquire()
                try:
                    hook(args)
                finally:
                    self.release()
            out = call(*args, **kwargs) if kwargs else call(*args)
            if kind:
                self.acquire()
                try:
                    if type(out) is _TENSOR:
                        if kind == FRESH:
                            self.fresh(out)
                        else:
                            self.output(out, False)
                    elif isinstance(out, _TENSOR):
                        self.output(out, kind == FRESH)
                    else:
                        self.outputs(out, kind == FRESH)
                finally:
                    self.release()
            return out
        finally:
            if prior is not None:
                set_eval_frame(prior)


_untraced = False


def _never_traced() -> None:
    """Put the package among the folders TorchDynamo never traces into (its warning would fail a strict suite)."""
    global _untraced
    if not _untraced:
        _untraced = True
        from torch._dynamo import trace_rules

        trace_rules.add("pytest_gpumem")
