"""One file that cannot be written never aborts the run.

A report, an artifact page or a step summary that cannot be written (a folder or a symbolic
link at its name, a full disk) is a warning that names the path and the reason; the run ends
as its tests say, and every other output is written. A baseline file that cannot be written
when the run was asked to update it fails the run (exit status 1) and is left as it was.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import run
from pytest_gpumem.report.artifacts import artifact_path
from tests._warm_sessions import run_session

pytest_plugins = ["pytester"]

SUITE = """
import pytest, torch


@pytest.mark.gpumem(peak="1B")
def test_too_big():
    torch.ones(1000)


@pytest.mark.gpumem
def test_fine():
    torch.ones(10)
"""

PASSING = """
import pytest, torch


@pytest.mark.gpumem
def test_a():
    torch.ones(100)


@pytest.mark.gpumem
def test_b():
    torch.ones(200)
"""


def no_crash(result: pytest.RunResult) -> str:
    text = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in text and "Traceback" not in text, text
    return " ".join(text.split())  # the gpumem section wraps long lines


def test_a_folder_at_the_artifact_page_s_name_is_a_warning(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_w=SUITE)
    folder = pytester.path / "artifacts"
    page = artifact_path(folder, "test_w.py::test_too_big", ".html")
    page.mkdir(parents=True)
    json_path, markdown = pytester.path / "r.json", pytester.path / "r.md"
    result = run(
        pytester, f"--gpumem-artifacts={folder}", f"--gpumem-json={json_path}", f"--gpumem-markdown={markdown}"
    )
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # as the tests say
    text = no_crash(result)
    assert f"could not write the artifact page {page}: Is a directory" in text
    assert json.loads(json_path.read_text())["summary"]["tests"] == 2 and "test_too_big" in markdown.read_text()


def test_a_symbolic_link_at_the_artifact_page_s_name_is_a_warning(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_w=SUITE)
    folder = pytester.path / "artifacts"
    page = artifact_path(folder, "test_w.py::test_too_big", ".html")
    folder.mkdir()
    victim = pytester.path / "victim.txt"
    victim.write_text("keep me")
    page.symlink_to(victim)
    result = run(pytester, f"--gpumem-artifacts={folder}", "--gpumem-artifacts-all")
    result.assert_outcomes(passed=1, failed=1)
    text = no_crash(result)
    assert f"could not write the artifact page {page}: a symbolic link is at its name" in text
    assert victim.read_text() == "keep me" and page.is_symlink()
    assert artifact_path(folder, "test_w.py::test_fine", ".html").is_file()  # the other page is written


REPLACES_THE_REPORT = """
import os, pytest, torch


@pytest.mark.gpumem
def test_one():
    os.mkdir(os.environ["REPORT_PATH"])  # the report's path was fine before the first test
    torch.ones(10)
