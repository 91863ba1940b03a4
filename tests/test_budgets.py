"""Budgets checked against what torch really allocates (CPU, real optimizer steps) and against the papers' formulas."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from fractions import Fraction
from typing import Any

import pytest
import torch
from torch import nn

from pytest_gpumem.budgets import optimizers
from pytest_gpumem.budgets.formulas import (
    PRECISIONS,
    Budget,
    Precision,
    count_parameters,
    mlp_activations,
    model_states,
    transformer_layer_activations,
)
from pytest_gpumem.budgets.optimizers import OptimizerState, optimizer_state, register_optimizer, registered_optimizers
from pytest_gpumem.validate.gpt2 import GPT2, PRESETS, Block, GPT2Config, gpt2

GPT2_SMALL_PSI = 124_439_808
GPT2_XL_PSI = 1_557_611_200


# --------------------------------------------------------------------------- helpers


def mlp(d_in: int = 6, hidden: int = 10, d_out: int = 3, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, d_out)).to(dtype)


class ConvNet(nn.Module):
    """Parameters of 0, 1, 2 and 4 dims, for Adafactor's factored state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, kernel_size=(2, 3))
        self.fc = nn.Linear(3 * 3 * 3, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.conv(x).flatten(1)) * self.scale
        return out


def convnet_input() -> torch.Tensor:
    return torch.randn(5, 2, 4, 5)


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (each storage once)."""
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def held_bytes(
    modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer, masters: Iterable[torch.Tensor] = ()
) -> dict[str, int]:
    """What torch really holds after a step, by budget item; every storage counted once."""
    params: list[nn.Parameter] = []
    for module in modules:
        params.extend(p for p in module.parameters() if all(p is not q for q in params))
    seen: set[int] = set()
    held: dict[str, int] = {
        "parameters": storage_bytes((p for p in params if p.requires_grad), seen),
        "frozen parameters": storage_bytes((p for p in params if not p.requires_grad), seen),
    }
    masters = list(masters)
    grads = [t.grad for t in [*params, *masters] if t.grad is not None]
    held["gradients"] = storage_bytes(grads, seen)
    held["master weights"] = storage_bytes(masters, seen)
    for state in optimizer.state.values():
        for name, value in state.items():
            assert torch.is_tensor(value), (name, value)
            item = "step counters" if name == "step" else name
            held[item] = held.get(item, 0) + storage_bytes([value], seen)
    return {name: nbytes for name, nbytes in held.items() if nbytes}


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, make_input: Callable[[], torch.Tensor], steps: int = 2
) -> None:
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        out = model(make_input())
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
        optimizer.step()


def expected_items(budget: Budget) -> dict[str, int]:
    return dict(budget.items)


# --------------------------------------------------------------------------- parameter counting


def test_count_trainable_and_frozen() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    count = count_parameters(model)
    assert (count.trainable, count.frozen, count.total, count.psi) == (8, 15, 23, 8)
    assert (count.trainable_tensors, count.frozen_tensors, count.tensors) == (2, 2, 4)
    assert count.nbytes == 23 * 4


def test_count_dedupes_tied_and_shared_parameters() -> None:
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    tied = nn.ModuleDict({"embedding": embedding, "head": head})
    assert count_parameters(tied).psi == 40
    # the same parameters reached through several modules, and a module passed twice
    assert count_parameters(embedding, head, tied, tied).psi == 40
    shared = nn.Linear(3, 3)
    assert count_parameters(nn.Sequential(shared, nn.ReLU(), shared), shared).psi == 12
    assert count_parameters([embedding, head], tied).psi == 40
    with pytest.raises(TypeError, match=r"expected torch\.nn\.Module objects, got Tensor"):
        count_parameters([torch.zeros(2)])  # type: ignore[list-item]


def test_count_per_dtype() -> None:
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 2), nn.Linear(2, 2).half())
    model[2].requires_grad_(False)
    count = count_parameters(model)
    assert dict(count.trainable_by_dtype) == {torch.bfloat16: 20, torch.float32: 10}
    assert dict(count.frozen_by_dtype) == {torch.float16: 6}
    assert dict(count.by_dtype) == {torch.bfloat16: 20, torch.float32: 10, torch.float16: 6}
    assert (count.trainable_bytes, count.frozen_bytes) == (20 * 2 + 10 * 4, 6 * 2)


def test_count_on_meta_without_touching_data() -> None:
    with torch.device("meta"):
        small = gpt2("gpt2")
    count = count_parameters(small)
    assert all(p.is_meta for p in small.parameters())
    assert count.psi == GPT2_SMALL_PSI == sum(p.numel() for p in small.parameters())
    assert count.frozen == 0


@pytest.fixture(scope="module")
def gpt2_xl() -> GPT2:
    with torch.device("meta"):
        return GPT2(GPT2Config.preset("gpt2-xl"))


def test_gpt2_xl_on_meta(gpt2_xl: GPT2) -> None:
    assert all(t.is_meta for t in [*gpt2_xl.parameters(), *gpt2_xl.buffers()])
    assert gpt2_xl.lm_head.weight is gpt2_xl.wte.weight
    assert count_parameters(gpt2_xl).psi == sum(p.numel() for p in gpt2_xl.parameters()) == GPT2_XL_PSI


def test_gpt2_presets() -> None:
    assert PRESETS["gpt2-xl"] == GPT2Config(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024)
    untied = GPT2Config.preset("gpt2", tie_weights=False)
    with torch.device("meta"):
        assert count_parameters(GPT2(untied)).psi == GPT2_SMALL_PSI + 50257 * 768
    with pytest.raises(ValueError, match="unknown GPT-2 preset 'gpt5'"):
        GPT2Config.preset("gpt5")
    with pytest.raises(ValueError, match="must divide"):
        GPT2Config(n_embd=10, n_head=3)


# --------------------------------------------------------------------------- budgets against real optimizer steps

OptimizerCase = tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.optim.Optimizer], Callable[[], torch.Tensor]]


def _mlp_input() -> torch.Tensor:
    return torch.randn(7, 6)


def _frozen_mlp() -> nn.Sequential:
    model = mlp()
    model[0].requires_grad_(False)
    return model


def _tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return gpt2("tiny")


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12))


def _two_groups_sgd(model: nn.Module) -> torch.optim.Optimizer:
    first, *rest = model.children()
    others = [p for module in rest for p in module.parameters()]
    groups: list[dict[str, Any]] = [{"params": list(first.parameters()), "momentum": 0.9}, {"params": others}]
    return torch.optim.SGD(groups, lr=0.1)


CASES: dict[str, OptimizerCase] = {
    "adamw": (mlp, lambda m: torch.optim.AdamW(m.parameters()), _mlp_input),
    "adamw-amsgrad": (mlp, lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), _mlp_input),
    "adam-fused": (mlp, lambda m: torch.optim.Adam(m.parameters(), fused=True), _mlp_input),
    "sgd-momentum": (mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), _mlp_input),
    "sgd-plain": (mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _mlp_input),
    "sgd-groups": (mlp, _two_groups_sgd, _mlp_input),
    "adagrad": (mlp, lambda m: torch.optim.Adagrad(m.parameters()), _mlp_input),
    "rmsprop": (mlp, lambda m: torch.optim.RMSprop(m.parameters(), momentum=0.9, centered=True), _mlp_input),
    "rmsprop-plain": (mlp, lambda m: torch.optim.RMSprop(m.parameters()), _mlp_input),
    "adamax": (mlp, lambda m: torch.optim.Adamax(m.parameters()), _mlp_input),
    "nadam": (mlp, lambda m: torch.optim.NAdam(m.parameters()), _mlp_input),
    "radam": (mlp, lambda m: torch.optim.RAdam(m.parameters()), _mlp_input),
    "adadelta": (mlp, lambda m: torch.optim.Adadelta(m.parameters()), _mlp_input),
    # frozen layers handed to the optimizer anyway: lazy optimizers skip them, Adagrad does not
    "frozen-adamw": (_frozen_mlp, lambda m: torch.optim.AdamW(m.parameters()), _mlp_input),
    "frozen-adagrad": (_frozen_mlp, lambda m: torch.optim.Adagrad(m.parameters()), _mlp_input),
    "frozen-adamw-trainable-only": (
        _frozen_mlp,
        lambda m: torch.optim.AdamW(p for p in m.parameters() if p.requires_grad),
        _mlp_input,
    ),
    "tied-gpt2-adamw": (_tiny_gpt2, lambda m: torch.optim.AdamW(m.parameters()), _tokens),
}
if hasattr(torch.optim, "Adafactor"):
    CASES["adafactor"] = (ConvNet, lambda m: torch.optim.Adafactor(m.parameters()), convnet_input)
if hasattr(torch.optim, "Muon"):
    CASES["muon"] = (
        lambda: nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 3, bias=False)),
        lambda m: torch.optim.Muon(m.parameters()),
        _mlp_input,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_budget_equals_real_step(case: str) -> None:
    make_model, make_optimizer, make_input = CASES[case]
    model = make_model()
    optimizer = make_optimizer(model)
    train(model, optimizer, make_input)
    budget = model_states(model, optimizer, "fp32")
    held = held_bytes([model], optimizer)
    assert expected_items(budget) == held
    assert budget.total == sum(held.values())
    assert budget.psi == count_parameters(model).psi
    assert budget.device == "cpu"


def test_real_step_cases_cover_the_brief() -> None:
    held = {}
    for case in ("adamw", "sgd-plain", "adagrad", "rmsprop", "frozen-adamw", "frozen-adagrad", "tied-gpt2-adamw"):
        make_model, make_optimizer, make_input = CASES[case]
        model = make_model()
        optimizer = make_optimizer(model)
        train(model, optimizer, make_input)
        held[case] = held_bytes([model], optimizer)
    psi = count_parameters(mlp()).psi
    assert held["adamw"] == {
        "parameters": 4 * psi,
        "gradients": 4 * psi,
        "exp_avg": 4 * psi,
        "exp_avg_sq": 4 * psi,
        "step counters": 4 * 6,  # one float32 scalar per parameter tensor (6 of them), on the CPU
    }
    assert held["sgd-plain"] == {"parameters": 4 * psi, "gradients": 4 * psi}
    assert set(held["rmsprop"]) == {
        "parameters",
        "gradients",
        "square_avg",
        "momentum_buffer",
        "grad_avg",
        "step counters",
    }
    assert held["frozen-adamw"]["frozen parameters"] == 4 * (6 * 10 + 10)
    assert held["frozen-adagrad"]["sum"] == 4 * psi  # Adagrad creates state for frozen tensors too
    tied = _tiny_gpt2()
    assert held["tied-gpt2-adamw"]["parameters"] == 4 * count_parameters(tied).psi
    assert held["tied-gpt2-adamw"]["parameters"] < 4 * sum(p.numel() for p in tied.state_dict().values())


def test_step_counters_follow_the_default_dtype() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = mlp(dtype=torch.float64)
        optimizer = torch.optim.AdamW(model.parameters())
        train(model, optimizer, _mlp_input)
        held = held_bytes([model], optimizer)
        budget = model_states(model, optimizer)
    finally:
        torch.set_default_dtype(previous)
    assert budget.items["step counters"] == held["step counters"] == 8 * count_parameters(model).tensors


def test_string_optimizer_equals_object() -> None:
    model = mlp()
    for name, optimizer, options in [
        ("adamw", torch.optim.AdamW(model.parameters()), None),
        ("adam", torch.optim.Adam(model.parameters(), amsgrad=True), {"amsgrad": True}),
        ("sgd", torch.optim.SGD(model.parameters(), lr=0.1), None),
        ("sgd", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), {"momentum": 0.9}),
        ("rmsprop", torch.optim.RMSprop(model.parameters(), centered=True), {"centered": True}),
        ("adagrad", torch.optim.Adagrad(model.parameters()), None),
    ]:
        by_name = model_states(model, name, optimizer_options=options)
        assert by_name.items == model_states(model, optimizer).items, name
        assert by_name.optimizer == type(optimizer).__name__
    assert "momentum_buffer" not in model_states(model, "SGD").items
    assert {"adam", "adamw", "sgd", "adagrad", "rmsprop"} <= set(registered_optimizers())


def _mixed_step(
    model: nn.Module, masters: list[nn.Parameter], optimizer: torch.optim.Optimizer, *, keep_fp32_grads: bool
) -> None:
    params = list(model.parameters())
    for p in params:
        p.grad = None
    model(_mlp_input().to(torch.bfloat16)).float().square().mean().backward()
    for p, master in zip(params, masters, strict=True):
        assert p.grad is not None
        master.grad = p.grad.float()
        if keep_fp32_grads:  # Megatron: fp32 main grads persist, the 16-bit ones do not
            p.grad = None
    optimizer.step()
    with torch.no_grad():
        for p, master in zip(params, masters, strict=True):
            p.copy_(master)
    if not keep_fp32_grads:  # ZeRO-paper recipe: the fp32 copy of the gradient is transient
        for master in masters:
            master.grad = None


@pytest.mark.parametrize(("precision", "keep_fp32_grads"), [("mixed", False), ("mixed-fp32-grads", True)])
def test_mixed_precision_recipe_equals_real_step(precision: str, keep_fp32_grads: bool) -> None:
    model = mlp(dtype=torch.bfloat16)
    masters = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    optimizer = torch.optim.AdamW(masters)
    for _ in range(2):
        _mixed_step(model, masters, optimizer, keep_fp32_grads=keep_fp32_grads)
    held = held_bytes([model], optimizer, masters)
    budget = model_states(model, optimizer, precision)
    psi = budget.psi
    assert expected_items(budget) == held
    per_psi = 16 if precision == "mixed" else 18
    assert budget.total == per_psi * psi + 4 * len(masters)  # + the CPU step counters
    grad_bytes = 2 if precision == "mixed" else 4
    assert dict(budget.items) == {
        "parameters": 2 * psi,
        "gradients": grad_bytes * psi,
        "master weights": 4 * psi,
        "exp_avg": 4 * psi,
        "exp_avg_sq": 4 * psi,
        "step counters": 4 * len(masters),
    }


def test_pure_bf16_recipe_equals_real_step() -> None:
    model = mlp(dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    train(model, optimizer, lambda: _mlp_input().to(torch.bfloat16))
    budget = model_states(model, optimizer, "bf16")
    assert expected_items(budget) == held_bytes([model], optimizer)
    assert budget.total == 8 * budget.psi + 4 * count_parameters(model).tensors


def test_several_modules_and_shared_parameters() -> None:
    shared = nn.Linear(4, 4)
    first, second = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(nn.Linear(2, 4), shared)
    optimizer = torch.optim.SGD([*first.parameters(), *second[0].parameters()], lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        second(first(torch.randn(3, 4))).sum().backward()
        optimizer.step()
    budget = model_states([first, second], optimizer)
    assert expected_items(budget) == held_bytes([first, second], optimizer)
    assert budget.psi == 20 + 10 + 12


class EmaSign(torch.optim.Optimizer):
    """A user optimizer: keeps an EMA of the gradient and a float64 'best' per parameter."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["ema"] = torch.zeros_like(p)
                    state["best"] = torch.zeros(p.shape, dtype=torch.float64)
                state["ema"].lerp_(p.grad, 1 - group["beta"])
                p.add_(state["ema"].sign(), alpha=-group["lr"])


