"""Prediction of a GPU's figures on a CPU-only machine: target profiles as data.

A *target* is one GPU family with one PyTorch version, described by a row of
``targets.json``: the device it stands for, the caching allocator's constants
(:class:`~pytest_gpumem.targets.allocator.AllocatorRules`), and the library workspaces its
threads allocate. A new GPU or PyTorch version is a new row, checked against a new record
made on that GPU by ``python -m pytest_gpumem validate`` (the row's ``record``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

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
class Workspace:
    """A library workspace a thread allocates at its first operator of a kind, and keeps.

    ``when``: ``"bias"`` limits it to ``addmm`` with a one-dimensional bias (the cuBLASLt
    path of ``Linear`` with a bias); None: every listed operator.
    """

    library: str
    nbytes: int
    operators: frozenset[str]
    when: str | None = None


@dataclass(frozen=True)
class AttentionBackend:
    """When a fused scaled-dot-product-attention kernel runs on the target, and what it keeps.

    A call runs the first backend of :attr:`Target.attention_order` whose conditions hold
    (PyTorch's ``sdp_utils`` checks: dtype, head size, an explicit mask, grouped-query
    attention); ``math`` (the composite of matrix products, softmax and dropout) takes the rest.
    A fused kernel keeps its output and a float32 log-sum-exp per query row (the rows padded to
    ``logsumexp_row_multiple``) for backward, and two int64 random-state tensors on the device
    ``"always"`` or only with dropout (``rng_state="dropout"``).
    """

    name: str
    dtypes: frozenset[str] = frozenset()
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    mask: bool = True
    gqa: bool = True
    logsumexp_row_multiple: int = 1
    rng_state: str = "always"

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> AttentionBackend:
        """The backend ``name`` from its row of ``targets.json`` (keys named as the fields)."""
        unknown = sorted(set(data) - set(cls.__dataclass_fields__) - {"name"})
        if unknown:
            raise ValueError(f"attention backend {name}: unknown key(s) {', '.join(unknown)}")
        return cls(
            name=name,
            dtypes=frozenset(data.get("dtypes", ())),
            max_head_dim=data.get("max_head_dim"),
            head_dim_multiple=int(data.get("head_dim_multiple", 1)),
            mask=bool(data.get("mask", True)),
            gqa=bool(data.get("gqa", True)),
            logsumexp_row_multiple=int(data.get("logsumexp_row_multiple", 1)),
            rng_state=str(data.get("rng_state", "always")),
        )

    def keeps_rng_state(self, dropout_p: float) -> bool:
        return self.rng_state == "always" or (self.rng_state == "dropout" and dropout_p > 0)

    def accepts(self, dtype: str, head_dim: int, value_head_dim: int, masked: bool, gqa: bool) -> bool:
        if self.name == "math":
            return True
        return (
            dtype in self.dtypes
            and (self.max_head_dim is None or max(head_dim, value_head_dim) <= self.max_head_dim)
            and head_dim % self.head_dim_multiple == 0
            and value_head_dim % self.head_dim_multiple == 0
            and (self.mask or not masked)
            and (self.gqa or not gqa)
        )


@dataclass(frozen=True)
class Target:
    """One GPU and PyTorch version whose figures a CPU run predicts (a row of ``targets.json``)."""

    name: str
    aliases: tuple[str, ...]
    device_name: str
    total_memory: int
    compute_capability: str
    torch_version: str
    cuda_version: str
    allocator: AllocatorRules
    workspaces: tuple[Workspace, ...]
    #: scaled-dot-product-attention backends, in the order the target's PyTorch tries them
    attention_order: tuple[AttentionBackend, ...] = ()
    #: the dtype of the mask a training-mode dropout keeps for backward ("bool": the fused
    #: ``native_dropout`` kernel, as on CUDA); None: as the CPU run does
    dropout_mask: str | None = None
    #: functions the target's autocast runs in float32 (its fp32 list), by name
    autocast_fp32: frozenset[str] = frozenset()
    #: functions the target's autocast runs in its lower precision where the CPU's does not
    autocast_lower: frozenset[str] = frozenset()
    #: the folder of the record it is checked against, relative to the project
    record: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Target:
        name = data.get("name", "?")
        try:
            workspaces = tuple(
                Workspace(
                    library=str(item["library"]),
                    nbytes=int(item["bytes"]),
                    operators=frozenset(str(op) for op in item["operators"]),
                    when=item.get("when"),
                )
                for item in data.get("workspaces", ())
            )
            for workspace in workspaces:
                if workspace.when not in (None, "bias"):
                    raise ValueError(f"workspace {workspace.library}: when={workspace.when!r} (use 'bias' or none)")
            attention = data.get("attention", {})
            backends = attention.get("backends", {})
            order = tuple(
                AttentionBackend.from_dict(str(name), backends.get(name, {})) for name in attention.get("order", ())
            )
            unknown = [b.name for b in order if b.name not in ("flash", "efficient", "math")]
            if unknown:
                raise ValueError(f"unknown attention backend(s) {', '.join(unknown)}")
            bad_rng = [b.name for b in order if b.rng_state not in ("always", "dropout", "never")]
            if bad_rng:
                raise ValueError(f"rng_state of {', '.join(bad_rng)}: use 'always', 'dropout' or 'never'")
            if order and order[-1].name != "math":
                raise ValueError("the attention order must end with 'math' (it takes every call)")
            return cls(
                name=str(data["name"]),
                aliases=tuple(str(alias) for alias in data.get("aliases", ())),
                device_name=str(data["device_name"]),
                total_memory=int(data["total_memory"]),
                compute_capability=str(data["compute_capability"]),
                torch_version=str(data["torch_version"]),
                cuda_version=str(data["cuda_version"]),
                allocator=AllocatorRules.from_dict(dict(data.get("allocator", {}))),
                workspaces=workspaces,
                attention_order=order,
                dropout_mask=data.get("dropout_mask"),
                autocast_fp32=frozenset(str(n) for n in data.get("autocast", {}).get("fp32", ())),
                autocast_lower=frozenset(str(n) for n in data.get("autocast", {}).get("lower", ())),
                record=data.get("record"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"prediction target {name!r} in targets.json: {detail}") from None


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
