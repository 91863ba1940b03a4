"""Numbers no memory can have are clear errors, never crashes.

A baseline file that a pull request edited to hold ``"peak": 10**400``, a negative peak, a
fraction or a value beyond 2**63 is refused with a message naming the file, the test and the
field, by the plugin and by ``baselines show`` / ``diff`` alike, and the file is left as it is.
A marker, a span, a tolerance or an option with such a number is a collection or usage error
naming the test or the option. ``gpumem.distributed``'s timeout is checked before any rank starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import CPU_ENV as CPU
from conftest import run
from pytest_gpumem import RankContext, run_ranks
from pytest_gpumem.baselines import BaselineEntry, BaselineFileError, BaselineStore, load, save
from pytest_gpumem.cli import main
from pytest_gpumem.data.findings import parse_tolerance
from pytest_gpumem.judge.limits import SpecError, parse_limit, parse_span_limits, parse_tolerance_keyword
from pytest_gpumem.units import SizeError, parse_size

MAX_BYTES = 2**63 - 1

pytest_plugins = ["pytester"]

TEST = "test_step.py::test_step"
STEP = """
import pytest, torch


@pytest.mark.gpumem
def test_step():
    torch.ones(100)
"""

HUGE = 10**400


def baseline_file(path: Path, field: str, value: object, *, where: str = "span") -> Path:
    """A real baseline file for ``TEST`` whose ``field`` (of the call span, or of its breakdown) holds
    ``value``, as a pull request would edit it."""
    store = BaselineStore()
    store.record(CPU, TEST, {"call": BaselineEntry({"peak": 1024, "allocated": 0, "reserved": None}, start=0)})
    save(store, path)
    data = json.loads(path.read_text())
    span = data["environments"][CPU.key]["tests"][TEST]["spans"]["call"]
    (span["breakdown"] if where == "breakdown" else span)[field] = value
    path.write_text(json.dumps(data, indent=2))
    return path


BAD = [
    ("peak", HUGE, "beyond"),
    ("peak", 2**63, "beyond"),
    ("peak", -1, "negative"),
    ("reserved", -(2**20), "negative"),
    ("start", -5, "negative"),
    ("allocated", -(2**64), "beyond"),
    ("max_microbatch", -2, "negative"),
]


@pytest.mark.parametrize(("field", "value", "why"), BAD, ids=[f"{f}={str(v)[:12]}" for f, v, _ in BAD])
def test_a_number_no_memory_can_have_is_refused_by_name(tmp_path: Path, field: str, value: int, why: str) -> None:
    path = baseline_file(tmp_path / "b.json", field, value)
    before = path.read_bytes()
    with pytest.raises(BaselineFileError) as error:
        load(path)
    message = str(error.value)
    assert message.startswith(f"{path}:") and TEST in message and f'["{field}"]' in message and why in message
    assert len(message) < 1000  # the value is not printed whole
    assert path.read_bytes() == before


def test_a_negative_allocated_cost_is_a_real_figure(tmp_path: Path) -> None:
    """A span that frees what was alive at its start ends below it: its allocated cost is negative."""
    path = baseline_file(tmp_path / "b.json", "allocated", -4096)
    entry = load(path).entry(CPU.key, TEST)
    assert entry is not None and entry.cost("allocated") == -4096


def test_a_negative_breakdown_is_refused(tmp_path: Path) -> None:
    store = BaselineStore()
    store.record(CPU, TEST, {"call": BaselineEntry({"peak": 8}, start=0, breakdown={"parameters": 8})})
    save(store, tmp_path / "b.json")
    data = json.loads((tmp_path / "b.json").read_text())
    data["environments"][CPU.key]["tests"][TEST]["spans"]["call"]["breakdown"]["parameters"] = -8
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(BaselineFileError, match=r"\[\"breakdown\"\].*negative"):
        load(tmp_path / "b.json")
    with pytest.raises(BaselineFileError, match="negative"):
        BaselineStore.from_dict(data)


def test_the_plugin_refuses_the_file_before_the_first_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_step=STEP)
    path = baseline_file(pytester.path / "gpumem-baselines.json", "peak", HUGE)
    before = path.read_bytes()
    for args in ((), ("--gpumem-update-baselines",)):
        result = run(pytester, *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        text = result.stderr.str() + result.stdout.str()
        assert "INTERNALERROR" not in text and "Traceback" not in text
        assert str(path) in text and TEST in text and '["peak"]' in text
    assert path.read_bytes() == before


@pytest.mark.parametrize("action", ["show", "diff"])
def test_show_and_diff_refuse_the_file_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    path = baseline_file(tmp_path / "b.json", "peak", HUGE)
    argv = ["show", "--file", str(path)] if action == "show" else ["diff", str(path), str(path)]
    assert main(["baselines", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith(f"python -m pytest_gpumem baselines {action}: error: {path}:")
    assert TEST in err and '["peak"]' in err


# --------------------------------------------------------------------------- markers, spans, options


@pytest.mark.parametrize(
    "value",
    ["1" * 5000, HUGE, "1" * 400 + "GiB", "9" * 25, 2**63, "8388608TiB", "1" * 5000 + "Ψ"],
    ids=["5000-digits", "10**400", "400-digit-GiB", "25-digits", "2**63", "2**63-as-TiB", "5000-digit-psi"],
)
def test_a_limit_too_large_is_a_spec_error(value: object) -> None:
    with pytest.raises(SpecError) as error:
        parse_limit("peak", value)
    message = str(error.value)
    assert message.startswith("peak=") and "too large" in message and len(message) < 400


def test_the_largest_size_is_accepted() -> None:
    assert parse_limit("peak", MAX_BYTES).expression.evaluate() == MAX_BYTES == 2**63 - 1
    assert parse_size(str(MAX_BYTES)) == MAX_BYTES
    with pytest.raises(SizeError, match="too large"):
        parse_size(MAX_BYTES + 1)


@pytest.mark.parametrize("text", ["1" * 400 + "%", "1" * 400, "1" * 5000 + "B", "2%," + "9" * 30, "1000001%"])
def test_a_tolerance_too_large_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="too large") as error:
        parse_tolerance(text)
    assert len(str(error.value)) < 400
    with pytest.raises(SpecError, match="tolerance="):
        parse_tolerance_keyword(text)


def test_a_span_limit_too_large_names_the_span() -> None:
    with pytest.raises(SpecError, match=r"span 'encode': peak=.*too large"):
        parse_span_limits("encode", {"peak": HUGE})


def test_a_budget_too_large_for_its_psi_is_an_error_not_an_overflow() -> None:
    spec = parse_limit("peak", "9" * 20 + "Ψ")
    with pytest.raises(ValueError, match="too large"):
        spec.resolve(10**9)


MARKERS = """
import pytest, torch


