"""The ``gpumem`` fixture while pytest-gpumem is disabled (``--gpumem-disable``): the test's code
runs, nothing is measured, and a test that reads a figure is skipped at that line, with a reason
that says so: the off switch never fails a test that passes with the plugin on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pytest_gpumem.budgets.formulas import Budget, tracked_psi
from pytest_gpumem.diagnose.distributed import DEFAULT_TIMEOUT, RankContext
from pytest_gpumem.diagnose.microbatch import Plan
from pytest_gpumem.judge.limits import check_span_name, parse_span_limits
from pytest_gpumem.measurement.steps import train_step_span
from pytest_gpumem.plugin.fixture import GpumemFixture, check_phase, distributed_ranks, tracked_budget

__all__ = ["Unmeasured", "UnmeasuredGpuMem"]


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


class UnmeasuredGpuMem(GpumemFixture):
    """The ``gpumem`` fixture while pytest-gpumem is disabled (``--gpumem-disable``).

    The test runs as it would with the plugin on, on the same device, with nothing measured:
    ``track()``, ``measure()`` blocks and ``train_step()`` run the code, Ψ and ``budget()``
    are computed (they are theory, not measurement), ``distributed()`` runs its ranks. A
    figure read from a span or a step skips the test there, as ``max_microbatch()`` and
    ``plan_accumulation()``, which search by measuring, do.
    """

    def __init__(self, device: torch.device, nodeid: str) -> None:
        self.device = device
        self.nodeid = nodeid
        self._tracked: list[Any] = []
        self._spans: list[Unmeasured] = []

    def track(self, *objects: Any) -> None:
        for obj in objects:
            if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                raise TypeError(
                    f"gpumem.track() takes torch.nn.Module and torch.optim.Optimizer objects, got {type(obj).__name__}"
                )
            if all(obj is not seen for seen in self._tracked):
                self._tracked.append(obj)

    def measure(self, name: str, **limits: Any) -> _UnmeasuredSpan:
        parse_span_limits(check_span_name(name), limits)  # bad limits are still errors
        span = _UnmeasuredSpan(f"gpumem.measure({name!r})", name)
        self._spans.append(span.measurement)
        return span

    def mark_phase(self, phase: str | None) -> None:
        check_phase(self.nodeid, phase)

    @property
    def psi(self) -> int | None:
        return tracked_psi(self._tracked)

    def budget(
        self,
        precision: str = "fp32",
        *,
        optimizer: torch.optim.Optimizer | str | None = None,
        zero_stage: int = 0,
        world_size: int = 1,
    ) -> Budget:
        return tracked_budget(self.nodeid, self._tracked, self.device, precision, optimizer, zero_stage, world_size)

    def distributed(
        self,
        fn: Callable[[int, RankContext], Any],
        world_size: int = 2,
        *,
        backend: str | None = None,
        device: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        predict: str | None = None,
        fake: bool | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Unmeasured]:
        __tracebackhide__ = True
        if predict is not None or fake:
            import pytest

            pytest.skip(
                "gpumem.distributed(predict=...) predicts by measuring: skipped while pytest-gpumem is disabled"
            )
        where = device or ("cuda" if self.device.type == "cuda" else "cpu")
        distributed_ranks(self.nodeid, fn, world_size, backend=backend, device=where, timeout=timeout)
        return [Unmeasured(f"gpumem.distributed(...)[{rank}]") for rank in range(world_size)]

    def max_microbatch(
        self,
        step: Callable[[int], Any],
        *,
        start: int = 1,
        limit: int | str | None = None,
        upper: int | None = None,
        cleanup: Callable[[], Any] | None = None,
    ) -> int:
        import pytest

        pytest.skip("gpumem.max_microbatch() searches by measuring: skipped while pytest-gpumem is disabled")

    def plan_accumulation(self, global_batch: int, step: Callable[[int], Any], **kwargs: Any) -> Plan:
        import pytest

        pytest.skip("gpumem.plan_accumulation() searches by measuring: skipped while pytest-gpumem is disabled")

    @property
    def spans(self) -> list[Unmeasured]:
        """The spans opened so far, unmeasured: their ``name`` reads, their figures raise."""
        return list(self._spans)

    def train_step(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        amp: str | None = None,
        warmup: int = 1,
        name: str = "step",
    ) -> Unmeasured:
        """The warm-up steps and the step, run as :meth:`GpuMem.train_step` runs them, unmeasured."""
        __tracebackhide__ = True
        train_step_span(self, model, optimizer, batch, loss_fn, amp=amp, warmup=warmup, name=name)
        return Unmeasured(f"gpumem.train_step(name={name!r})", name)
