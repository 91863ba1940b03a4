"""Optimizer state by rule: the bytes each optimizer keeps per parameter, and :func:`register_optimizer` for more."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["OptimizerRule", "OptimizerState", "optimizer_state", "register_optimizer", "registered_optimizers"]

# --------------------------------------------------------------------------- optimizer state rules


@dataclass(frozen=True)
class OptimizerState:
    """The state an optimizer keeps for one parameter group.

    ``elements`` are per-element states by torch's name (in elements, stored at the recipe's ``state_bytes``);
    ``nbytes`` states whose width does not follow the recipe; ``scalars`` the number of scalar tensors by name, on the
    parameters' device when ``scalars_on_device`` (``fused``/``capturable``), else on the CPU.
    """

    elements: Mapping[str, int] = field(default_factory=dict)
    nbytes: Mapping[str, int] = field(default_factory=dict)
    scalars: Mapping[str, int] = field(default_factory=dict)
    scalars_on_device: bool = False
    scalar_dtype: torch.dtype = torch.float32


#: A state rule: ``fn(group, params) -> OptimizerState``, from a group's hyper-parameters and tensors (maybe on
#: ``meta``: read shapes, never data).
OptimizerRule = Callable[[Mapping[str, Any], Sequence[torch.Tensor]], OptimizerState]

_RULES: dict[type[torch.optim.Optimizer], OptimizerRule] = {}
_NAMES: dict[str, type[torch.optim.Optimizer]] = {}


def register_optimizer(
    optimizer_class: type[torch.optim.Optimizer], fn: OptimizerRule, *, name: str | None = None
) -> None:
    """Register ``fn(group, params) -> OptimizerState`` as the state rule of ``optimizer_class`` and its subclasses.

    ``name`` (default: the class name in lower case) lets :func:`model_states` take the optimizer as a string;
    registering a class again replaces its rule.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"{optimizer_class!r} is not a torch.optim.Optimizer subclass")
    if not callable(fn):
        raise TypeError(f"the state rule of {optimizer_class.__name__} must be callable, got {fn!r}")
    _RULES[optimizer_class] = fn
    _NAMES[(name or optimizer_class.__name__).lower()] = optimizer_class


def registered_optimizers() -> Mapping[str, type[torch.optim.Optimizer]]:
    """The optimizers :func:`model_states` knows, by the name it accepts."""
    return MappingProxyType(dict(_NAMES))


def _rule_for(optimizer_class: type[torch.optim.Optimizer]) -> OptimizerRule:
    for cls in optimizer_class.__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule
    raise ValueError(
        f"no state rule for optimizer {optimizer_class.__name__}; "
        f"register one with pytest_gpumem.budgets.optimizers.register_optimizer({optimizer_class.__name__}, fn)"
    )


def _defaults(optimizer_class: type[torch.optim.Optimizer]) -> dict[str, Any]:
    signature = inspect.signature(optimizer_class.__init__)
    return {
        name: param.default
        for name, param in signature.parameters.items()
        if name not in ("self", "params") and param.default is not inspect.Parameter.empty
    }


def optimizer_state(
    optimizer: torch.optim.Optimizer | str,
    params: Sequence[torch.Tensor] = (),
    options: Mapping[str, Any] | None = None,
) -> list[OptimizerState]:
    """The state rule's answer for each parameter group of ``optimizer`` (an object, or a name over ``params``)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if options or params:
            raise ValueError("params and optimizer options apply only to an optimizer named by a string")
        rule = _rule_for(type(optimizer))
        return [rule(MappingProxyType(group), tuple(group["params"])) for group in optimizer.param_groups]
    if not isinstance(optimizer, str):
        raise TypeError(f"expected a torch.optim.Optimizer or a name, got {type(optimizer).__name__}")
    cls = _NAMES.get(optimizer.lower())
    if cls is None:
        names = ", ".join(repr(name) for name in sorted(_NAMES))
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {names}")
    group = _defaults(cls)
    for key, value in (options or {}).items():
        if key not in group:
            raise ValueError(f"{cls.__name__} has no option {key!r}; its options are {', '.join(sorted(group))}")
        group[key] = value
    return [_rule_for(cls)(MappingProxyType(group), tuple(params))]


def _scalar_dtype(fused: bool = False) -> torch.dtype:
    """torch.optim.optimizer._get_scalar_dtype: float32, or float64 when it is the default dtype."""
    return torch.float64 if not fused and torch.get_default_dtype() == torch.float64 else torch.float32


def _with_grad(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors that get a gradient, hence lazily created state."""
    return [p for p in params if p.requires_grad]


