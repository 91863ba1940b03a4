"""Rank processes started warm: forked from a server that has imported what every rank imports.

With ``spawn`` each rank process is a new interpreter that imports torch, and on fake ranks
TorchDynamo (which ``FakeTensorMode`` imports), before the rank's function runs: about 1.2
CPU-seconds a process on gloo ranks and 2.3 on fake ranks, in every run. On Linux,
:func:`~pytest_gpumem.diagnose.distributed.run_ranks` starts CPU ranks (gloo) and fake ranks
from a fork server instead, multiprocessing's ``forkserver`` kind, private to pytest-gpumem (a
``forkserver`` the user's own code starts is not touched): it imports, once, the modules such
a rank process imports before the rank's function runs (:data:`PRELOAD`, no other), and then
forks a rank process per request, which starts in a fraction of a second.

The rank runs as it would in a spawned process: the same modules imported when its function
starts, its function and arguments sent the same way, ``sys.path`` and the working folder the
caller's (multiprocessing's own preparation), and the caller's environment variables as they are
when the run starts (it takes them first). A server is started for the environment it
was asked in and kept for later runs of the process that started it; a run asked with other
values of the variables that the interpreter and torch read while they start (:func:`import_key`)
starts a new server. The server ends when that process ends.

CUDA ranks are still spawned: forking is unsafe in a process that may have initialised CUDA, and
a rank on a GPU pays CUDA's start-up anyway. ``PYTEST_GPUMEM_RANK_START=spawn`` spawns every rank.
This module imports only on platforms with a fork server: ``run_ranks`` imports it where it starts
ranks warm.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

__all__ = ["PRELOAD", "WarmProcess", "import_key", "server_pid", "stop_servers"]

#: What a rank process of each kind imports before the rank's function runs, imported by its server once.
#: ``tests/test_warm_ranks.py`` checks that a warm rank process has no module a spawned one lacks.
PRELOAD: dict[str, tuple[str, ...]] = {
    "gloo": ("pytest_gpumem.diagnose.distributed", "torch.distributed", "pytest_gpumem.measurement.active"),
    "fake": (
        "pytest_gpumem.diagnose.distributed",
        "torch.distributed",
        "pytest_gpumem.measurement.active",
        "torch.testing._internal.distributed.fake_pg",
        "pytest_gpumem.diagnose.fake_ddp",
        "pytest_gpumem.measurement.engines.fake",
        "torch.distributed.tensor.debug",
    ),
}

#: The prefixes of the environment variables that the interpreter, torch and its libraries read
#: while they import and start their thread pools (``PYTHONPATH``, ``TORCH_*``, ``OMP_NUM_THREADS``...).
IMPORT_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "CUDA_", "LD_")


def import_key(environment: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What a process started in ``environment`` imports differently by: the interpreter and the
    variables of :data:`IMPORT_PREFIXES`. A server is reused while it is the same: the rest of the
    environment (which pytest and its tests change at every test) a rank takes from its run."""
    chosen = sorted((name, value) for name, value in environment.items() if name.startswith(IMPORT_PREFIXES))
    return (("<interpreter>", sys.executable), *chosen)


@dataclass
class _Server:
    """A fork server for one kind of rank, and what it was started by and in."""

    owner: int  # the process that started it: only that one may ask it for ranks, or stop it
    key: tuple[tuple[str, str], ...]  # the :func:`import_key` of the environment it was started in
    forkserver: Any  # ForkServer: its stop and pid are CPython's private names (3.8 to 3.14)


_lock = threading.Lock()
#: kind → its server
_servers: dict[str, _Server] = {}
_stopped_at_exit = False


def _server(kind: str) -> Any:
    """The running fork server for ``kind`` in this process and environment, started when there is none.

    A process forked from one that started servers (a data loader worker) starts its own: the
    servers it inherited the names of are its parent's children, not its own.
    """
    global _stopped_at_exit
    key = import_key(os.environ)
    with _lock:
        known = _servers.get(kind)
        if known is not None and known.owner == os.getpid():
            if known.key == key:
                return known.forkserver
            known.forkserver._stop()
        if not _stopped_at_exit:
            atexit.register(stop_servers)  # waits for them, so that their CPU time is counted as this process's
            _stopped_at_exit = True
        server = forkserver.ForkServer()
        server.set_forkserver_preload(list(PRELOAD[kind]))
        _servers[kind] = _Server(os.getpid(), key, server)
        return server


def server_pid(kind: str) -> int | None:
    """The process id of this process's server for ``kind`` (``"gloo"``, ``"fake"``), None when none is running."""
    with _lock:
        known = _servers.get(kind)
        return known.forkserver._forkserver_pid if known is not None and known.owner == os.getpid() else None


def stop_servers() -> None:
    """Stop every server this process started, and wait for each to end (when its rank processes have)."""
    with _lock:
        for known in _servers.values():
            if known.owner == os.getpid():
                known.forkserver._stop()
        _servers.clear()


class _WarmPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver ``Popen``, asking this package's server instead of the global one."""

    def __init__(self, process_obj: Any, server: Any) -> None:
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:  # popen_forkserver.Popen._launch, with self._server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        parent_w = os.dup(w)  # the child's sentinel of this process: closed when this process ends
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class WarmProcess(mp_context.ForkServerProcess):
    """A rank process forked by the server for ``kind`` (the other arguments are ``Process``'s)."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kind = kind

    def _Popen(self, process_obj: Any) -> _WarmPopen:  # type: ignore[override]
        return _WarmPopen(process_obj, _server(self._kind))
