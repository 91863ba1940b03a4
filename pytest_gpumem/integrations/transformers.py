"""Hugging Face ``transformers.Trainer`` under the ``gpumem`` marker.

:class:`GpumemCallback` tracks the model and the optimizer the trainer builds and measures each optimizer step (all its
accumulation micro-batches) as a span ``step1``, ``step2``, ... (docs/integrations.md).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from pytest_gpumem.integrations import StepSpans, run_of, unwrap

__all__ = ["GpumemCallback"]


class GpumemCallback(TrainerCallback):
    """Tracks the ``Trainer``'s model and optimizer in the ``gpumem`` fixture and measures each step as a span
    ``prefix`` + its number."""

    def __init__(self, gpumem: Any, prefix: str = "step") -> None:
        self.gpumem = gpumem
        self.spans = StepSpans(gpumem, prefix)
        self._tracked_in: Any = object()  # the run of the test that tracks them: a new run tracks them again

    def _track(self, model: Any, optimizer: Any) -> None:
        run = run_of(self.gpumem)
        if run is self._tracked_in or model is None or optimizer is None:
            return
        self.gpumem.track(unwrap(model), unwrap(optimizer))
        self._tracked_in = run

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._track(kwargs.get("model"), kwargs.get("optimizer"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._track(kwargs.get("model"), kwargs.get("optimizer"))
        self.spans.begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.spans.end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.spans.end()  # a step that did not reach its end (a stop the trainer caught)
