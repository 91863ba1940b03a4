"""Pytest sessions in processes of their own, forked from a process that has imported torch.

:func:`conftest.run_fresh` runs a pytest session in a new process, so that nothing an earlier
session of the suite made is alive in it. A new interpreter spends most of such a session
importing torch (2.4 of the 3.6 CPU-seconds of an average one on the project's slower VM); a
process forked from one that has imported torch and pytest, and nothing else, starts with
what a new interpreter has once it has imported them, in a fraction of a second.

One such process (the *zygote*) runs per suite process (per xdist worker) and environment: it
imports ``torch``, ``pytest`` and the other installed pytest plugins (each session loads them at
its start; this project's own plugin it leaves to each session), runs no operator (torch's thread
pools start with the first one, and a fork must not copy threads), and forks a session per request. The session process
takes the request's working folder, environment, ``sys.path`` (the folder first, then
``PYTHONPATH``'s entries, then the interpreter's own, as ``python -m pytest`` has it) and
arguments; its standard input is ``/dev/null`` and its output goes to the files pytester reads.
It ends as an interpreter does: the non-daemon threads joined, the ``atexit`` functions run.

A zygote is started again when a variable that the interpreter or torch reads while it starts
(``pytest_gpumem.diagnose.warm_ranks.import_key``: ``TORCH_*``, ``OMP_*``, ``CUDA_*``, ``PYTHON*``,
the interpreter) differs from the one it was started in; ``PYTHONPATH`` is compared without the
session's own folder, which pytester puts first and changes each test. The rest of the
environment (``HOME``, the tests' own variables) a session takes from its request.
``GPUMEM_TESTS_COLD_SESSIONS=1`` starts a new interpreter for every session instead, to rule
this module out when a test fails. The documents' test modules
(``tests/docs_examples.py``) run so too; the sessions a document's own code starts, and the
suite's other subprocesses (``torchrun``, ``scripts/gpu-check``, the benchmarks, signals sent to a
pytest process), are new interpreters, as their users' are.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _pytest.pathlib import make_numbered_dir

from pytest_gpumem.diagnose.warm_ranks import import_key

#: A zygote's imports beside torch and pytest: the installed plugins every session loads at its start
#: (hypothesis's imports hypothesis at the session's end), this project's own left to each session.
PLUGINS = r"""
import importlib.metadata, hypothesis
for plugin in importlib.metadata.entry_points(group="pytest11"):
    if not plugin.value.startswith("pytest_gpumem"):
        plugin.load()
"""

_ZYGOTE = (
    PLUGINS
    + r"""
import atexit, json, os, sys, threading, traceback
import torch, pytest, pytest.__main__

own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
base = [p for p in sys.path[1:] if p not in own]  # the interpreter's own entries ('' of -c left out)
requests = os.fdopen(0, "rb", buffering=0)

def session(request):
    opened = [os.open(os.devnull, os.O_RDONLY)]
    opened += [os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in ("stdout", "stderr")]
    for fd, source in enumerate(opened):
        os.dup2(source, fd)
        os.close(source)  # only 0, 1 and 2 open, as in a new interpreter
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *path, *base]
    sys.argv[:] = [pytest.__main__.__file__, *request["args"]]
    try:
        code = int(pytest.main(request["args"]))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code

while True:
    line = requests.readline()
    if not line:
        break
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = session(json.loads(line))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    os.write(1, (json.dumps(os.waitstatus_to_exitcode(status)) + "\n").encode())
"""
)


class _Zygote:
    def __init__(self, environment: dict[str, str], cwd: Path) -> None:
        self.key = _key(environment, cwd)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment
        )

    def run(self, request: dict[str, Any]) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the session zygote ended (exit {self.process.wait()})")
        return int(json.loads(answer))

    def stop(self) -> None:
        """Close its requests and wait for it: its sessions' CPU time is counted as this process's."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


_zygotes: dict[int, _Zygote] = {}  # by the process that started it (a forked test process starts its own)


def _key(environment: dict[str, str], cwd: Path) -> tuple[tuple[str, str], ...]:
    """What the zygote's imports may depend on, for a session in ``cwd`` (see the module's docstring)."""
    path = [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(cwd)]
    return import_key({**environment, "PYTHONPATH": os.pathsep.join(path)})


def _zygote(environment: dict[str, str], cwd: Path) -> _Zygote:
    known = _zygotes.get(os.getpid())
    if known is not None and known.key == _key(environment, cwd) and known.process.poll() is None:
        return known
    if known is not None:
        known.stop()
    else:
        atexit.register(_stop)
    _zygotes[os.getpid()] = started = _Zygote(environment, cwd)
    return started


def _stop() -> None:
    known = _zygotes.pop(os.getpid(), None)
    if known is not None:
        known.stop()


def run_session(args: list[str], *, cwd: Path, env: dict[str, str], stdout: Path, stderr: Path) -> int:
    """``python -m pytest *args`` in ``cwd`` with ``env``, its output written to ``stdout`` and
    ``stderr``, in a process forked from the zygote: its exit code (minus a signal's number when
    one ended it), as ``subprocess.run`` gives it."""
    if os.environ.get("GPUMEM_TESTS_COLD_SESSIONS") == "1":
        with stdout.open("w", encoding="utf8") as out, stderr.open("w", encoding="utf8") as err:
            command = [sys.executable, "-m", "pytest", *args]
            return subprocess.run(
                command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err
            ).returncode
    request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
    return _zygote(env, cwd).run(request)


def runpytest_warm(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """``pytester.runpytest_subprocess(*args)``, the session forked from the zygote."""
    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    arguments = [f"--basetemp={basetemp}", *args]
    for plugin in reversed(pytester.plugins):
        if not isinstance(plugin, str):
            raise ValueError(f"a session in a process of its own takes plugins by name, not {plugin!r}")
        arguments[:0] = ["-p", plugin]
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), environment.get("PYTHONPATH", "")]))
    stdout, stderr = pytester.path / "stdout", pytester.path / "stderr"
    began = time.perf_counter()
    code = run_session(arguments, cwd=Path.cwd(), env=environment, stdout=stdout, stderr=stderr)
    out = stdout.read_text(encoding="utf8").splitlines()
    err = stderr.read_text(encoding="utf8").splitlines()
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    ret: int | pytest.ExitCode = code
    with contextlib.suppress(ValueError):
        ret = pytest.ExitCode(code)
    return pytest.RunResult(ret, out, err, time.perf_counter() - began)
