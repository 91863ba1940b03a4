"""How the CPU engine observes memory: the names, validated without torch, and their conflicts with other settings."""

from __future__ import annotations

__all__ = ["OBSERVE", "ObserveError", "choose_observe", "observe_conflict", "parse_observe"]

#: How the CPU engine observes memory: a dispatch mode over operators, or the CPU allocator's reports to the profiler.
OBSERVE: tuple[str, ...] = ("operators", "allocations")


class ObserveError(ValueError):
    """An ``observe=`` value that is not a way of observing memory."""


def parse_observe(value: object) -> str:
    """``value`` if it is one of :data:`OBSERVE`, else an :class:`ObserveError` naming it."""
    if value not in OBSERVE:
        raise ObserveError(f"observe={value!r} is not a way of observing memory: use 'operators' or 'allocations'")
    return str(value)


def observe_conflict(observe: str | None, *, predict: str | None = None, limit: str | None = None) -> str | None:
    """Why ``observe`` cannot run with the prediction ``predict`` or under the device limit ``limit``."""
    if observe != "allocations":
        return None
    if predict is not None:
        return f"observe='allocations' cannot predict={predict!r}: a prediction follows the operators"
    if limit is not None:
        return f"observe='allocations' cannot run under {limit}: an emulated device limit needs observe='operators'"
    return None


def choose_observe(observe: str | None, *, default: str, predict: str | None = None, limit: bool = False) -> str:
    """How a test is observed: ``observe``, else what a prediction or a device limit needs, else ``default``."""
    if observe is not None:
        return observe
    return "operators" if predict is not None or limit else default
