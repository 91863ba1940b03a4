"""Shared test set-up.

In-process pytester runs restore ``sys.modules`` afterwards, so a torch module first
imported inside one (optimizers import parts of torch lazily at their first step)
would be imported again by the next and register its operators twice. One real
training step of each kind here imports them all before any pytester run, and so
does importing the plugin's measuring modules, which the plugin loads lazily.
"""

from __future__ import annotations

import torch

# The plugin imports its measuring machinery (and the parts of torch it uses) only when a
# test is measured; import it here, before any in-process pytester run, for the same reason.
import pytest_gpumem.fixture
import pytest_gpumem.runner  # noqa: F401


def _warm_up_lazy_torch_imports() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    for optimizer in (
        torch.optim.AdamW(model.parameters()),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ):
        for dtype in (torch.bfloat16, torch.float16):
            scaler = torch.amp.GradScaler("cpu")
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


_warm_up_lazy_torch_imports()


def pytest_collection_modifyitems(config: object, items: list[object]) -> None:
    """Tests marked ``cuda`` need a CUDA device: skipped with a reason without one."""
    import pytest

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none is available here)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # type: ignore[attr-defined]
            item.add_marker(skip)  # type: ignore[attr-defined]
