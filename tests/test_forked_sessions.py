"""The warm server of ``tests/_forked_sessions.py``: a session forked from it is what a fresh
``python -m pytest`` would be, in everything its tests can observe."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _forked_sessions as forked
import pytest

#: On the tests of forking (not on the fallback's): sessions are forked on Linux, unless GPUMEM_TESTS_FORK=0.
forking = pytest.mark.skipif(not forked.enabled(), reason="sessions are not forked here")

TESTS = str(Path(__file__).resolve().parent)


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` ends (or is a zombie: dead, its parent not told yet) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@forking
def test_exit_codes_are_a_fresh_sessions(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_codes="""
import os, signal, pytest

def test_pass(): pass
def test_fail(): assert False
def test_exit(): os._exit(3)
def test_signal(): os.kill(os.getpid(), signal.SIGTERM)
"""
    )
    expected = {
        "test_pass": pytest.ExitCode.OK,
        "test_fail": pytest.ExitCode.TESTS_FAILED,
        "test_exit": 3,
        "test_signal": -signal.SIGTERM,
    }
    for name, code in expected.items():
        assert forked.runpytest(pytester, "-p", "no:cacheprovider", "-k", name).ret == code, name
    assert forked.runpytest(pytester, "--no-such-option").ret == pytest.ExitCode.USAGE_ERROR


@pytest.mark.slow
@forking
def test_output_goes_to_the_files_and_the_session_ends_as_the_interpreter_does(pytester: pytest.Pytester) -> None:
    """stdout and stderr, by ``print`` and by file descriptor; at the end, the non-daemon threads
    are joined, then the ``atexit`` handlers run, and what they print is kept."""
    pytester.makepyfile(
        test_output="""
import atexit, os, sys, threading, time

def test_prints():
    print("out: ünïcode")
    print("err by print", file=sys.stderr)
    os.write(1, b"out by fd\\n")
    os.write(2, b"err by fd\\n")
    assert sys.stdin.read() == ""

def test_leaves_a_thread_and_an_exit_handler():
    thread = threading.Thread(target=lambda: (time.sleep(0.3), print("thread done")))
    thread.start()
    atexit.register(lambda: print("atexit ran after the thread:", not thread.is_alive()))
"""
    )
    result = forked.runpytest(pytester, "-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert "out: ünïcode" in result.outlines and "out by fd" in result.stdout.str()
    assert {"err by print", "err by fd"} <= set(result.errlines)
    assert result.outlines[-2:] == ["thread done", "atexit ran after the thread: True"]
    assert (pytester.path / "stdout").read_text(encoding="utf8").splitlines() == result.outlines


#: What a test sees of its process, as JSON on one line.
OBSERVED = """
import json, multiprocessing, os, signal, sys

def test_observe():
    main = sys.modules["__main__"]
    seen = {
        "path": sys.path, "cwd": os.getcwd(), "environ": dict(os.environ), "argv": sys.argv,
        "orig_argv": sys.orig_argv, "main": [main.__file__, main.__spec__.name],
        "flags": list(sys.flags), "parent_process": repr(multiprocessing.parent_process()),
        "streams": [[s.encoding, s.errors, s.line_buffering, s.isatty(), s.fileno()]
                    for s in (sys.stdin, sys.stdout, sys.stderr)],
        "std streams": [s is d for s, d in ((sys.stdin, sys.__stdin__), (sys.stdout, sys.__stdout__))],
        "signals": [repr(signal.getsignal(n)) for n in (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM)],
        "modules imported": ["pytest_gpumem" in sys.modules, "torch._dynamo" in sys.modules],
    }
    print("SEEN", json.dumps(seen))
"""


@pytest.mark.slow
@forking
def test_a_forked_session_sees_what_a_new_process_sees(pytester: pytest.Pytester) -> None:
    """The same arguments, working directory and environment (relative and empty ``PYTHONPATH``
    entries included, in the C locale, which Python coerces to C.UTF-8 in its environment) for a
    real ``python -m pytest`` and a forked one: they see the same process."""
    pytester.makepyfile(test_observe=OBSERVED)
    (pytester.path / "lib").mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("LC_ALL", "LC_CTYPE")}
    env.update(LANG="C", GPUMEM_SEEN="ünïcode", PYTHONPATH=os.pathsep.join(["lib", "", "/tmp/../opt/x/"]))
    # (pytest-memray, where installed, puts a new temporary folder in the environment of a session
    # that has none: the suite's in-process runs remove the suite's own)
    args = ["-s", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:memray"]
    real = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=pytester.path, env=env, capture_output=True)
    fork = forked.run(args, cwd=pytester.path, env=env)
    seen = []
    for done in (real, fork):
        assert done.returncode == 0, (done.stdout, done.stderr)
        stdout = done.stdout if isinstance(done.stdout, str) else done.stdout.decode()
        (line,) = [line for line in stdout.splitlines() if line.startswith("SEEN ")]
        seen.append(json.loads(line[len("SEEN ") :]))
    real_env, fork_env = seen[0].pop("environ"), seen[1].pop("environ")
    names = real_env.keys() | fork_env.keys()
    assert {
        name: (real_env.get(name), fork_env.get(name)) for name in names if real_env.get(name) != fork_env.get(name)
    } == {}
    assert seen[0] == seen[1]
    assert seen[1]["path"][:3] == [str(pytester.path), str(pytester.path / "lib"), str(pytester.path)]
    assert fork_env["GPUMEM_SEEN"] == "ünïcode" and fork_env["LC_CTYPE"] == "C.UTF-8"


@pytest.mark.slow
@forking
def test_a_timeout_kills_the_session_and_the_processes_it_started(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_sleeps="""
import os, subprocess, time

