"""The run's index page in the artifact folder, and the figures and page links in pytest-html's report."""

from __future__ import annotations

import html
import json
import re

import pytest

from tests.conftest import run

SUITE = """
import pytest, torch

@pytest.mark.gpumem(peak="100KB")
def test_too_big():
    x = torch.ones(100_000)
    y = x * 2

@pytest.mark.gpumem
def test_own_assert():
    x = torch.ones(10)
    assert x.sum() == 3

@pytest.mark.gpumem
def test_small():
    torch.ones(1000)

def test_unmeasured():
    pass
"""


def _costs(pytester: pytest.Pytester) -> dict[str, dict[str, int | None]]:
    report = json.loads((pytester.path / "r.json").read_text())
    return {
        test["nodeid"]: {
            m: test["measurements"][0][m] - (test["measurements"][0]["start"] if m in ("peak", "allocated") else 0)
            for m in ("peak", "allocated")
        }
        for test in report["tests"]
    }


def _rows(page: str) -> dict[str, tuple[str, str, list[str], str]]:
    """test → (status, link or "", the figure cells' exact bytes, why)."""
    rows = {}
    for row in re.findall(r"<tr data-test=.*?</tr>", page):
        test = re.search(r'data-test="([^"]*)"', row)[1]
        status = re.search(r'data-status="([^"]*)"', row)[1]
        link = re.search(r'<a href="([^"]*)"', row)
        exact = [value.replace(",", "") for value in re.findall(r'title="([\d,]+) B"', row)]
        why = re.search(r'<td class="why">(.*?)</td>', row)[1]
        rows[test] = (status, link[1] if link else "", exact, why)
    return rows


def test_index_lists_every_measured_test_and_links_the_pages_written(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = run(pytester, "--gpumem-artifacts=art", "--gpumem-json=r.json")
    result.assert_outcomes(passed=2, failed=2)
    page = (pytester.path / "art" / "index.html").read_text()
    assert "<script" not in page and "default-src 'none'" in page
    rows = _rows(page)
    assert sorted(rows) == [
        "test_suite.py::test_own_assert",
        "test_suite.py::test_small",
        "test_suite.py::test_too_big",
    ]
    costs = _costs(pytester)
    for test, (status, link, exact, why) in rows.items():
        assert exact[:2] == [str(costs[test]["peak"]), str(costs[test]["allocated"])]
        if test.endswith("test_small"):
            assert (status, link, why) == ("passed", "", "")
        else:
            assert status == "failed" and (pytester.path / "art" / link).is_file()  # relative: the folder moves whole
    assert rows["test_suite.py::test_too_big"][3].startswith("peak cost 781.25 KiB exceeds the limit 100.00 KiB")
    assert rows["test_suite.py::test_own_assert"][3] == "the test&#x27;s own code failed"
    assert list(rows)[:2] == ["test_suite.py::test_own_assert", "test_suite.py::test_too_big"]  # failed first


def test_no_index_without_a_page(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ok="import pytest, torch\n@pytest.mark.gpumem\ndef test_ok():\n    torch.ones(10)\n")
    run(pytester, "--gpumem-artifacts=art").assert_outcomes(passed=1)
    assert not (pytester.path / "art").exists()
    run(pytester, "--gpumem-artifacts=art", "--gpumem-artifacts-all").assert_outcomes(passed=1)
    rows = _rows((pytester.path / "art" / "index.html").read_text())
    status, link, _, _ = rows["test_ok.py::test_ok"]
    assert status == "passed" and link.startswith("test_ok.py_test_ok-") and (pytester.path / "art" / link).is_file()


def test_pytest_html_report_gets_the_figures_and_the_page(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_html")
    pytester.makepyfile(test_suite=SUITE)
    result = run(pytester, "--gpumem-artifacts=art", "--gpumem-json=r.json", "--html=report/report.html", "-p", "html")
    result.assert_outcomes(passed=2, failed=2)
    report = (pytester.path / "report" / "report.html").read_text()
    data = json.loads(html.unescape(re.search(r'data-jsonblob="([^"]*)"', report)[1]))
    tests = data["tests"]
    costs = _costs(pytester)
    for nodeid in ("test_suite.py::test_too_big", "test_suite.py::test_own_assert"):
        (call,) = [t for t in tests[nodeid] if t["testId"] == nodeid]
        kinds = {extra["format_type"]: extra for extra in call["extras"]}
        link = kinds["url"]["content"]
        assert link.startswith("../art/") and (pytester.path / "report" / link).resolve().is_file()
        assert "gpumem, memory" in kinds["html"]["content"]
    (small,) = [t for t in tests["test_suite.py::test_small"] if t["testId"] == "test_suite.py::test_small"]
    (figures,) = [extra["content"] for extra in small["extras"]]
    assert "gpumem, memory ok" in figures and "3.91 KiB" in figures
    assert costs["test_suite.py::test_small"]["peak"] == 4000
    assert [t for t in tests["test_suite.py::test_unmeasured"] if t["extras"]] == []


def test_an_index_that_cannot_be_written_is_a_warning_and_the_pages_are_written(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    (pytester.path / "art" / "index.html").mkdir(parents=True)  # a folder at its name
    result = run(pytester, "--gpumem-artifacts=art")
    result.assert_outcomes(passed=2, failed=2)
    text = " ".join(result.stdout.str().split())
    assert f"could not write the artifact index {pytester.path / 'art' / 'index.html'}" in text
    assert "INTERNALERROR" not in text and len(list((pytester.path / "art").glob("test_suite*.html"))) == 2
