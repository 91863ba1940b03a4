"""Automatic microbatch search: the largest microbatch a training step fits in, and an accumulation plan.

:func:`max_microbatch` doubles the microbatch size from ``start`` while the step
fits, then bisects between the last size that fit and the first that ran out of
memory (as Lightning's BatchSizeFinder does). Each try runs the user's
``step(size)``; an out-of-memory error (:func:`~pytest_gpumem.diagnose.oom.is_oom`) means
"does not fit", any other error propagates. Between tries the failed step's
frames are released and garbage is collected (:func:`~pytest_gpumem.diagnose.oom.release_oom`),
so one try's leftovers do not shrink the next one's room.

:func:`plan_accumulation` turns the result into microbatch size × accumulation
steps for a global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pytest_gpumem.diagnose.oom import is_oom, release_oom
from pytest_gpumem.measurement import collector
from pytest_gpumem.units import format_size, parse_size

if TYPE_CHECKING:
    from pytest_gpumem.measurement.engines.base import Engine

__all__ = ["MAX_DOUBLINGS", "MicrobatchError", "Plan", "max_microbatch", "plan_accumulation", "plan_for"]

#: Without ``upper``, how many times the search doubles the size before it concludes that the step's
#: memory does not grow with it (a size 2**30 times ``start``: no microbatch is a billion samples).
MAX_DOUBLINGS = 30


class MicrobatchError(RuntimeError):
    """No microbatch size fits (not even the smallest one tried), or every size does (the step's
    memory does not grow with its size)."""


def _check_size(name: str, value: int | None, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"max_microbatch: {name} must be an int >= {minimum}, got {value!r}")


@contextmanager
def _watching(engine: Engine | None, limit: int | None) -> Iterator[None]:
    """Make sure ``engine`` sees the tries' allocations when a limit is in force (the CPU engine's tracker)."""
    if engine is None or (limit is None and engine.memory_limit() is None):
        yield
        return
    with engine.watching():
        yield


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
    """The largest microbatch size in ``[start, upper]`` that ``step`` runs without running out of memory.

    Args:
        step: ``step(size)`` runs one training step on a microbatch of ``size``
            samples (build the batch inside; return nothing the search should keep).
        start: the first size tried (>= 1).
        limit: an emulated device limit for each try (bytes or a size string such
            as ``"8GB"``), through :func:`~pytest_gpumem.measurement.devicelimit.device_limit`; needs
            ``engine``. None: the device's real memory. On the CPU engine the
            tracker is started for the search when it is not running.
        upper: the largest size worth trying (say the global batch). Without it
            the size doubles until a try runs out of memory, at most
            :data:`MAX_DOUBLINGS` times (then :class:`MicrobatchError` says the step's
            memory does not grow with its size); on the CPU engine without a limit
            it is required.
        engine: the engine of the device the step runs on, or its name
            (``"cpu"``, ``"cuda:0"``; see :func:`~pytest_gpumem.measurement.active.engine_for`):
            needed for ``limit``, and on CUDA-like devices it lets the search
            empty the allocator's cache between tries.
        cleanup: called after every try, successful or not, before garbage
            collection: reset what the step leaves on your objects, typically
            ``optimizer.zero_grad(set_to_none=True)`` so that a partial
            backward's gradients do not count against the next try. Dropping the
            failed try's frames, ``gc.collect()`` (when allocated memory did not
            come back to where it was before the try, or without ``engine``) and
            ``empty_cache()`` (CUDA) are done here.
        predict: search on the CPU engine as this GPU would (``"h100"``; see
            docs/prediction.md): the search runs in a measurement of its own, or joins the
            running one; instead of ``engine``.
        fake: with ``predict``, every try runs on fake tensors (shapes, no data): build the
            model, optimizer and batch inside ``step``; a model larger than this machine is
            searched in seconds.

    Returns:
        The largest size that fits, or 0 when not even ``start`` fits (a
        measured outcome, not an error; :func:`plan_accumulation` raises on it).

    Sizes are assumed monotonic: a size that fits means every smaller one fits.
    The doubling phase tries ``start, 2·start, 4·start, …`` (capped at ``upper``),
    the bisection ``O(log)`` more sizes; memory left behind by a try that fit
    (optimizer state created at the first step) stays for the next tries, so
    warm the step up first when steady state is what matters.
    """
    if predict is not None or fake:
        if predict is None:
            raise ValueError("max_microbatch: fake=True needs predict= (the GPU whose memory is searched)")
        if engine is not None:
            raise ValueError("max_microbatch: give engine= or predict=, not both")
        from pytest_gpumem.measurement.active import measure

        with measure("max_microbatch", device="cpu", predict=predict, fake=fake):
            return max_microbatch(step, start=start, limit=limit, upper=upper, engine="cpu", cleanup=cleanup)
    _check_size("start", start, 1)
    _check_size("upper", upper, 1)
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

    def fits(size: int) -> bool:
        guard = searched.limit_memory(nbytes) if searched is not None and nbytes is not None else nullcontext()
        before = searched.allocated() if searched is not None else None
        # the search catches every out-of-memory error of a try: no report is built at its
        # refused allocation (a census of every live tensor, each named by what holds it)
        watch = searched.swap_oom_callback(None) if searched is not None else None
        fitted = True
        try:
            with guard:
                step(size)
        except Exception as exc:
            if not is_oom(exc):
                raise
            release_oom(exc, collect=False)  # drop the failed try's frames; collected below when needed
            fitted = False
        finally:
            if searched is not None:
                searched.swap_oom_callback(watch)
            if cleanup is not None:
                cleanup()
            # A full collection costs ~0.1 s in a large process: skip it when memory came back anyway.
            if before is None or searched is None or searched.allocated() > before:
                collector.collect()
            if searched is not None:
                searched.empty_cache()
        return fitted

    with _watching(searched, nbytes):
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

    ``microbatch * accumulation_steps == global_batch`` always holds: the
    microbatch is the largest divisor of the global batch that fits, so every
    microbatch has the same size and gradients average without weighting.
    ``max_microbatch`` is the largest size that fit, which may be larger.
    """

    microbatch: int
    accumulation_steps: int
    global_batch: int
    max_microbatch: int


