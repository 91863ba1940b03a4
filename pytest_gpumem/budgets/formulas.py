"""Theoretical memory budgets of a training step: parameter counts, model states and saved activations.

Only shapes are read (``meta`` models work); every ``*_bytes`` figure and budget item is in bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import torch

from pytest_gpumem.budgets.optimizers import OptimizerState, optimizer_state, registered_optimizers
from pytest_gpumem.codec import Coded, coded
from pytest_gpumem.tables import table
from pytest_gpumem.units import format_size

__all__ = [
    "ACTIVATIONS",
    "PRECISIONS",
    "RECOMPUTE",
    "Budget",
    "ParamCount",
    "Precision",
    "count_parameters",
    "mlp_activations",
    "model_states",
    "tracked_psi",
    "transformer_layer_activations",
]


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one or more modules, in elements; a shared or tied parameter counts once.

    Trainable means ``requires_grad``; the ``*_by_dtype`` maps are elements per ``torch.dtype``.
    """

    trainable: int
    frozen: int
    trainable_tensors: int
    frozen_tensors: int
    trainable_by_dtype: Mapping[torch.dtype, int] = field(default_factory=dict)
    frozen_by_dtype: Mapping[torch.dtype, int] = field(default_factory=dict)

    @property
    def psi(self) -> int:
        """Ψ: the number of trainable parameters (elements)."""
        return self.trainable

    @property
    def total(self) -> int:
        """Trainable plus frozen elements."""
        return self.trainable + self.frozen

    @property
    def tensors(self) -> int:
        """Number of distinct parameter tensors, trainable and frozen."""
        return self.trainable_tensors + self.frozen_tensors

    @property
    def by_dtype(self) -> Mapping[torch.dtype, int]:
        """All elements (trainable and frozen) per ``torch.dtype``."""
        merged = dict(self.trainable_by_dtype)
        for dtype, count in self.frozen_by_dtype.items():
            merged[dtype] = merged.get(dtype, 0) + count
        return MappingProxyType(merged)

    @property
    def trainable_bytes(self) -> int:
        """Bytes of the trainable parameters at their own dtypes."""
        return sum(count * dtype.itemsize for dtype, count in self.trainable_by_dtype.items())

    @property
    def frozen_bytes(self) -> int:
        """Bytes of the frozen parameters at their own dtypes."""
        return sum(count * dtype.itemsize for dtype, count in self.frozen_by_dtype.items())

    @property
    def nbytes(self) -> int:
        """Bytes of all parameters at their own dtypes."""
        return self.trainable_bytes + self.frozen_bytes


def _as_modules(modules: torch.nn.Module | Iterable[torch.nn.Module]) -> tuple[torch.nn.Module, ...]:
    """A module, or an iterable of modules, as a tuple of modules."""
    if isinstance(modules, torch.nn.Module):
        return (modules,)
    result = tuple(modules)
    for module in result:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"expected torch.nn.Module objects, got {type(module).__name__}")
    return result


