"""How the CPU engine observes memory: the names, validated without torch."""

from __future__ import annotations

__all__ = ["OBSERVE", "ObserveError", "parse_observe"]

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
