"""An ``accelerate`` training loop under the marker: three steps of a small MLP, with a peak
limit and a model-state budget in Ψ."""

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

from pytest_gpumem.integrations.accelerate import track  # noqa: E402


# After the loop: the parameters (4Ψ) and AdamW's exp_avg and exp_avg_sq (8Ψ); zero_grad sets
# the gradients to None. The 64 KiB hold AdamW's step counters and the data (32 KiB).
@pytest.mark.gpumem(peak="4MiB", allocated="12Ψ + 64KiB")
def test_accelerate_three_steps(gpumem):
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=gpumem.device.type == "cpu")
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randn(64, 64))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    track(gpumem, model, optimizer)
    for step, (inputs, targets) in enumerate(loader, 1):
        if step > 3:
            break
        with gpumem.measure(f"step{step}"):
            accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
    assert gpumem.psi == sum(p.numel() for p in model.parameters())
