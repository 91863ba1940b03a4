"""pytest-xdist's workers for the suite's sessions, forked from a process that has imported torch.

A session of the suite run with ``-n 2`` starts two workers, each a new interpreter that imports
torch, pytest and the plugin again (about 2 CPU-seconds each). :func:`warm_workers` makes them
start as ``tests/_warm_sessions.py`` starts sessions: execnet starts a worker as
``python -u -c "import sys;exec(eval(sys.stdin.readline()))"`` and speaks to it over its standard
input and output; here it starts a small launcher instead (``python -I -S``, no imports), which
hands its standard streams, working folder, environment and arguments to a *zygote* that has
imported torch, pytest, execnet, xdist and the other installed pytest plugins (not this project's),
and nothing else (no operator run, no thread). The
zygote forks; the child takes the streams, folder and environment and runs execnet's bootstrap
line, as the new interpreter would, and its exit code goes back through the launcher. A request
whose environment differs from the zygote's in what the interpreter or torch reads at import
(``import_key``), or any other command, gets a new interpreter (``exec``), as without the launcher.
``GPUMEM_TESTS_COLD_SESSIONS=1`` leaves the workers as they are.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.diagnose.warm_ranks import IMPORT_PREFIXES, import_key
from tests._warm_sessions import PLUGINS

#: What execnet runs in a new worker (``execnet.gateway_io.popen_bootstrapline``).
BOOTSTRAP = "import sys;exec(eval(sys.stdin.readline()))"

_ZYGOTE = (
    PLUGINS
    + r"""
import atexit, contextlib, json, os, select, socket, sys, threading, traceback
import torch, pytest, execnet, execnet.gateway_base, xdist, xdist.plugin, _pytest.config

address, BOOTSTRAP = sys.argv[1], sys.argv[2]
own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
base = [p for p in sys.path[1:] if p not in own]  # the interpreter's own entries ('' of -c left out)
server = socket.socket(socket.AF_UNIX)
server.bind(address)
server.listen(16)
sys.stdout.write("ready\n")
sys.stdout.flush()


def worker(connection, request, fds):
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    args, env = request["args"], request["env"]
    os.environ.clear()
    os.environ.update(env)
    sys.dont_write_bytecode = "-B" in args or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ["", *path, *base]
    sys.argv[:] = ["-c"]
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    code = 0
    try:
        exec(compile(BOOTSTRAP, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
        connection.sendall(str(code).encode())
    os._exit(code)


def reap(block):
    # reaped, a child's CPU time is counted in this process's children's, and so in the suite's
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


while True:
    ready, _, _ = select.select([server, sys.stdin], [], [])
    reap(block=False)
    if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):  # the suite's process is done with it
        reap(block=True)
        break
    if server not in ready:
        continue
    connection, _ = server.accept()
    message, fds, _, _ = socket.recv_fds(connection, 1 << 22, 3)
    while not message.endswith(b"\n"):
        message += connection.recv(1 << 22)
    if os.fork() == 0:
        server.close()
        try:
            worker(connection, json.loads(message), fds)
        finally:
            os._exit(70)
    connection.close()
    for fd in fds:
        os.close(fd)
"""
)

#: The launcher: the standard library only, no site (``-I -S``). Another command than execnet's, or
#: an environment that differs from the zygote's in :func:`key`, gets a new interpreter (``exec``).
_LAUNCHER = r"""#!PYTHON -IS
import json, os, socket, sys

environment = dict(os.environ)
chosen = sorted([name, value] for name, value in environment.items() if name.startswith(PREFIXES))
args = sys.argv[1:]
if json.dumps(chosen) != KEY or args not in (["-u", "-c", BOOTSTRAP], ["-u", "-B", "-c", BOOTSTRAP]):
    os.execv(sys.executable, [sys.executable, *args])
request = {"args": args, "cwd": os.getcwd(), "env": environment}
connection = socket.socket(socket.AF_UNIX)
connection.connect(ADDRESS)
socket.send_fds(connection, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
answer = b""
while chunk := connection.recv(64):
    answer += chunk
sys.exit(int(answer) if answer else 1)
"""


def key(environment: dict[str, str]) -> str:
    """The zygote's key for ``environment``: what the interpreter and torch read at import."""
    return json.dumps([list(item) for item in import_key(environment)[1:]])


class _Zygote:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="gpumem-xdist-"))
        address = str(self.folder / "zygote")
        self.key = key(dict(os.environ))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, address, BOOTSTRAP], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the xdist worker zygote did not start (exit {self.process.wait()})")
        self.launcher = self.folder / "python"
        source = _LAUNCHER.replace("PYTHON -IS", f"{sys.executable} -IS", 1)
        source = source.replace("PREFIXES", repr(IMPORT_PREFIXES)).replace("ADDRESS", repr(address))
        source = source.replace("KEY", repr(self.key)).replace("BOOTSTRAP", repr(BOOTSTRAP))
        self.launcher.write_text(source, encoding="utf-8")
        self.launcher.chmod(0o755)

    def stop(self) -> None:
        """Close its requests and wait for it: its workers' CPU time is counted as this process's."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_zygotes: dict[int, _Zygote] = {}


def _zygote() -> _Zygote:
    known = _zygotes.get(os.getpid())
    if known is not None and known.key == key(dict(os.environ)) and known.process.poll() is None:
        return known
    if known is not None:
        known.stop()
    else:
        atexit.register(_stop)
    _zygotes[os.getpid()] = started = _Zygote()
    return started


def _stop() -> None:
    known = _zygotes.pop(os.getpid(), None)
    if known is not None:
        known.stop()


@contextlib.contextmanager
def warm_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In this block, the xdist workers of a session run in this process start forked (``run``)."""
    if os.environ.get("GPUMEM_TESTS_COLD_SESSIONS") == "1":
        yield
        return
    import execnet.gateway_io

    launcher = str(_zygote().launcher)
    popen_args = execnet.gateway_io.popen_args

    def forked(spec: Any) -> list[str]:
        args = popen_args(spec)
        if not spec.python:
            args[0] = launcher
        return args

    with monkeypatch.context() as patch:
        patch.setattr(execnet.gateway_io, "popen_args", forked)
        yield
