"""The judgement where CI reads it: JUnit properties per span and metric, the run's own failure
(strict-mode stale baselines) in red and in the JUnit file, GitHub Actions' ``::error``
annotations at the line that grew, and a step summary that folds passing rows and stays under
GitHub's 1 MiB."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import run
from pytest_gpumem.data.findings import Finding
from pytest_gpumem.report.ci import STEP_SUMMARY_LIMIT, Annotation, capped_summary, junit_properties
from tests._sessions_xdist import warm_workers

pytest_plugins = ["pytester"]

MiB = 1 << 20

# b grows with N (rows of 256 float32: 1 KiB each); a does not
SUITE = """
import os
import pytest
import torch

N = int(os.environ.get("GROW", "1024"))


@pytest.mark.gpumem(peak="64MiB")
def test_grows():
    a = torch.zeros(1024, 256)
    b = torch.ones(N, 256)
    del a, b


@pytest.mark.gpumem
def test_steady(gpumem):
    with gpumem.measure("alloc"):
        torch.ones(256, 256)
"""

#: the lines of ``test_grows`` (pytest's location: its first decorator) and of ``b = torch.ones(N, 256)`` in the
#: file pytester writes (SUITE less its first line)
TEST_LINE = SUITE.strip().splitlines().index('@pytest.mark.gpumem(peak="64MiB")') + 1
GROWING_LINE = SUITE.strip().splitlines().index("    b = torch.ones(N, 256)") + 1


def properties(junit: Path, name: str) -> dict[str, str]:
    """The properties of the test case ``name`` in a JUnit XML file."""
    case = next(c for c in ET.parse(junit).iter("testcase") if c.get("name") == name)
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


@pytest.fixture
def grown(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A suite whose baselines are recorded, then ``test_grows`` grows by 1 MiB (at GROWING_LINE)."""
    pytester.makepyfile(test_suite=SUITE)
    assert pytester.path.joinpath("test_suite.py").read_text().splitlines()[GROWING_LINE - 1].strip().startswith("b =")
    assert pytester.path.joinpath("test_suite.py").read_text().splitlines()[TEST_LINE].startswith("def test_grows")
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=2)
    monkeypatch.setenv("GROW", "2048")
    for name in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "GITHUB_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    return pytester


@pytest.mark.slow
def test_junit_properties_carry_what_was_judged(grown: pytest.Pytester) -> None:
    result = run(grown, "--junitxml=junit.xml")
    result.assert_outcomes(failed=1, passed=1)
    props = properties(grown.path / "junit.xml", "test_grows")
    assert props["gpumem.peak.cost"] == str(3 * MiB)
    assert props["gpumem.peak.baseline"] == str(2 * MiB)
    assert props["gpumem.peak.limit"] == str(64 * MiB)
    assert props["gpumem.peak.status"] == "regressed"
    assert props["gpumem.peak.measured"] == props["gpumem.peak"]  # the figure, as before
    assert props["gpumem.allocated.cost"] == "0"
    assert props["gpumem.allocated.baseline"] == "0"
    assert props["gpumem.allocated.status"] == "ok"
    assert "gpumem.peak.budget" not in props
    assert props["gpumem.failure"] == (
        "peak cost 3.00 MiB regressed from baseline 2.00 MiB by +1.00 MiB (+50.0%), tolerance 0 (exact); "
        "by category at the peak: temporaries +1.00 MiB"
    )
    steady = properties(grown.path / "junit.xml", "test_steady")
    assert steady["gpumem.peak.cost"] == steady["gpumem.peak.baseline"] == str(256 * 1024)
    assert steady["gpumem.peak.status"] == "ok"
    assert steady["gpumem[alloc].peak.cost"] == steady["gpumem[alloc].peak.baseline"] == str(256 * 1024)
    assert steady["gpumem[alloc].peak.status"] == "ok"
    assert "gpumem.failure" not in steady


