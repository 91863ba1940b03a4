"""Fresh pytest sessions forked from a warm server, instead of started from nothing.

A session in a new process (``python -m pytest``) spends most of its CPU time importing torch
and pytest. The server is a Python process that has imported them, and nothing else (not the
plugin, not TorchDynamo, no framework), and forks one child per session. The child
makes itself what ``python -m pytest ARGS`` would be in a new process, before pytest runs:

- its own process group, so that a timeout kills it with the processes it started;
- stdin on ``/dev/null``, stdout and stderr on the caller's files (file descriptors 0, 1, 2 and
  fresh ``sys.stdin``/``sys.stdout``/``sys.stderr`` over them);
- the caller's working directory and environment (the variables of :data:`PER_TEST` as the
  caller has them, the others as the server's start-up left them: equal to the caller's, and
  to what a new process would have, with locale coercion's ``LC_CTYPE`` say);
- ``sys.argv``, and ``sys.path`` as ``-m`` makes it: the working directory, the ``PYTHONPATH``
  entries, then the interpreter's own entries (read by the server as it starts, without
  ``PYTHONPATH``);
- a new ``multiprocessing`` authentication key;

then runs ``runpy.run_module("pytest", run_name="__main__", alter_sys=True)`` and ends as the
interpreter does: non-daemon threads joined, ``atexit`` handlers run, output flushed. Its exit
status (a negative signal number if a signal killed it) is the session's.

What a fork cannot give: the hash seed (``PYTHONHASHSEED`` unset) is the server's, the same for
every session; the modules torch and pytest import are imported already when the session starts
(use a real subprocess for a test of what importing something imports).

The server forks only while it is one thread: ``import torch`` starts OpenBLAS's thread pool
unless ``OMP_NUM_THREADS=1`` (the suite's conftest sets it), and it never runs a torch operator
or initialises CUDA; a server with a second thread answers with a refusal and the caller runs a
real subprocess. The server starts on the first session, with the caller's environment, and
is replaced when a later session's environment differs in a variable other than those pytest,
pytester, pytest-xdist and this suite's fixtures change per test (:data:`PER_TEST`), which
torch and pytest do not read as they are imported. It ends when the suite's process does: at
exit, or when its stdin closes (the process died), it kills the sessions still running.

Each process (an xdist worker, a session that starts sessions itself) has its own server.
Only on Linux (``os.fork``, ``os.pidfd_open``); elsewhere, or with ``GPUMEM_TESTS_FORK=0`` in
the environment, every session is a real subprocess.

The protocol: one JSON request a line on the server's stdin (``args``, ``cwd``, ``env``,
``stdout``, ``stderr``); on its stdout, ``{"started": PID}`` (or ``{"started": null}``, the
refusal) at once, and ``{"exited": PID, "code": CODE}`` when the child is reaped.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import pytest

#: Variables that pytester (its ``__init__`` and ``popen``), pytest (``PYTEST_CURRENT_TEST``),
#: pytest-xdist, pytest-memray (its session sets ``MEMRAY_RESULT_PATH``, an in-process pytester
#: run's removes it) and this suite (``CI``, ``BUILD_NUMBER``: the ``_as_on_a_terminal`` fixture;
#: ``COLUMNS``, the terminal's width, read as a session prints) set or remove per test or session,
#: and that nothing reads as torch and pytest are imported: a session whose environment differs
#: from the server's only in these is forked from it.
PER_TEST = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "PYTEST_ADDOPTS",
        "PYTHONPATH",
        "HOME",
        "USERPROFILE",
        "PYTEST_DEBUG_TEMPROOT",
        "PY_COLORS",
        "TOX_ENV_DIR",
        "PYTEST_XDIST_WORKER",
        "PYTEST_XDIST_WORKER_COUNT",
        "PYTEST_XDIST_TESTRUNUID",
        "CI",
        "BUILD_NUMBER",
        "MEMRAY_RESULT_PATH",
        "COLUMNS",
    }
)


def enabled() -> bool:
    """Whether sessions are forked here: on Linux, unless ``GPUMEM_TESTS_FORK=0``."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "fork")
        and hasattr(os, "pidfd_open")
        and os.environ.get("GPUMEM_TESTS_FORK") != "0"
    )


# --------------------------------------------------------------------------- the caller's side


#: The server's ``python -c``: this file's code, run outside ``sys.modules`` (a session that
#: imports this module gets its own copy), then :func:`serve`.
_BOOTSTRAP = """
import sys
if not getattr(sys.flags, "safe_path", False):
    del sys.path[0]
server = {{"__name__": "_forked_sessions_server"}}
exec(compile(open({path!r}, encoding="utf-8").read(), {path!r}, "exec"), server)
server["serve"]()
"""


