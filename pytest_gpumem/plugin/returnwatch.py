"""Run a callback when a function returns, while its frame (and locals) are still alive.

The plugin reads a test's ``allocated`` figure this way: as the test function
returns, so that what a training step leaves allocated is measured before the
test's locals are freed.

Python 3.12+ uses ``sys.monitoring`` with a ``PY_RETURN`` event on the test's code
object only: nothing else is slowed down. Python 3.11 traces one call with
``sys.settrace``, the test function's, keeps its frame (and so its locals) alive past
the return, and runs the callback when the watch ends, just after the call; when
another tracer (coverage, a debugger) is installed there, the watch is skipped and
the figure is read after the call instead. A test function's return value is
pytest's to drop (it warns about one that is not None): on Python 3.11 it is gone
when the watch reads, on 3.12+ it is still alive.
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
    """While the block runs, call ``callback()`` when ``code`` returns, its locals still alive
    (Python 3.11: just after its first call returns, when the block ends).

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
    """Python 3.11: ``sys.settrace`` for one call event, the test function's; the watch keeps a
    reference to its frame, so its locals outlive the return until the block ends, where
    ``callback()`` runs and the reference goes (the locals with it, unless a traceback of the
    test's failure holds the frame: then they go with the traceback, as they always would).

    Tracing the whole call instead (a trace function asked at every Python call) made every
    operator of a training step about 3 µs slower under the plugin's dispatch mode."""
    if sys.gettrace() is not None:
        yield False
        return
    held: list[FrameType] = []

    def first_call(frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code is code:
            held.append(frame)
            sys.settrace(None)  # the one call it waited for: nothing else is traced
        return None

    sys.settrace(first_call)
    try:
        yield True
    finally:
        if sys.gettrace() is first_call:  # the function was never called
            sys.settrace(None)
        if held:
            frame = held.pop()  # it was called, and has returned: its locals are alive while ``frame`` is
            callback()
            del frame
