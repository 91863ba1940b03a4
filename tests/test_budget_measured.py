"""Budgets hold against measurement: after a real optimizer step on the CPU engine,
the bytes of parameters + gradients + optimizer state equal the budget to the byte."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from pytest_gpumem import measure
from pytest_gpumem.budgets.formulas import (
    count_parameters,
    mlp_activations,
    model_states,
    transformer_layer_activations,
)
from pytest_gpumem.data.figures import Measurement

MODEL_STATES = ("parameters", "gradients", "optimizer_state")


def measured_model_states(m: Measurement) -> int:
    assert m.allocated_breakdown is not None
    return sum(m.allocated_breakdown[c] for c in MODEL_STATES)


def two_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Measurement:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()

    step()  # optimizers create their state lazily at the first step
    with measure("step", device="cpu", track=(model, opt)) as span:
        step()
    return span.measurement


def mlp(d: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fp32_model_states_equal_the_budget(name: str) -> None:
    model = mlp()
    opt = OPTIMIZERS[name](list(model.parameters()))
    m = two_steps(model, opt, torch.randn(8, 32))
    budget = model_states(model, opt, "fp32")
    assert measured_model_states(m) == budget.total
    n = count_parameters(model).psi
    tensors = len(list(model.parameters()))
    expected = {
        "adamw": 16 * n + 4 * tensors,  # 4+4+8 per parameter, plus Adam's float32 step counters
        "sgd-momentum": 12 * n,
        "sgd": 8 * n,
    }[name]
    assert budget.total == expected
    if name == "adamw":
        assert budget.items["step counters"] == 4 * tensors  # named, not a fudge factor


def test_frozen_layers_cost_only_their_weights() -> None:
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    m = two_steps(model, opt, torch.randn(8, 32))
    budget = model_states(model, opt, "fp32")
    assert measured_model_states(m) == budget.total
    frozen = sum(p.numel() for p in model[0].parameters())
    assert budget.items["frozen parameters"] == 4 * frozen


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def test_tied_weights_count_once() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters())
    m = two_steps(model, opt, torch.randint(0, 64, (4, 8)))
    budget = model_states(model, opt, "fp32")
    assert budget.psi == 64 * 32 + 32 * 32 + 32 == m.psi
    assert measured_model_states(m) == budget.total


def test_bf16_parameters_with_fp32_master_weights_match_the_mixed_recipe() -> None:
    """A mixed-precision recipe written here: bf16 model, fp32 master copies updated by AdamW."""
    model = mlp().to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-3)
    x = torch.randn(8, 32, dtype=torch.bfloat16)

    def step() -> None:
        for p in params:
            p.grad = None
        model(x).float().pow(2).mean().backward()
        for p, master in zip(params, masters, strict=True):
            master.grad = p.grad.float()  # type: ignore[union-attr]
        opt.step()
        for p, master in zip(params, masters, strict=True):
            master.grad = None
            p.data.copy_(master.data)

    step()
    with measure("step", device="cpu", track=(model, opt)) as span:
        step()
    budget = model_states(model, "adamw", "mixed", device="cpu")
    n = count_parameters(model).psi
    assert budget.total == 16 * n + 4 * len(params)  # 2 + 2 + 4 (master) + 8 (Adam), and step counters
    assert measured_model_states(span.measurement) == budget.total


@pytest.mark.parametrize(("b", "s", "d"), [(2, 16, 32), (4, 32, 64)])
@pytest.mark.parametrize("activation", ["gelu", "relu", "tanh"])
def test_mlp_saved_activations_match_the_estimator(b: int, s: int, d: int, activation: str) -> None:
    act = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}[activation]
    model = nn.Sequential(nn.Linear(d, 4 * d), act(), nn.Linear(4 * d, d)).to(torch.bfloat16)
    x = torch.randn(b, s, d, dtype=torch.bfloat16)
    with measure("forward", device="cpu", track=(model,)) as span:
        out = model(x)
    assert span.saved_activations == mlp_activations(b, s, d, activation)
    del out


class MegatronLayer(nn.Module):
    """The transformer layer Korthikanti et al. count: explicit attention with softmax and
    dropout on the scores, dropout after attention and MLP, two LayerNorms, GELU MLP."""

    def __init__(self, h: int, a: int, p: float = 0.1) -> None:
        super().__init__()
        self.a = a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.a, h // self.a).permute(2, 1, 3, 0, 4)
        scores = torch.softmax(q @ k.transpose(-1, -2) / (h // self.a) ** 0.5, dim=-1)
        context = (self.drop(scores) @ v).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + self.drop(self.proj(context))
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))))


def test_transformer_layer_compared_with_korthikanti() -> None:
    s, b, h, a = 64, 2, 64, 4
    torch.manual_seed(0)
    layer = MegatronLayer(h, a).to(torch.bfloat16)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    with measure("forward", device="cpu", track=(layer,)) as span:
        out = layer(x)
    estimate = transformer_layer_activations(s, b, h, a)
    assert estimate == s * b * h * (34 + 5 * a * s // h)
    measured = span.saved_activations
    assert measured is not None
    # Every saved byte is accounted for. The formula assumes 1-byte dropout masks; on
    # the CPU torch keeps them in the activation's dtype (bf16: 2 bytes), one byte more
    # per element for the two s*b*h masks and the a*s*s*b mask on the scores. The
    # formula also leaves out LayerNorm's saved mean and rstd: 2 per token per norm.
    mask_extra = 2 * s * b * h + a * s * s * b
    layernorm_stats = 2 * 2 * s * b * 2
    assert measured == estimate + mask_extra + layernorm_stats
    assert round(measured / estimate, 4) == 1.1134  # the ratio the README states
    del out
