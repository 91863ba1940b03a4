"""Sites on CUDA: the caching allocator's history (Python stacks, events stamped by window), replayed. Pure."""

from __future__ import annotations

import ast
import linecache
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pytest_gpumem.data.site_figures import BEFORE, ELSEWHERE, Site, SiteCounts
from pytest_gpumem.measurement.engines.site_tracking import Found, source_line
from pytest_gpumem.units import cuda_rounded

__all__ = ["TraceMoment", "functions_in", "merge_found", "replay_moments", "replay_trace", "window_numbers"]

_FREES = ("free_requested", "free", "free_completed")
_OTHER = 5  # CATEGORIES.index("other"): the allocator does not know what a block holds


@dataclass
class TraceMoment:
    """A moment of a replayed trace: allocated bytes then, and the blocks alive by address."""

    allocated: int
    before: int
    blocks: dict[int, tuple[int, int]] = field(default_factory=dict)  # address → (size, event index)


def functions_in(text: str) -> tuple[tuple[int, int, str], ...]:
    """(first line with decorators, last line, qualified name) of every function in ``text``, outer before inner."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append((first, child.end_lineno or child.lineno, prefix + child.name))
                visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return tuple(found)


@lru_cache(maxsize=256)
def _functions(filename: str) -> tuple[tuple[int, int, str], ...]:
    """:func:`functions_in` of the file ``filename``."""
    return functions_in("".join(linecache.getlines(filename)))


def frame_site(filename: str, name: str, line: int, file: str) -> Site:
    """The site of a recorded frame, its function's qualified name and first line read from the source."""
    inner = [f for f in _functions(filename) if f[2].rsplit(".", 1)[-1] == name and f[0] <= line <= f[1]]
    if not inner:
        return Site(file, name, line, line, source_line(filename, line))
    first, _, qualname = max(inner, key=lambda f: f[0])
    return Site(file, qualname, line - first, line, source_line(filename, line))


def replay_trace(
    events: Sequence[Mapping[str, Any]],
    name_of: Callable[[str], str | None],
    *,
    start: int,
    windows: Iterable[int] = (),
    ends: Iterable[int] = (),
    prefix: str = "",
    phases: Mapping[int, str] | None = None,
) -> tuple[dict[int, list[Found]], dict[int, list[Found]]]:
    """Replay ``events`` from ``start`` bytes: the sites at each of ``windows'`` peaks and before each of ``ends``."""
    numbers = window_numbers(events, prefix)
    wanted = set(windows)
    peaks: dict[int, tuple[int, int]] = {}  # number → (peak bytes, index of the event after which it was)
    allocated = start
    for index, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            allocated += _block(event)
        elif action in _FREES:
            allocated -= _freed_size(event, index, events)
        number = numbers[index]
        if number in wanted and allocated > peaks.get(number, (-1, 0))[0]:
            peaks[number] = (allocated, index)
    cuts = {}
    for mark in ends:
        later = next((i for i, number in enumerate(numbers) if number >= mark), len(events))
        cuts[mark] = later - 1
    states = replay_moments(events, start, {**{("peak", k): v for k, (_, v) in peaks.items()}, **cuts})
    phases = phases or {}
    at_peak = {k: _found(events, states[("peak", k)], name_of, numbers, phases) for k in peaks}
    at_end = {k: _found(events, states[k], name_of, numbers, phases) for k in cuts}
    return at_peak, at_end


def window_numbers(events: Sequence[Mapping[str, Any]], prefix: str) -> list[int]:
    """The window of each event: the number of the last stamp ``prefix<number>`` seen up to it (0 before the first)."""
    current = 0
    numbers = []
    for event in events:
        stamp = str(event.get("user_metadata") or "")
        if prefix and stamp.startswith(prefix) and stamp[len(prefix) :].isdigit():
            current = int(stamp[len(prefix) :])
        numbers.append(current)
    return numbers


def _freed_size(event: Mapping[str, Any], index: int, events: Sequence[Mapping[str, Any]]) -> int:
    """The bytes a free event takes off ``memory_allocated`` (none for a ``free_completed`` after its request)."""
    if event.get("action") != "free_completed":
        return _block(event)
    addr = event.get("addr")
    for earlier in reversed(events[max(0, index - 64) : index]):
        if earlier.get("addr") == addr and earlier.get("action") == "free_requested":
            return 0
    return _block(event)


def _block(event: Mapping[str, Any]) -> int:
    """The bytes ``memory_allocated`` counts for an event's block: the requested size rounded up to 512 B."""
    return cuda_rounded(int(event["size"]))


def replay_moments(
    events: Sequence[Mapping[str, Any]], start: int, moments: Mapping[Any, int]
) -> dict[Any, TraceMoment]:
    """The moment after the event at each index of ``moments`` (-1: before the first event)."""
    result: dict[Any, TraceMoment] = {}
    by_index: dict[int, list[Any]] = {}
    for name, index in moments.items():
        by_index.setdefault(index, []).append(name)
    now = TraceMoment(start, start)
    for name in by_index.get(-1, []):
        result[name] = TraceMoment(now.allocated, now.before, dict(now.blocks))
    for index, event in enumerate(events):
        action = event.get("action")
        addr = int(event.get("addr") or 0)
        if action == "alloc":
            size = _block(event)
            now.blocks[addr] = (size, index)
            now.allocated += size
        elif action in _FREES:
            size = _freed_size(event, index, events)
            if size:
                now.allocated -= size
                if now.blocks.pop(addr, None) is None:
                    now.before -= size  # allocated before recording started
        for name in by_index.get(index, []):
            result[name] = TraceMoment(now.allocated, now.before, dict(now.blocks))
    return result


def _found(
    events: Sequence[Mapping[str, Any]],
    moment: TraceMoment,
    name_of: Callable[[str], str | None],
    numbers: Sequence[int],
    phases: Mapping[int, str],
) -> list[Found]:
    """The blocks of ``moment`` by site and phase (their allocation's frames and stamp)."""
    counts: dict[tuple[Site, str], SiteCounts] = {}
    sites: dict[tuple[str, str, int], Site] = {}  # each frame's once: its site reads the source
    for size, index in moment.blocks.values():
        event = events[index]
        site = Site("", ELSEWHERE)
        for frame in event.get("frames") or ():
            filename = str(frame.get("filename", ""))
            file = name_of(filename)
            if file is not None:
                where = (filename, str(frame.get("name", "")), int(frame.get("line", 0)))
                if where not in sites:
                    sites[where] = frame_site(*where, file)
                site = sites[where]
                break
        key = (site, phases.get(numbers[index], ""))
        found = counts.setdefault(key, SiteCounts())
        found.nbytes[_OTHER] += size
        found.count += 1
    result: list[Found] = [(site, phase, c, None, ()) for (site, phase), c in counts.items()]
    if moment.before:
        before = SiteCounts()
        before.nbytes[_OTHER] = moment.before
        result.append((Site("", BEFORE), "", before, None, ()))
    return result


def merge_found(peak: Iterable[Found], end: Iterable[Found]) -> list[Found]:
    """One list of (site, phase, at the peak, at the end, examples) from the sites at a peak and at an end."""
    merged: dict[tuple[str, str], list[Any]] = {}
    for moment, found in ((2, peak), (3, end)):
        for site, phase, counts, _, examples in found:
            item = merged.setdefault((site.key, phase), [site, phase, None, None, examples])
            item[moment] = counts
    return [(item[0], item[1], item[2], item[3], item[4]) for item in merged.values()]
