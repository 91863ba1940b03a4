"""PyTorch Lightning's ``Trainer`` under the ``gpumem`` marker (``lightning`` or the older
``pytorch_lightning``, whichever is installed).

::

    from pytest_gpumem.integrations.lightning import GpumemCallback

    @pytest.mark.gpumem(peak="64MiB", allocated="12Ψ + 64KiB")
    def test_fit(gpumem, tmp_path):
        trainer = L.Trainer(max_steps=3, callbacks=[GpumemCallback(gpumem)], default_root_dir=tmp_path, ...)
        trainer.fit(module, loader)

The callback tracks the ``LightningModule`` and its optimizers when training starts (for Ψ
and the breakdown by category), marks the forward / backward / optimizer phases with
Lightning's own hooks (automatic optimization runs the forward and backward passes inside
``optimizer.step(closure)``), and measures each training batch as a span ``step1``, ``step2``, ...
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
    """Tracks the module and its optimizers in ``gpumem`` and measures each training batch as a span.

    Args:
        gpumem: the test's ``gpumem`` fixture.
        prefix: the spans' names are ``prefix`` and the batch's number (``step1``, ...).
    """

    def __init__(self, gpumem: Any, prefix: str = "step") -> None:
        self.gpumem = gpumem
        self.spans = StepSpans(gpumem, prefix)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.gpumem.track(unwrap(pl_module), *(unwrap(optimizer) for optimizer in trainer.optimizers))

    # Lightning's automatic optimization runs the forward and backward passes inside
    # ``optimizer.step(closure)``: its own hooks mark the phases, not the optimizer's.

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
