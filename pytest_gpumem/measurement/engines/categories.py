"""A test's categories are its own: what an earlier test made, saved or tracked is "other" to the next."""

from __future__ import annotations

from pytest_gpumem.measurement.engines.tracker import OTHER, StorageTracker

__all__ = ["forget_categories"]


def forget_categories(tracker: StorageTracker) -> None:
    """Count every storage ``tracker`` counts as "other", before the scan that finds parameters and gradients again."""
    tracker.flush()
    with tracker._lock:
        for entry in tracker._entries.values():
            if entry.category != OTHER:
                tracker._move(entry, OTHER, discovered=False)
