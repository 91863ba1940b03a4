"""The ``gpumem`` fixture where the plugin measures: :class:`GpuMem`, the device, spans, tracking,
a training step (it implements :class:`~pytest_gpumem.plugin.fixture.GpumemFixture`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from pytest_gpumem.budgets.formulas import Budget
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.metrics import SPAN_METRICS
from pytest_gpumem.diagnose.distributed import DEFAULT_TIMEOUT, RankContext
from pytest_gpumem.diagnose.microbatch import Plan, plan_for
from pytest_gpumem.diagnose.microbatch import max_microbatch as search_microbatch
from pytest_gpumem.judge.limits import LimitSpec, check_span_name
from pytest_gpumem.measurement.recorder import Recorder, Span
from pytest_gpumem.measurement.steps import train_step_span
from pytest_gpumem.plugin.fixture import GpumemFixture, check_phase, distributed_ranks, tracked_budget
from pytest_gpumem.units import parse_size

__all__ = ["GpuMem"]


class GpuMem(GpumemFixture):
    """Measure memory inside a test. Given by the ``gpumem`` fixture.

    Attributes:
        device: the ``torch.device`` under test (put the model and batch there).
        recorder: the recording of the test call (figures of every closed span).
    """

    def __init__(self, recorder: Recorder, nodeid: str, marker_limits: Sequence[LimitSpec] = ()) -> None:
        self.recorder = recorder
        self.device: torch.device = recorder.engine.device
        self.nodeid = nodeid
        self._marker_limits = tuple(marker_limits)

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
        if predict is None:
            predict = self.recorder.engine.predicts
        if fake is None:
            fake = self.recorder.fake
        where = device or ("cuda" if self.device.type == "cuda" and predict is None else "cpu")
        measurements = distributed_ranks(
            self.nodeid,
            fn,
            world_size,
            backend=backend,
            device=where,
            timeout=timeout,
            predict=predict,
            fake=fake,
            ranks=ranks,
            sites=self.recorder.sites,
        )
        limits = [spec for spec in self._marker_limits if spec.metric in SPAN_METRICS]
        self.recorder.ranks_measured = True
        named = []
        for measurement in measurements:
            name = f"{measurement.name}-of-{world_size}"  # run_ranks names each rank's span rank{r}
            if name in self.recorder.span_names:
                raise ValueError(f"{self.nodeid}: span name {name!r} is used twice in this test")
            measurement = replace(measurement, name=name)
            self.recorder.spans.append(Span.finished(self.recorder, name, measurement, limits))
            named.append(measurement)
        return named

    def mark_phase(self, phase: str | None) -> None:
        """Mark the phase running now (``"forward"``, ``"backward"``, ``"optimizer"``, None for
        none) for a framework whose own hooks know it better than the tracked objects' hooks:
        from the first call on, only these marks set the phase (see the Lightning adapter)."""
        check_phase(self.nodeid, phase)
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
        return tracked_budget(
            self.nodeid, self.recorder.tracked, self.device, precision, optimizer, zero_stage, world_size
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
        bound = self.recorder.device_limit if limit is None else parse_size(limit)
        found = search_microbatch(
            step, start=start, limit=bound, upper=upper, engine=self.recorder.engine, cleanup=cleanup
        )
        previous = self.recorder.max_microbatch
        self.recorder.max_microbatch = found if previous is None else max(previous, found)
        return found

    def plan_accumulation(self, global_batch: int, step: Callable[[int], Any], **kwargs: Any) -> Plan:
        """Microbatch size and gradient-accumulation steps for ``global_batch``.

        Searches with :meth:`max_microbatch` (capped at ``global_batch``; keyword
        arguments pass through), then takes the largest size that divides
        ``global_batch`` and fits.
        """
        kwargs.setdefault("upper", global_batch)
        return plan_for(global_batch, self.max_microbatch(step, **kwargs))

    @property
    def spans(self) -> list[Measurement]:
        """Figures of the spans closed so far, in order."""
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
        return span.measurement