@pytest.mark.gpumem(peak="1" * 5000)
def test_digits():
    torch.ones(10)


@pytest.mark.gpumem(peak=10**400)
def test_int():
    torch.ones(10)


@pytest.mark.gpumem(tolerance="1" * 400 + "%")
def test_tolerance():
    torch.ones(10)


@pytest.mark.gpumem(peak="1MiB")
def test_fine():
    torch.ones(10)
"""


def test_markers_with_numbers_too_large_are_collection_errors_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_markers=MARKERS)
    result = run(pytester)
    text = result.stdout.str()
    assert "INTERNALERROR" not in text and "Exceeds the limit" not in text and "OverflowError" not in text
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error stops the run, as pytest's own do
    for name in ("test_digits", "test_int", "test_tolerance"):
        assert f"invalid gpumem marker on test_markers.py::{name}" in text
    assert "test_fine" not in text.split("short test summary")[-1]


@pytest.mark.parametrize(
    ("option", "value"),
    [("--gpumem-tolerance", "1" * 400 + "%"), ("--gpumem-tolerance", "9" * 5000), ("--gpumem-device-limit", "9" * 30)],
    ids=["tolerance-percent", "tolerance-digits", "device-limit"],
)
def test_options_with_numbers_too_large_are_usage_errors(pytester: pytest.Pytester, option: str, value: str) -> None:
    pytester.makepyfile(test_step=STEP)
    result = run(pytester, f"{option}={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    text = result.stderr.str()
    assert option in text and "too large" in text and "Traceback" not in text
    assert len(text) < 2000


# --------------------------------------------------------------------------- distributed


def nothing(rank: int, ctx: RankContext) -> None:
    raise AssertionError("no rank may start")


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, 0, -1.0, 1e300, True, "60"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused_before_any_rank_starts(timeout: object) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds") as error:
        run_ranks(nothing, 2, timeout=timeout)  # type: ignore[arg-type]
    assert repr(timeout) in str(error.value)


DISTRIBUTED_NAN = """
import math
import pytest


def step(rank, ctx):
    pass


@pytest.mark.gpumem(device="cpu")
def test_nan(gpumem):
    gpumem.distributed(step, world_size=2, timeout=math.nan)
"""


def test_the_fixture_names_the_test_and_the_timeout(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nan=DISTRIBUTED_NAN)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*ValueError: test_nan.py::test_nan: gpumem.distributed: timeout must be a positive, finite number*nan*"]
    )


@pytest.mark.parametrize("value", [10**400, 10**5000, 2**63], ids=["10**400", "10**5000", "2**63"])
def test_a_min_microbatch_too_large_is_a_spec_error(value: int) -> None:
    from pytest_gpumem.plugin.marker import parse_marker

    with pytest.raises(SpecError, match=r"min_microbatch=.* must be a positive int"):
        parse_marker([((), {"min_microbatch": value})])
    with pytest.raises(SpecError, match=r"device_limit=an integer of about .* too large"):
        parse_marker([((), {"device_limit": value * 10**400})])
