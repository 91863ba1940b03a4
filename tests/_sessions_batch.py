"""A test module's pytest sessions, run once for all its tests (and all the xdist workers of a run).

Tests that each started sessions of their own in processes of their own, each importing the
same frameworks, share a few sessions instead: :func:`run_batch` writes their test modules into
one folder and runs the sessions there one after another (a later one sees what an earlier one
wrote, its baselines), each in a process forked from the suite's zygote
(``tests/_warm_sessions.py``), with the environment a ``pytester`` session has. Each test then
reads its own part of a session: its outcome, its failure's section of the output
(:func:`section`), its entry in the JSON report."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _pytest.pathlib import make_numbered_dir

from conftest import once_for_the_workers
from tests._warm_sessions import run_session


@dataclass(frozen=True)
class Session:
    """One pytest session: its arguments (after the suite's pinned ones), the environment variables
    it adds, and the test modules it runs (in this order, written before it starts)."""

    args: tuple[str, ...]
    modules: Mapping[str, str]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Ran:
    """A session's result, its JSON report (``--gpumem-json``, written for every session) and its folder."""

    result: pytest.RunResult
    report: dict[str, Any]
    folder: Path

    def test(self, nodeid: str) -> dict[str, Any]:
        """The JSON report's entry of ``nodeid``."""
        (found,) = [test for test in self.report["tests"] if test["nodeid"] == nodeid]
        return found

    def outcome(self, nodeid: str) -> str:
        """``passed``, ``failed`` ... as the short summary (``-rap``) gives ``nodeid``'s outcome."""
        lines = self.result.outlines
        found = [line.split()[0] for line in lines if line.endswith(f" {nodeid}") or f" {nodeid} - " in line]
        assert len(found) == 1, (nodeid, found)
        return found[0].lower()

    def section(self, name: str) -> str:
        """The failure section of the test function ``name`` (``___ name ___`` to the next header)."""
        return section(self.result.stdout.str(), name)


def section(text: str, name: str) -> str:
    """The part of a session's output under the header ``____ name ____`` (a failure's), to the next header."""
    header = re.compile(rf"^_+ {re.escape(name)} _+$", re.MULTILINE)
    found = list(header.finditer(text))
    assert len(found) == 1, (name, [m.group(0) for m in found])
    start = found[0].end()
    following = re.compile(r"^(_{3,} \S.* _{3,}|={3,} .* ={3,})$", re.MULTILINE).search(text, start)
    return text[start : following.start() if following else len(text)]


def _environment(folder: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """What a ``pytester`` session of this suite has (``tests/conftest.py``'s ``pytester``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "CI", "BUILD_NUMBER", "TOX_ENV_DIR")}
    env.update(HOME=str(folder), USERPROFILE=str(folder), PY_COLORS="0")
    env["PYTEST_ADDOPTS"] = "-p no:randomly -p no:hypothesispytest"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def _run(folder: Path, number: int, session: Session) -> dict[str, Any]:
    for name, source in session.modules.items():
        (folder / name).write_text(source, encoding="utf-8")
    report = folder / f"report-{number}.json"
    basetemp = make_numbered_dir(root=folder, prefix="runpytest-", mode=0o700)
    args = [f"--basetemp={basetemp}", "-p", "no:cacheprovider", "-W", "ignore::UserWarning"]
    args += ["--gpumem-device=cpu", f"--gpumem-json={report}", "-rap", *session.args, *session.modules]
    stdout, stderr = folder / f"stdout-{number}", folder / f"stderr-{number}"
    began = time.perf_counter()
    code = run_session(args, cwd=folder, env=_environment(folder, session.env), stdout=stdout, stderr=stderr)
    return {
        "ret": code,
        "stdout": stdout.read_text(encoding="utf8"),
        "stderr": stderr.read_text(encoding="utf8"),
        "duration": time.perf_counter() - began,
        "report": report.read_text(encoding="utf-8") if report.is_file() else "{}",
    }


def run_batch(request: pytest.FixtureRequest, name: str, sessions: Sequence[Session]) -> list[Ran]:
    """Run ``sessions`` in order, in one new folder, once a run (:func:`conftest.once_for_the_workers`)."""
    factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def make() -> dict[str, Any]:
        folder = factory.mktemp(name)
        with capture.global_and_fixture_disabled():  # a minute of sessions is never silent
            print(f"\n{request.node.nodeid}: {len(sessions)} pytest sessions in {folder}", flush=True)
        return {"folder": str(folder), "runs": [_run(folder, number, s) for number, s in enumerate(sessions, 1)]}

    answer = once_for_the_workers(request, name, make)
    ran = []
    for run in answer["runs"]:
        code: int | pytest.ExitCode = run["ret"]
        with contextlib.suppress(ValueError):
            code = pytest.ExitCode(code)
        result = pytest.RunResult(code, run["stdout"].splitlines(), run["stderr"].splitlines(), run["duration"])
        ran.append(Ran(result, json.loads(run["report"]), Path(answer["folder"])))
    return ran
