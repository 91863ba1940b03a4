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
    """Sees each operator's outputs and reports new storages to the tracker.

    This runs once per operator: views and in-place operators (a third of a
    training step's operators) return at the first dictionary lookup.
    """

    def __init__(self, tracker: Dispatched) -> None:
        super().__init__()
        self.tracker = tracker
        self.operators = tracker._operators
        self.hooks = tracker.operator_hooks
        # bound once (the lock's methods too: cheaper than a with-statement): this runs once per operator
        self.acquire, self.release = tracker._lock.acquire, tracker._lock.release
        self.output, self.outputs, self.fresh = tracker._output, tracker._outputs, tracker._fresh
        #: set once the mode is on the stack: from then on only TorchDynamo asks
        #: :meth:`ignore_compile_internals` (the mode's own ``__enter__`` asks it first)
        self.armed = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch would wrap ``__torch_dispatch__`` in ``torch._dynamo.disable``, so that
        TorchDynamo never compiles the mode's own frames. The wrapper imports TorchDynamo at the
        first operator (which a suite that never compiles does not pay otherwise) and adds three
        Python frames per operator; :meth:`__torch_dispatch__` does what it does, turning
        TorchDynamo's frame hook off while it runs, with one C call (benchmarks/README.md)."""
        return set_eval_frame is None

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        """TorchDynamo asks every dispatch mode on the stack this before it compiles or runs a
        ``torch.compile``'d frame; False makes it run the frame eagerly, operator by operator,
        which is what the tracker sees. True would let compiled code run unseen (Inductor's
        kernels allocate their buffers outside the dispatcher), so the answer stays False and
        the skipped frame is reported instead: figures of the eager program must never pass
        for figures of the compiled one in silence."""
        if self.armed:  # TorchDynamo asks (the mode's own __enter__ asked first): it is imported
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
        # TorchDynamo's frame hook, set while a torch.compile'd function runs, must not compile the
        # mode's own frames (nor an operator's Python kernel): off while it works, as the wrapper
        # torch puts around other modes does (see _should_skip_dynamo)
        prior = set_eval_frame(None) if set_eval_frame is not None else None
        try:
            # by identity: an operator's own __hash__ is a Python method; the entry holds the
            # operator, so its identity is not reused while the table has it
            operator = self.operators.get(id(func))
            if operator is None:
                hook = self.hooks.get(func._overloadpacket.__name__)
                operator = self.operators[id(func)] = (*operator_of(func), hook, func)
            call, kind, hook, _ = operator
            if kind == FRESH and self.tracker.limit is not None:  # refused before the host allocates
                refuse_early(self.tracker, func, args, kwargs)
            if hook is not None:
                self.acquire()
                try:
                    hook(args)
                finally:
                    self.release()
            out = call(*args, **kwargs) if kwargs else call(*args)
            if kind:
                self.acquire()  # one count for every thread the tracker watches
                try:
                    if type(out) is _TENSOR:
                        if kind == FRESH:
                            self.fresh(out)  # the common case: one call
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
    """Put the package among the folders TorchDynamo never traces into (once, as it starts to
    compile: it is imported by then). Tracing a compiled frame under the tracker would otherwise
    inline this mode's ``__torch_dispatch__`` and warn that it cannot trace its frame-hook call: a
    ``UserWarning`` that a suite with ``filterwarnings = error`` would see as a failure."""
    global _untraced
    if not _untraced:
        _untraced = True
        from torch._dynamo import trace_rules

        trace_rules.add("pytest_gpumem")
