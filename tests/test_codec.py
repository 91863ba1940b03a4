"""The codec (pytest_gpumem.codec): every serialised dataclass writes the bytes it wrote before the codec
(tests/data/codec_golden.json, written by the hand-written methods it replaced) and reads them back."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.baselines import Environment
from pytest_gpumem.codec import from_data, to_data
from pytest_gpumem.data.figures import Measurement, Timeline
from pytest_gpumem.data.findings import Finding
from pytest_gpumem.data.site_figures import SiteProfile
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.judge.site_changes import SiteDiff
from pytest_gpumem.targets import Target, target
from pytest_gpumem.validate.results import Check
from tests import codec_samples as samples

GOLDEN = Path(__file__).parent / "data" / "codec_golden.json"


def test_every_dataclass_writes_the_bytes_the_hand_written_methods_wrote() -> None:
    assert json.dumps(samples.samples(), indent=1) + "\n" == GOLDEN.read_text()


@pytest.mark.parametrize(
    ("cls", "value"),
    [
        (Measurement, samples.MEASUREMENT),
        (Timeline, samples.TIMELINE),
        (Finding, samples.FINDING),
        (SiteDiff, samples.DIFF),
        (SiteProfile, samples.PROFILE),
        (Environment, samples.ENVIRONMENT),
        (TestRecord, samples.record()),
        (Check, Check("g", "n", False, 1, None, "d")),
    ],
)
def test_what_is_written_reads_back_equal(cls: type, value: object) -> None:
    data = json.loads(json.dumps(to_data(value)))
    assert from_data(cls, data) == value
    assert TestRecord.from_json(samples.record().to_json()) == samples.record()


def test_data_written_before_a_field_existed_reads_with_its_old_meaning() -> None:
    profile = SiteProfile.from_dict({"sites": [], "rest": {"peak": 5}})
    assert (profile.rest_peak, profile.rest_end, profile.by_category) == (5, 0, False)  # one row a site
    measurement = Measurement.from_dict(
        {
            "name": "call",
            "engine": "cpu",
            "device": "cpu",
            "start": 1,
            "peak": 2,
            "allocated": 1,
            "phases": None,
            "notes": None,
        }
    )
    assert (measurement.reserved, measurement.phases, measurement.notes) == (None, {}, ())
    assert Environment.from_dict({"total_memory": "80GB", "cuda_rounding": "yes"}) == Environment("unknown")


def test_a_value_of_the_wrong_type_is_named_by_its_key_path() -> None:
    data = to_data(samples.record())
    data["measurements"][1]["peak"] = "lots"
    with pytest.raises(ValueError, match=r"^measurements\[1\]\.peak: expected int, found 'lots'$"):
        TestRecord.from_dict(data)
    with pytest.raises(ValueError, match=r"^measurements\[0\]: expected an object, found an array$"):
        TestRecord.from_dict({"nodeid": "t", "measurements": [[]]})
    with pytest.raises(ValueError, match=r"^missing 'nodeid'$"):
        TestRecord.from_dict({})


@pytest.mark.parametrize("record", sorted((Path(__file__).parents[1] / "fixtures" / "recorded").glob("*/record.json")))
def test_the_committed_gpu_records_read_back_to_the_same_data(record: Path) -> None:
    data = json.loads(record.read_text(encoding="utf-8"))
    for workload in data["workloads"].values():
        assert Measurement.from_dict(workload["measurement"]).to_dict() == workload["measurement"]
    assert [Check.from_dict(check).to_dict() for check in data["checks"]] == data["checks"]
    for key in ("environment", "cpu_environment"):
        assert Environment.from_dict(data[key]).to_dict() == data[key]


def _target_row() -> dict[str, Any]:
    text = resources.files("pytest_gpumem.targets").joinpath("targets.json").read_text(encoding="utf-8")
    row: dict[str, Any] = json.loads(text)["targets"][0]
    return row


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            lambda r: r["attention"]["backends"]["flash"].update(head_dims=1),
            "attention backend flash: unknown key(s) head_dims",
        ),
        (lambda r: r["allocator"].update(min_blok=1), "unknown allocator rule(s) min_blok"),
        (lambda r: r["allocator"].update(min_block=0), "allocator rules must be positive byte counts: min_block=0"),
        (lambda r: r["workspaces"][0].update(when="always"), "workspace cuBLAS: when='always' (use 'bias' or none)"),
        (
            lambda r: r["attention"]["backends"]["flash"].update(rng_state="x"),
            "rng_state of flash: use 'always', 'dropout' or 'never'",
        ),
        (
            lambda r: r["attention"].update(order=["math", "flash"]),
            "the attention order must end with 'math' (it takes every call)",
        ),
        (lambda r: r["attention"].update(order=["fast", "math"]), "unknown attention backend(s) fast"),
        (lambda r: r.pop("device_name"), "missing 'device_name'"),
    ],
)
def test_a_bad_row_of_targets_json_is_refused_naming_the_target_and_the_problem(
    change: Callable[[dict[str, Any]], object], problem: str
) -> None:
    row = _target_row()
    assert Target.from_dict(copy.deepcopy(row)) == target(row["name"])
    change(row)
    with pytest.raises(ValueError) as info:
        Target.from_dict(row)
    assert str(info.value) == f"prediction target {row['name']!r} in targets.json: {problem}"
