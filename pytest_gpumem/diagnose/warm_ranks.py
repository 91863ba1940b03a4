"""Rank processes started warm: forked from a server that has imported what every rank imports.

On Linux, CPU and fake ranks come from a fork server private to this package (imports :data:`PRELOAD` once), one per
:func:`import_key`, kept until its process ends; CUDA ranks are still spawned (forking after CUDA is unsafe). Only
imported on platforms with a fork server.
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

_EVERY_RANK = ("pytest_gpumem.diagnose.distributed", "torch.distributed", "pytest_gpumem.measurement.active")
#: What a rank process of each kind imports before the rank's function runs (``tests/test_warm_ranks.py`` checks it).
PRELOAD: dict[str, tuple[str, ...]] = {
    "gloo": (*_EVERY_RANK, "torch._dynamo"),
    "fake": (
        *_EVERY_RANK,
        "torch.testing._internal.distributed.fake_pg",
        "pytest_gpumem.measurement.engines.fake",
        "torch.distributed.tensor.debug",
    ),
}

#: Prefixes of the environment variables read while the interpreter and torch import and start their threads.
IMPORT_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "CUDA_", "LD_")


def import_key(environment: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What a process started in ``environment`` imports differently by: a server is reused while it is the same."""
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

    A forked process (a data loader worker) starts its own: the servers it inherited are its parent's children.
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
