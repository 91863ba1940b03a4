"""A run that collects part of the suite never prunes what it did not see.

A baseline is stale only when the run could have seen its test and did not: its file no
longer exists, or its file was collected whole and the test is not in it. ``--lf``, a run from
a folder below the rootdir, ``testpaths`` against explicit paths, node ids on the command line,
``-k`` / ``-m`` / ``--deselect``: every baseline they did not collect is kept, and the summary
says how many and why. A whole-suite run still prunes a deleted test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import CPU_ENV
from conftest import H100_ENV as H100
from pytest_gpumem.baselines import BaselineEntry, BaselineStore, load, save
from pytest_gpumem.baselines.staleness import (
    LAST_FAILED,
    NO_FILE_EXISTS,
    NOT_COLLECTED,
    SKIPPED,
    Collection,
    find_stale,
)
from tests._sessions_xdist import warm_workers

pytest_plugins = ["pytester"]

UNIT = """
import os

import pytest, torch


@pytest.mark.gpumem
def test_a1():
    torch.ones(100)


@pytest.mark.gpumem
def test_a2():
    assert os.environ.get("FAIL_A2") != "1"
    torch.ones(200)
"""

OTHER = """
import pytest, torch


@pytest.mark.gpumem
def test_b():
    torch.ones(300)
"""

EXAMPLE = """
import pytest, torch


@pytest.mark.gpumem
def test_ex():
    torch.ones(400)
"""

EVERY = [
    "examples/test_ex.py::test_ex",
    "tests/other/test_b.py::test_b",
    "tests/unit/test_a.py::test_a1",
    "tests/unit/test_a.py::test_a2",
]


def session(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """A pytest session in this process, with pytest's cache (``--lf`` reads it)."""
    return pytester.runpytest_inprocess("-W", "ignore::UserWarning", "--gpumem-device=cpu", *args)


def suite(pytester: pytest.Pytester) -> Path:
    """The suite: ``testpaths = tests``, examples beside it; every test recorded."""
    pytester.makeini("[pytest]\ntestpaths = tests\n")
    for folder, name, text in (
        ("tests/unit", "test_a.py", UNIT),
        ("tests/other", "test_b.py", OTHER),
        ("examples", "test_ex.py", EXAMPLE),
    ):
        (pytester.path / folder).mkdir(parents=True, exist_ok=True)
        (pytester.path / folder / name).write_text(text)
    session(pytester, "tests", "examples", "--gpumem-update-baselines").assert_outcomes(passed=4)
    path = pytester.path / "gpumem-baselines.json"
    assert recorded(pytester) == EVERY
    return path


def recorded(pytester: pytest.Pytester) -> list[str]:
    store = load(pytester.path / "gpumem-baselines.json")
    (environment,) = store.environment_keys()
    return list(store.tests(environment))


