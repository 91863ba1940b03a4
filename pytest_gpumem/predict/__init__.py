"""Prediction of a GPU's figures on a CPU-only machine: target profiles as data.

A *target* is one GPU family with one PyTorch version, described by a row of
``targets.json``: the device it stands for, the caching allocator's constants
(:class:`~pytest_gpumem.predict.allocator.AllocatorRules`), and the library workspaces its
threads allocate. A new GPU or PyTorch version is a new row, checked against a new record
made on that GPU by ``scripts/gpu-validate`` (the row's ``record``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from pytest_gpumem.predict.allocator import AllocatorRules, CachingAllocatorModel

__all__ = [
    "AllocatorRules",
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
