"""End to end: out of memory as a test outcome, leak checks, artifacts, microbatch search (CPU)."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import run, run_fresh

pytest_plugins = ["pytester"]

# Each test runs whole pytest sessions with real training steps.
pytestmark = pytest.mark.slow

STEP = """
import pytest, torch

def step(gpumem, width):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.GELU(), torch.nn.Linear(width, 256))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256)
    return gpumem.train_step(model, opt, (x, torch.zeros(64, 256)), torch.nn.functional.mse_loss)
"""


def test_device_limit_oom_report_and_a_larger_limit_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # room for the error in the short summary line
    pytester.makepyfile(
        STEP
        + """
@pytest.mark.gpumem(device_limit="5MiB")
def test_too_big(gpumem):
    step(gpumem, 1024)           # 2 MiB of parameters and 2 of gradients fit; AdamW's 4 MiB do not

@pytest.mark.gpumem(device_limit="64MiB")
def test_fits(gpumem):
    step(gpumem, 1024)
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "OutOfMemory" in text  # a torch.OutOfMemoryError raised by the CPU engine
    assert "over the emulated device limit of 5242880 bytes" in text
    # the report: request, allocated, phase, breakdown and the largest tensors with their holders
    assert "out of memory on cpu" in text
    assert re.search(r"requested:\s+1\.00 MiB \(1048576 B\)", text)
    assert "out of memory on cpu during optimizer" in text
    assert re.search(r"parameters\s+2\.00 MiB", text)
    assert "largest live tensors" in text
    assert re.search(r"1\.00 MiB\s+1024×256\s+float32\s+parameters\s+\S*0\.weight", text)
    line = next(line for line in result.outlines if "gpumem artifacts:" in line)
    page = Path(line.split("gpumem artifacts:")[1].strip()).read_text(encoding="utf-8")
    assert 'data-line="device limit"' in page
    result.stdout.fnmatch_lines(["FAILED *test_too_big - pytest_gpumem*"])  # the error, not source code


def test_run_option_device_limit_and_marker_wins(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        STEP
        + """
@pytest.mark.gpumem
def test_run_limit(gpumem):
    step(gpumem, 1024)

@pytest.mark.gpumem(device_limit="1GiB")
def test_marker_limit(gpumem):
    step(gpumem, 1024)
"""
    )
    result = run(pytester, "--gpumem-device-limit=1MiB")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_run_limit*"])
    bad = run(pytester, "--gpumem-device-limit=lots")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "--gpumem-device-limit / ini gpumem_device_limit" in bad.stderr.str()


NEXT_TEST = """
@pytest.mark.gpumem
def test_next(gpumem):
    step(gpumem, 64)
"""


def test_the_test_after_an_oom_starts_clean(pytester: pytest.Pytester) -> None:
    oom = """
@pytest.mark.gpumem(device_limit="3MiB")
def test_oom(gpumem):
    kept = [torch.ones(256, 256) for _ in range(8)]   # held by the failing frame
    step(gpumem, 2048)
"""
    pytester.makepyfile(test_a=STEP + oom + NEXT_TEST)
    with_oom = run_fresh(pytester, "--gpumem-json=with.json")
    with_oom.assert_outcomes(passed=1, failed=1)
    pytester.makepyfile(test_a=STEP + NEXT_TEST)
    alone = run_fresh(pytester, "--gpumem-json=alone.json")
    alone.assert_outcomes(passed=1)

    def start_of_next(name: str) -> int:
        report = json.loads((pytester.path / name).read_text(encoding="utf-8"))
        (test,) = [t for t in report["tests"] if t["nodeid"].endswith("test_next")]
        return int(test["measurements"][0]["start"])

    assert start_of_next("with.json") == start_of_next("alone.json")


def test_leak_check_names_the_leaked_tensors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_leaky="""
import pytest, torch

CACHE = []

@pytest.mark.gpumem(retained="0B")
def test_leaks():
    CACHE.append(torch.ones(1000))
    CACHE.append(torch.zeros(10, 10))

@pytest.mark.gpumem(retained="0B")
def test_clean():
    x = torch.ones(1000)
    y = [x, x * 2]
"""
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "retained 4.30 KiB exceeds the limit 0 B (0B) by +4.30 KiB" in text  # 4000 + 400 bytes
    assert "CACHE[0]" in text and "CACHE[1]" in text
    assert re.search(r"3\.91 KiB\s+1000\s+float32", text) and re.search(r"400 B\s+10×10\s+float32", text)


