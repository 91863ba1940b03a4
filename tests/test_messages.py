"""A failure message never prints the same number twice: two sizes that differ read differently,
a tiny change is not "+0.0%", an absurd one is a factor, and the bytes beyond the model states
are named where the tracker knows them."""

from __future__ import annotations

import re

import pytest

from conftest import run
from pytest_gpumem.data.findings import Finding, Tolerance, failure_message
from pytest_gpumem.units import format_percent, format_sizes

pytest_plugins = ["pytester"]

KiB, MiB = 1 << 10, 1 << 20


def sizes(line: str) -> list[str]:
    return re.findall(r"[-+]?[\d,]+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)", line)


@pytest.mark.parametrize(
    ("measured", "reference"),
    [
        (8_536_064 + 4 * KiB, 8_536_064),  # 8.14 MiB and 8.14 MiB, +4 KiB
        (7_266_560, 7_266_328),  # 6.93 MiB and 6.93 MiB, +232 B
        (2**40 + 1, 2**40),  # one byte on a TiB
        (3 * MiB, 2 * MiB),  # already different
        (512, 512),  # equal: equal
    ],
)
def test_two_sizes_that_differ_read_differently(measured: int, reference: int) -> None:
    first, second = format_sizes(measured, reference)
    assert (first == second) == (measured == reference)
    for shown, exact in ((first, measured), (second, reference)):
        number, unit = shown.rsplit(" ", 1)
        scale = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": 1 << 30, "TiB": 1 << 40}[unit]
        assert abs(float(number.replace(",", "")) * scale - exact) <= scale * 0.005  # each still reads right


@pytest.mark.parametrize(
    ("finding", "wanted"),
    [
        (
            Finding("t", "call", "allocated", "baseline", "regressed", 8_536_064 + 4 * KiB, 8_536_064, Tolerance()),
            "allocated cost 8.1445 MiB regressed from baseline 8.1406 MiB by +4.00 KiB (+0.048%)",
        ),
        (
            Finding("t", "call", "peak", "budget", "exceeded", 7_266_560, 7_266_328, detail="16Ψ"),
            "peak cost 6.9299 MiB exceeds the budget 6.9297 MiB (16Ψ) by +232 B (+0.0032%), 1.00003x the theory",
        ),
        (
            Finding("t", "call", "peak", "limit", "exceeded", 8 * MiB, 1 * KiB, detail="1KiB"),
            "peak cost 8.00 MiB exceeds the limit 1.00 KiB (1KiB) by +8.00 MiB (×8,192)",
        ),
    ],
)
def test_a_failure_line_says_something(finding: Finding, wanted: str) -> None:
    line = failure_message([finding])
    assert line.startswith(wanted)
    first, second = sizes(line)[:2]
    assert first != second


def test_percentages() -> None:
    assert format_percent(1, 4) == "+25.0%"
    assert format_percent(4 * KiB, 8_536_064) == "+0.048%"
    assert format_percent(-1, 2**40) == "-<0.001%"
    assert format_percent(8191, 1) == "×8,192"
    assert format_percent(100, 10) == "×11.0"
    assert format_percent(99, 10) == "+990.0%"
    assert format_percent(-10, 10) == "-100.0%"
    assert format_percent(8, -4) == "+200.0%"  # of a negative cost: of its size
    assert format_percent(0, 0) == "+0.0%" and format_percent(1, 0) == "n/a" and format_percent(None, 4) == "n/a"


BEYOND = """
import pytest, torch

keep = []


@pytest.mark.gpumem(allocated="12Ψ")  # SGD with momentum: parameters, gradients, momentum
def test_budget(gpumem):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gpumem.track(model, opt)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    keep.append(torch.ones(58))  # 232 B that are no model state
"""


def test_the_bytes_beyond_the_model_states_are_named(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_beyond=BEYOND)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = " ".join(result.stdout.str().split())
    assert "allocated at the return beyond the model states: temporaries 232 B" in text