def test_sleeps():
    sleeper = subprocess.Popen(["sleep", "60"])
    with open("pids", "w") as out:
        out.write(f"{os.getpid()} {sleeper.pid}")
    time.sleep(60)
"""
    )
    began = time.monotonic()
    with pytest.raises(pytester.TimeoutExpired):
        forked.runpytest(pytester, "-p", "no:cacheprovider", timeout=4)
    assert time.monotonic() - began < 30
    session, sleeper = map(int, (pytester.path / "pids").read_text().split())
    assert _gone(session) and _gone(sleeper)


#: Two gloo ranks started with ``torch.multiprocessing.spawn``: each is a child of the session.
SPAWNS = """
import multiprocessing, os, socket
import torch, torch.distributed as dist, torch.multiprocessing as mp


def rank(index, port, parents):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    total = torch.tensor([index + 1.0])
    dist.all_reduce(total)
    parents[index] = (multiprocessing.parent_process().pid, total.item())
    dist.destroy_process_group()


def test_spawns_ranks():
    assert multiprocessing.parent_process() is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        parents = manager.dict()
        mp.spawn(rank, args=(port, parents), nprocs=2)
        assert dict(parents) == {0: (os.getpid(), 3.0), 1: (os.getpid(), 3.0)}
"""


@pytest.mark.slow
@forking
def test_a_session_spawns_processes_as_a_new_process_would(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_spawns=SPAWNS)
    forked.runpytest(pytester, "-p", "no:cacheprovider", timeout=300).assert_outcomes(passed=1)


PARENT = """
import os

def test_parent():
    print("PARENT", os.getppid())
"""


def _parent(pytester: pytest.Pytester) -> int:
    result = forked.runpytest(pytester, "-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    (parent,) = re.findall(r"PARENT (\d+)", result.stdout.str())
    return int(parent)


@pytest.mark.slow
@forking
def test_the_server_is_replaced_when_the_environment_differs_in_what_imports_could_read(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_parent=PARENT)
    assert _parent(pytester) == forked.server_pid()
    server = forked.server_pid()
    assert server is not None
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # pytest's, per test: the same server
    assert _parent(pytester) == server
    monkeypatch.setenv("GPUMEM_TESTS_SOMETHING", "1")  # anything else: a new server
    assert _parent(pytester) == forked.server_pid() != server
    assert _gone(server)


@pytest.mark.slow
def test_with_gpumem_tests_fork_0_a_session_is_a_real_subprocess(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_parent=PARENT)
    monkeypatch.setenv("GPUMEM_TESTS_FORK", "0")
    assert not forked.enabled()
    assert _parent(pytester) == os.getpid()
    done = forked.run(["-q", "-s", "-p", "no:cacheprovider"], cwd=pytester.path, env=dict(os.environ))
    assert done.returncode == 0 and f"PARENT {os.getpid()}" in done.stdout


#: A session that forks a session itself (so starts a server of its own), then ends: at exit, or
#: without running its exit handlers.
SERVER_OWNER = """
import os, sys
sys.path.insert(0, {tests!r})

import _forked_sessions as forked


def test_uses_a_server(pytester):
    pytester.makepyfile(test_inner="def test_inner(): pass")
    forked.runpytest(pytester, "-p", "no:cacheprovider").assert_outcomes(passed=1)
    with open({pids!r}, "a") as out:
        out.write(f"{{forked.server_pid()}}\\n")
    if {abrupt}:
        os._exit(0)
"""


@pytest.mark.slow
@forking
@pytest.mark.parametrize("abrupt", [False, True], ids=["at exit", "os._exit"])
def test_no_server_outlives_its_process(pytester: pytest.Pytester, abrupt: bool) -> None:
    pids = pytester.path / "pids"
    pytester.makepyfile(test_owner=SERVER_OWNER.format(tests=TESTS, pids=str(pids), abrupt=abrupt))
    result = forked.runpytest(pytester, "-p", "no:cacheprovider", "-p", "pytester")
    assert result.ret == 0
    (server,) = map(int, pids.read_text().split())
    assert _gone(server)
