"""Automatic microbatch search: the largest microbatch a training step fits in, and an accumulation plan.

:func:`max_microbatch` doubles the size while the step fits, then bisects (as Lightning's BatchSizeFinder does); an
out-of-memory error means "does not fit", and the failed try is released before the next.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pytest_gpumem.diagnose.oom import is_oom, release_oom
from pytest_gpumem.measurement import collector
from pytest_gpumem.units import format_size, parse_size

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines.base import Engine

__all__ = ["MAX_DOUBLINGS", "MicrobatchError", "Plan", "max_microbatch", "plan_accumulation", "plan_for"]

#: Without ``upper``, how often the size doubles before the search concludes the step's memory does not grow with it.
MAX_DOUBLINGS = 30


class MicrobatchError(RuntimeError):
    """No microbatch size fits, or every size does (the step's memory does not grow with its size)."""


def _check_size(function: str, name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{function}: {name} must be an int >= 1, got {value!r}")


def max_microbatch(
    step: Callable[[int], Any],
    *,
    start: int = 1,
    limit: int | str | None = None,
    upper: int | None = None,
    engine: Engine | str | torch.device | None = None,
    cleanup: Callable[[], Any] | None = None,
    predict: str | None = None,
    fake: bool = False,
) -> int:
    """The largest microbatch size in ``[start, upper]`` that ``step(size)`` runs without running out of memory.

    ``limit`` emulates a device size for each try (needs ``engine``, an engine or its name); without ``upper`` the size
    doubles at most :data:`MAX_DOUBLINGS` times (required on the CPU engine without a limit). ``cleanup`` runs after
    every try (``optimizer.zero_grad(set_to_none=True)``, say). ``predict`` searches on the CPU engine as that GPU
    would, ``fake`` on fake tensors. Returns 0 when not even ``start`` fits.

    Sizes are assumed monotonic, and memory a try that fit leaves behind stays for the next: warm the step up first.
    """
    if predict is not None or fake:
        if predict is None:
            raise ValueError("max_microbatch: fake=True needs predict= (the GPU whose memory is searched)")
        if engine is not None:
            raise ValueError("max_microbatch: give engine= or predict=, not both")
        from pytest_gpumem.measurement.active import measure

        with measure("max_microbatch", device="cpu", predict=predict, fake=fake):
            return max_microbatch(step, start=start, limit=limit, upper=upper, engine="cpu", cleanup=cleanup)
    _check_size("max_microbatch", "start", start)
    _check_size("max_microbatch", "upper", upper)
    if upper is not None and upper < start:
        raise ValueError(f"max_microbatch: upper ({upper}) is below start ({start})")
    if limit is not None and engine is None:
        raise ValueError("max_microbatch: limit needs the engine of the device the step runs on")
    if isinstance(engine, (str, torch.device)):
        from pytest_gpumem.measurement.active import engine_for

        engine = engine_for(engine)
    nbytes = None if limit is None else parse_size(limit)
    if upper is None and nbytes is None and engine is not None and engine.exact and engine.memory_limit() is None:
        raise ValueError(
            "max_microbatch: on the CPU engine without a limit the step never runs out of memory; give upper="
        )
    searched = engine
    categories = None if engine is None else engine.categories

    def fits(size: int) -> bool:
        guard = searched.limit_memory(nbytes) if searched is not None and nbytes is not None else nullcontext()
        before = searched.allocated() if searched is not None else None
        # the search catches every OOM of a try: no report (a census of every live tensor) at its refused allocation
        watch = None if categories is None else categories.on_oom
        if categories is not None:
            categories.on_oom = None
        try:
            with guard:
                step(size)
            return True
        except Exception as exc:
            if not is_oom(exc):
                raise
            release_oom(exc, collect=False)  # drop the failed try's frames; collected below when needed
            return False
        finally:
            if categories is not None:
                categories.on_oom = watch
            if cleanup is not None:
                cleanup()
            if before is None or searched is None or searched.allocated() > before:
                collector.collect()
            if searched is not None:
                searched.empty_cache()

    # the tries' allocations must be seen (the CPU engine's tracker) when a limit is in force
    limited = searched is not None and (nbytes is not None or searched.memory_limit() is not None)
    with searched.watching() if searched is not None and limited else nullcontext():
        if not fits(start):
            return 0
        fit = start
        failed: int | None = None
        doublings = 0
        while failed is None:
            if upper is not None and fit >= upper:
                return fit
            if upper is None and doublings == MAX_DOUBLINGS:
                where = "on the device" if nbytes is None else f"under the limit {format_size(nbytes)}"
                raise MicrobatchError(
                    f"max_microbatch: every size from {start:,} to {fit:,} fit {where} ({MAX_DOUBLINGS} doublings): "
                    "the step's memory does not grow with its size (or too little to ever run out); the search "
                    "stopped there. Build the batch from size in step(size), or give upper="
                )
            size = fit * 2 if upper is None else min(fit * 2, upper)
            doublings += 1
            if fits(size):
                fit = size
            else:
                failed = size
        while failed - fit > 1:
            middle = (fit + failed) // 2
            if fits(middle):
                fit = middle
            else:
                failed = middle
        return fit


@dataclass(frozen=True)
class Plan:
    """How to run a global batch: ``accumulation_steps`` microbatches of ``microbatch`` samples.

    The microbatch is the largest fitting divisor of the global batch, so all microbatches are equal; ``max_microbatch``
    is the largest size that fit.
    """

    microbatch: int
    accumulation_steps: int
    global_batch: int
    max_microbatch: int


def plan_for(global_batch: int, max_size: int) -> Plan:
    """The accumulation plan for ``global_batch`` with microbatches up to ``max_size`` (96 with 40 fitting: 3 × 32).

    Raises :class:`MicrobatchError` when ``max_size`` is 0.
    """
    _check_size("plan_for", "global_batch", global_batch)
    if max_size < 1:
        raise MicrobatchError(f"no microbatch size fits (global batch {global_batch}); the largest that fit is 0")
    small = [d for d in range(1, math.isqrt(global_batch) + 1) if global_batch % d == 0]
    best = max(d for d in (*small, *(global_batch // d for d in small)) if d <= max_size)
    return Plan(
        microbatch=best,
        accumulation_steps=global_batch // best,
        global_batch=global_batch,
        max_microbatch=max_size,
    )


def plan_accumulation(global_batch: int, step: Callable[[int], Any], **kwargs: Any) -> Plan:
    """Search the largest microbatch up to ``global_batch`` (``kwargs`` to :func:`max_microbatch`), then plan for it."""
    _check_size("plan_accumulation", "global_batch", global_batch)
    upper = kwargs.pop("upper", None)
    upper = global_batch if upper is None else min(int(upper), global_batch)
    found = max_microbatch(step, upper=upper, **kwargs)
    return plan_for(global_batch, found)
