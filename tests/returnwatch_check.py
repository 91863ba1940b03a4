"""The return watch's mechanism alone, on the Python that runs this file (stdlib only: no torch,
no pytest): ``python returnwatch_check.py PATH_TO_RETURNWATCH_PY`` prints ``ok`` and exits 0, or
fails an assertion. ``tests/test_returnwatch.py`` runs it under every Python 3.10+ it finds.

What it checks, with and without a trace function installed before the watch (as coverage
or a debugger installs one), and on Python 3.12+ with other ``sys.monitoring`` tools active:
the callback runs as the watched function returns with its locals alive; they are freed
once the watch ends; a trace function sees every line it sees without the watch, and is the
trace function again afterwards; other monitoring tools keep their events; with every tool id
taken the watch raises.
"""

from __future__ import annotations

import importlib.util
import sys
import weakref
from typing import Any

spec = importlib.util.spec_from_file_location("returnwatch", sys.argv[1])
assert spec is not None and spec.loader is not None
returnwatch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(returnwatch)


class Payload:
    """A local whose life the checks follow."""


def helper(n: int) -> int:
    total = 0
    for i in range(n):
        if i % 2:
            total += i
    return total


def watched(box: list[weakref.ref[Payload]]) -> int:
    payload = Payload()
    box.append(weakref.ref(payload))
    value = helper(5)
    value += helper(3)
    return value


#: Python 3.12+: the tool ids the watch held when its callback ran, a list per run
TOOLS: list[list[int]] = []


def run_watch() -> tuple[bool, bool]:
    """Whether the payload was alive when the callback ran, and whether it is freed after the watch."""
    box: list[weakref.ref[Payload]] = []
    seen: list[bool] = []

    def callback() -> None:
        seen.append(box[0]() is not None)
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is not None:
            TOOLS.append([tool for tool in range(6) if monitoring.get_tool(tool) == "pytest-gpumem"])

    with returnwatch.watch_return(watched.__code__, callback) as installed:
        assert installed
        assert watched(box) == 5
    assert len(seen) == 1, seen
    return seen[0], box[0]() is None


class LineTracer:
    """A trace function that records the lines of this file's functions (a local tracer for each frame)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, int]] = []

    def __call__(self, frame: Any, event: str, arg: object) -> Any:
        if frame.f_code.co_filename != __file__:
            return None
        if event == "line":
            self.lines.append((frame.f_code.co_name, frame.f_lineno))
        return self


def traced_run(watch: bool) -> tuple[list[tuple[str, int]], tuple[bool, bool] | None]:
    outer = sys.gettrace()  # a tracer this file runs under (coverage): set aside while it runs
    tracer = LineTracer()
    sys.settrace(tracer)
    try:
        if watch:
            result: tuple[bool, bool] | None = run_watch()
        else:
            box: list[weakref.ref[Payload]] = []
            assert watched(box) == 5
            result = None
        assert sys.gettrace() is tracer, "the trace function is back after the watch"
    finally:
        sys.settrace(outer)
    return [line for line in tracer.lines if line[0] in ("watched", "helper")], result


def main() -> None:
    outer = sys.gettrace()
    assert run_watch() == (True, True)
    assert sys.gettrace() is outer

    lines_without, _ = traced_run(watch=False)
    lines_with, result = traced_run(watch=True)
    assert result == (True, True), result
    assert lines_with == lines_without and lines_without, (lines_with, lines_without)

    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        check_monitoring(monitoring)
    print("ok")


def check_monitoring(monitoring: Any) -> None:
    """Python 3.12+: the watch takes a tool id of its own, other tools' events on the same code keep
    coming, and with every tool id taken it raises ReturnWatchError."""
    returns: dict[int, int] = {}
    taken = [tool for tool in (1, 3) if monitoring.get_tool(tool) is None]  # coverage's, and a free one
    for tool in taken:
        monitoring.use_tool_id(tool, f"other-{tool}")
        returns[tool] = 0

        def on_return(code: Any, offset: int, value: object, tool: int = tool) -> None:
            returns[tool] += code is watched.__code__

        monitoring.register_callback(tool, monitoring.events.PY_RETURN, on_return)
        monitoring.set_local_events(tool, watched.__code__, monitoring.events.PY_RETURN)
    try:
        assert TOOLS[-1] == [3], TOOLS  # no other tool: the first id no tool claims by convention
        assert run_watch() == (True, True)
        assert TOOLS[-1] == [4], TOOLS  # coverage's id and 3 taken
        assert all(count == 1 for count in returns.values()), returns
        assert all(monitoring.get_tool(tool) == f"other-{tool}" for tool in taken)
        free = [tool for tool in range(6) if monitoring.get_tool(tool) is None]
        for tool in free:
            monitoring.use_tool_id(tool, f"filler-{tool}")
        try:
            try:
                with returnwatch.watch_return(watched.__code__, lambda: None):
                    raise AssertionError("the watch ran with every tool id taken")
            except returnwatch.ReturnWatchError as exc:
                assert "every sys.monitoring tool id is taken" in str(exc), exc
        finally:
            for tool in free:
                monitoring.free_tool_id(tool)
    finally:
        for tool in taken:
            monitoring.set_local_events(tool, watched.__code__, 0)
            monitoring.register_callback(tool, monitoring.events.PY_RETURN, None)
            monitoring.free_tool_id(tool)


if __name__ == "__main__":
    main()
