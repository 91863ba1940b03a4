"""``python -m pytest_gpumem baselines history``: the baseline file's figures across git commits.

The histories are real: a git repository in a temporary folder, whose baseline file each commit
records with a real pytest session (``--gpumem-update-baselines``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pytest_gpumem.baselines.history import read_history
from pytest_gpumem.cli import main
from tests.conftest import run

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

FILE = "gpumem-baselines.json"

MLP = """
import pytest, torch

@pytest.mark.gpumem
def test_mlp(gpumem):
    model = torch.nn.Sequential(torch.nn.Linear(64, {hidden}), torch.nn.ReLU(), torch.nn.Linear({hidden}, 8))
    gpumem.track(model)
    with gpumem.measure("forward"):
        model(torch.randn(32, 64)).sum().backward()
"""

ONES = """
@pytest.mark.gpumem
def test_ones():
    torch.ones(1000)
"""


def _git(folder: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=dev", "-c", "user.email=dev@example.com", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def _record(pytester: pytest.Pytester, source: str, subject: str) -> str:
    """Write the test file, record its baselines with a real session, commit; returns the commit."""
    pytester.makepyfile(test_m=source)
    run(pytester, "--gpumem-update-baselines", "-p", "no:cacheprovider").assert_outcomes(
        passed=source.count("def test_")
    )
    _git(pytester.path, "add", "-A")
    _git(pytester.path, "commit", "-q", "-m", subject)
    return _git(pytester.path, "rev-parse", "HEAD")


@pytest.fixture
def repository(pytester: pytest.Pytester) -> dict[str, str]:
    """Five commits: the MLP recorded, widened, a test added, a bad merge (conflict markers), the merge fixed."""
    _git(pytester.path, "init", "-q")
    commits = {
        "first": _record(pytester, MLP.format(hidden=256), "Add the MLP test"),
        "wider": _record(pytester, MLP.format(hidden=512), "Widen the hidden layer"),
        "ones": _record(pytester, MLP.format(hidden=512) + ONES, "Add test_ones"),
    }
    path = pytester.path / FILE
    good = path.read_text()
    path.write_text(good.replace('\n  "environments"', '\n<<<<<<< HEAD\n  "environments"', 1))
    _git(pytester.path, "commit", "-q", "-am", "A bad merge")
    commits["bad"] = _git(pytester.path, "rev-parse", "HEAD")
    path.write_text(good)
    _git(pytester.path, "commit", "-q", "-am", "Fix the merge")
    commits["fixed"] = _git(pytester.path, "rev-parse", "HEAD")
    return commits


def _costs(pytester: pytest.Pytester, commit: str, test: str, span: str) -> dict[str, int | None]:
    tree = json.loads(_git(pytester.path, "show", f"{commit}:{FILE}"))
    (env,) = tree["environments"].values()
    return env["tests"][test]["spans"][span]


def test_history_reads_each_commit_and_skips_the_unreadable(
    pytester: pytest.Pytester, repository: dict[str, str]
) -> None:
    history = read_history(pytester.path / FILE)
    assert [v.commit.sha for v in history.versions] == [repository[k] for k in ("first", "wider", "ones", "fixed")]
    assert [v.commit.subject for v in history.versions] == [
        "Add the MLP test",
        "Widen the hidden layer",
        "Add test_ones",
        "Fix the merge",
    ]
    (skipped,) = history.skipped
    assert skipped.commit.sha == repository["bad"] and "conflict marker" in skipped.reason
    for version in history.versions:
        for (_, test, span), figures in version.figures.items():
            stored = _costs(pytester, version.commit.sha, test, span)
            assert figures == {m: v for m, v in stored.items() if m in figures}
            assert figures["peak"] == stored["peak"] and figures["allocated"] == stored["allocated"]


def test_cli_prints_each_commits_figures_exactly(
    pytester: pytest.Pytester, repository: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.chdir()
    assert main(["baselines", "history", "--bytes", "test_mlp"]) == 0
    out, err = capsys.readouterr()
    assert f"skipped {repository['bad'][:10]} (A bad merge)" in err and "conflict marker" in err
    rows = [line.split() for line in out.splitlines() if line.startswith("test_m.py::test_mlp")]
    assert len(rows) == 8  # two spans, four readable commits
    for row in rows:
        test, span, short = row[0], row[1], row[2]
        commit = next(sha for sha in repository.values() if sha.startswith(short))
        stored = _costs(pytester, commit, test, span)
        numbers = [cell for cell in row[3:] if cell.isdigit()]
        assert numbers[-2:] == [str(stored["peak"]), str(stored["allocated"])]
    first, wider = (_costs(pytester, repository[k], "test_m.py::test_mlp", "call") for k in ("first", "wider"))
    grew = f"peak +{wider['peak'] - first['peak']}, allocated +{wider['allocated'] - first['allocated']}"
    assert grew in out
    assert "test_m.py::test_ones" not in out


def test_sparklines_show_the_trend(
    pytester: pytest.Pytester, repository: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.chdir()
    assert main(["baselines", "history", "--sparklines"]) == 0
    out = capsys.readouterr().out
    lines = {tuple(line.split()[:3]): line for line in out.splitlines() if line.startswith("test_m.py::")}
    assert "▁███" in lines[("test_m.py::test_mlp", "call", "peak")]
    assert "4 / 1" in lines[("test_m.py::test_mlp", "call", "peak")]
    assert "▄▄" in lines[("test_m.py::test_ones", "call", "peak")]


def test_html_page_has_a_chart_per_span_with_each_change_marked(
    pytester: pytest.Pytester, repository: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.chdir()
    assert main(["baselines", "history", "--html", "trend/history.html"]) == 0
    page = (pytester.path / "trend" / "history.html").read_text()
    assert "<script" not in page and "http" not in page.replace('http-equiv="Content-Security-Policy"', "")
    assert "default-src 'none'" in page
    sections = re.findall(r'<section class="card" data-test="([^"]*)" data-span="([^"]*)">', page)
    assert sections == [
        ("test_m.py::test_mlp", "call"),
        ("test_m.py::test_mlp", "forward"),
        ("test_m.py::test_ones", "call"),
    ]
    mlp = page.split('data-test="test_m.py::test_mlp" data-span="call"')[1].split("</section>")[0]
    assert re.findall(r'data-commit="([0-9a-f]+)"', mlp) == [repository["first"], repository["wider"]]
    assert mlp.count('<circle data-metric="peak"') == 4
    ones = page.split('data-test="test_m.py::test_ones"')[1]
    assert re.findall(r'data-commit="([0-9a-f]+)"', ones) == [repository["ones"]]
    assert "A bad merge: skipped" in page


def test_exports_for_github_benchmark_and_openmetrics(
    pytester: pytest.Pytester, repository: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.chdir()
    args = ["baselines", "history", "--export", "github-benchmark", "gb.json", "--export", "openmetrics", "m.txt"]
    assert main(args) == 0
    latest = {
        (test, span): _costs(pytester, repository["fixed"], test, span)
        for test, span in [
            ("test_m.py::test_mlp", "call"),
            ("test_m.py::test_mlp", "forward"),
            ("test_m.py::test_ones", "call"),
        ]
    }
    entries = json.loads((pytester.path / "gb.json").read_text())
    assert {(e["name"], e["unit"], e["value"]) for e in entries} == {
        (f"{test} [{span}] {metric}", "bytes", costs[metric])
        for (test, span), costs in latest.items()
        for metric in ("peak", "allocated")
    }
    assert all(repository["fixed"][:10] in e["extra"] for e in entries)
    text = (pytester.path / "m.txt").read_text()
    lines = text.splitlines()
    assert lines[:2] == ["# TYPE gpumem_cost_bytes gauge", "# UNIT gpumem_cost_bytes bytes"] and lines[-1] == "# EOF"
    sample = re.compile(
        r'gpumem_cost_bytes\{test="([^"]+)",span="([^"]+)",metric="([a-z_]+)",environment="[^"]+"\} (\d+)'
    )
    samples = [sample.fullmatch(line) for line in lines if not line.startswith("#")]
    assert all(samples) and len(samples) == 6
    assert {(m[1], m[2], m[3], int(m[4])) for m in samples if m} == {
        (test, span, metric, costs[metric])
        for (test, span), costs in latest.items()
        for metric in ("peak", "allocated")
    }


def test_a_renamed_file_and_an_older_schema_are_followed(
    pytester: pytest.Pytester, repository: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    (pytester.path / "ci").mkdir()
    _git(pytester.path, "mv", FILE, f"ci/{FILE}")
    _git(pytester.path, "commit", "-q", "-m", "Move the baselines")
    path = pytester.path / "ci" / FILE
    path.write_text(path.read_text().replace('"schema": 1', '"schema": 0', 1))  # as an older release wrote it
    _git(pytester.path, "commit", "-q", "-am", "An older release's file")
    history = read_history(path)
    assert next(v.commit.subject for v in history.versions) == "Add the MLP test"
    assert [v.path for v in history.versions][-2:] == [f"ci/{FILE}", f"ci/{FILE}"]
    assert history.versions[-1].note == "schema version 0, read by its shape"
    assert history.versions[-1].figures == history.versions[-2].figures
    pytester.chdir()
    assert main(["baselines", "history", "--file", f"ci/{FILE}", "--max-count", "2"]) == 0
    out, err = capsys.readouterr()
    assert "read " in err and "schema version 0" in err and "Add the MLP test" not in out


def test_errors_name_the_file_and_the_problem(pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    pytester.chdir()
    pytester.makefile(".json", **{"gpumem-baselines": '{"schema": 1, "environments": {}}'})
    assert main(["baselines", "history"]) == 2
    err = capsys.readouterr().err
    assert f"{FILE}: git rev-parse failed: fatal: not a git repository" in err
    _git(pytester.path, "init", "-q")
    assert main(["baselines", "history"]) == 2
    assert f"{FILE}: git log failed: fatal: your current branch" in capsys.readouterr().err
    pytester.makefile(".txt", other="another file")
    _git(pytester.path, "add", "other.txt")
    _git(pytester.path, "commit", "-q", "-m", "another file")
    assert main(["baselines", "history"]) == 2
    assert f"{FILE}: git has no commit of this file (commit it first)" in capsys.readouterr().err
    _git(pytester.path, "add", "-A")
    _git(pytester.path, "commit", "-q", "-m", "empty")
    assert main(["baselines", "history", "--export", "csv", "x.csv"]) == 2
    assert "--export 'csv': the formats are github-benchmark, openmetrics" in capsys.readouterr().err
    assert main(["baselines", "history", "test_nothing"]) == 2
    assert "TEST 'test_nothing' matches no test" in capsys.readouterr().err


def test_the_openmetrics_export_parses_with_the_prometheus_client(
    pytester: pytest.Pytester, repository: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = pytest.importorskip("prometheus_client.openmetrics.parser")
    pytester.chdir()
    assert main(["baselines", "history", "--export", "openmetrics", "m.txt"]) == 0
    (family,) = parser.text_string_to_metric_families((pytester.path / "m.txt").read_text())
    assert (family.name, family.type, family.unit) == ("gpumem_cost_bytes", "gauge", "bytes")
    latest = _costs(pytester, repository["fixed"], "test_m.py::test_mlp", "call")
    values = {(s.labels["test"], s.labels["span"], s.labels["metric"]): s.value for s in family.samples}
    assert values[("test_m.py::test_mlp", "call", "peak")] == latest["peak"] and len(values) == 6


def test_a_commit_nested_too_deeply_is_skipped_with_why(pytester: pytest.Pytester) -> None:
    """Deeper than Python's recursion limit, where ``json`` gives up with a RecursionError, not a ValueError."""
    _git(pytester.path, "init", "-q")
    path = pytester.path / FILE
    path.write_text('{"schema": 1, "environments": {}}\n')
    _git(pytester.path, "add", FILE)
    _git(pytester.path, "commit", "-q", "-m", "empty")
    path.write_text('{"schema": 1, "environments": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    _git(pytester.path, "commit", "-q", "-am", "Nested too deeply")
    history = read_history(path)
    assert [v.commit.subject for v in history.versions] == ["empty"]
    (skipped,) = history.skipped
    assert skipped.commit.subject == "Nested too deeply" and "nested too deeply" in skipped.reason, skipped.reason