def _ema_sign_rule(group: Mapping[str, Any], params: Any) -> OptimizerState:
    live = [p for p in params if p.requires_grad]
    return OptimizerState(
        elements={"ema": sum(p.numel() for p in live)}, nbytes={"best": 8 * sum(p.numel() for p in live)}
    )


@pytest.fixture
def registry() -> Iterator[None]:
    """A test that registers an optimizer takes it away again: the registry is the process's."""
    rules, names = dict(optimizers._RULES), dict(optimizers._NAMES)
    yield
    optimizers._RULES.clear()
    optimizers._RULES.update(rules)
    optimizers._NAMES.clear()
    optimizers._NAMES.update(names)


def test_register_user_optimizer(registry: None) -> None:
    model = mlp()
    optimizer = EmaSign(model.parameters())
    with pytest.raises(ValueError, match=r"no state rule for optimizer EmaSign; register one"):
        model_states(model, optimizer)
    register_optimizer(EmaSign, _ema_sign_rule, name="ema-sign")
    train(model, optimizer, _mlp_input)
    budget = model_states(model, optimizer)
    assert expected_items(budget) == held_bytes([model], optimizer)
    assert model_states(model, "ema-sign", optimizer_options={"beta": 0.5}).items == budget.items
    assert registered_optimizers()["ema-sign"] is EmaSign
    with pytest.raises(TypeError, match=r"not a torch\.optim\.Optimizer subclass"):
        register_optimizer(int, _ema_sign_rule)  # type: ignore[arg-type]


