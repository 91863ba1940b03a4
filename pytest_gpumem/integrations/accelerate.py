"""An ``accelerate`` training loop under the ``gpumem`` marker: :func:`track` what ``Accelerator.prepare`` returns.

It tracks the torch objects inside accelerate's wrappers, so Ψ, the optimizer's state and the phases are those of the
real objects (docs/integrations.md).
"""

from __future__ import annotations

from typing import Any

from pytest_gpumem.integrations import unwrap

__all__ = ["track"]


def track(gpumem: Any, *prepared: Any) -> None:
    """``gpumem.track`` the modules and optimizers ``Accelerator.prepare`` returned (not loaders nor schedulers)."""
    import torch

    objects = [unwrap(obj) for obj in prepared]
    gpumem.track(*(obj for obj in objects if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))))