class _Server:
    """The server process, and the line-by-line reading of its answers."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = _relevant(env)
        # without PYTHONPATH, its sys.path less the ``-c`` entry is the interpreter's own
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP.format(path=__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={key: value for key, value in env.items() if key != "PYTHONPATH"},
            cwd="/",
        )
        self._buffer = b""

    def start(self, request: dict[str, Any]) -> int | None:
        """Send a session's request: the child's pid, or None where the server refuses to fork."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        started = self._answer(None)
        assert started is not None and "started" in started, started
        return started["started"]  # type: ignore[no-any-return]

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit status, or None once ``timeout`` seconds passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        answer = self._answer(deadline)
        if answer is None:
            return None
        assert answer.get("exited") == pid, answer
        return answer["code"]  # type: ignore[no-any-return]

    def _answer(self, deadline: float | None) -> dict[str, Any] | None:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"the session server (pid {self.process.pid}) ended: {self.process.wait()}")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Close its stdin (it kills the sessions still running, and ends) and reap it."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_server: _Server | None = None


def _relevant(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key not in PER_TEST}


def server_pid() -> int | None:
    """The pid of this process's server, if one runs."""
    return None if _server is None else _server.process.pid


def stop() -> None:
    """Stop this process's server, if one runs (at exit, and when a session needs another)."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None


def _forked(
    args: list[str], *, cwd: str, env: dict[str, str], stdout: Path, stderr: Path, timeout: float | None
) -> int | None:
    """Run ``python -m pytest ARGS`` as a child of the server, its output into ``stdout`` and
    ``stderr``: its exit status, or None where the server refused to fork (the caller then runs
    a real subprocess). Raises :class:`subprocess.TimeoutExpired` after killing the child's
    process group once ``timeout`` seconds passed."""
    global _server
    if _server is not None and (_server.env != _relevant(env) or _server.process.poll() is not None):
        stop()
    if _server is None:
        _server = _Server(env)
        atexit.unregister(stop)  # once, however many servers this process starts
        atexit.register(stop)
    request = {"args": args, "cwd": cwd, "env": env, "stdout": str(stdout), "stderr": str(stderr)}
    pid = _server.start(request)
    if pid is None:
        return None
    code = _server.wait(pid, timeout)
    if code is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _server.wait(pid, None)
        raise subprocess.TimeoutExpired([sys.executable, "-m", "pytest", *args], timeout or 0)
    return code


def runpytest(pytester: pytest.Pytester, *args: str, timeout: float | None = None) -> pytest.RunResult:
    """``pytester.runpytest_subprocess(*args, timeout=timeout)``, forked: the same ``--basetemp``
    and ``-p`` arguments, environment (pytester's ``popen``: the working directory first on
    ``PYTHONPATH``), ``stdout``/``stderr`` files in ``pytester.path`` and printed output."""
    __tracebackhide__ = True
    if not enabled():
        return pytester.runpytest_subprocess(*args, timeout=timeout)
    from _pytest.pathlib import make_numbered_dir

    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    arguments: tuple[str, ...] = (f"--basetemp={basetemp}", *args)
    for plugin in pytester.plugins:
        if not isinstance(plugin, str):
            raise ValueError(f"a forked session takes plugins by name, not {plugin}")
        arguments = ("-p", plugin, *arguments)
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    out, err = pytester.path / "stdout", pytester.path / "stderr"
    out.write_text("")
    err.write_text("")
    print("running (forked):", sys.executable, "-mpytest", *arguments)
    print("     in:", Path.cwd())
    began = time.perf_counter()
    try:
        code = _forked(list(arguments), cwd=os.getcwd(), env=env, stdout=out, stderr=err, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise pytester.TimeoutExpired(
            f"{timeout} second timeout expired running: {(sys.executable, '-mpytest', *arguments)}"
        ) from None
    if code is None:
        return pytester.runpytest_subprocess(*args, timeout=timeout)
    outlines = out.read_text(encoding="utf8").splitlines()
    errlines = err.read_text(encoding="utf8").splitlines()
    for lines, stream in ((outlines, sys.stdout), (errlines, sys.stderr)):
        for line in lines:
            print(line, file=stream)
    ret: int | pytest.ExitCode = code
    with contextlib.suppress(ValueError):
        ret = pytest.ExitCode(code)
    return pytest.RunResult(ret, outlines, errlines, time.perf_counter() - began)


def run(
    args: list[str], *, cwd: str | os.PathLike[str], env: dict[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)``, forked."""
    command = [sys.executable, "-m", "pytest", *args]
    if enabled():
        with tempfile.TemporaryDirectory(prefix="gpumem-forked-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            out.write_text("")
            err.write_text("")
            code = _forked(args, cwd=os.fspath(cwd), env=env, stdout=out, stderr=err, timeout=timeout)
            if code is not None:
                return subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


# --------------------------------------------------------------------------- the server's side


def serve() -> None:
    """The server's loop: fork a child per request, report each child's exit; at the end of its
    stdin, kill the children still running and return."""
    import torch  # noqa: F401  (what a session would import first: the reason for the server)

    # the server's start environment is the sessions' (but for PER_TEST), as the interpreter and
    # the imports left it: with locale coercion's LC_CTYPE, say
    base = {"path": list(sys.path), "env": _relevant(dict(os.environ))}
    children: dict[int, int] = {}  # pidfd: pid
    buffer = b""
    try:
        while True:
            for fd in select.select([0, *children], [], [])[0]:
                if fd in children:
                    pid = children.pop(fd)
                    os.close(fd)
                    _, status = os.waitpid(pid, 0)
                    _send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                    continue
                data = os.read(0, 65536)
                if not data:
                    return
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    _send({"started": _fork(json.loads(line), base, children)})
    finally:
        for fd, pid in children.items():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(fd)


def _send(message: dict[str, Any]) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def _fork(request: dict[str, Any], base: dict[str, Any], children: dict[int, int]) -> int | None:
    """Fork the session's child (None, without forking, unless this process is one thread)."""
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        return None
    pid = os.fork()
    if pid == 0:
        try:
            _session(request, base, list(children))
        except BaseException as error:  # the session's set-up failed (the session itself exits)
            sys.excepthook(type(error), error, error.__traceback__)
        finally:
            os._exit(1)
    with contextlib.suppress(OSError):  # the child may have done it, or be gone already
        os.setpgid(pid, pid)
    children[os.pidfd_open(pid)] = pid
    return pid


def _text_stream(fd: int, mode: str, like: TextIO) -> io.TextIOWrapper:
    """A text stream over ``fd`` configured as ``like``, as the interpreter makes ``sys.stdout``."""
    assert isinstance(like, io.TextIOWrapper)
    binary = open(fd, mode + "b", closefd=False)  # noqa: SIM115
    return io.TextIOWrapper(
        binary,
        encoding=like.encoding,
        errors=like.errors,
        newline="\n",
        line_buffering=like.line_buffering,
        write_through=like.write_through,
    )


def _session(request: dict[str, Any], base: dict[str, Any], server_fds: list[int]) -> None:
    """In the child: become ``python -m pytest ARGS`` in a new process, run it, and exit.
    ``base``: the interpreter's own ``sys.path`` entries, and the environment but for
    :data:`PER_TEST` as the server's start-up left it."""
    import importlib
    import multiprocessing
    import runpy

    os.setpgid(0, 0)
    for fd in server_fds:
        os.close(fd)
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o666)
        os.dup2(opened, fd)
        os.close(opened)
    # as the interpreter makes them (over the server's pipes, configured alike)
    sys.stdin = sys.__stdin__ = _text_stream(0, "r", sys.stdin)  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = _text_stream(1, "w", sys.stdout)  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = _text_stream(2, "w", sys.stderr)  # type: ignore[misc]

    os.chdir(request["cwd"])
    os.environ.clear()
    per_test = {key: value for key, value in request["env"].items() if key in PER_TEST}
    os.environ.update({**per_test, **base["env"]})
    python_path = os.environ.get("PYTHONPATH")
    entries = [os.path.abspath(entry) for entry in python_path.split(os.pathsep)] if python_path else []
    safe_path = getattr(sys.flags, "safe_path", False)  # -P, PYTHONSAFEPATH (Python 3.11)
    sys.path[:] = [*([] if safe_path else [os.getcwd()]), *entries, *base["path"]]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    sys.argv = ["-m", *request["args"]]
    sys.orig_argv = [sys.orig_argv[0], "-m", "pytest", *request["args"]]
    multiprocessing.current_process().authkey = os.urandom(32)

    code, interrupted = 0, False
    try:
        runpy.run_module("pytest", run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException as error:
        sys.excepthook(type(error), error, error.__traceback__)
        code, interrupted = 1, isinstance(error, KeyboardInterrupt)
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # as Python does after an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)