def test_subclass_inherits_rule() -> None:
    class MyAdamW(torch.optim.AdamW):
        pass

    model = mlp()
    optimizer = MyAdamW(model.parameters())
    train(model, optimizer, _mlp_input)
    assert expected_items(model_states(model, optimizer)) == held_bytes([model], optimizer)


def test_adafactor_factored_shapes() -> None:
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch >= 2.5")
    weight = nn.Parameter(torch.empty(3, 5, 7, 11, device="meta"))
    vector = nn.Parameter(torch.empty(13, device="meta"))
    (state,) = optimizer_state("adafactor", [weight, vector])
    assert dict(state.elements) == {"row_var": 3 * 5 * 7, "col_var": 3 * 5 * 11, "variance": 13}
    assert dict(state.scalars) == {"step": 2}
    assert not state.scalars_on_device


# --------------------------------------------------------------------------- recipes and ZeRO on a meta GPT-2-XL


def test_meta_gpt2_xl_recipes(gpt2_xl: GPT2) -> None:
    psi = GPT2_XL_PSI
    mixed = model_states(gpt2_xl, "adam", "mixed")
    assert mixed.psi == psi
    assert mixed.total == 16 * psi
    assert dict(mixed.items) == {
        "parameters": 2 * psi,
        "gradients": 2 * psi,
        "master weights": 4 * psi,
        "exp_avg": 4 * psi,
        "exp_avg_sq": 4 * psi,
    }
    assert mixed.bytes_per_psi == 16
    assert model_states(gpt2_xl, "adamw", "mixed-fp32-grads").total == 18 * psi
    assert model_states(gpt2_xl, "adamw", "bf16").total == 8 * psi
    assert model_states(gpt2_xl, "adamw", "fp32").total == 16 * psi
    assert model_states(gpt2_xl, "sgd", "fp32", optimizer_options={"momentum": 0.9}).total == 12 * psi
    assert model_states(gpt2_xl, "sgd", "fp32").total == 8 * psi
    assert model_states(gpt2_xl, None, "fp32").total == 8 * psi
    assert (
        model_states(gpt2_xl, "adam", "mixed", device="cpu").total == 16 * psi + 4 * count_parameters(gpt2_xl).tensors
    )


