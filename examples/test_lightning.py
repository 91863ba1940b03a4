"""A PyTorch Lightning ``Trainer.fit`` under the marker: three steps of a small MLP, with a
peak limit and a model-state budget in Ψ."""

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from pytest_gpumem.integrations.lightning import GpumemCallback  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# After fit: the parameters (4Ψ), the last step's gradients (4Ψ: Lightning zeroes them before
# each step, not after) and AdamW's exp_avg and exp_avg_sq (8Ψ). The 64 KiB hold AdamW's step
# counters and the data (32 KiB).
@pytest.mark.gpumem(peak="4MiB", allocated="16Ψ + 64KiB")
def test_fit_three_steps(gpumem, tmp_path):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randn(64, 64))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu" if gpumem.device.type == "cpu" else "gpu",
        devices=1,
        callbacks=[GpumemCallback(gpumem)],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader)
    assert [span.name for span in gpumem.spans] == ["step1", "step2", "step3"]
