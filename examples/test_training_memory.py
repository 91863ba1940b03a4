"""The pytest-gpumem demo suite: memory tests of real small training steps.

Run it with ``pytest examples``. On a machine with a CUDA GPU the figures come
from the caching allocator; without one, from the CPU engine's exact tensor
tracker. Limits bound what each test allocates (its cost), so the same markers
hold on both. The gpumem table at the end of the run lists every figure.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

B, S, D, HEADS = 4, 128, 256, 4


def mlp(activation: type[nn.Module]) -> nn.Module:
    """The transformer MLP: d → 4d → activation → d."""
    return nn.Sequential(nn.Linear(D, 4 * D), activation(), nn.Linear(4 * D, D))


@pytest.mark.gpumem(peak="32MiB", retained="0B")
@pytest.mark.parametrize(("activation", "factor"), [(nn.GELU, 18), (nn.ReLU, 10)], ids=["gelu", "relu"])
def test_mlp_saved_activations(gpumem, activation: type[nn.Module], factor: int) -> None:
    """A bf16 MLP saves 18·b·s·d bytes for backward with GELU, 10·b·s·d with ReLU."""
    torch.manual_seed(0)
    model = mlp(activation).to(gpumem.device, torch.bfloat16)
    x = torch.randn(B, S, D, device=gpumem.device, dtype=torch.bfloat16)
    gpumem.track(model)
    with gpumem.measure("forward") as forward:
        out = model(x)
    with gpumem.measure("backward"):
        out.float().pow(2).mean().backward()
    assert forward.saved_activations == factor * B * S * D


class Block(nn.Module):
    """A pre-norm transformer block: attention and MLP, each with a residual."""

    def __init__(self, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = mlp(nn.GELU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


# 16 bytes per parameter for fp32 AdamW (weights, gradients, exp_avg, exp_avg_sq), plus room
# for the batch (x and target: 1 MiB, alive as the test returns) and Adam's step counters.
@pytest.mark.gpumem(allocated="16Ψ + 2MiB", peak="16Ψ + 64MiB")
def test_transformer_block_adamw(gpumem) -> None:
    torch.manual_seed(0)
    model = Block().to(gpumem.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(B, S, D, device=gpumem.device)
    target = torch.randn(B, S, D, device=gpumem.device)
    step = gpumem.train_step(model, opt, (x, target), F.mse_loss)
    assert list(step.phases) == ["forward", "backward", "optimizer"]
    budget = gpumem.budget(precision="fp32")
    print(f"\nmodel-state budget of the block (Ψ = {budget.psi:,}):\n{budget}")
    if step.breakdown is not None:  # CPU engine, or --gpumem-breakdown on CUDA
        optimizer_items = sum(v for k, v in budget.items.items() if k not in ("parameters", "gradients"))
        assert step.breakdown["parameters"] == budget.items["parameters"]
        assert step.breakdown["optimizer_state"] == optimizer_items


@pytest.mark.gpumem(peak="64MiB")
def test_bf16_mixed_precision_step(gpumem) -> None:
    """fp32 weights, bf16 autocast: activations are saved in bf16."""
    torch.manual_seed(0)
    model = Block().to(gpumem.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(B, S, D, device=gpumem.device)
    target = torch.randn(B, S, D, device=gpumem.device)
    fp32 = gpumem.train_step(model, opt, (x, target), F.mse_loss, name="fp32 step")
    bf16 = gpumem.train_step(model, opt, (x, target), F.mse_loss, amp="bf16", name="bf16 step")
    if fp32.saved_activations is not None and bf16.saved_activations is not None:
        assert bf16.saved_activations < fp32.saved_activations
