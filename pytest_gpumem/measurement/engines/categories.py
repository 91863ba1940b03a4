"""A test's categories are its own: what an earlier test made, saved or tracked is "other" to the next.

The storage tracker keeps each storage's category while it lives, across the tests of a run (its
engine is the run's). A tensor that one test made (a temporary) and left alive in a module-level
cache would count as the next test's temporaries, and the parameters of a model one test tracked
as the next one's parameters: each test's breakdown would depend on the tests before it.
"""

from __future__ import annotations

from pytest_gpumem.measurement.engines.tracker import OTHER, StorageTracker

__all__ = ["forget_categories"]


def forget_categories(tracker: StorageTracker) -> None:
    """Count every storage ``tracker`` counts as "other". The engines call it as they clean the
    device before a test, before the tracker's scan, which finds the parameters and gradients
    among them again; the test's own tracking, operators and saved tensors do the rest."""
    tracker.flush()
    with tracker._lock:
        for entry in tracker._entries.values():
            if entry.category != OTHER:
                tracker._move(entry, OTHER, discovered=False)
