"""Run a callback when a function returns, while its frame (and locals) are still alive: how a test's ``allocated``
is read, under any tracer, or :class:`ReturnWatchError` (never after the locals are gone in silence)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

__all__ = ["ReturnWatchError", "code_of", "watch_return"]

_TOOL_NAME = "pytest-gpumem"
#: ``sys.monitoring`` tool ids, in the order the watch tries them: 3 and 4 are no tool's by convention
_TOOL_IDS = (3, 4, 2, 5, 0, 1)


class ReturnWatchError(RuntimeError):
    """The figure cannot be read as the function returns (every tool id taken, a trace function not callable)."""


def code_of(function: Any) -> CodeType | None:
    """The code object that runs when ``function`` is called (unwrapping decorators and methods)."""
    function = getattr(function, "__func__", function)
    try:
        function = inspect.unwrap(function)
    except ValueError:
        return None
    code = getattr(function, "__code__", None)
    return code if isinstance(code, CodeType) else None


@contextmanager
def watch_return(code: CodeType | None, callback: Callable[[], None]) -> Iterator[bool]:
    """While the block runs, call ``callback()`` as ``code`` returns, its locals alive; yields whether it watches."""
    if code is None:
        yield False
        return
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        with _monitor(monitoring, code, callback) as installed:
            yield installed
    else:
        with _trace(code, callback) as installed:
            yield installed


@contextmanager
def _monitor(monitoring: Any, code: CodeType, callback: Callable[[], None]) -> Iterator[bool]:
    tool = next((i for i in _TOOL_IDS if monitoring.get_tool(i) is None), None)
    if tool is None:
        users = ", ".join(f"{i}: {monitoring.get_tool(i)!r}" for i in range(6))
        raise ReturnWatchError(
            "allocated cannot be read as the test returns: every sys.monitoring tool id is taken "
            f"({users}); free one, or measure without the tools that hold them"
        )
    monitoring.use_tool_id(tool, _TOOL_NAME)
    event = monitoring.events.PY_RETURN

    def on_return(returned_code: CodeType, offset: int, value: object) -> Any:
        if returned_code is code:
            callback()
        return None

    monitoring.register_callback(tool, event, on_return)
    monitoring.set_local_events(tool, code, event)
    try:
        yield True
    finally:
        monitoring.set_local_events(tool, code, 0)
        monitoring.register_callback(tool, event, None)
        monitoring.free_tool_id(tool)


@contextmanager
def _trace(code: CodeType, callback: Callable[[], None]) -> Iterator[bool]:
    """Before 3.12: ``sys.settrace`` holds the test function's frame until the block ends, chained to any tracer."""
    previous = sys.gettrace()
    if previous is not None and not callable(previous):
        raise ReturnWatchError(
            f"allocated cannot be read as the test returns: the trace function {previous!r} cannot be called"
        )
    held: list[FrameType] = []
    chained: list[Any] = [previous]  # the trace function to give events to (a tracer may replace itself)

    def first_call(frame: FrameType, event: str, arg: object) -> Any:
        tracer = chained[0]
        local = None if tracer is None else tracer(frame, event, arg)
        current = sys.gettrace()
        if current is not first_call and current is not tracer:  # the tracer replaced itself
            chained[0] = tracer = current
        if frame.f_code is code:
            held.append(frame)
            if current is not tracer:
                sys.settrace(tracer)  # the one call it waited for: the trace function is the previous one again
        elif current is not first_call:
            sys.settrace(first_call)  # a C tracer called from Python reinstalled itself: back in front of it
        return local

    sys.settrace(first_call)
    try:
        yield True
    finally:
        if sys.gettrace() is first_call:  # the function was never called
            sys.settrace(chained[0])
        if held:
            frame = held.pop()  # it was called, and has returned: its locals are alive while ``frame`` is
            callback()
            del frame