def _numel(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _rule(
    *names: str,
    options: Mapping[str, str] = MappingProxyType({}),
    scalars: tuple[str, ...] = ("step",),
    every_tensor: bool = False,
) -> OptimizerRule:
    """A rule for optimizers with one full-size state per name (and per option set: ``option → name``), and scalars
    on the CPU unless ``fused`` or ``capturable``; ``every_tensor``: state made in ``__init__`` for every tensor."""

    def rule(group: Mapping[str, Any], params: Sequence[torch.Tensor]) -> OptimizerState:
        live = list(params) if every_tensor else _with_grad(params)
        kept = [*names, *(name for option, name in options.items() if group.get(option))]
        fused = bool(group.get("fused"))
        return OptimizerState(
            elements=dict.fromkeys(kept, _numel(live)),
            scalars=dict.fromkeys(scalars, len(live)),
            scalars_on_device=fused or bool(group.get("capturable")),
            scalar_dtype=_scalar_dtype(fused),
        )

    return rule


def _sgd(group: Mapping[str, Any], params: Sequence[torch.Tensor]) -> OptimizerState:
    if not group.get("momentum"):
        return OptimizerState()
    return OptimizerState(elements={"momentum_buffer": _numel(_with_grad(params))})


def _rmsprop(group: Mapping[str, Any], params: Sequence[torch.Tensor]) -> OptimizerState:
    live = _with_grad(params)
    n = _numel(live)
    elements = {"square_avg": n}
    if group.get("momentum", 0) > 0:
        elements["momentum_buffer"] = n
    if group.get("centered"):
        elements["grad_avg"] = n
    return OptimizerState(
        elements=elements,
        scalars={"step": len(live)},
        scalars_on_device=bool(group.get("capturable")),
        scalar_dtype=_scalar_dtype(),
    )


def _adafactor(group: Mapping[str, Any], params: Sequence[torch.Tensor]) -> OptimizerState:
    # torch/optim/_adafactor.py: a tensor of 2+ dims keeps a row and a column factor; others a full "variance".
    live = _with_grad(params)
    row = col = variance = 0
    for p in live:
        shape = tuple(p.shape)
        if len(shape) > 1:
            row += math.prod(shape[:-1])
            col += math.prod(shape[:-2]) * shape[-1]
        else:
            variance += p.numel()
    elements = {name: n for name, n in (("row_var", row), ("col_var", col), ("variance", variance)) if n}
    return OptimizerState(elements=elements, scalars={"step": len(live)}, scalar_dtype=_scalar_dtype())


def _muon(group: Mapping[str, Any], params: Sequence[torch.Tensor]) -> OptimizerState:
    return OptimizerState(elements={"momentum_buffer": _numel(_with_grad(params))})


def _register_builtins() -> None:
    optim = torch.optim
    register_optimizer(optim.SGD, _sgd)
    adam = _rule("exp_avg", "exp_avg_sq", options={"amsgrad": "max_exp_avg_sq"})
    register_optimizer(optim.Adam, adam)
    register_optimizer(optim.AdamW, adam)
    register_optimizer(optim.Adagrad, _rule("sum", every_tensor=True))  # made in __init__, for every tensor
    register_optimizer(optim.RMSprop, _rmsprop)
    register_optimizer(optim.Adamax, _rule("exp_avg", "exp_inf"))
    register_optimizer(optim.RAdam, _rule("exp_avg", "exp_avg_sq"))
    register_optimizer(optim.NAdam, _rule("exp_avg", "exp_avg_sq", scalars=("step", "mu_product")))
    register_optimizer(optim.Adadelta, _rule("square_avg", "acc_delta"))
    adafactor = getattr(optim, "Adafactor", None)  # torch >= 2.5
    if adafactor is not None:
        register_optimizer(adafactor, _adafactor)
    muon = getattr(optim, "Muon", None)  # torch >= 2.9
    if muon is not None:
        register_optimizer(muon, _muon)


_register_builtins()