@pytest.mark.slow
def test_junit_properties_under_xdist(grown: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller judges, and adds the properties to the teardown report, where the JUnit file reads them."""
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(grown.path))
    with warm_workers(monkeypatch):
        result = run(grown, "-n", "2", "--junitxml=junit.xml")
    result.assert_outcomes(failed=1, passed=1)
    props = properties(grown.path / "junit.xml", "test_grows")
    assert (props["gpumem.peak.cost"], props["gpumem.peak.baseline"]) == (str(3 * MiB), str(2 * MiB))
    assert props["gpumem.peak.status"] == "regressed"
    errors = [line for line in result.stdout.lines if line.startswith("::error")]
    assert len(errors) == 1 and errors[0].startswith(f"::error file=test_suite.py,line={GROWING_LINE},")


@pytest.mark.slow
def test_strict_stale_baselines_say_why_in_red_and_in_the_junit_file(
    grown: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GROW")
    grown.makepyfile(test_suite=SUITE.replace("def test_steady", "def test_renamed"))
    result = run(grown, "--gpumem-strict", "--junitxml=junit.xml", "-k", "grows", "--color=yes")
    result.assert_outcomes(passed=1, deselected=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    why = (
        "gpumem: the run fails: 1 stale baseline(s) with --gpumem-strict (first: test_suite.py::test_steady): "
        "refresh the baseline file with --gpumem-update-baselines --gpumem-prune"
    )
    assert f"\x1b[31m{why}" in result.stdout.str()  # red
    cases = {(c.get("classname"), c.get("name")): c for c in ET.parse(grown.path / "junit.xml").iter("testcase")}
    failure = cases[("gpumem", "run")].find("failure")
    assert failure is not None and failure.get("message") == why
    suite = next(ET.parse(grown.path / "junit.xml").iter("testsuite"))
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")


@pytest.mark.slow
def test_github_annotations_point_at_the_line_that_grew(
    grown: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(grown.path))
    result = run(grown)
    result.assert_outcomes(failed=1, passed=1)
    errors = [line for line in result.stdout.lines if line.startswith("::error")]
    assert errors == [
        f"::error file=test_suite.py,line={GROWING_LINE},title=gpumem%3A test_suite.py%3A%3Atest_grows::"
        "peak cost 3.00 MiB regressed from baseline 2.00 MiB by +1.00 MiB (+50.0%25), tolerance 0 (exact); "
        "by category at the peak: temporaries +1.00 MiB"
        f"%0A(the line whose tensors grew most: test_suite.py:{GROWING_LINE})"
    ]
    monkeypatch.delenv("GITHUB_ACTIONS")
    assert not [line for line in run(grown).stdout.lines if line.startswith("::")]  # off GitHub: none


@pytest.mark.slow
def test_without_sites_the_annotation_is_at_the_test(grown: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(grown.path.parent))
    result = run(grown, "--gpumem-sites=off")
    errors = [line for line in result.stdout.lines if line.startswith("::error")]
    assert len(errors) == 1
    assert errors[0].startswith(f"::error file={grown.path.name}/test_suite.py,line={TEST_LINE},title=gpumem%3A ")


@pytest.mark.slow
def test_the_step_summary_folds_passing_tests(grown: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = grown.path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    run(grown, "--gpumem-markdown=report.md").assert_outcomes(failed=1, passed=1)
    text = summary.read_text(encoding="utf-8")
    shown, folded = text.split("<details><summary>1 test(s) passing on memory</summary>")
    folded, after = folded.split("</details>")
    assert "test_suite.py::test_grows" in shown and "test_suite.py::test_steady" not in shown
    assert "test_suite.py::test_steady" in folded and "test_suite.py::test_grows" not in folded
    assert "test_suite.py::test_steady" not in after and "### Sites" in after
    report = (grown.path / "report.md").read_text(encoding="utf-8")
    assert "<details>" not in report  # the report file keeps one table
    assert "test_suite.py::test_steady" in report


@pytest.mark.slow
def test_the_step_summary_stays_under_github_s_limit(grown: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = grown.path / "summary.md"
    earlier = b"# earlier steps\n" + b"x" * (STEP_SUMMARY_LIMIT - 1200) + b"\n"
    summary.write_bytes(earlier)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    run(grown).assert_outcomes(failed=1, passed=1)
    data = summary.read_bytes()
    assert len(data) <= STEP_SUMMARY_LIMIT
    assert data.startswith(earlier)
    assert b"The gpumem report was cut here" in data
    summary.write_bytes(b"y" * (STEP_SUMMARY_LIMIT - 10))  # no room even for the note: a warning, nothing written
    result = run(grown)
    assert summary.stat().st_size == STEP_SUMMARY_LIMIT - 10
    assert "could not append to $GITHUB_STEP_SUMMARY" in result.stdout.str()


def test_counts_are_properties_too() -> None:
    """``max_microbatch`` (a count) with its minimum (the marker's ``min_microbatch``, a limit)."""
    from test_gate import measured

    record = measured("t.py::test_fit", 1000)
    record.measurements[0] = replace(record.measurements[0], max_microbatch=16)
    record.findings.append(Finding("t.py::test_fit", "call", "max_microbatch", "limit", "ok", measured=16, reference=8))
    props = dict(junit_properties(record))
    assert props["gpumem.max_microbatch.measured"] == props["gpumem.max_microbatch.cost"] == 16
    assert props["gpumem.max_microbatch.limit"] == 8
    assert props["gpumem.max_microbatch.status"] == "ok"
    assert props["gpumem.peak.cost"] == 4000
    assert "gpumem.failure" not in props


def test_a_cut_summary_closes_what_it_opened() -> None:
    opened = "<details><summary>n</summary>\n\n"
    markdown = "## gpumem\n\n| a |\n|---|\n| 1 |\n\n" + opened + "| row |\n" * 1000 + "</details>\n"
    whole, cut = capped_summary(markdown, 10_000)
    assert (whole.decode(), cut) == (markdown, False)
    data, cut = capped_summary(markdown, 2000)
    text = data.decode()
    assert cut and len(data) <= 2000
    assert text.count("<details>") == text.count("</details>") == 1
    assert text.endswith("in the files of `--gpumem-markdown` and `--gpumem-json`.\n")
    assert capped_summary(markdown, 100) == (b"", True)


def test_annotation_commands_escape_what_github_reads() -> None:
    annotation = Annotation("tests/a,b.py", 7, "gpumem: t.py::test[x:1]", "50% over\nsecond line")
    assert annotation.command() == (
        "::error file=tests/a%2Cb.py,line=7,title=gpumem%3A t.py%3A%3Atest[x%3A1]::50%25 over%0Asecond line"
    )
    assert Annotation("", 0, "gpumem: the run fails", "why").command() == "::error title=gpumem%3A the run fails::why"
