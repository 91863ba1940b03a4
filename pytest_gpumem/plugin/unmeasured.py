"""What the ``gpumem`` fixture records into while pytest-gpumem is disabled (``--gpumem-disable``):
:class:`Unrecorded`, a recorder that measures nothing, and :class:`Unmeasured`, the stand-in for
figures. The test's code runs; a test that reads a figure is skipped at that line, with a reason
that says so: the off switch never fails a test that passes with the plugin on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from pytest_gpumem.budgets.formulas import tracked_psi
from pytest_gpumem.judge.limits import parse_span_limits

if TYPE_CHECKING:
    from pytest_gpumem.measurement.recorder import Span

__all__ = ["NullEngine", "Unmeasured", "Unrecorded"]


class Unmeasured:
    """Stands for the figures of a span in a run where nothing is measured: reading one skips the
    test with a reason that says so (never a 0 that a test could compare)."""

    def __init__(self, what: str, name: str | None = None) -> None:
        self._what = what
        #: the span's name (``gpumem.spans`` lists the spans a test opened, unmeasured)
        self.name = name

    def __getattr__(self, name: str) -> Any:
        __tracebackhide__ = True
        if name.startswith("__"):  # copy, pickle and inspection probe for these: they are not figures
            raise AttributeError(name)
        import pytest

        pytest.skip(
            f"{self._what}.{name}: nothing is measured while pytest-gpumem is disabled "
            "(--gpumem-disable or PYTEST_GPUMEM_DISABLE): a test that reads figures is skipped there"
        )

    def __repr__(self) -> str:
        return f"<{self._what}: not measured (pytest-gpumem is disabled)>"


class _UnmeasuredSpan(Unmeasured):
    """A ``with gpumem.measure(name)`` block that measures nothing."""

    def __enter__(self) -> _UnmeasuredSpan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    @property
    def measurement(self) -> Unmeasured:
        return Unmeasured(self._what, self.name)


@dataclass(frozen=True)
class NullEngine:
    """The engine of a test that nothing measures: its device, and no GPU predicted."""

    device: torch.device
    predicts: str | None = None


class Unrecorded:
    """The null :class:`~pytest_gpumem.measurement.recorder.Recorder`: what the fixture reads of a
    recorder, with nothing measured. It tracks objects (Ψ and budgets are theory) and keeps the
    spans a test opens as :class:`Unmeasured` stand-ins; span names are not checked."""

    active = True  # measure() blocks run anywhere
    fake = False
    sites = None
    span_names: tuple[str, ...] = ()

    def __init__(self, device: torch.device) -> None:
        self.engine = NullEngine(device)
        self.tracked: list[Any] = []
        self.spans: list[Span] = []  # stand-ins, read as the recorder's spans are

    def track(self, *objects: Any) -> None:
        for obj in objects:
            if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                raise TypeError(
                    f"gpumem.track() takes torch.nn.Module and torch.optim.Optimizer objects, got {type(obj).__name__}"
                )
            if all(obj is not seen for seen in self.tracked):
                self.tracked.append(obj)

    @property
    def psi(self) -> int | None:
        return tracked_psi(self.tracked)

    def mark_phase(self, phase: str | None) -> None:
        return None

    def span(self, name: str, **limits: Any) -> Span:
        parse_span_limits(name, limits)  # bad limits are still errors
        span = cast("Span", _UnmeasuredSpan(f"gpumem.measure({name!r})", name))
        self.spans.append(span)
        return span
