"""Accuracy of the CPU engine as a benchmark output: measured bytes against the analytic budgets.

Run: ``python benchmarks/bench_accuracy.py``

Two families of cases, each measured with ``pytest_gpumem.measurement.recorder(device="cpu")``:

* Saved activations of a bf16 transformer MLP (``Linear(d, 4d)`` → activation →
  ``Linear(4d, d)``), forward only: ``span.saved_activations`` against
  ``budgets.mlp_activations(b, s, d, activation)`` — 18·b·s·d bytes with GELU,
  10·b·s·d with ReLU or Tanh (their backward reads the output, which the second
  Linear saves anyway); with a dropout after the MLP, plus its mask (b·s·d elements,
  kept in the activation's dtype by eager CPU dropout: ``mask_bytes=2``).
* Model states after a training step (a warm-up step first: optimizers create their
  state lazily): ``parameters + gradients + optimizer_state`` of the span's
  ``allocated_breakdown`` against ``budgets.model_states(model, optimizer, precision)``
  — fp32 AdamW 16 bytes per parameter (plus AdamW's 4-byte ``step`` tensor per
  parameter tensor), SGD with momentum 12, plain SGD 8, and mixed precision (bf16
  model, fp32 master weights updated by AdamW) 16.

Every measured figure must equal its analytic figure to the byte; the script exits
with status 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_gpumem import measure
from pytest_gpumem.budgets.formulas import count_parameters, mlp_activations, model_states
from pytest_gpumem.data.figures import Measurement

MODEL_STATES = ("parameters", "gradients", "optimizer_state")
ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}


def saved_activations(b: int, s: int, d: int, activation: str, dropout: bool) -> int:
    """Bytes a bf16 MLP saves for backward in one forward pass, as the CPU engine measures them."""
    torch.manual_seed(0)
    layers = [nn.Linear(d, 4 * d), ACTIVATIONS[activation](), nn.Linear(4 * d, d)]
    if dropout:
        layers.append(nn.Dropout(0.1))
    model = nn.Sequential(*layers).to(torch.bfloat16)
    x = torch.randn(b, s, d, dtype=torch.bfloat16)
    with measure("forward", device="cpu", track=(model,)) as span:
        out = model(x)
    del out
    assert span.saved_activations is not None
    return span.saved_activations


def states_after_step(model: nn.Module, opt: torch.optim.Optimizer, step: Callable[[], None]) -> int:
    """Bytes of parameters, gradients and optimizer state allocated after a measured (second) step."""
    step()  # optimizers create their state at the first step
    with measure("step", device="cpu", track=(model, opt)) as span:
        step()
    m: Measurement = span.measurement
    assert m.allocated_breakdown is not None
    return sum(m.allocated_breakdown[c] for c in MODEL_STATES)


def mlp(d: int = 64, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).to(dtype)


def fp32_case(optimizer: str) -> tuple[int, int, int]:
    """(measured, budget, Ψ) for an fp32 MLP trained with ``optimizer``."""
    model = mlp()
    params = list(model.parameters())
    opt: torch.optim.Optimizer = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "sgd": lambda: torch.optim.SGD(params, lr=0.1),
    }[optimizer]()
    x = torch.randn(8, 16, 64)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    measured = states_after_step(model, opt, step)
    return measured, model_states(model, opt, "fp32").total, count_parameters(model).psi


def mixed_case() -> tuple[int, int, int]:
    """(measured, budget, Ψ): bf16 model, fp32 master copies updated by AdamW (the ZeRO paper's 16Ψ)."""
    model = mlp(dtype=torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-3)
    x = torch.randn(8, 16, 64, dtype=torch.bfloat16)

    def step() -> None:
        for p in params:
            p.grad = None
        model(x).float().pow(2).mean().backward()
        for p, master in zip(params, masters, strict=True):
            assert p.grad is not None
            master.grad = p.grad.float()
        opt.step()
        for p, master in zip(params, masters, strict=True):
            master.grad = None
            p.data.copy_(master.data)

    measured = states_after_step(model, opt, step)
    return measured, model_states(model, "adamw", "mixed", device="cpu").total, count_parameters(model).psi


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        description="The CPU engine's measured bytes against the analytic budgets (no options): "
        "exits 1 unless every case is equal to the byte."
    ).parse_args(argv)
    torch.set_num_threads(1)
    rows: list[list[str]] = []
    failures = 0

    def row(case: str, formula: str, measured: int, analytic: int) -> None:
        nonlocal failures
        ok = measured == analytic
        failures += not ok
        rows.append(
            [
                case,
                formula,
                f"{measured:,}",
                f"{analytic:,}",
                f"{measured - analytic:+,}",
                "equal" if ok else "DIFFERENT",
            ]
        )

    for b, s, d in ((2, 16, 32), (4, 128, 256)):
        for activation in ("gelu", "relu", "tanh"):
            factor = 18 if activation == "gelu" else 10
            row(
                f"bf16 MLP {activation}, b={b} s={s} d={d}",
                f"{factor}·b·s·d",
                saved_activations(b, s, d, activation, dropout=False),
                mlp_activations(b, s, d, activation),
            )
        row(
            f"bf16 MLP gelu + dropout, b={b} s={s} d={d}",
            "18·b·s·d + 2·b·s·d",
            saved_activations(b, s, d, "gelu", dropout=True),
            mlp_activations(b, s, d, "gelu", dropout=True, mask_bytes=2),
        )
    for optimizer, formula in (("adamw", "16Ψ + 4·tensors"), ("sgd-momentum", "12Ψ"), ("sgd", "8Ψ")):
        measured, analytic, psi = fp32_case(optimizer)
        row(f"fp32 {optimizer} model states, Ψ={psi:,}", formula, measured, analytic)
    measured, analytic, psi = mixed_case()
    row(f"bf16 + fp32 master AdamW model states, Ψ={psi:,}", "16Ψ + 4·tensors", measured, analytic)

    print(f"torch {torch.__version__}, CPU engine (exact storage tracker)")
    print(
        tabulate(
            rows,
            headers=["case", "formula", "measured B", "analytic B", "difference", "verdict"],
            disable_numparse=True,
            colalign=("left", "left", "right", "right", "right", "left"),
        )
    )
    print(f"\n{len(rows) - failures} of {len(rows)} cases equal to the byte")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