def plan_for(global_batch: int, max_size: int) -> Plan:
    """The accumulation plan for ``global_batch`` when microbatches up to ``max_size`` fit.

    The microbatch is the largest divisor of ``global_batch`` that is at most
    ``max_size`` (1 always divides, so a plan exists whenever ``max_size >= 1``):
    a global batch of 96 with at most 40 fitting runs as 3 × 32. Raises
    :class:`MicrobatchError` when ``max_size`` is 0 (nothing fits).
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"plan_for: global_batch must be an int >= 1, got {global_batch!r}")
    if max_size < 1:
        raise MicrobatchError(f"no microbatch size fits (global batch {global_batch}); the largest that fit is 0")
    best = 1
    divisor = 1
    while divisor * divisor <= global_batch:
        if global_batch % divisor == 0:
            for candidate in (divisor, global_batch // divisor):
                if best < candidate <= max_size:
                    best = candidate
        divisor += 1
    return Plan(
        microbatch=best,
        accumulation_steps=global_batch // best,
        global_batch=global_batch,
        max_microbatch=max_size,
    )


def plan_accumulation(global_batch: int, step: Callable[[int], Any], **kwargs: Any) -> Plan:
    """Search the largest microbatch (:func:`max_microbatch`, ``upper`` capped at ``global_batch``)
    and plan the accumulation (:func:`plan_for`).

    ``kwargs`` go to :func:`max_microbatch` (``start``, ``limit``, ``engine``,
    ``cleanup``, ``upper``). Raises :class:`MicrobatchError` when not even
    ``start`` fits.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"plan_accumulation: global_batch must be an int >= 1, got {global_batch!r}")
    upper = kwargs.pop("upper", None)
    upper = global_batch if upper is None else min(int(upper), global_batch)
    found = max_microbatch(step, upper=upper, **kwargs)
    return plan_for(global_batch, found)