def test_meta_gpt2_xl_optimizer_object(gpt2_xl: GPT2) -> None:
    psi = GPT2_XL_PSI
    tensors = count_parameters(gpt2_xl).tensors
    # a default optimizer keeps its step counters on the CPU: not on the budgeted (meta/cuda) device
    assert model_states(gpt2_xl, torch.optim.AdamW(gpt2_xl.parameters()), "mixed").total == 16 * psi
    fused = model_states(gpt2_xl, torch.optim.AdamW(gpt2_xl.parameters(), fused=True), "mixed")
    assert fused.items["step counters"] == 4 * tensors
    capturable = model_states(gpt2_xl, torch.optim.Adam(gpt2_xl.parameters(), capturable=True), "mixed")
    assert capturable.total == 16 * psi + 4 * tensors


@pytest.mark.parametrize(
    ("stage", "per_rank"),
    [
        (0, lambda p, n: 16 * p),
        (1, lambda p, n: 4 * p + 12 * p // n),
        (2, lambda p, n: 2 * p + 14 * p // n),
        (3, lambda p, n: 16 * p // n),
    ],
)
def test_meta_gpt2_xl_zero(gpt2_xl: GPT2, stage: int, per_rank: Callable[[int, int], int]) -> None:
    assert GPT2_XL_PSI % 8 == 0
    budget = model_states(gpt2_xl, "adam", "mixed", zero_stage=stage, world_size=8)
    assert budget.total == per_rank(GPT2_XL_PSI, 8)
    assert (budget.zero_stage, budget.world_size) == (stage, 8)


def test_zero_rounds_each_item_up() -> None:
    model = nn.Linear(3, 1)  # Ψ = 4
    budget = model_states(model, "adam", "mixed", zero_stage=3, world_size=3, device="meta")
    assert dict(budget.items) == {
        "parameters": 2 * 2,  # ceil(4 / 3) = 2 elements per rank
        "gradients": 2 * 2,
        "master weights": 4 * 2,
        "exp_avg": 4 * 2,
        "exp_avg_sq": 4 * 2,
    }
    frozen = nn.Sequential(nn.Linear(3, 1), nn.Linear(1, 1))
    frozen[0].requires_grad_(False)
    stage2 = model_states(frozen, "sgd", "fp32", zero_stage=2, world_size=4, optimizer_options={"momentum": 0.9})
    assert dict(stage2.items) == {
        "parameters": 4 * 2,
        "frozen parameters": 4 * 4,
        "gradients": 4 * 1,
        "momentum_buffer": 4 * 1,
    }
    assert model_states(frozen, zero_stage=3, world_size=4).items["frozen parameters"] == 4 * 1


def test_frozen_parameters_cost_only_weights() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 1))
    model[0].requires_grad_(False)
    budget = model_states(model, "adamw", "mixed", device="meta")
    assert budget.psi == 11
    assert dict(budget.items) == {
        "parameters": 22,
        "frozen parameters": 220,
        "gradients": 22,
        "master weights": 44,
        "exp_avg": 44,
        "exp_avg_sq": 44,
    }


def test_custom_precision() -> None:
    fp8 = Precision("fp8-states", param_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=1)
    budget = model_states(nn.Linear(7, 1), "adam", fp8, device="meta")
    assert budget.precision == "fp8-states"
    assert budget.total == (2 + 2 + 4 + 1 + 1) * 8
    assert set(PRECISIONS) == {"fp32", "mixed", "mixed-fp32-grads", "bf16"}


def test_budget_table() -> None:
    budget = model_states(nn.Linear(3, 1), "adamw", "mixed", device="meta")
    text = str(budget)
    lines = text.splitlines()
    assert lines[0] == "model states: precision=mixed, optimizer=AdamW, Ψ=4"
    assert lines[1].split() == ["item", "bytes", "size", "bytes", "per", "Ψ"]
    rows = {line.split("  ")[0].strip(): line.split() for line in lines[3:]}
    assert rows["master weights"][-1] == "4"
    assert rows["total"][-4:] == ["64", "64", "B", "16"]
    empty = model_states(nn.Linear(3, 1).requires_grad_(False), "adamw", device="meta")
    assert empty.bytes_per_psi is None
    assert str(empty).splitlines()[-1].split()[-1] == "n/a"
    zero = str(model_states(nn.Linear(3, 1), "adamw", "mixed", zero_stage=2, world_size=4, device="meta"))
    assert budget.to_dict() == {
        "precision": "mixed",
        "optimizer": "AdamW",
        "psi": 4,
        "zero_stage": 0,
        "world_size": 1,
        "device": "meta",
        "items": {"parameters": 8, "gradients": 8, "master weights": 16, "exp_avg": 16, "exp_avg_sq": 16},
        "total": 64,
    }
    assert "ZeRO-2 over 4 ranks (per rank)" in zero


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"precision": "fp16"},
            r"unknown precision 'fp16'; expected one of 'fp32', 'mixed', 'mixed-fp32-grads', 'bf16'",
        ),
        ({"optimizer": "lion"}, r"unknown optimizer 'lion'; expected one of .*'adamw'"),
        ({"optimizer": "sgd", "optimizer_options": {"momentun": 0.9}}, r"SGD has no option 'momentun'"),
        ({"optimizer_options": {"momentum": 0.9}}, "optimizer_options given without an optimizer"),
        ({"zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3"),
        ({"zero_stage": 1, "world_size": 0}, "world_size must be a positive int"),
    ],
)
def test_model_states_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_states(nn.Linear(2, 2), **kwargs)


