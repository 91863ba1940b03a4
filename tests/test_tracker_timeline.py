"""The storage tracker's timeline on a long span: a bounded number of samples, each the higher of
those it replaced, in event order."""

from __future__ import annotations

import torch

from pytest_gpumem.judge.record import TIMELINE_SAMPLES
from pytest_gpumem.measurement.engines.tracker import TIMELINE_LIMIT, StorageTracker


def test_a_long_span_keeps_at_most_the_limit_of_samples_in_order() -> None:
    """3,000 allocations of growing size: the timeline is halved (keeping the higher sample of each
    pair) down to at most 512 samples (as many as a test's record keeps), its events rise, its
    totals rise with the count, and the highest is one of the span's last events."""
    assert TIMELINE_LIMIT == TIMELINE_SAMPLES == 512
    tracker = StorageTracker(torch.device("cpu"))
    tracker.scan()
    kept = []
    tracker.start(saved_tensors=False, timeline=True)
    try:
        start = tracker.current
        for size in range(1, 3001):
            kept.append(torch.empty(size, dtype=torch.uint8))
    finally:
        tracker.stop()
    timeline = tracker.timeline
    assert timeline is not None and TIMELINE_LIMIT // 2 <= len(timeline) <= TIMELINE_LIMIT
    events = [event for event, _ in timeline]
    totals = [sum(parts) for _, parts in timeline]
    assert events == sorted(set(events)) and totals[0] > start
    assert totals == sorted(totals)
    assert events[-1] > 3000 - 8 and totals[-1] <= tracker.current == start + sum(range(1, 3001))
    del kept