def test_last_failed_keeps_the_baselines_of_the_tests_it_skipped(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite(pytester)
    monkeypatch.setenv("FAIL_A2", "1")
    session(pytester).assert_outcomes(passed=2, failed=1)
    monkeypatch.delenv("FAIL_A2")
    result = session(pytester, "--lf", "--gpumem-update-baselines", "--gpumem-prune")
    result.assert_outcomes(passed=1)
    assert recorded(pytester) == EVERY
    assert "stale" not in result.stdout.str()
    said = " ".join(result.stdout.lines)
    assert "kept the baselines of 3 tests this run could not judge: 3 in files --lf collected only in part" in said


@pytest.mark.slow
def test_last_failed_under_xdist_keeps_the_baselines_of_the_tests_it_skipped(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite(pytester)
    monkeypatch.setenv("FAIL_A2", "1")
    with warm_workers(monkeypatch):
        session(pytester, "-n", "2").assert_outcomes(passed=2, failed=1)
    monkeypatch.delenv("FAIL_A2")
    with warm_workers(monkeypatch):
        result = session(pytester, "--lf", "-n", "2", "--gpumem-update-baselines", "--gpumem-prune")
    result.assert_outcomes(passed=1)
    assert recorded(pytester) == EVERY
    assert "stale" not in result.stdout.str()


def test_a_run_from_a_folder_below_the_rootdir_keeps_the_baselines_outside_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite(pytester)
    monkeypatch.chdir(pytester.path / "tests" / "unit")
    result = session(pytester, "--gpumem-update-baselines", "--gpumem-prune")
    result.assert_outcomes(passed=2)
    assert recorded(pytester) == EVERY
    result.stdout.fnmatch_lines(["*kept the baselines of 2 tests this run could not judge*"])


def test_testpaths_keep_what_explicit_paths_recorded(pytester: pytest.Pytester) -> None:
    suite(pytester)
    result = session(pytester, "--gpumem-update-baselines", "--gpumem-prune", "--gpumem-strict")
    result.assert_outcomes(passed=3)
    assert result.ret == 0  # nothing stale: the example is not under testpaths, its file exists
    assert recorded(pytester) == EVERY


@pytest.mark.parametrize(
    "narrowing",
    [
        ["tests/unit/test_a.py::test_a1"],
        ["tests/unit/test_a.py::test_a1", "tests/other"],
        ["--deselect", "tests/unit/test_a.py::test_a2"],
        ["-k", "not a2"],
    ],
    ids=["node-id", "node-id-and-folder", "deselect", "k"],
)
def test_narrowed_runs_keep_what_they_did_not_run(pytester: pytest.Pytester, narrowing: list[str]) -> None:
    path = suite(pytester)
    before = path.read_bytes()
    result = session(pytester, *narrowing, "--gpumem-update-baselines", "--gpumem-prune", "--gpumem-strict")
    assert result.ret == 0, result.stdout.str()
    assert recorded(pytester) == EVERY
    assert path.read_bytes() == before  # the same figures: nothing recorded changed, nothing removed


def test_a_whole_suite_run_still_prunes_deleted_tests(pytester: pytest.Pytester) -> None:
    suite(pytester)
    (pytester.path / "tests" / "unit" / "test_a.py").write_text(UNIT.replace("def test_a2", "def test_a2_renamed"))
    (pytester.path / "tests" / "other" / "test_b.py").unlink()
    (pytester.path / "examples" / "test_ex.py").unlink()
    listed = session(pytester)
    listed.stdout.fnmatch_lines(["*stale baselines*", "*tests/other/test_b.py::test_b*"])
    result = session(pytester, "--gpumem-update-baselines", "--gpumem-prune")
    result.assert_outcomes(passed=2)
    assert recorded(pytester) == ["tests/unit/test_a.py::test_a1", "tests/unit/test_a.py::test_a2_renamed"]


def test_a_partial_run_prunes_what_it_collected_whole(pytester: pytest.Pytester) -> None:
    """``pytest tests/unit`` collects tests/unit/test_a.py whole: a test gone from it is stale; a
    deleted file anywhere is stale; the rest of the suite is kept."""
    suite(pytester)
    (pytester.path / "tests" / "unit" / "test_a.py").write_text(UNIT.replace("def test_a2", "def test_a3"))
    (pytester.path / "examples" / "test_ex.py").unlink()
    result = session(pytester, "tests/unit", "--gpumem-update-baselines", "--gpumem-prune")
    result.assert_outcomes(passed=2)
    assert recorded(pytester) == [
        "tests/other/test_b.py::test_b",
        "tests/unit/test_a.py::test_a1",
        "tests/unit/test_a.py::test_a3",
    ]
    result.stdout.fnmatch_lines(["*kept the baselines of 1 test this run could not judge*"])


def test_only_the_current_environment_is_pruned(pytester: pytest.Pytester) -> None:
    suite(pytester)
    store = load(pytester.path / "gpumem-baselines.json")
    store.record(H100, "tests/other/test_gone.py::test_x", {"call": BaselineEntry({"peak": 1}, start=0)})
    save(store)
    session(pytester, "--gpumem-update-baselines", "--gpumem-prune").assert_outcomes(passed=3)
    # another environment's baseline is never judged: a test may exist only where it can be collected
    assert load(pytester.path / "gpumem-baselines.json").tests(H100.key) == ("tests/other/test_gone.py::test_x",)


# --------------------------------------------------------------------------- the rule, without pytest


def test_the_rule_judges_only_what_a_run_could_see(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    for name in ("test_whole.py", "test_elsewhere.py", "test_skipped.py"):
        (tmp_path / "tests" / name).write_text("")
    store = BaselineStore()
    tests = [
        "tests/test_whole.py::test_kept",
        "tests/test_whole.py::test_gone",  # its file was collected whole, it is not in it
        "tests/test_elsewhere.py::test_x",  # its file exists, this run did not collect it
        "tests/test_skipped.py::test_x",
        "tests/test_deleted.py::test_x",  # its file is gone
        "../outside/test_o.py::test_x",  # outside the rootdir: never judged missing
        "/abs/test_a.py::test_x",
    ]
    for test in tests:
        store.record(CPU_ENV, test, {"call": BaselineEntry({"peak": 1}, start=0)})
    collection = Collection(
        items=frozenset({"tests/test_whole.py::test_kept"}),
        whole=frozenset({"tests/test_whole.py"}),
        rootdir=tmp_path,
        partial={"tests/test_skipped.py": SKIPPED},
    )
    found = find_stale(store, collection, CPU_ENV.key)
    assert [entry.test for entry in found.stale] == ["tests/test_deleted.py::test_x", "tests/test_whole.py::test_gone"]
    assert found.kept == {NOT_COLLECTED: 3, SKIPPED: 1}
    everything = find_stale(store, Collection(rootdir=tmp_path, everything=LAST_FAILED), CPU_ENV.key)
    assert [entry.test for entry in everything.stale] == ["tests/test_deleted.py::test_x"]  # gone is gone
    assert everything.kept == {LAST_FAILED: 6}
    assert find_stale(store, Collection(), CPU_ENV.key).kept == {NOT_COLLECTED: 7}  # no rootdir: nothing is missing


def test_when_no_file_exists_the_rootdir_is_wrong_and_nothing_is_stale(tmp_path: Path) -> None:
    store = BaselineStore()
    for test in ("tests/test_a.py::test_x", "tests/test_b.py::test_y"):
        store.record(CPU_ENV, test, {"call": BaselineEntry({"peak": 1}, start=0)})
    found = find_stale(store, Collection(rootdir=tmp_path / "elsewhere"), CPU_ENV.key)
    assert found.stale == [] and found.kept == {NO_FILE_EXISTS: 2}
