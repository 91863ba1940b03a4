"""``allocated`` is read as the test returns under any tracer: coverage (pytest-cov), a plain
``sys.settrace`` trace function, a debugger; and the tracer sees what it sees without the plugin."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run, run_fresh
from pytest_gpumem.measurement import returnwatch

CHECK = Path(__file__).with_name("returnwatch_check.py")

HELPERS = """
def helper(n):
    total = 0
    for i in range(n):
        if i % 2:
            total += i
        else:
            total -= 1
    return total


def never():
    return "not run"


def generator(n):
    for i in range(n):
        yield i * 2
"""

SUITE = """
import pytest, torch
from helpers import generator, helper
DEVICE = "cpu"

@pytest.mark.gpumem(allocated="64KiB")
def test_keeps_a_local():
    big = torch.ones(32 * 1024, device=DEVICE)     # 128 KiB alive until the test returns
    value = helper(5)
    if value > 100:
        value = 0
    assert sum(generator(3)) == 6

def test_after():
    assert helper(2) == 0
"""


def _outcome(result: pytest.RunResult, *, measured: bool) -> None:
    if measured:
        result.assert_outcomes(passed=1, failed=1)
        result.stdout.fnmatch_lines(["*allocated cost 128.00 KiB exceeds the limit 64.00 KiB (64KiB)*"])
    else:
        result.assert_outcomes(passed=2)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_allocated_is_read_as_the_test_returns_under_pytest_cov(pytester: pytest.Pytester, device: str) -> None:
    """``pytest --cov``: the return watch chains to coverage's trace function (before Python 3.12)
    instead of stepping aside (where ``allocated`` read 0 B and the test passed); coverage's report
    is the same, line by line and branch by branch, as without the plugin."""
    pytest.importorskip("pytest_cov")
    pytester.makepyfile(helpers=HELPERS, test_suite=SUITE.replace('DEVICE = "cpu"', f"DEVICE = {device!r}"))
    reports = {}
    for measured in (True, False):
        report = pytester.path / f"coverage-{measured}.json"
        args = ["-p", "pytest_cov", f"--cov={pytester.path}", "--cov-branch", f"--cov-report=json:{report}"]
        result = run_fresh(pytester, *args, *(() if measured else ("--gpumem-disable",)), device=device)
        _outcome(result, measured=measured)
        files = json.loads(report.read_text())["files"]
        reports[measured] = {
            Path(name).name: {key: data[key] for key in ("executed_lines", "missing_lines", "executed_branches")}
            for name, data in files.items()
        }
    assert reports[True] == reports[False]
    assert reports[True]["helpers.py"]["missing_lines"] == [12]  # never()'s body: the report is a real one
    assert reports[True]["test_suite.py"]["missing_lines"] == [10]


TRACER = """
import sys

LINES = []

def tracer(frame, event, arg):
    if not frame.f_code.co_filename.endswith(("helpers.py", "test_suite.py")):
        return None
    if event == "line":
        LINES.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
    return tracer

sys.settrace(tracer)

def pytest_sessionfinish(session):
    assert sys.gettrace() is tracer, sys.gettrace()
    with open("lines.txt", "w") as out:
        out.write("\\n".join(LINES))
"""


@pytest.mark.slow
def test_allocated_is_read_as_the_test_returns_under_a_trace_function(pytester: pytest.Pytester) -> None:
    """A trace function installed before the tests (a debugger, a tracer of the user's) keeps
    seeing every line, in order, and is the trace function again after the test."""
    pytester.makepyfile(helpers=HELPERS, test_suite=SUITE, conftest=TRACER)
    lines = {}
    for measured in (True, False):  # (no second run of the failing test, with sites: its lines would be seen twice)
        result = run_fresh(pytester, *(("--gpumem-sites=off",) if measured else ("--gpumem-disable",)))
        _outcome(result, measured=measured)
        lines[measured] = (pytester.path / "lines.txt").read_text().splitlines()
    assert lines[True] == lines[False]
    assert "test_keeps_a_local:7" in lines[True] and "helper:5" in lines[True] and "test_after:14" in lines[True]


def _interpreter(version: str) -> str | None:
    """A path to a runnable Python ``version`` ("3.12") on this machine, else None."""
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        return sys.executable
    name = f"python{version}"
    candidates = [shutil.which(name)]
    root = os.environ.get("PYENV_ROOT")
    if root:  # pyenv's shims run only the versions pyenv is told to: its installs run as they are
        candidates += sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", name)))
    expected = f"{tuple(int(part) for part in version.split('.'))}"
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True)
        if probe.returncode == 0 and probe.stdout.decode().strip() == expected:
            return candidate
    return None


@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12", "3.13", "3.14"])
def test_the_watch_mechanism_on_every_python(version: str) -> None:
    """The watch alone (stdlib only: runs without torch) on each Python this machine has: before
    3.12 chained to a trace function, on 3.12+ through ``sys.monitoring`` beside other tools."""
    interpreter = _interpreter(version)
    if interpreter is None:
        pytest.skip(f"no runnable python{version} on this machine")
    done = subprocess.run([interpreter, str(CHECK), returnwatch.__file__], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring: Python 3.12+")
def test_a_test_fails_saying_so_where_allocated_cannot_be_read_at_its_return(pytester: pytest.Pytester) -> None:
    """Every ``sys.monitoring`` tool id taken (by tools a conftest started): no silent 0 B."""
    pytester.makeconftest(
        """
import sys

def pytest_configure(config):
    config.gpumem_taken = [i for i in range(6) if sys.monitoring.get_tool(i) is None]
    for i in config.gpumem_taken:
        sys.monitoring.use_tool_id(i, f"tool-{i}")

def pytest_unconfigure(config):
    for i in config.gpumem_taken:
        sys.monitoring.free_tool_id(i)
"""
    )
    pytester.makepyfile(
        """
import pytest, torch

@pytest.mark.gpumem(allocated="1MiB")
def test_step():
    x = torch.ones(10)
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_step: allocated cannot be read as the test returns: every sys.monitoring*"])
