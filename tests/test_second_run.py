"""The second run for sites goes through pytest's own protocol, or not at all.

A test that fails on memory runs once more with sites on, after its first run's teardown, with
fresh function-scoped fixtures (those of wider scope are kept), its first run's reports held back
until the sites are attached. What the second run does (a skip, a failure, an exit, a warning,
a finalizer's error) never replaces, adds to or changes the first run's outcome: it is noted with
the sites. Where a second run cannot be done safely (ranks, a long call, a per-test timeout, a
debugger, a plugin that reruns tests), it is not done, and the failure says how to get the sites.
"""

from __future__ import annotations

import json

import pytest

from conftest import run

#: Tests that fail on memory (a peak over 1 KiB) and behave differently the second time.
SECOND_TIME = """
import unittest
import pytest, torch

CALLS = []
SETUPS = {"function": 0, "module": 0}
TEARDOWNS = {"function": 0, "module": 0}


@pytest.fixture
def fresh():
    SETUPS["function"] += 1
    box = []
    yield box
    TEARDOWNS["function"] += 1


@pytest.fixture(scope="module")
def shared():
    SETUPS["module"] += 1
    yield
    TEARDOWNS["module"] += 1


def _second():
    CALLS.append(1)
    return len(CALLS) % 2 == 0


@pytest.mark.gpumem(peak="1KiB")
def test_skips_the_second_time(fresh, shared):
    fresh.append(torch.ones(1000))
    assert len(fresh) == 1  # a fresh fixture value each run
    if _second():
        pytest.skip("the second time")


@pytest.mark.gpumem(peak="1KiB")
def test_fails_the_second_time(request):
    torch.ones(1000)
    request.addfinalizer(lambda: None)  # registered once per run: no extra teardown error
    if _second():
        pytest.fail("the second time")


@pytest.mark.gpumem(peak="1KiB")
def test_exits_the_second_time():
    torch.ones(1000)
    if _second():
        pytest.exit("the second time")


@pytest.mark.gpumem(peak="1KiB")
def test_warns_the_second_time():
    torch.ones(1000)
    if _second():
        import warnings
        warnings.warn(UserWarning("the second time"))


@pytest.mark.xfail(reason="a known memory regression")
@pytest.mark.gpumem(peak="1KiB")
def test_expected_to_fail():
    torch.ones(1000)


@pytest.mark.xfail(reason="a known memory regression", strict=True)
@pytest.mark.gpumem(peak="1KiB")
def test_expected_to_fail_strictly():
    torch.ones(1000)


class TestCounts(unittest.TestCase):
    runs = 0

    @pytest.mark.gpumem(peak="1KiB")
    def test_counts_its_runs(self):
        type(self).runs += 1
        torch.ones(1000)
        self.assertEqual(type(self).runs, 1)


def test_zz_fixtures_were_fresh():
    assert SETUPS == {"function": 2, "module": 1}, SETUPS
    assert TEARDOWNS == {"function": 2, "module": 0}, TEARDOWNS
"""


def test_the_second_run_never_changes_the_first_runs_outcome(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_second=SECOND_TIME)
    report = pytester.path / "report.json"
    result = run(pytester, "-p", "no:randomly", "-rA", f"--gpumem-json={report}", "-W", "error::UserWarning")
    result.assert_outcomes(failed=5, passed=1, xfailed=2)
    text = result.stdout.str()
    for name in ("skips", "fails", "exits", "warns"):
        assert f"FAILED test_second.py::test_{name}_the_second_time - peak cost" in text
    assert "FAILED test_second.py::TestCounts::test_counts_its_runs - peak cost" in text
    assert "XFAIL test_second.py::test_expected_to_fail_strictly - a known memory regression" in text
    assert "XPASS" not in text and "ERROR" not in text
    notes = {
        test["nodeid"].split("::")[-1]: test["measurements"][0]["sites"]["note"]
        for test in json.loads(report.read_text())["tests"]
        if test["measurements"][0].get("sites")
    }
    assert notes["test_skips_the_second_time"] == "the second run was skipped in its call: the second time"
    assert notes["test_fails_the_second_time"] == "the second run failed in its call: Failed: the second time"
    assert notes["test_exits_the_second_time"].startswith("the second run called pytest.exit (the second time)")
    assert notes["test_warns_the_second_time"].startswith("the second run failed in its call: UserWarning")
    assert notes["test_counts_its_runs"].startswith("the second run failed in its call: AssertionError: 2 != 1")


SLOW = """
import time
import pytest, torch


@pytest.mark.gpumem(peak="1KiB")
def test_slow():
    torch.ones(1000)
    time.sleep(0.3)
"""


@pytest.mark.parametrize(
    ("args", "env", "reason"),
    [
        (("--gpumem-sites-rerun-limit=0.1",), {}, "its call took 0.3 s, over --gpumem-sites-rerun-limit=0.1 s"),
        (("--timeout=60",), {}, "a per-test timeout is set (--timeout=60.0)"),
        ((), {"WORLD_SIZE": "2"}, "it runs on 2 ranks (a launcher started them)"),
    ],
)
def test_no_second_run_where_it_cannot_be_done_safely(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], env: dict[str, str], reason: str
) -> None:
    if "--timeout=60" in args:
        pytest.importorskip("pytest_timeout")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile(test_slow=SLOW.replace("0.3", "0.3" if args and "limit" in args[0] else "0"))
    result = run(pytester, *args)
    result.assert_outcomes(failed=1)
    text = " ".join(result.stdout.str().split())
    assert f"sites: not recorded: no second run, since {reason}" in text
    assert "--gpumem-sites=always" in text
