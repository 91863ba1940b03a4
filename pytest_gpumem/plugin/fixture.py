"""The ``gpumem`` fixture: :class:`GpuMem`, over the test's recorder, or :class:`Unrecorded` where it is disabled."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import pytest
import torch

from pytest_gpumem.budgets.formulas import Budget, model_states, tracked_psi
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.metrics import SPAN_METRICS
from pytest_gpumem.diagnose.distributed import DEFAULT_TIMEOUT, DistributedError, RankContext, run_ranks
from pytest_gpumem.diagnose.microbatch import Plan, plan_for
from pytest_gpumem.diagnose.microbatch import max_microbatch as search_microbatch
from pytest_gpumem.judge.limits import LimitSpec, check_span_name, parse_span_limits
from pytest_gpumem.measurement.recorder import Recorder, Span
from pytest_gpumem.measurement.steps import train_step_span
from pytest_gpumem.measurement.tracked import check_trackable
from pytest_gpumem.units import parse_size

__all__ = ["GpuMem", "NullEngine", "Unmeasured", "Unrecorded"]


class GpuMem:
    """Measure memory inside a test. Given by the ``gpumem`` fixture; ``device`` is the ``torch.device`` under test.
    With ``--gpumem-disable`` the code runs as with the plugin on; reading a figure skips the test, saying why."""

    def __init__(self, recorder: Recorder | Unrecorded, nodeid: str, marker_limits: Sequence[LimitSpec] = ()) -> None:
        self.recorder = recorder
        self.device: torch.device = recorder.engine.device
        self.nodeid = nodeid
        self._marker_limits = tuple(marker_limits)

    def _measuring(self, what: str) -> Recorder:
        """The recorder, for ``what`` measures; the test is skipped where nothing is measured."""
        __tracebackhide__ = True
        if isinstance(self.recorder, Unrecorded):
            pytest.skip(f"{what}: skipped while pytest-gpumem is disabled")
        return self.recorder

    def track(self, *objects: Any) -> None:
        """Register modules and optimizers for the breakdown, the phases and Ψ."""
        self.recorder.track(*objects)

    def measure(self, name: str, **limits: Any) -> Span:
        """A ``with`` block measured as the span ``name``, with its own limits (``peak="1GiB"``, ``tolerance``)."""
        span = self.recorder.span(check_span_name(name), **limits)
        if name in self.recorder.span_names:
            raise ValueError(f"{self.nodeid}: span name {name!r} is used twice in this test; give each span its own")
        if not self.recorder.active:
            raise RuntimeError(
                f"{self.nodeid}: gpumem.measure({name!r}) can only run inside the test function "
                "(the plugin measures the test call)"
            )
        return span

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
    ) -> list[Measurement]:
        """Run ``fn(rank, ctx)`` in ``world_size`` rank processes, each a measured span (docs/distributed.md)."""
        __tracebackhide__ = True
        recorder = self.recorder
        if predict is not None or fake:
            self._measuring("gpumem.distributed(predict=...) predicts by measuring")
        predict = recorder.engine.predicts if predict is None else predict
        fake = recorder.fake if fake is None else fake
        ranks = ranks if isinstance(recorder, Recorder) else None  # disabled: real ranks all run
        where = device or ("cuda" if self.device.type == "cuda" and predict is None else "cpu")
        try:
            measurements = run_ranks(
                fn,
                world_size,
                backend=backend,
                device=where,
                timeout=timeout,
                predict=predict,
                fake=fake,
                ranks=ranks,
                sites=recorder.sites,
            )
        except DistributedError as exc:
            raise DistributedError(f"{self.nodeid}: gpumem.distributed: {exc.message}", exc.reports) from None
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{self.nodeid}: gpumem.distributed: {exc}") from None
        if isinstance(recorder, Unrecorded):
            return [cast(Measurement, Unmeasured(f"gpumem.distributed(...)[{rank}]")) for rank in range(world_size)]
        limits = [spec for spec in self._marker_limits if spec.metric in SPAN_METRICS]
        recorder.ranks_measured = True
        named = []
        for measurement in measurements:
            name = f"{measurement.name}-of-{world_size}"
            if name in recorder.span_names:
                raise ValueError(f"{self.nodeid}: span name {name!r} is used twice in this test")
            measurement = replace(measurement, name=name)
            recorder.spans.append(Span.finished(recorder, name, measurement, limits))
            named.append(measurement)
        return named

    def mark_phase(self, phase: str | None) -> None:
        """Mark the phase running now, for a framework whose hooks know it better: from then on only marks set it."""
        if phase not in (None, "forward", "backward", "optimizer"):
            expected = "expected 'forward', 'backward', 'optimizer' or None"
            raise ValueError(f"{self.nodeid}: mark_phase({phase!r}): {expected}")
        self.recorder.mark_phase(phase)

    @property
    def psi(self) -> int | None:
        """Trainable parameter count Ψ of the tracked objects (None when nothing is tracked)."""
        return self.recorder.psi

    def budget(
        self,
        precision: str = "fp32",
        *,
        optimizer: torch.optim.Optimizer | str | None = None,
        zero_stage: int = 0,
        world_size: int = 1,
    ) -> Budget:
        """The model-state budget of the tracked modules, with ``optimizer`` (or ``"adamw"``), else the tracked one."""
        tracked = self.recorder.tracked
        modules = [obj for obj in tracked if isinstance(obj, torch.nn.Module)]
        optimizers = [obj for obj in tracked if isinstance(obj, torch.optim.Optimizer)]
        if not modules:
            raise ValueError(f"{self.nodeid}: gpumem.budget() needs a tracked model: call gpumem.track(model, ...)")
        if optimizer is None and len(optimizers) > 1:
            raise ValueError(
                f"{self.nodeid}: {len(optimizers)} optimizers are tracked: pass gpumem.budget(optimizer=...)"
            )
        chosen = optimizer if optimizer is not None else (optimizers[0] if optimizers else None)
        return model_states(
            modules, chosen, precision, zero_stage=zero_stage, world_size=world_size, device=self.device
        )

    def max_microbatch(
        self,
        step: Callable[[int], Any],
        *,
        start: int = 1,
        limit: int | str | None = None,
        upper: int | None = None,
        cleanup: Callable[[], Any] | None = None,
    ) -> int:
        """The largest microbatch size at which ``step(size)`` fits the device, or ``limit`` (docs/oom-and-leaks.md)."""
        recorder = self._measuring("gpumem.max_microbatch() searches by measuring")
        bound = recorder.device_limit if limit is None else parse_size(limit)
        found = search_microbatch(step, start=start, limit=bound, upper=upper, engine=recorder.engine, cleanup=cleanup)
        previous = recorder.max_microbatch
        recorder.max_microbatch = found if previous is None else max(previous, found)
        return found

    def plan_accumulation(self, global_batch: int, step: Callable[[int], Any], **kwargs: Any) -> Plan:
        """Microbatch size and gradient-accumulation steps for ``global_batch``, searched by :meth:`max_microbatch`."""
        self._measuring("gpumem.plan_accumulation() searches by measuring")
        kwargs.setdefault("upper", global_batch)
        return plan_for(global_batch, self.max_microbatch(step, **kwargs))

    @property
    def spans(self) -> list[Measurement]:
        """Figures of the spans closed so far, in order (opened so far where nothing is measured)."""
        return [span.measurement for span in self.recorder.spans]

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
    ) -> Measurement:
        """Run ``warmup`` unmeasured training steps, then one measured step; return its figures (see the README)."""
        __tracebackhide__ = True
        span: Span = train_step_span(self, model, optimizer, batch, loss_fn, amp=amp, warmup=warmup, name=name)
        if isinstance(self.recorder, Unrecorded):
            return cast(Measurement, Unmeasured(f"gpumem.train_step(name={name!r})", name))
        return span.measurement


class Unmeasured:
    """Stands for a span's figures where nothing is measured: reading one skips the test (never a 0 to compare)."""

    def __init__(self, what: str, name: str | None = None) -> None:
        self._what = what
        self.name = name

    def __getattr__(self, name: str) -> Any:
        __tracebackhide__ = True
        if name.startswith("__"):  # copy, pickle and inspection probe for these
            raise AttributeError(name)
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
    """The null recorder: it tracks objects (for Ψ and budgets) and keeps the spans as :class:`Unmeasured` stand-ins."""

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
            check_trackable(obj)
            if all(obj is not seen for seen in self.tracked):
                self.tracked.append(obj)

    @property
    def psi(self) -> int | None:
        return tracked_psi(self.tracked)

    def mark_phase(self, phase: str | None) -> None:
        pass

    def span(self, name: str, **limits: Any) -> Span:
        parse_span_limits(name, limits)  # bad limits are still errors
        span = cast(Span, _UnmeasuredSpan(f"gpumem.measure({name!r})", name))
        self.spans.append(span)
        return span
