"""The rank processes of :func:`~pytest_gpumem.diagnose.distributed.run_ranks`, kept from outliving a run."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

#: The signal that ends a process at once (Windows has no SIGKILL: there, terminating is killing).
KILL = getattr(signal, "SIGKILL", signal.SIGTERM)


def own_group() -> int | None:
    """Make this process the leader of a process group of its own; its id, None where there are none."""
    if not hasattr(os, "setpgid"):
        return None
    try:
        os.setpgid(0, 0)
    except OSError:
        return None
    return os.getpid()


def end_group(group: int | None) -> None:
    """End this rank, with every process of its group."""
    if group is not None:
        with contextlib.suppress(OSError):
            os.killpg(group, KILL)
    os._exit(1)


def die_with_parent(group: int | None) -> None:
    """End this rank and its group when the process that started it is gone (a thread waits on its sentinel)."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        wait([sentinel])
        end_group(group)

    threading.Thread(target=watch, name="gpumem-parent-watch", daemon=True).start()


def ended(exitcode: int | None) -> str:
    """How a rank process ended before reporting, from its exit code (negative: the signal that killed it)."""
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode} before reporting"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return f"was killed by signal {-exitcode} before reporting"
    text = f"was killed by {name} (signal {-exitcode}) before reporting"
    if name == "SIGKILL":
        text += " (SIGKILL: often the system's out-of-memory killer; see the kernel log, `dmesg`)"
    return text


def signal_group(process: Any, group: int | None, signum: int) -> None:
    """Send ``signum`` to a rank's process group (it and the processes it started), else to it alone."""
    if group is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signum)
    elif process.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signum)


@contextlib.contextmanager
def _stopped_on_sigterm(processes: list[Any], groups: dict[int, int | None]) -> Iterator[None]:
    """While the ranks run, a SIGTERM kills them first, then goes to the previous handler (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield
        return
    if previous is None:  # a handler set outside Python: none can be restored, the default is
        previous = signal.SIG_DFL

    def stop(signum: int, frame: Any) -> None:
        for rank, process in enumerate(processes):
            signal_group(process, groups.get(rank), KILL)
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def rank_processes(groups: dict[int, int | None]) -> Iterator[list[Any]]:
    """The rank processes; on leaving, each still alive is terminated, then killed, with its process group."""
    processes: list[Any] = []
    try:
        with _stopped_on_sigterm(processes, groups):
            yield processes
    finally:
        for rank, process in enumerate(processes):
            if process.is_alive():
                signal_group(process, groups.get(rank), signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for rank, process in enumerate(processes):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                signal_group(process, groups.get(rank), KILL)
                process.kill()
                process.join()
        for rank, process in enumerate(processes):  # what a rank started and left running
            if groups.get(rank) is not None:
                signal_group(process, groups[rank], KILL)
