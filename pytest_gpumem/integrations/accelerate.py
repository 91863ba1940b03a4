"""An ``accelerate`` training loop under the ``gpumem`` marker.

::

    from pytest_gpumem.integrations.accelerate import track

    @pytest.mark.gpumem(peak="64MiB", allocated="12Ψ + 64KiB")
    def test_loop(gpumem):
        accelerator = Accelerator(cpu=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        track(gpumem, model, optimizer)
        for n, batch in enumerate(loader, 1):
            with gpumem.measure(f"step{n}"):
                accelerator.backward(loss_of(model, batch))
                optimizer.step()
                optimizer.zero_grad()

``Accelerator.prepare`` returns wrappers: the optimizer is an ``AcceleratedOptimizer`` around
the torch one (the one that holds the state), and the model may be wrapped for distributed
or compiled training. :func:`track` tracks what is inside, so that Ψ, the optimizer's state
and the phases are those of the real objects. Mixed precision is what the accelerator sets
(its autocast wraps the model's forward): the figures are those of the step as it runs.
"""

from __future__ import annotations

from typing import Any

from pytest_gpumem.integrations import unwrap

__all__ = ["track"]


def track(gpumem: Any, *prepared: Any) -> None:
    """``gpumem.track`` the modules and optimizers that ``Accelerator.prepare`` returned
    (data loaders and schedulers among them are left out)."""
    import torch

    objects = [unwrap(obj) for obj in prepared]
    gpumem.track(*(obj for obj in objects if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))))
