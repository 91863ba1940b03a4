"""Adapters for the training frameworks a test already uses (transformers, Lightning, accelerate).

Each tracks the model and optimizer the framework builds and measures each training step as a span; each imports its
framework only when imported itself, so the frameworks stay optional.
"""

from __future__ import annotations

from typing import Any

__all__ = ["unwrap"]


def unwrap(obj: Any) -> Any:
    """The torch object inside a framework's wrapper (accelerate's or Lightning's optimizer, DDP, a compiled module)."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = None
        if type(obj).__name__ in ("AcceleratedOptimizer", "LightningOptimizer"):
            inner = getattr(obj, "optimizer", None) or getattr(obj, "_optimizer", None)
        elif type(obj).__name__ in ("DistributedDataParallel", "DataParallel"):
            inner = getattr(obj, "module", None)
        elif type(obj).__name__ == "OptimizedModule":
            inner = getattr(obj, "_orig_mod", None)
        if inner is None:
            return obj
        obj = inner
    return obj


def run_of(gpumem: Any) -> Any:
    """What ``gpumem`` records into now (None unmeasured): a memory failure's second run reuses the fixtures' values, so
    a callback made in a fixture sees another recorder."""
    return getattr(gpumem, "recorder", None)


class StepSpans:
    """Opens a span ``step1``, ``step2``, ... (``prefix`` and the step's number) per training step, counted from 1 in
    each run of the test."""

    def __init__(self, gpumem: Any, prefix: str = "step") -> None:
        self.gpumem = gpumem
        self.prefix = prefix
        self.count = 0
        self._open: Any = None
        self._run: Any = run_of(gpumem)

    def begin(self) -> None:
        run = run_of(self.gpumem)
        if run is not self._run:  # a new run of the test: the last one's spans are its own
            self._run, self.count, self._open = run, 0, None
        if self._open is not None:  # a step that never ended (an exception the framework caught)
            self.end()
        self.count += 1
        self._open = self.gpumem.measure(f"{self.prefix}{self.count}")
        self._open.__enter__()

    def end(self) -> None:
        span, self._open = self._open, None
        if span is not None:
            span.__exit__(None, None, None)
