"""What the ``gpumem`` fixture gives a test (:class:`GpumemFixture`): a
:class:`~pytest_gpumem.plugin.measured.GpuMem` where the plugin measures, an
:class:`~pytest_gpumem.plugin.unmeasured.UnmeasuredGpuMem` where it is disabled; both implement
it, member for member. What the two share: :class:`NotMeasured`, :func:`check_phase`,
:func:`tracked_budget`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pytest_gpumem.budgets.formulas import Budget, model_states
from pytest_gpumem.diagnose.distributed import DEFAULT_TIMEOUT, DistributedError, run_ranks

if TYPE_CHECKING:
    from pytest_gpumem.data.figures import Measurement
    from pytest_gpumem.diagnose.distributed import RankContext
    from pytest_gpumem.diagnose.microbatch import Plan
    from pytest_gpumem.plugin.unmeasured import Unmeasured

__all__ = ["GpumemFixture", "NotMeasured", "check_phase", "distributed_ranks", "tracked_budget"]

#: What :meth:`GpumemFixture.mark_phase` takes.
PHASE_MARKS = (None, "forward", "backward", "optimizer")


class NotMeasured(RuntimeError):
    """A figure was read in a run where pytest-gpumem is disabled (``--gpumem-disable``)."""


class GpumemFixture(Protocol):
    """What the ``gpumem`` fixture gives a test, measured
    (:class:`~pytest_gpumem.plugin.measured.GpuMem`) or not
    (:class:`~pytest_gpumem.plugin.unmeasured.UnmeasuredGpuMem`): both implement every member
    with the same parameters and defaults. Figures are :class:`Measurement` objects where the
    plugin measures, :class:`~pytest_gpumem.plugin.unmeasured.Unmeasured` stand-ins (reading one
    raises :class:`NotMeasured`) where it is disabled. ``GpuMem`` documents each member."""

    device: torch.device
    nodeid: str

    def track(self, *objects: Any) -> None: ...

    def measure(self, name: str, **limits: Any) -> AbstractContextManager[Any]: ...

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
    ) -> Sequence[Measurement | Unmeasured]: ...

    def mark_phase(self, phase: str | None) -> None: ...

    @property
    def psi(self) -> int | None: ...

    def budget(
        self,
        precision: str = "fp32",
        *,
        optimizer: torch.optim.Optimizer | str | None = None,
        zero_stage: int = 0,
        world_size: int = 1,
    ) -> Budget: ...

    def max_microbatch(
        self,
        step: Callable[[int], Any],
        *,
        start: int = 1,
        limit: int | str | None = None,
        upper: int | None = None,
        cleanup: Callable[[], Any] | None = None,
    ) -> int: ...

    def plan_accumulation(self, global_batch: int, step: Callable[[int], Any], **kwargs: Any) -> Plan: ...

    @property
    def spans(self) -> Sequence[Measurement | Unmeasured]: ...

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
    ) -> Measurement | Unmeasured: ...


def check_phase(nodeid: str, phase: str | None) -> None:
    """Refuse what :meth:`GpumemFixture.mark_phase` does not take."""
    if phase not in PHASE_MARKS:
        raise ValueError(f"{nodeid}: mark_phase({phase!r}): expected 'forward', 'backward', 'optimizer' or None")


def distributed_ranks(
    nodeid: str, fn: Callable[[int, RankContext], Any], world_size: int, **options: Any
) -> list[Measurement]:
    """``gpumem.distributed``'s ranks (:func:`~pytest_gpumem.diagnose.distributed.run_ranks`); an
    error names the test."""
    __tracebackhide__ = True
    try:
        return run_ranks(fn, world_size, **options)
    except DistributedError as exc:
        raise DistributedError(f"{nodeid}: gpumem.distributed: {exc.message}", exc.reports) from None
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{nodeid}: gpumem.distributed: {exc}") from None


def tracked_budget(
    nodeid: str,
    tracked: Sequence[Any],
    device: torch.device,
    precision: str,
    optimizer: torch.optim.Optimizer | str | None,
    zero_stage: int,
    world_size: int,
) -> Budget:
    """``gpumem.budget()``: the model-state budget of the ``tracked`` modules and their optimizer."""
    modules = [obj for obj in tracked if isinstance(obj, torch.nn.Module)]
    optimizers = [obj for obj in tracked if isinstance(obj, torch.optim.Optimizer)]
    if not modules:
        raise ValueError(f"{nodeid}: gpumem.budget() needs a tracked model: call gpumem.track(model, ...)")
    if optimizer is None and len(optimizers) > 1:
        raise ValueError(f"{nodeid}: {len(optimizers)} optimizers are tracked: pass gpumem.budget(optimizer=...)")
    chosen = optimizer if optimizer is not None else (optimizers[0] if optimizers else None)
    return model_states(modules, chosen, precision, zero_stage=zero_stage, world_size=world_size, device=device)
