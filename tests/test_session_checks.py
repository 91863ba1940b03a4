"""What the run checks before its first test and what it records at its end: report paths that
cannot be written are usage errors before any test runs (serially and under xdist), a baseline
file that cannot be read stops an xdist run as it stops a serial one, and a test that failed in
any phase (an XPASS(strict), a failing teardown) never records a baseline."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run
from tests._sessions_xdist import warm_workers

pytest_plugins = ["pytester"]

OUTCOMES = """
import pytest, torch

@pytest.fixture
def failing_teardown():
    yield
    raise RuntimeError("the fixture's teardown fails")

@pytest.mark.gpumem
def test_passes():
    torch.ones(100)

@pytest.mark.xfail(strict=True)
@pytest.mark.gpumem
def test_xpass_strict():
    torch.ones(100)

@pytest.mark.xfail
@pytest.mark.gpumem
def test_xpass_not_strict():
    torch.ones(100)

@pytest.mark.xfail(strict=True)
@pytest.mark.gpumem
def test_xfailed():
    torch.ones(100)
    assert False

@pytest.mark.gpumem
def test_teardown_fails(failing_teardown):
    torch.ones(100)

@pytest.mark.gpumem
def test_fails():
    torch.ones(100)
    assert False
"""


def recorded_tests(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    return sorted(test for env in data["environments"].values() for test in env["tests"])


@pytest.mark.parametrize("workers", [(), pytest.param(("-n", "2"), marks=pytest.mark.slow)], ids=["serial", "xdist"])
def test_a_test_that_failed_in_any_phase_records_no_baseline(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: tuple[str, ...]
) -> None:
    pytester.makepyfile(test_phases=OUTCOMES)
    with warm_workers(monkeypatch):
        result = run(pytester, "--gpumem-update-baselines", *workers)
    result.assert_outcomes(passed=2, failed=2, xfailed=1, xpassed=1, errors=1)
    # a non-strict XPASS is reported as passed (pytest counts it so): it records, as any passing test
    assert recorded_tests(pytester.path / "gpumem-baselines.json") == [
        "test_phases.py::test_passes",
        "test_phases.py::test_xpass_not_strict",
    ]
    result.stdout.fnmatch_lines(["not recorded, the test or its memory check failed:*"])
    said = " ".join(result.stdout.str().split("not recorded, the test or its memory check failed:")[1].split())
    for name in ("test_xpass_strict", "test_xfailed", "test_teardown_fails", "test_fails"):
        assert f"test_phases.py::{name}" in said


@pytest.mark.parametrize(
    ("option", "make", "why"),
    [
        ("--gpumem-json", "directory", "{target} is a directory: give a file name"),
        ("--gpumem-markdown", "directory", "{target} is a directory: give a file name"),
        ("--gpumem-json", "under-a-file", "{target} cannot be created: {target.parent} is not a directory"),
        ("--gpumem-markdown", "read-only", "{target} cannot be written: the folder {target.parent} is not writable"),
        ("--gpumem-artifacts", "file", "{target} is a file: give a folder"),
        ("--gpumem-baselines", "directory", "{target} is a directory: give a file name"),
    ],
)
def test_a_report_path_that_cannot_be_written_is_a_usage_error_before_the_first_test(
    pytester: pytest.Pytester, option: str, make: str, why: str
) -> None:
    pytester.makepyfile(
        test_one="""
import pytest, torch
from pathlib import Path

@pytest.mark.gpumem
def test_one():
    Path("ran").touch()
"""
    )
    if make == "directory":
        target = pytester.mkdir("out")
    elif make == "file":
        target = pytester.path / "afile"
        target.write_text("")
    elif make == "under-a-file":
        (pytester.path / "afile").write_text("")
        target = pytester.path / "afile" / "report.json"
    else:
        if sys.platform == "win32" or os.geteuid() == 0:
            pytest.skip("root (or Windows) can write into a read-only folder")
        folder = pytester.mkdir("locked")
        folder.chmod(0o500)
        target = folder / "report.md"
    result = run(pytester, f"{option}={target}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert not (pytester.path / "ran").exists()  # no test ran
    text = result.stderr.str()
    dest = option[2:].replace("-", "_")
    assert f"{option} / ini {dest}: {why.format(target=target)}" in text, text
    assert "Traceback" not in text and "INTERNALERROR" not in text


def test_a_report_path_in_the_ini_file_is_named_by_its_ini_key(pytester: pytest.Pytester) -> None:
    pytester.mkdir("out")
    pytester.makeini("[pytest]\ngpumem_json = out\n")
    pytester.makepyfile(test_one="import pytest\n@pytest.mark.gpumem\ndef test_one():\n    pass\n")
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    expected = f"--gpumem-json / ini gpumem_json: {pytester.path / 'out'} is a directory: give a file name"
    assert expected in result.stderr.str()


def test_a_report_path_whose_folder_does_not_exist_yet_is_created(pytester: pytest.Pytester) -> None:
    """As pytest's own --junitxml does: the folder is made when the report is written."""
    pytester.makepyfile(test_one="import pytest\n@pytest.mark.gpumem\ndef test_one():\n    pass\n")
    target = pytester.path / "new" / "deeper" / "report.json"
    run(pytester, f"--gpumem-json={target}").assert_outcomes(passed=1)
    assert json.loads(target.read_text())["summary"]["tests"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("update", [(), ("--gpumem-update-baselines",)], ids=["judge", "update"])
def test_under_xdist_an_unreadable_baseline_file_stops_the_run_before_any_test(
    pytester: pytest.Pytester, update: tuple[str, ...]
) -> None:
    pytester.makepyfile(
        test_many="""
import pytest, torch
from pathlib import Path

@pytest.mark.parametrize("n", range(8))
@pytest.mark.gpumem
def test_step(n):
    Path(f"ran-{n}").touch()
"""
    )
    (pytester.path / "gpumem-baselines.json").write_text("{ not json")
    serial = run(pytester, "-p", "no:randomly", *update)
    result = run(pytester, "-p", "no:randomly", "-n", "2", *update)
    for ran in (serial, result):
        assert ran.ret == pytest.ExitCode.USAGE_ERROR
        assert "gpumem baselines:" in ran.stderr.str() and "gpumem-baselines.json" in ran.stderr.str()
    assert list(pytester.path.glob("ran-*")) == []
    assert (pytester.path / "gpumem-baselines.json").read_text() == "{ not json"  # left untouched


def test_a_report_that_cannot_be_written_at_the_end_says_so_without_a_traceback(pytester: pytest.Pytester) -> None:
    """The path was fine before the first test; a test replaced its folder with a file."""
    out = pytester.mkdir("out")
    pytester.makepyfile(
        test_one=f"""
import shutil, pytest
from pathlib import Path

@pytest.mark.gpumem
def test_one():
    shutil.rmtree({str(out)!r})
    Path({str(out)!r}).write_text("now a file")
"""
    )
    result = run(pytester, f"--gpumem-json={out / 'report.json'}")
    assert result.ret == pytest.ExitCode.OK  # a warning: the test passed
    text = result.stdout.str()
    assert f"gpumem: could not write the JSON report {out / 'report.json'}: File exists ({out})" in text
    assert "Traceback" not in text and "INTERNALERROR" not in text
    assert "test_one.py::test_one" in text  # the summary is still there
