"""Run a callback when a function returns, while its frame (and locals) are still alive.

The plugin reads a test's ``allocated`` figure this way: as the test function
returns, so that what a training step leaves allocated is measured before the
test's locals are freed.

Python 3.12+ uses ``sys.monitoring`` with a ``PY_RETURN`` event on the test's code
object only: nothing else is slowed down. Python 3.11 uses ``sys.settrace`` for
the duration of the call (every Python call then pays a small tracing cost);
when another tracer (coverage, a debugger) is installed there, the watch is
skipped and the figure is read after the call instead.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

__all__ = ["code_of", "watch_return"]

_TOOL_NAME = "pytest-gpumem"


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
    """While the block runs, call ``callback()`` each time ``code`` returns.

    Yields whether the watch is installed (False: no code object, or another
    tracer owns ``sys.settrace`` on Python < 3.12).
    """
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
    tool = next((i for i in range(6) if monitoring.get_tool(i) is None), None)
    if tool is None:
        yield False
        return
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
    if sys.gettrace() is not None:
        yield False
        return

    def local(frame: FrameType, event: str, arg: object) -> Any:
        if event == "return":
            callback()
        return local

    def global_(frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code is code:
            frame.f_trace_lines = False
            return local
        return None

    sys.settrace(global_)
    try:
        yield True
    finally:
        sys.settrace(None)
