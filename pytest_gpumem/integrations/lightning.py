"""PyTorch Lightning's ``Trainer`` under the ``gpumem`` marker (``lightning`` or ``pytorch_lightning``).

:class:`GpumemCallback` tracks the module and its optimizers, marks the phases with Lightning's hooks and measures each
training batch as a span ``step1``, ``step2``, ... (docs/integrations.md).
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]

from pytest_gpumem.integrations import StepSpans, unwrap

__all__ = ["GpumemCallback"]


class GpumemCallback(Callback):
    """Tracks the module and its optimizers in the ``gpumem`` fixture and measures each training batch as a span
    ``prefix`` + its number."""

    def __init__(self, gpumem: Any, prefix: str = "step") -> None:
        self.gpumem = gpumem
        self.spans = StepSpans(gpumem, prefix)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.gpumem.track(unwrap(pl_module), *(unwrap(optimizer) for optimizer in trainer.optimizers))

    # automatic optimization runs forward and backward in ``optimizer.step(closure)``: its hooks mark the phases

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.spans.begin()
        self.gpumem.mark_phase("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.gpumem.mark_phase("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self.gpumem.mark_phase(None)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.gpumem.mark_phase("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.gpumem.mark_phase(None)
        self.spans.end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.spans.end()
