"""How the CPU engine observes memory: the names, validated without torch, and the one rule
that ties them to predictions and emulated device limits (:func:`observe_conflict`,
:func:`choose_observe`), which the marker, the plugin and :func:`~pytest_gpumem.make_engine` follow."""

from __future__ import annotations

__all__ = ["OBSERVE", "ObserveError", "choose_observe", "observe_conflict", "parse_observe"]

#: How the CPU engine observes memory: ``operators`` (the storage tracker's dispatch mode) or
#: ``allocations`` (the CPU allocator's reports to PyTorch's profiler: ``torch.compile``'d code
#: runs as compiled). See :mod:`pytest_gpumem.measurement.engines.allocations`.
OBSERVE: tuple[str, ...] = ("operators", "allocations")


class ObserveError(ValueError):
    """An ``observe=`` value that is not a way of observing memory."""


def parse_observe(value: object) -> str:
    """``value`` if it is one of :data:`OBSERVE`, else an :class:`ObserveError` naming it."""
    if value not in OBSERVE:
        raise ObserveError(f"observe={value!r} is not a way of observing memory: use 'operators' or 'allocations'")
    return str(value)


def observe_conflict(observe: str | None, *, predict: str | None = None, limit: str | None = None) -> str | None:
    """Why ``observe`` cannot run with the prediction ``predict`` or under the emulated device
    limit written ``limit`` (``"device_limit='24GiB'"``, ``"--gpumem-device-limit=N"``); None
    when it can. Only the operator tracker can: an allocation replayed from the profiler
    afterwards cannot be refused, and a prediction follows the operators."""
    if observe != "allocations":
        return None
    if predict is not None:
        return f"observe='allocations' cannot predict={predict!r}: a prediction follows the operators"
    if limit is not None:
        return f"observe='allocations' cannot run under {limit}: an emulated device limit needs observe='operators'"
    return None


def choose_observe(observe: str | None, *, default: str, predict: str | None = None, limit: bool = False) -> str:
    """How a test is observed: ``observe`` when it says (see :func:`observe_conflict`), else
    ``"operators"`` where a prediction or an emulated device limit needs it, else ``default``
    (the run's ``--gpumem-observe``)."""
    if observe is not None:
        return observe
    return "operators" if predict is not None or limit else default
