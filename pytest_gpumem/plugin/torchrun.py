"""``torchrun -m pytest``: every rank runs the suite; rank 0 gathers the records and writes (docs/distributed.md)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from pytest_gpumem.judge.record import TestRecord

__all__ = ["GatherError", "Launch", "gather_records", "launch", "merge", "rank_span", "rename"]

#: Seconds rank 0 waits for the other ranks' records at the end of the session.
GATHER_TIMEOUT = 600.0


class GatherError(RuntimeError):
    """The ranks' records could not all be gathered on rank 0."""


@dataclass(frozen=True)
class Launch:
    """Where this pytest process stands in a ``torchrun`` launch."""

    rank: int
    world_size: int
    local_rank: int


def launch(environ: dict[str, str] | None = None) -> Launch | None:
    """The ``torchrun`` launch (of more than one rank) this process is part of; None otherwise."""
    env = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(name in env for name in names):
        return None
    try:
        rank, world_size, local_rank = (int(env[name]) for name in names)
        valid = world_size >= 1 and 0 <= rank < world_size and local_rank >= 0
    except ValueError:
        valid = False
    if not valid:
        shown = ", ".join(f"{name}={env[name]!r}" for name in names)
        raise ValueError(f"torchrun's environment is not a launch: {shown}")
    return None if world_size == 1 else Launch(rank, world_size, local_rank)


def rank_span(name: str, rank: int, world_size: int) -> str:
    """The span ``name`` of rank ``rank``: ``call@rank1-of-2``."""
    return f"{name}@rank{rank}-of-{world_size}"


def rename(record: TestRecord, where: Launch) -> TestRecord:
    """``record`` with its spans (and what refers to them) named for this rank."""
    rank, size = where.rank, where.world_size
    tolerances = {rank_span(k, rank, size): v for k, v in record.tolerances.items()}
    if "call" in record.tolerances:
        tolerances["call"] = record.tolerances["call"]
    return replace(
        record,
        measurements=[replace(m, name=rank_span(m.name, rank, size)) for m in record.measurements],
        asked={rank_span(k, rank, size): v for k, v in record.asked.items()},
        findings=[replace(f, span=rank_span(f.span, rank, size)) for f in record.findings],
        tolerances=tolerances,
    )


def _interruptible(call: Callable[[], None]) -> None:
    """``call()`` in a thread of its own, so that Ctrl-C ends the wait for a collective blocked in C++."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # raised again in the waiting thread
            failure.append(exc)

    worker = threading.Thread(target=run, name="gpumem-gather", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if failure:
        raise failure[0]


def gather_records(records: list[dict[str, Any]], where: Launch, timeout: float = GATHER_TIMEOUT) -> list[Any] | None:
    """Every rank's ``records`` on rank 0, over a ``gloo`` group; None on the other ranks."""
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * where.world_size if where.rank == 0 else None

    def gather() -> None:
        created = False
        try:
            if not dist.is_initialized():
                dist.init_process_group(
                    "gloo",
                    init_method="env://",
                    rank=where.rank,
                    world_size=where.world_size,
                    timeout=timedelta(seconds=timeout),
                )
                created = True
            group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            dist.gather_object(records, gathered, dst=0, group=group)
        finally:
            if created and dist.is_initialized():
                dist.destroy_process_group()

    try:
        _interruptible(gather)
    except Exception as exc:  # torch raises RuntimeError, DistBackendError, TimeoutError...
        raise GatherError(f"rank {where.rank} of {where.world_size}: {type(exc).__name__}: {exc}") from exc
    if gathered is not None and any(part is None for part in gathered):
        raise GatherError("not every rank sent its records")
    return gathered


def merge(per_rank: list[list[dict[str, Any]]]) -> dict[str, TestRecord]:
    """One record per test from every rank's, spans side by side; recordable only if every rank's is."""
    by_test: dict[str, list[TestRecord]] = {}
    for sent in per_rank:
        for data in sent:
            one = TestRecord.from_dict(data)
            by_test.setdefault(one.nodeid, []).append(one)
    merged: dict[str, TestRecord] = {}
    for nodeid, ranks in by_test.items():
        first = ranks[0]
        errors = list(first.errors)
        for other in ranks[1:]:
            errors += other.errors
            if other.environment_key != first.environment_key:
                errors.append(
                    f"ranks measured in different environments ({first.environment_key} and "
                    f"{other.environment_key}): not recorded"
                )
        if len(ranks) != len(per_rank):
            errors.append(f"measured on {len(ranks)} of {len(per_rank)} ranks: not recorded")
        merged[nodeid] = replace(
            first,
            measurements=[m for one in ranks for m in one.measurements],
            findings=[f for one in ranks for f in one.findings],
            errors=errors,
            reports=[r for one in ranks for r in one.reports],
            tolerances={span: t for one in ranks for span, t in one.tolerances.items()},
            passed=all(one.passed for one in ranks),
        )
    return merged
