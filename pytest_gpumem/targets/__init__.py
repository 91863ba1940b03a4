"""Prediction of a GPU's figures on a CPU-only machine: target profiles as data.

A target (one GPU family with one PyTorch version) is a row of ``targets.json``: its device, allocator constants and
library workspaces, checked against the ``record`` a GPU validation run made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from pytest_gpumem.codec import Coded, coded, from_data
from pytest_gpumem.targets.allocator import AllocatorRules, CachingAllocatorModel

__all__ = [
    "AllocatorRules",
    "AttentionBackend",
    "CachingAllocatorModel",
    "Target",
    "Workspace",
    "parse_predict",
    "target",
    "targets",
]


class UnknownTarget(ValueError):
    """A prediction target that ``targets.json`` does not describe."""


@dataclass(frozen=True)
class Workspace(Coded):
    """A library workspace a thread allocates at its first operator of a kind and keeps (``when="bias"``: only ``addmm``
    with a 1-d bias)."""

    library: str
    nbytes: int = field(metadata=coded(key="bytes"))
    operators: frozenset[str]
    when: str | None = None

    def __post_init__(self) -> None:
        if self.when not in (None, "bias"):
            raise ValueError(f"workspace {self.library}: when={self.when!r} (use 'bias' or none)")


@dataclass(frozen=True)
class AttentionBackend(Coded):
    """When a fused scaled-dot-product-attention kernel runs on the target, and what it keeps for backward.

    The first backend of :attr:`Target.attention_order` whose conditions hold runs (``math`` takes the rest); a fused
    kernel keeps its output, a float32 log-sum-exp per query row and, ``"always"`` or with dropout, two int64
    random-state tensors.
    """

    name: str
    dtypes: frozenset[str] = frozenset()
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    mask: bool = True
    gqa: bool = True
    logsumexp_row_multiple: int = 1
    rng_state: str = "always"
    _codec_strict = True

    def keeps_rng_state(self, dropout_p: float) -> bool:
        return self.rng_state == "always" or (self.rng_state == "dropout" and dropout_p > 0)

    def accepts(self, dtype: str, head_dim: int, value_head_dim: int, masked: bool, gqa: bool) -> bool:
        return self.name == "math" or (
            dtype in self.dtypes
            and (self.max_head_dim is None or max(head_dim, value_head_dim) <= self.max_head_dim)
            and head_dim % self.head_dim_multiple == 0
            and value_head_dim % self.head_dim_multiple == 0
            and (self.mask or not masked)
            and (self.gqa or not gqa)
        )


def _attention(data: dict[str, Any]) -> tuple[AttentionBackend, ...]:
    """``{"order": [name, ...], "backends": {name: {...}}}``: the backends in their order."""
    backends = data.get("backends", {})
    return tuple(
        from_data(AttentionBackend, {**backends.get(name, {}), "name": name}, f"attention backend {name}")
        for name in data.get("order", ())
    )


@dataclass(frozen=True)
class Target(Coded):
    """One GPU and PyTorch version whose figures a CPU run predicts (a row of ``targets.json``)."""

    name: str
    aliases: tuple[str, ...] = field(metadata=coded(missing=()))
    device_name: str
    total_memory: int
    compute_capability: str
    torch_version: str
    cuda_version: str
    allocator: AllocatorRules = field(metadata=coded(read=AllocatorRules.from_dict, missing=AllocatorRules()))
    workspaces: tuple[Workspace, ...] = field(metadata=coded(missing=()))
    #: scaled-dot-product-attention backends, in the order the target's PyTorch tries them
    attention_order: tuple[AttentionBackend, ...] = field(default=(), metadata=coded(key="attention", read=_attention))
    #: the dtype of the mask a training-mode dropout keeps ("bool": the fused kernel, as on CUDA); None: as on the CPU
    dropout_mask: str | None = None
    #: functions the target's autocast runs in float32 (its fp32 list), by name
    autocast_fp32: frozenset[str] = field(default=frozenset(), metadata=coded(key="autocast.fp32"))
    #: functions the target's autocast runs in its lower precision where the CPU's does not
    autocast_lower: frozenset[str] = field(default=frozenset(), metadata=coded(key="autocast.lower"))
    #: the folder of the record it is checked against, relative to the project
    record: str | None = None

    def __post_init__(self) -> None:
        order = self.attention_order
        unknown = [b.name for b in order if b.name not in ("flash", "efficient", "math")]
        if unknown:
            raise ValueError(f"unknown attention backend(s) {', '.join(unknown)}")
        bad_rng = [b.name for b in order if b.rng_state not in ("always", "dropout", "never")]
        if bad_rng:
            raise ValueError(f"rng_state of {', '.join(bad_rng)}: use 'always', 'dropout' or 'never'")
        if order and order[-1].name != "math":
            raise ValueError("the attention order must end with 'math' (it takes every call)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Target:
        """The target of a row of ``targets.json``; ``ValueError`` naming the target and the problem."""
        try:
            return from_data(cls, data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"prediction target {data.get('name', '?')!r} in targets.json: {exc}") from None


@cache
def targets() -> tuple[Target, ...]:
    """Every target the package describes, in file order."""
    text = resources.files(__package__).joinpath("targets.json").read_text(encoding="utf-8")
    return tuple(Target.from_dict(row) for row in json.loads(text)["targets"])


def _names() -> str:
    return ", ".join(repr(t.name) for t in targets())


def target(name: str) -> Target:
    """The target called ``name`` (or one of its aliases, in any case)."""
    wanted = name.strip().lower()
    for candidate in targets():
        if wanted == candidate.name or wanted in candidate.aliases:
            return candidate
    raise UnknownTarget(f"predict={name!r} is not a known GPU: use one of {_names()}")


def parse_predict(value: object) -> str:
    """The canonical name of the target ``value`` names; a ``ValueError`` naming the value otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise UnknownTarget(f"predict={value!r} is not a GPU name: use one of {_names()}")
    return target(value).name