"""


@pytest.mark.parametrize("report", ["json", "markdown"])
def test_a_report_that_cannot_be_written_is_a_warning_and_the_other_is_written(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, report: str
) -> None:
    pytester.makepyfile(test_r=REPLACES_THE_REPORT)
    paths = {"json": pytester.path / "r.json", "markdown": pytester.path / "r.md"}
    monkeypatch.setenv("REPORT_PATH", str(paths[report]))
    result = run(pytester, f"--gpumem-json={paths['json']}", f"--gpumem-markdown={paths['markdown']}")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK  # a warning: the tests passed
    kind = {"json": "JSON", "markdown": "Markdown"}[report]
    assert f"could not write the {kind} report {paths[report]}: Is a directory" in no_crash(result)
    other = paths["markdown" if report == "json" else "json"]
    assert other.is_file() and "test_one" in other.read_text()
    assert "OutputNotWritten" in result.stdout.str()  # in pytest's warnings summary too


def test_a_step_summary_that_cannot_be_written_is_a_warning(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_p=PASSING)
    summary = pytester.mkdir("summary")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = run(pytester, f"--gpumem-json={pytester.path / 'r.json'}")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
    assert f"could not append to $GITHUB_STEP_SUMMARY ({summary}): Is a directory" in no_crash(result)
    assert (pytester.path / "r.json").is_file()


def test_a_baseline_file_that_cannot_be_written_fails_the_update_and_the_reports_are_written(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_p=PASSING)
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=2)
    path = pytester.path / "gpumem-baselines.json"
    before = path.read_bytes()
    pytester.makepyfile(test_p=PASSING.replace("torch.ones(200)", "torch.ones(300)"))
    path.chmod(0o444)
    result = run(pytester, "--gpumem-update-baselines", f"--gpumem-json={pytester.path / 'r.json'}")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert f"could not write the baseline file: {path}: the baseline file is read-only" in no_crash(result)
    assert path.read_bytes() == before
    assert (pytester.path / "r.json").is_file()


# --------------------------------------------------------------------------- a full disk, for every file


def _full_disk(limit: int) -> None:
    """In the child: writes past ``limit`` bytes fail with EFBIG (Python ignores SIGXFSZ)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def full_disk_session(folder: Path, *args: str, limit: int = 300) -> subprocess.CompletedProcess[str]:
    """``python -m pytest`` on a full disk; the interpreter writes no ``.pyc`` (one written under the
    limit is cut short, and every later import of that module fails on it)."""
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(folder / "summary.md"), "PYTEST_ADDOPTS": "-p no:randomly"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("CI", None)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--gpumem-device=cpu",
        "-W",
        "ignore::UserWarning",
    ]
    return subprocess.run(
        [*command, *args], cwd=folder, env=env, capture_output=True, text=True, preexec_fn=lambda: _full_disk(limit)
    )


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="RLIMIT_FSIZE is POSIX")
def test_a_full_disk_fails_every_write_by_name_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "test_p.py").write_text(PASSING)
    # python -m pytest, forked from the session zygote (tests/_warm_sessions.py): the disk is not full yet
    args = ["-p", "no:cacheprovider", "--gpumem-device=cpu", "--gpumem-update-baselines"]
    env = {**os.environ, "PYTEST_ADDOPTS": "-p no:randomly"}
    with tempfile.TemporaryDirectory(prefix="gpumem-output-") as output:  # not in the session's folder
        out, err = Path(output) / "stdout", Path(output) / "stderr"
        code = run_session(args, cwd=tmp_path, env=env, stdout=out, stderr=err)
        assert code == 0, out.read_text(encoding="utf-8")
    path = tmp_path / "gpumem-baselines.json"
    (tmp_path / "test_p.py").write_text(PASSING.replace("torch.ones(200)", "torch.ones(300)"))
    (tmp_path / "summary.md").write_text("# an earlier step\n")
    files = {name: (tmp_path / name).read_bytes() for name in ("gpumem-baselines.json", "summary.md")}
    outputs = ("--gpumem-json=r.json", "--gpumem-markdown=r.md", "--gpumem-artifacts=art", "--gpumem-artifacts-all")
    updated = full_disk_session(tmp_path, "--gpumem-update-baselines", *outputs)
    (tmp_path / "test_p.py").write_text(PASSING)  # as recorded: the tests pass
    reported = full_disk_session(tmp_path, *outputs)
    for result in (updated, reported):
        text = " ".join((result.stdout + result.stderr).split())
        assert "INTERNALERROR" not in text and "Traceback" not in text, text
        assert "2 passed" in text
        assert f"could not write the JSON report {tmp_path / 'r.json'}: File too large" in text
        assert f"could not write the Markdown report {tmp_path / 'r.md'}: File too large" in text
        assert f"could not append to $GITHUB_STEP_SUMMARY ({tmp_path / 'summary.md'}): File too large" in text
        page = artifact_path(tmp_path / "art", "test_p.py::test_a", ".html")
        assert f"could not write the artifact page {page}: File too large" in text
    assert f"could not write the baseline file: {path}: cannot write the baseline file: File too large" in " ".join(
        updated.stdout.split()
    )
    assert updated.returncode == pytest.ExitCode.TESTS_FAILED  # asked to update the baselines: it could not
    assert reported.returncode == pytest.ExitCode.OK  # only reports: warnings
    assert {name: (tmp_path / name).read_bytes() for name in files} == files  # untouched, not truncated
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".") or p.suffix == ".tmp") == []
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.md").exists()
    assert list((tmp_path / "art").iterdir()) == []


def test_the_warning_made_an_error_fails_the_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_r=REPLACES_THE_REPORT)
    monkeypatch.setenv("REPORT_PATH", str(pytester.path / "r.json"))
    result = run(pytester, f"--gpumem-json={pytester.path / 'r.json'}", "-W", "error::pytest_gpumem.OutputNotWritten")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert f"could not write the JSON report {pytester.path / 'r.json'}: Is a directory" in no_crash(result)