def _unique_parameters(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Distinct parameters of ``modules`` in registration order (identity, not value)."""
    return list({id(param): param for module in modules for param in module.parameters()}.values())


def _local_numel(param: torch.Tensor) -> int:
    """Elements this process holds: a DTensor parameter (FSDP2, tensor parallelism) counts its local shard."""
    to_local = getattr(param, "to_local", None)
    return int(to_local().numel()) if callable(to_local) else int(param.numel())


def tracked_psi(objects: Sequence[Any]) -> int | None:
    """Ψ of tracked modules and optimizers: the modules' trainable parameters, else (only
    optimizers tracked) their distinct trainable parameters; None when nothing is tracked."""
    if not objects:
        return None
    modules = [obj for obj in objects if isinstance(obj, torch.nn.Module)]
    if modules:
        return count_parameters(modules).psi
    params = {id(p): p for o in objects for group in o.param_groups for p in group["params"]}
    return sum(int(p.numel()) for p in params.values() if p.requires_grad)


def count_parameters(*modules: torch.nn.Module | Sequence[torch.nn.Module]) -> ParamCount:
    """Count the parameters of ``modules`` (each a module or a sequence of modules), deduplicated by identity.

    A ``DTensor`` parameter (FSDP2, tensor parallelism) counts this process's shard.
    """
    params = _unique_parameters(module for arg in modules for module in _as_modules(arg))
    frozen: dict[torch.dtype, int] = {}
    trainable: dict[torch.dtype, int] = {}
    for param in params:
        target = trainable if param.requires_grad else frozen
        target[param.dtype] = target.get(param.dtype, 0) + _local_numel(param)
    trainable_tensors = sum(param.requires_grad for param in params)
    return ParamCount(
        trainable=sum(trainable.values()),
        frozen=sum(frozen.values()),
        trainable_tensors=trainable_tensors,
        frozen_tensors=len(params) - trainable_tensors,
        trainable_by_dtype=MappingProxyType(trainable),
        frozen_by_dtype=MappingProxyType(frozen),
    )


# --------------------------------------------------------------------------- precision recipes


@dataclass(frozen=True)
class Precision:
    """A precision recipe: bytes per element of each model state (``master_bytes`` 0 without an fp32 master copy)."""

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int


#: The built-in precision recipes, by name.
PRECISIONS: Mapping[str, Precision] = MappingProxyType(
    {
        "fp32": Precision("fp32", param_bytes=4, grad_bytes=4, master_bytes=0, state_bytes=4),
        "mixed": Precision("mixed", param_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4),
        "mixed-fp32-grads": Precision("mixed-fp32-grads", param_bytes=2, grad_bytes=4, master_bytes=4, state_bytes=4),
        "bf16": Precision("bf16", param_bytes=2, grad_bytes=2, master_bytes=0, state_bytes=2),
    }
)


def _precision(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        names = ", ".join(repr(name) for name in PRECISIONS)
        raise ValueError(f"unknown precision {precision!r}; expected one of {names} or a Precision") from None


# --------------------------------------------------------------------------- model states


@dataclass(frozen=True)
class Budget(Coded):
    """A theoretical memory budget: item name → bytes, in report order (per rank under ZeRO)."""

    items: Mapping[str, int]
    psi: int
    precision: str
    optimizer: str | None = None
    zero_stage: int = 0
    world_size: int = 1
    device: str = field(default="cpu", metadata=coded(then={"total": lambda b: b.total}))
    _codec_order = ("precision", "optimizer", "psi", "zero_stage", "world_size", "device")

    @property
    def total(self) -> int:
        """The sum of all items, in bytes."""
        return sum(self.items.values())

    @property
    def bytes_per_psi(self) -> Fraction | None:
        """``total / Ψ`` exactly; None when Ψ is 0."""
        return Fraction(self.total, self.psi) if self.psi else None

    def __str__(self) -> str:
        per_rank = f", ZeRO-{self.zero_stage} over {self.world_size} ranks (per rank)" if self.zero_stage else ""
        title = (
            f"model states: precision={self.precision}, optimizer={self.optimizer or 'none'}, Ψ={self.psi:,}{per_rank}"
        )
        rows = [
            (name, f"{nbytes:,}", format_size(nbytes), _per_psi(nbytes, self.psi))
            for name, nbytes in [*self.items.items(), ("total", self.total)]
        ]
        return f"{title}\n{table(('item', 'bytes', 'size', 'bytes per Ψ'), rows, right=(1, 2, 3))}"


def _per_psi(nbytes: int, psi: int) -> str:
    if not psi:
        return "n/a"
    ratio = Fraction(nbytes, psi)
    if ratio.denominator == 1:
        return str(ratio.numerator)
    if 0 < ratio < Fraction(1, 1000):
        return "<0.001"
    return f"{float(ratio):.3f}"


@dataclass
class _Item:
    elements: int
    width: int
    stage: int  # the ZeRO stage from which the item is partitioned

    def nbytes(self, zero_stage: int, world_size: int) -> int:
        elements = -(-self.elements // world_size) if zero_stage >= self.stage else self.elements
        return elements * self.width


def model_states(
    modules: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer | str | None = None,
    precision: str | Precision = "fp32",
    *,
    zero_stage: int = 0,
    world_size: int = 1,
    optimizer_options: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> Budget:
    """The bytes of the model states of training ``modules`` (see docs/budgets.md).

    ``optimizer`` is None, a ``torch.optim.Optimizer`` (its type and actual hyper-parameters are read) or a registered
    name (``"adamw"``, with ``optimizer_options``); ``precision`` a name in :data:`PRECISIONS` or a :class:`Precision`.
    ZeRO ``zero_stage`` 1 partitions master weights and optimizer state over ``world_size`` ranks, 2 also gradients, 3
    also parameters. Step counters count only when they live on ``device`` (default: the first parameter's).
    """
    recipe = _precision(precision)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    params = _unique_parameters(_as_modules(modules))
    trainable = [p for p in params if p.requires_grad]
    psi = sum(p.numel() for p in trainable)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    first = params[0].device if params else "cpu"
    budget_device = torch.device(first if device is None else device)

    items: dict[str, _Item] = {"parameters": _Item(psi, recipe.param_bytes, 3)}
    if frozen:
        items["frozen parameters"] = _Item(frozen, recipe.param_bytes, 3)
    items["gradients"] = _Item(psi, recipe.grad_bytes, 2)
    if recipe.master_bytes:
        items["master weights"] = _Item(psi, recipe.master_bytes, 1)

    optimizer_name: str | None = None
    if optimizer is not None:
        named = not isinstance(optimizer, torch.optim.Optimizer)
        states = optimizer_state(optimizer, trainable if named else (), optimizer_options)
        _add_states(items, states, recipe, budget_device)
        optimizer_name = registered_optimizers()[str(optimizer).lower()].__name__ if named else type(optimizer).__name__
    elif optimizer_options:
        raise ValueError("optimizer_options given without an optimizer")

    return Budget(
        items=MappingProxyType({name: item.nbytes(zero_stage, world_size) for name, item in items.items()}),
        psi=psi,
        precision=recipe.name,
        optimizer=optimizer_name,
        zero_stage=zero_stage,
        world_size=world_size,
        device=str(budget_device),
    )


def _add_states(
    items: dict[str, _Item], states: Sequence[OptimizerState], recipe: Precision, device: torch.device
) -> None:
    def add(name: str, elements: int, width: int) -> None:
        item = items.get(name)
        if item is None:
            items[name] = _Item(elements, width, 1)
        elif item.width == width:
            item.elements += elements
        else:  # the same state at two widths: keep bytes
            item.elements, item.width = item.elements * item.width + elements * width, 1

    scalars: list[tuple[str, int, int]] = []
    for state in states:
        for name, count in state.elements.items():
            if count:
                add(name, count, recipe.state_bytes)
        for name, nbytes in state.nbytes.items():
            if nbytes:
                add(name, nbytes, 1)
        if state.scalars_on_device or device.type == "cpu":
            scalars.extend((name, count, state.scalar_dtype.itemsize) for name, count in state.scalars.items())
    for name, count, width in scalars:
        if count:
            add("step counters" if name == "step" else name, count, width)


# --------------------------------------------------------------------------- activations

#: Activation functions → True when backward needs the input, False when it reads the output (which the next Linear
#: saves anyway).
ACTIVATIONS: Mapping[str, bool] = MappingProxyType(
    {"gelu": True, "silu": True, "relu": False, "tanh": False, "sigmoid": False}
)

#: Recomputation strategies :func:`transformer_layer_activations` knows.
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")


def _check_counts(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def mlp_activations(
    batch: int,
    seq: int,
    hidden: int,
    activation: str = "gelu",
    *,
    dtype_bytes: int = 2,
    dropout: bool = False,
    ffn_hidden: int | None = None,
    mask_bytes: int = 1,
) -> int:
    """Bytes a transformer MLP (``Linear(d, f)`` → activation → ``Linear(f, d)``) saves for backward.

    ``e·b·s·(d + 2f)`` when the activation saves its input (GELU, SiLU), ``e·b·s·(d + f)`` when it reads its output
    (ReLU, Tanh, Sigmoid); ``dropout`` adds a b·s·d mask of ``mask_bytes`` (bool on accelerators; pass
    ``mask_bytes=dtype_bytes`` for eager CPU dropout).
    """
    _check_counts(batch=batch, seq=seq, hidden=hidden, dtype_bytes=dtype_bytes, mask_bytes=mask_bytes)
    f = 4 * hidden if ffn_hidden is None else ffn_hidden
    _check_counts(ffn_hidden=f)
    saves_input = ACTIVATIONS.get(activation.lower()) if isinstance(activation, str) else None
    if saves_input is None:
        names = ", ".join(repr(name) for name in ACTIVATIONS)
        raise ValueError(f"unknown activation {activation!r}; expected one of {names}")
    tokens = batch * seq
    elements = tokens * (hidden + (2 * f if saves_input else f))
    return elements * dtype_bytes + (tokens * hidden * mask_bytes if dropout else 0)


def transformer_layer_activations(seq: int, batch: int, hidden: int, heads: int, *, recompute: str = "none") -> int:
    """Bytes one transformer layer saves for backward (Korthikanti et al. 2022, no tensor parallelism): exact
    integers."""
    _check_counts(seq=seq, batch=batch, hidden=hidden, heads=heads)
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {', '.join(repr(r) for r in RECOMPUTE)}")
    sbh = seq * batch * hidden
    return {"none": 34 * sbh + 5 * heads * seq * seq * batch, "selective": 34 * sbh, "full": 2 * sbh}[recompute]