def test_leak_check_from_ini(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_leaky="""
import pytest, torch

CACHE = []

@pytest.mark.gpumem
def test_leaks():
    CACHE.append(torch.ones(256))
"""
    )
    run(pytester).assert_outcomes(passed=1)
    pytester.makeini("[pytest]\ngpumem_leak_check = true\n")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*retained 1.00 KiB exceeds the limit 0 B (0B (gpumem_leak_check))*"])


class _SvgParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.categories: list[str] = []
        self.lines: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("data-category"):
            self.categories.append(str(values["data-category"]))
        if values.get("data-line"):
            self.lines.append(str(values["data-line"]))


def test_html_artifact_for_a_failed_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        STEP
        + """
@pytest.mark.gpumem(peak="1MiB")
@pytest.mark.parametrize("width", [512], ids=["wide/../../x y"])
def test_over(gpumem, width):
    step(gpumem, width)

@pytest.mark.gpumem(peak="1GiB")
def test_under(gpumem):
    step(gpumem, 64)
"""
    )
    result = run(pytester, "--gpumem-artifacts=art")
    result.assert_outcomes(passed=1, failed=1)
    # the summary names the test whole, "/" in its parametrize id included
    summary = result.stdout.str().split("= gpumem =")[1]
    assert "test_html_artifact_for_a_failed_test.py::test_over[wide/../../x y]" in summary
    assert re.search(r"^\s*call\s+peak\b.*\bexceeded\b", summary, re.MULTILINE)
    # (with CI=true pytest repeats the whole message in the short summary: take the first)
    line = next(line for line in result.outlines if "gpumem artifacts:" in line)
    path = pytester.path / "art" / line.split("gpumem artifacts:")[1].strip().rsplit("/", 1)[-1]
    assert path.parent == pytester.path / "art" and path.exists()
    files = sorted((pytester.path / "art").iterdir())
    assert files == [pytester.path / "art" / "index.html", path]  # no page for the passing test, nothing outside
    page = path.read_text(encoding="utf-8")
    parser = _SvgParser()
    parser.feed(page)
    from pytest_gpumem.data.metrics import CATEGORIES

    assert [c for c in CATEGORIES if c in parser.categories] == list(CATEGORIES)
    assert any("limit peak" in line for line in parser.lines)
    assert "http" not in page.replace("http-equiv", "") and "<script" not in page
    everything = run(pytester, "--gpumem-artifacts=all", "--gpumem-artifacts-all")
    everything.assert_outcomes(passed=1, failed=1)
    assert len(list((pytester.path / "all").iterdir())) == 3  # the two pages and the run's index


MICROBATCH = """
import pytest, torch

def make_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(size):
        x = torch.randn(size, 128)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    return step, opt

@pytest.mark.gpumem(device_limit="{limit}", min_microbatch={minimum})
def test_search(gpumem):
    step, opt = make_step()
    found = gpumem.max_microbatch(step, cleanup=lambda: opt.zero_grad(set_to_none=True))
    print("FOUND", found)
    plan = gpumem.plan_accumulation(96, step, cleanup=lambda: opt.zero_grad(set_to_none=True))
    assert plan.microbatch * plan.accumulation_steps == 96
    assert plan.microbatch <= found
"""


def test_max_microbatch_is_asserted_and_baselined(pytester: pytest.Pytester) -> None:
    """Fresh processes: the emulated limit is absolute, so nothing else may be alive."""
    pytester.makepyfile(test_mb=MICROBATCH.format(limit="2MiB", minimum=8))
    result = run_fresh(pytester, "-s", "--gpumem-update-baselines")
    result.assert_outcomes(passed=1)
    found = int(next(line for line in result.outlines if line.startswith("FOUND") or "FOUND" in line).split()[-1])
    assert found >= 8
    data = json.loads((pytester.path / "gpumem-baselines.json").read_text(encoding="utf-8"))
    (env,) = data["environments"].values()
    assert env["tests"]["test_mb.py::test_search"]["spans"]["call"]["max_microbatch"] == found
    # too high a floor fails the test
    pytester.makepyfile(test_mb=MICROBATCH.format(limit="2MiB", minimum=found + 1))
    high = run_fresh(pytester)
    high.assert_outcomes(failed=1)
    high.stdout.fnmatch_lines([f"*max_microbatch {found} is below the minimum limit {found + 1}*"])
    # a smaller device: the size drops, which is a regression of the baseline
    pytester.makepyfile(test_mb=MICROBATCH.format(limit="1.5MiB", minimum=1))
    dropped = run_fresh(pytester)
    dropped.assert_outcomes(failed=1)
    dropped.stdout.fnmatch_lines(["*max_microbatch*regressed from baseline*"])
