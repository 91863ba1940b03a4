"""The ``gpumem`` fixture: :class:`GpuMem`, over the test's
:class:`~pytest_gpumem.measurement.recorder.Recorder` where the plugin measures, over an
:class:`~pytest_gpumem.plugin.unmeasured.Unrecorded` where it is disabled (``--gpumem-disable``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

import pytest
import torch

from pytest_gpumem.budgets.formulas import Budget, model_states
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.metrics import SPAN_METRICS
from pytest_gpumem.diagnose.distributed import DEFAULT_TIMEOUT, DistributedError, RankContext, run_ranks
from pytest_gpumem.diagnose.microbatch import Plan, plan_for
from pytest_gpumem.diagnose.microbatch import max_microbatch as search_microbatch
from pytest_gpumem.judge.limits import LimitSpec, check_span_name
from pytest_gpumem.measurement.recorder import Recorder, Span
from pytest_gpumem.measurement.steps import train_step_span
from pytest_gpumem.plugin.unmeasured import Unmeasured, Unrecorded
from pytest_gpumem.units import parse_size

__all__ = ["GpuMem"]


class GpuMem:
    """Measure memory inside a test. Given by the ``gpumem`` fixture.

    With ``--gpumem-disable`` the test runs on the same device with nothing measured: ``track()``,
    ``measure()`` blocks, ``train_step()`` and ``distributed()`` run the code, Ψ and ``budget()``
    are computed (theory, not measurement); reading a figure skips the test there, as
    ``max_microbatch()`` and ``plan_accumulation()``, which search by measuring, do.

    Attributes:
        device: the ``torch.device`` under test (put the model and batch there).
        recorder: the recording of the test call (figures of every closed span).
    """

    def __init__(self, recorder: Recorder | Unrecorded, nodeid: str, marker_limits: Sequence[LimitSpec] = ()) -> None:
        self.recorder = recorder
        self.device: torch.device = recorder.engine.device
        self.nodeid = nodeid
        self._marker_limits = tuple(marker_limits)

    def _measuring(self, what: str) -> Recorder:
        """The recorder, for ``what`` measures; where nothing is measured the test is skipped."""
        __tracebackhide__ = True
        if isinstance(self.recorder, Unrecorded):
            pytest.skip(f"{what}: skipped while pytest-gpumem is disabled")
        return self.recorder

    def track(self, *objects: Any) -> None:
        """Register modules and optimizers for the breakdown, the phases and Ψ."""
        self.recorder.track(*objects)

    def measure(self, name: str, **limits: Any) -> Span:
        """A ``with`` block measured as the span ``name``.

        Keyword limits (``peak``, ``allocated``, ``reserved`` as sizes or budget
        expressions, and ``tolerance``) apply to this span; a broken one fails the
        test at its end. After the block the returned span holds the figures.
        """
        span = self.recorder.span(check_span_name(name), **limits)  # validates the limits, once
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
        """Run ``fn(rank, ctx)`` in ``world_size`` rank processes, each measured; returns their
        :class:`Measurement` in rank order (see :mod:`pytest_gpumem.diagnose.distributed`).

        Each rank is the span ``"rank{r}-of-{world_size}"`` of this test: the marker's ``peak``,
        ``allocated`` and ``reserved`` limits and budgets apply to every rank (Ψ is the rank's
        own tracked trainable parameters: ``ctx.track(model, optimizer)`` in ``fn``), and
        baselines are kept per rank and world size. ``device``: ``"cpu"`` or ``"cuda"`` (rank
        ``r`` on ``cuda:r``); default: the test's device type. ``predict`` and ``fake`` default
        to the test's (its marker's ``predict=`` and ``fake=``, ``--gpumem-predict``,
        ``--gpumem-fake``); with ``fake`` the ranks run one after another in one process over
        the fake process group, and ``ranks`` chooses which (default: all). A rank that fails,
        runs out of memory or does not finish in ``timeout`` seconds fails the test with its report.
        """
        __tracebackhide__ = True
        recorder = self.recorder
        if isinstance(recorder, Unrecorded):
            if predict is not None or fake:
                self._measuring("gpumem.distributed(predict=...) predicts by measuring")
            ranks = None  # real ranks all run
        if predict is None:
            predict = recorder.engine.predicts
        if fake is None:
            fake = recorder.fake
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
            name = f"{measurement.name}-of-{world_size}"  # run_ranks names each rank's span rank{r}
            if name in recorder.span_names:
                raise ValueError(f"{self.nodeid}: span name {name!r} is used twice in this test")
            measurement = replace(measurement, name=name)
            recorder.spans.append(Span.finished(recorder, name, measurement, limits))
            named.append(measurement)
        return named

    def mark_phase(self, phase: str | None) -> None:
        """Mark the phase running now (``"forward"``, ``"backward"``, ``"optimizer"``, None for
        none) for a framework whose own hooks know it better than the tracked objects' hooks:
        from the first call on, only these marks set the phase (see the Lightning adapter)."""
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
        """The theoretical model-state budget of the tracked objects (bytes; see ``budgets.model_states``).

        The tracked modules are the model. The optimizer is ``optimizer`` when
        given (an object or a registered name such as ``"adamw"``), else the one
        tracked optimizer; with several tracked, pass one.
        """
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
        """The largest microbatch size whose training step fits the device.

        ``step(size)`` runs one training step at that microbatch size. The search
        doubles from ``start`` while the step fits, then bisects between the last
        size that fit and the first that ran out of memory; each out-of-memory
        error is caught and cleaned up (frames dropped, garbage collected, cache
        emptied on CUDA), ``cleanup()`` runs after every try (zero the gradients
        there). ``limit`` (bytes or a size) emulates a smaller device; the default
        is the test's ``device_limit``. ``upper`` caps the search; on the CPU
        engine, one of ``limit``/``upper`` is needed for the search to end, and
        without ``upper`` a step whose memory does not grow with its size raises
        :class:`~pytest_gpumem.diagnose.microbatch.MicrobatchError` after 30 doublings.
        Returns 0 when not even ``start`` fits. The largest size any search of
        the test found is its ``max_microbatch`` figure (``min_microbatch=``
        bounds it; baselines keep it).
        """
        recorder = self._measuring("gpumem.max_microbatch() searches by measuring")
        bound = recorder.device_limit if limit is None else parse_size(limit)
        found = search_microbatch(step, start=start, limit=bound, upper=upper, engine=recorder.engine, cleanup=cleanup)
        previous = recorder.max_microbatch
        recorder.max_microbatch = found if previous is None else max(previous, found)
        return found

    def plan_accumulation(self, global_batch: int, step: Callable[[int], Any], **kwargs: Any) -> Plan:
        """Microbatch size and gradient-accumulation steps for ``global_batch``.

        Searches with :meth:`max_microbatch` (capped at ``global_batch``; keyword
        arguments pass through), then takes the largest size that divides
        ``global_batch`` and fits.
        """
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
        """Run ``warmup`` unmeasured training steps, then one measured step; return its figures.

        A step is: ``optimizer.zero_grad(set_to_none=True)``, forward, loss,
        backward, ``optimizer.step()``. The model and optimizer are tracked; the
        forward / backward / optimizer phases are marked by hooks. Warm-up steps
        matter: optimizers create their state lazily at the first step.

        ``batch``: a tensor (``model(batch)``), a tuple or list
        (``model(*batch)``) or a mapping (``model(**batch)``). With ``loss_fn``
        and an ``(inputs, target)`` pair the loss is
        ``loss_fn(model(inputs), target)`` (``inputs`` unpacked as above); with
        ``loss_fn`` and a tensor or a mapping (an unsupervised loss) it is
        ``loss_fn(model(batch))``. Without ``loss_fn`` the model's output must
        be the loss: a scalar tensor, or an object with a ``loss`` attribute or
        key (Hugging Face outputs).

        ``amp``: None (as the model is), ``"bf16"`` (autocast to bfloat16) or
        ``"fp16"`` (autocast to float16 with a gradient scaler).
        """
        __tracebackhide__ = True
        span: Span = train_step_span(self, model, optimizer, batch, loss_fn, amp=amp, warmup=warmup, name=name)
        if isinstance(self.recorder, Unrecorded):
            return cast(Measurement, Unmeasured(f"gpumem.train_step(name={name!r})", name))
        return span.measurement