def test_options_with_an_optimizer_object_are_rejected() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="only to an optimizer named by a string"):
        model_states(model, torch.optim.SGD(model.parameters()), optimizer_options={"momentum": 0.9})
    with pytest.raises(ValueError, match="only to an optimizer named by a string"):
        optimizer_state(torch.optim.SGD(model.parameters()), list(model.parameters()))
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer or a name, got int"):
        optimizer_state(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- activations: formulas

SHAPES = [(1, 1, 1), (2, 16, 64), (4, 128, 768), (8, 2048, 1600), (3, 5, 7)]


@pytest.mark.parametrize(("b", "s", "d"), SHAPES)
def test_mlp_activation_formulas(b: int, s: int, d: int) -> None:
    assert mlp_activations(b, s, d) == 18 * b * s * d
    assert mlp_activations(b, s, d, "gelu", dropout=True) == 19 * b * s * d
    assert mlp_activations(b, s, d, "relu") == mlp_activations(b, s, d, "tanh") == 10 * b * s * d
    assert mlp_activations(b, s, d, "ReLU", dropout=True) == 11 * b * s * d
    assert mlp_activations(b, s, d, "gelu", dtype_bytes=4) == 36 * b * s * d
    assert mlp_activations(b, s, d, "gelu", dtype_bytes=4, dropout=True) == 37 * b * s * d
    assert mlp_activations(b, s, d, "silu", ffn_hidden=3 * d) == 2 * b * s * (d + 6 * d)
    assert mlp_activations(b, s, d, "tanh", dropout=True, mask_bytes=2) == 12 * b * s * d
    assert mlp_activations(b, s, d, "tanh", dropout=False, mask_bytes=2) == 10 * b * s * d


@pytest.mark.parametrize(("s", "b", "h", "a"), [(2048, 1, 12288, 96), (1024, 8, 1600, 25), (7, 3, 10, 5)])
def test_transformer_layer_formulas(s: int, b: int, h: int, a: int) -> None:
    paper = s * b * h * (34 + Fraction(5 * a * s, h))
    assert paper.denominator == 1
    none = transformer_layer_activations(s, b, h, a)
    assert isinstance(none, int)
    assert none == paper
    assert transformer_layer_activations(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert transformer_layer_activations(s, b, h, a, recompute="full") == 2 * s * b * h


def test_activation_errors() -> None:
    with pytest.raises(ValueError, match="unknown activation 'swiglu'"):
        mlp_activations(1, 1, 1, "swiglu")
    with pytest.raises(ValueError, match="unknown recompute 'some'"):
        transformer_layer_activations(1, 1, 1, 1, recompute="some")
    with pytest.raises(ValueError, match="batch must be a non-negative int"):
        mlp_activations(-1, 1, 1)
    with pytest.raises(ValueError, match="seq must be a non-negative int"):
        transformer_layer_activations(1.5, 1, 1, 1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- activations: real saved tensors


class NativeDropout(nn.Module):
    """What ``F.dropout`` runs on accelerators: ``native_dropout``, which saves a bool mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _mask = torch.native_dropout(x, 0.1, True)
        return out


class Mlp(nn.Module):
    def __init__(self, d: int, activation: nn.Module, dropout: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = activation
        self.fc2 = nn.Linear(4 * d, d)
        self.drop: nn.Module = {"none": nn.Identity(), "native": NativeDropout(), "cpu": nn.Dropout(0.1)}[dropout]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.fc2(self.act(self.fc1(x))))
        return out


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of distinct storages saved for backward, parameters and their views excluded."""
    excluded = {storage_key(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in excluded:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.float().sum().backward()
    return sum(saved.values())


ACTIVATION_MODULES: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "silu": nn.SiLU,
    "sigmoid": nn.Sigmoid,
}


@pytest.mark.parametrize("activation", sorted(ACTIVATION_MODULES))
@pytest.mark.parametrize(("b", "s", "d"), [(1, 1, 8), (2, 16, 32), (3, 7, 24), (1, 64, 64)])
@pytest.mark.parametrize("dropout", ["none", "native", "cpu"])
def test_mlp_activations_equal_saved_tensors(activation: str, b: int, s: int, d: int, dropout: str) -> None:
    torch.manual_seed(0)
    model = Mlp(d, ACTIVATION_MODULES[activation](), dropout).to(torch.bfloat16).train()
    x = torch.randn(b, s, d, dtype=torch.bfloat16)
    # nn.Dropout on the CPU keeps its mask in the activation dtype (2 bytes), native_dropout a bool (1 byte)
    expected = mlp_activations(b, s, d, activation, dropout=dropout != "none", mask_bytes=2 if dropout == "cpu" else 1)
    assert saved_activation_bytes(model, x) == expected


def test_gpt2_mlp_matches_gelu_formula() -> None:
    torch.manual_seed(0)
    model = gpt2("tiny").to(torch.bfloat16)
    block = model.h[0]
    assert isinstance(block, Block)
    block_mlp = block.mlp
    x = torch.randn(2, 9, model.config.n_embd, dtype=torch.bfloat16)
    assert saved_activation_bytes(block_mlp, x) == mlp_activations(2, 9, model.config.n_embd, "gelu")


def test_meta_models_never_allocate() -> None:
    # building and budgeting GPT-2-XL on meta is fast and leaves every tensor on meta
    with torch.device("meta"):
        model = gpt2("gpt2-xl")
    budget = model_states(model, torch.optim.AdamW(model.parameters()), "mixed", zero_stage=1, world_size=8)
    assert budget.device == "meta"
    assert budget.total == 4 * GPT2_XL_PSI + math.ceil(12 * GPT2_XL_PSI / 8)
    assert all(p.is_meta for p in model.parameters())
