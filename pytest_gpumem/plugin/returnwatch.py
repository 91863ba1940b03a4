"""Run a callback when a function returns, while its frame (and locals) are still alive.

The plugin reads a test's ``allocated`` figure this way: as the test function
returns, so that what a training step leaves allocated is measured before the
test's locals are freed. It does so under any tracer (coverage, a debugger), on
every Python the package supports, or raises :class:`ReturnWatchError`: it never
reads after the locals are gone in silence.

Python 3.12+ uses ``sys.monitoring`` with a tool id of its own (3 or 4, the ids no
tool claims by convention, else any free one) and a ``PY_RETURN`` event on the test's
code object only: nothing else is slowed down, and another tool's monitoring
(coverage's, a debugger's, a profiler's) is left as it is. Before 3.12, the watch traces
one call with ``sys.settrace``, the test function's, keeps its frame (and so its locals)
alive past the return, and runs the callback when the watch ends, just after the call.
When another trace function is installed there (coverage, a debugger), the watch
chains to it: every event reaches it as before, the local tracer it returns for a frame
is that frame's, and it is back in place once the test function has been called.
A test function's return value is pytest's to drop (it warns about one that is not
None): before 3.12 it is gone when the watch reads, on 3.12+ it is still alive.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

__all__ = ["ReturnWatchError", "code_of", "watch_return"]

_TOOL_NAME = "pytest-gpumem"
#: ``sys.monitoring`` tool ids, in the order the watch tries them: 3 and 4 are no
#: tool's by convention (0 is the debuggers', 1 coverage's, 2 the profilers', 5 the
#: optimizers')
_TOOL_IDS = (3, 4, 2, 5, 0, 1)


class ReturnWatchError(RuntimeError):
    """The figure cannot be read as the function returns (every ``sys.monitoring`` tool id
    taken, a trace function that cannot be called)."""


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
    (before Python 3.12: just after its first call returns, when the block ends).

    Yields whether the watch is installed (False: no code object). Raises
    :class:`ReturnWatchError` when it cannot be installed.
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
    """Before Python 3.12: ``sys.settrace`` until the test function's call event; the watch keeps a
    reference to its frame, so its locals outlive the return until the block ends, where
    ``callback()`` runs and the reference goes (the locals with it, unless a traceback of the
    test's failure holds the frame: then they go with the traceback, as they always would).

    A trace function installed before (coverage, a debugger) is chained: each call event goes to
    it first and what it returns (its local tracer for the frame) is returned, so it sees every
    line it would have seen; once the test function is called it is the trace function again.
    Coverage's C tracer puts itself back at each call event it is given from Python: the watch
    then puts itself back in front of it until the test function's call: nothing else is traced."""
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
