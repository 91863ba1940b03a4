"""The caching-allocator model: each rule of CUDACachingAllocator.cpp, byte for byte."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from pytest_gpumem.targets import AllocatorRules, CachingAllocatorModel, parse_predict, target, targets

MiB = 1 << 20


def test_small_requests_share_a_two_mib_segment_and_round_to_512_bytes() -> None:
    model = CachingAllocatorModel()
    assert model.malloc("a", 1) == 512
    assert model.malloc("b", 513) == 1024
    assert model.malloc("c", MiB) == MiB  # still the small pool: at most 1 MiB
    assert (model.allocated, model.reserved, model.segments_reserved) == (512 + 1024 + MiB, 2 * MiB, 1)
    assert model.malloc("d", MiB) == MiB  # what is left (1 MiB − 1.5 KiB) does not fit: a new segment
    assert (model.reserved, model.segments_reserved) == (4 * MiB, 2)


def test_a_large_request_under_ten_mib_takes_a_twenty_mib_segment_and_splits_it() -> None:
    model = CachingAllocatorModel()
    assert model.malloc("a", 3 * MiB + 100) == 3 * MiB + 512
    assert model.reserved == 20 * MiB
    assert model.malloc("b", 15 * MiB) == 15 * MiB  # the 17 MiB − 512 B rest serves it, split again
    # (16 MiB would have left 1 MiB − 512 B: not split, the whole 17 MiB − 512 B allocated)
    assert model.reserved == 20 * MiB
    assert model.malloc("c", 2 * MiB) == 2 * MiB  # only 2 MiB − 512 B left: a new segment
    assert model.reserved == 40 * MiB
    assert model.allocated == 3 * MiB + 512 + 15 * MiB + 2 * MiB


def test_a_block_is_not_split_when_at_most_one_mib_would_remain() -> None:
    model = CachingAllocatorModel()
    # 11 MiB + 1 B: rounded to 11 MiB + 512 B, its segment to 12 MiB; the 1 MiB − 512 B rest stays in the block
    assert model.malloc("a", 11 * MiB + 1) == 12 * MiB
    assert (model.allocated, model.reserved) == (12 * MiB, 12 * MiB)
    assert model.size_of("a") == 11 * MiB + 512
    model.free("a")
    # 10.5 MiB from the cached 12 MiB block: 1.5 MiB would remain, more than 1 MiB: split
    assert model.malloc("b", 10 * MiB + MiB // 2) == 10 * MiB + MiB // 2
    assert model.allocated == 10 * MiB + MiB // 2


def test_the_smallest_cached_block_that_fits_serves_a_request() -> None:
    model = CachingAllocatorModel()
    for key, size in (("a", 12 * MiB), ("b", 16 * MiB), ("c", 14 * MiB)):
        model.malloc(key, size)
    model.free("b")
    model.free("c")
    assert model.malloc("d", 13 * MiB) == 14 * MiB  # the 14 MiB block: 1 MiB left is not split off
    assert model.reserved == 42 * MiB


def test_freed_neighbours_merge_and_empty_cache_releases_free_segments() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 4 * MiB)
    model.malloc("b", 4 * MiB)
    model.malloc("c", 12 * MiB)  # the first segment's 12 MiB rest serves it whole
    assert (model.allocated, model.reserved) == (20 * MiB, 20 * MiB)
    for key in ("c", "a", "b"):  # b merges with both free neighbours: one free 20 MiB block again
        model.free(key)
    assert model.malloc("d", 18 * MiB) == 18 * MiB  # 2 MiB would remain, more than 1 MiB: split
    assert model.reserved == 20 * MiB
    model.free("d")
    model.empty_cache()  # the segment is wholly free: released
    assert (model.allocated, model.reserved, model.peak_allocated) == (0, 0, 20 * MiB)
    model.malloc("e", 11 * MiB + 1)
    model.reset_peaks()
    assert (model.peak_allocated, model.peak_reserved) == (12 * MiB, 12 * MiB)


def test_keys_are_checked() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 10)
    with pytest.raises(KeyError, match="'a' is allocated already"):
        model.malloc("a", 10)
    with pytest.raises(KeyError):
        model.free("b")


def test_rules_from_data_name_a_bad_rule() -> None:
    assert AllocatorRules.from_dict({"min_block": 512}) == AllocatorRules()
    with pytest.raises(ValueError, match="unknown allocator rule"):
        AllocatorRules.from_dict({"min_blok": 512})
    with pytest.raises(ValueError, match="min_block=0"):
        AllocatorRules.from_dict({"min_block": 0})


def test_targets_are_data_and_names_are_checked() -> None:
    h100 = target("H100")
    assert h100 in targets()
    assert (h100.device_name, h100.torch_version) == ("NVIDIA H100 80GB HBM3", "2.11")
    assert parse_predict(" nvidia-h100-80gb-hbm3 ") == "h100"
    with pytest.raises(ValueError, match=r"predict='a100' is not a known GPU: use one of 'h100', 'h200'"):
        parse_predict("a100")
    with pytest.raises(ValueError, match=r"predict=3 is not a GPU name"):
        parse_predict(3)


def test_the_allocation_trace_recorded_on_an_h100_replays_to_the_same_segments(recorded_h100: Path) -> None:
    """The memory snapshot recorded on the H100 (torch 2.11, the reference workloads of
    ``python -m pytest_gpumem validate``, clean-state protocol 2): its whole trace replayed through
    the model reserves a segment exactly where the H100 did, of the same size, and ends with the
    snapshot's segments, block for block. One segment is older than the trace: the 2 MiB small
    segment the trace's first allocation (a 4-byte tensor) lands in, which the model reserves
    there."""
    with (recorded_h100 / "snapshot.pickle").open("rb") as file:
        snapshot = pickle.load(file)
    trace = snapshot["device_traces"][0]
    reserved_in_trace = {event["addr"] for event in trace if event["action"] == "segment_alloc"}
    older = [segment for segment in snapshot["segments"] if segment["address"] not in reserved_in_trace]
    assert [(segment["total_size"], segment["segment_type"]) for segment in older] == [(2 * 1024 * 1024, "small")]
    model = CachingAllocatorModel(target("h100").allocator)
    recorded, modelled = [(0, 2 * 1024 * 1024)], []  # the older segment, reserved for the first allocation
    for index, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            reserved = model.reserved
            model.malloc(event["addr"], event["size"])
            if model.reserved > reserved:
                modelled.append((index, model.reserved - reserved))
        elif action == "free_completed":
            model.free(event["addr"])
        elif action == "segment_alloc":
            recorded.append((index + 1, event["size"]))  # the allocation that needed it comes next
        elif action == "segment_free":
            model.empty_cache()
    assert len(recorded) == 17
    assert modelled == recorded
    expected = [
        (
            segment["total_size"],
            segment["segment_type"] == "small",
            tuple((block["size"], block["state"] == "active_allocated") for block in segment["blocks"]),
        )
        for segment in snapshot["segments"]
    ]
    assert sorted(model.segments()) == sorted(expected)
    stats = json.loads((recorded_h100 / "memory_stats.json").read_text(encoding="utf-8"))["snapshot"]
    assert (model.reserved, model.allocated) == (69_206_016, 68_157_440)
    assert model.reserved == stats["reserved_bytes.all.current"]
    assert model.allocated == stats["allocated_bytes.all.current"]
