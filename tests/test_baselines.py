"""The baseline file: environments, load, record, stale/prune, atomic save (pure: no pytester)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pytest_gpumem
import pytest_gpumem.baselines as baselines
from conftest import CPU_ENV as CPU
from conftest import H100_ENV as H100
from pytest_gpumem.baselines import (
    BaselineEntry,
    BaselineFileError,
    BaselineStore,
    Environment,
    StaleEntry,
    load,
    parse,
    save,
)
from pytest_gpumem.baselines.store import EnvironmentRemoved, Recorded, Removed
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.metrics import CATEGORIES

MiB = 1 << 20
CPU_ROUNDED = Environment(engine="cpu", torch_version="2.13", cuda_rounding=True)
PACKAGE = Path(pytest_gpumem.__file__).parent


def span(name: str = "call", *, start: int = 0, peak: int = 10 * MiB, allocated: int = MiB, **kw: Any) -> Measurement:
    return Measurement(name=name, engine="cpu", device="cpu", start=start, peak=peak, allocated=allocated, **kw)


def full_breakdown(total: int) -> dict[str, int]:
    values = {c: total // len(CATEGORIES) for c in CATEGORIES}
    values["other"] += total - sum(values.values())
    return values


def recorded(*tests: str, environment: Environment = CPU) -> BaselineStore:
    store = BaselineStore()
    for i, test in enumerate(tests):
        store.record(environment, test, [span(peak=(i + 2) * MiB), span("step", start=MiB, peak=(i + 3) * MiB)])
    return store


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- environment


def test_detect_cpu_key_has_engine_torch_version_and_rounding() -> None:
    major, minor = torch.__version__.split(".")[:2]
    exact = Environment.detect("cpu", torch.device("cpu"), cuda_rounding=False)
    rounded = Environment.detect("cpu", torch.device("cpu"), cuda_rounding=True)
    assert exact.key == f"cpu | torch {major}.{minor} | cuda_rounding off"
    assert rounded.key == f"cpu | torch {major}.{minor} | cuda_rounding on"
    # the CPU model, memory and CUDA build do not matter to tensor-storage bytes
    assert exact.device_name is None and exact.total_memory is None and exact.cuda_version is None
    assert exact.allocator is None


def test_detect_rejects_unknown_engine() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tpu'"):
        Environment.detect("tpu", torch.device("cpu"))


def test_environment_round_trip_and_key_is_a_function_of_the_dict() -> None:
    for environment in (CPU, CPU_ROUNDED, H100, Environment(engine="cuda")):
        data = json.loads(json.dumps(environment.to_dict()))
        assert Environment.from_dict(data) == environment
        assert Environment.from_dict(data).key == environment.key


def test_cuda_key_shows_every_part_and_unknowns() -> None:
    assert H100.key == (
        "cuda | NVIDIA H100 80GB HBM3 | 79 GiB | cc 9.0 | torch 2.13 | CUDA 12.8 | cuDNN 91002 | default allocator"
    )
    assert Environment(engine="cuda", torch_version="2.13").key == (
        "cuda | unknown | memory unknown | cc unknown | torch 2.13 | allocator unknown"
    )


def fake_cuda(monkeypatch: pytest.MonkeyPatch, *, hip: str | None = None, **props: Any) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(**props))
    monkeypatch.setattr(torch.version, "cuda", None if hip else "12.8")
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    for name in baselines.ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_detect_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, name="NVIDIA A100-SXM4-40GB", total_memory=42_298_834_944, major=8, minor=0)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", " expandable_segments:True ")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "")  # blank: not set
    environment = Environment.detect("cuda", torch.device("cuda:1"))
    assert environment.allocator == (
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
    )
    major, minor = torch.__version__.split(".")[:2]
    assert environment.key == (
        f"cuda | NVIDIA A100-SXM4-40GB | 39 GiB | cc 8.0 | torch {major}.{minor} | CUDA 12.8 | cuDNN 91002 | "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True | CUBLAS_WORKSPACE_CONFIG=:4096:8"
    )
    assert environment.cuda_rounding is None
    assert Environment.from_dict(json.loads(json.dumps(environment.to_dict()))).key == environment.key


def test_detect_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(
        monkeypatch,
        hip="6.2.41133-dd7f95766",
        name="AMD Instinct MI250X",
        total_memory=68_702_699_520,
        major=9,
        minor=0,
        gcnArchName="gfx90a:sramecc+:xnack-",
    )
    environment = Environment.detect("cuda", "cuda")
    assert (environment.compute_capability, environment.hip_version, environment.cuda_version) == (
        "gfx90a",
        "6.2",
        None,
    )
    assert "| cc gfx90a |" in environment.key and "| HIP 6.2 | MIOpen 91002 |" in environment.key


def test_detect_without_a_device_shows_unknowns(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: object = None) -> None:
        raise RuntimeError("no CUDA GPUs are available")

    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    environment = Environment.detect("cuda", torch.device("cuda"))
    assert (environment.device_name, environment.total_memory, environment.compute_capability) == (None, None, None)
    assert "| unknown | memory unknown | cc unknown |" in environment.key


# --------------------------------------------------------------------------- environment labels

LABELLED = Environment(
    engine="cpu", torch_version="2.13", cuda_rounding=False, labels=(("zone", "eu"), ("image", "cu128"))
)


def test_labels_are_sorted_and_come_last_in_the_key() -> None:
    assert LABELLED.labels == (("image", "cu128"), ("zone", "eu"))
    assert Environment(**{**CPU.__dict__, "labels": {"zone": "eu", "image": "cu128"}}) == LABELLED
    assert LABELLED.key == "cpu | torch 2.13 | cuda_rounding off | image=cu128 | zone=eu"
    assert LABELLED.to_dict()["labels"] == {"image": "cu128", "zone": "eu"}
    assert Environment.from_dict(json.loads(json.dumps(LABELLED.to_dict()))) == LABELLED  # as xdist workers send it
    tuned = Environment(**{**H100.__dict__, "allocator": (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)})
    labelled_gpu = Environment(**{**tuned.__dict__, "labels": (("cluster", "a"),)})
    assert labelled_gpu.key == tuned.key + " | cluster=a"
    assert Environment(**{**H100.__dict__, "labels": (("cluster", "a"),)}).key.endswith(
        "| default allocator | cluster=a"
    )


def test_no_labels_leave_keys_and_dicts_as_they_were() -> None:
    assert CPU.labels == () and "labels" not in CPU.to_dict() and "labels" not in H100.to_dict()
    assert CPU.key == "cpu | torch 2.13 | cuda_rounding off"
    assert Environment.from_dict(CPU.to_dict()).labels == ()


def test_labels_round_trip_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    store = BaselineStore()
    store.record(LABELLED, "t.py::a", [span()])
    store.record(CPU, "t.py::a", [span(peak=3 * MiB)])
    save(store, path)
    text = path.read_text()
    described = json.loads(text)["environments"][LABELLED.key]["environment"]
    assert list(described)[-1] == "labels" and list(described["labels"].items()) == [("image", "cu128"), ("zone", "eu")]
    assert '"labels"' not in json.dumps(json.loads(text)["environments"][CPU.key])
    again = load(path)
    assert again.environment(LABELLED.key) == LABELLED
    assert again.environment_keys() == (CPU.key, LABELLED.key)
    entry = again.entry(LABELLED.key, "t.py::a")
    assert entry is not None and entry.cost("peak") == 10 * MiB
    # a hand-edited file with labels out of order is written back in canonical order
    data = json.loads(text)
    data["environments"][LABELLED.key]["environment"]["labels"] = {"zone": "eu", "image": "cu128"}
    write(path, json.dumps(data, indent=2))
    reordered = load(path)
    assert save(reordered)
    assert path.read_text() == text


@pytest.mark.parametrize(
    ("labels", "words"),
    [
        ((("", "x"),), "'=x': the name is empty"),
        ((("team", ""),), "'team=': the value is empty"),
        ((("a|b", "x"),), "'a|b=x': the name contains '|'"),
        ((("team", "x | y"),), "'team=x | y': the value contains '|'"),
        ((("team", "x\ny"),), "the value contains a line break"),
        ((("team", "x\r"),), "the value contains a line break"),
        ((("team ", "x"),), "leading or trailing spaces"),
        ((("a=b", "x"),), "the name contains '='"),
        ((("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),), "CUBLAS_WORKSPACE_CONFIG is an allocator variable"),
        ((("team", 3),), "'team'=3: the value must be a string"),
        ((("team",),), "expected a (name, value) pair"),
        ((("team", "a"), ("team", "b")), "the name 'team' appears twice"),
        (None, "None: expected (name, value) pairs or a mapping"),
        ("team=a", "'team=a': expected (name, value) pairs or a mapping"),
    ],
)
def test_bad_labels_are_refused_by_name(labels: Any, words: str) -> None:
    with pytest.raises(ValueError, match="invalid environment label") as info:
        Environment(engine="cpu", labels=labels)
    assert words in str(info.value)


def test_bad_labels_in_a_file_are_located(tmp_path: Path) -> None:
    good = BaselineStore()
    good.record(LABELLED, "t.py::a", [span()])
    text = good.dumps().decode().replace('"zone": "eu"', '"zone": "eu|west"')
    path = write(tmp_path / "b.json", text)
    line = text.splitlines().index('          "zone": "eu|west"') + 1
    error = assert_error(path, line, '["labels"]["zone"]', "the value contains '|'")
    assert "Correct it by hand" in str(error)
    data = json.loads(good.dumps())
    data["environments"][LABELLED.key]["environment"]["labels"] = ["image=cu128"]
    path = write(tmp_path / "c.json", json.dumps(data))
    assert_error(path, 1, '["labels"]: expected an object of strings, found an array')


# --------------------------------------------------------------------------- round trip and layout


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "gpumem.json"
    store = load(path)  # missing: empty
    assert len(store) == 0
    breakdown = full_breakdown(10 * MiB)
    store.record(CPU, "t.py::a", [span(start=MiB, peak=11 * MiB, allocated=2 * MiB, breakdown=breakdown)])
    assert save(store)
    again = load(path)
    kept = {c: v for c, v in breakdown.items() if c != "other"}  # what depends on the run's order is not kept
    assert again.entry(CPU.key, "t.py::a") == BaselineEntry(
        {"peak": 10 * MiB, "allocated": MiB, "reserved": None}, start=None, breakdown=kept
    )
    assert again.entry(CPU.key, "t.py::a", "step") is None
    assert again.entry(H100.key, "t.py::a") is None
    assert again.environment(CPU.key) == CPU
    assert again.environment_keys() == (CPU.key,)
    assert again.tests(CPU.key) == ("t.py::a",)


def test_file_layout(tmp_path: Path) -> None:
    store = BaselineStore()
    call = span(peak=5, allocated=2, breakdown={"other": 2, "zcat": 3})
    store.record(CPU, "t.py::a", [span("step", peak=3, allocated=1), call])
    text = store.dumps().decode()
    assert text.endswith("}\n") and not text.endswith("\n\n")
    data = json.loads(text)
    assert list(data) == ["schema", "environments"] and data["schema"] == 1
    env = data["environments"]["cpu | torch 2.13 | cuda_rounding off"]
    assert list(env) == ["environment", "tests"]
    assert list(env["tests"]["t.py::a"]["spans"]) == ["call", "step"]  # call first, then by name
    call = env["tests"]["t.py::a"]["spans"]["call"]
    assert list(call) == ["peak", "allocated", "reserved", "breakdown"]  # no start: it depends on the run's order
    assert "breakdown" not in env["tests"]["t.py::a"]["spans"]["step"]
    # every category but "other" (it depends on the run's order), then one this release does not know
    assert call["breakdown"] == {**{c: 0 for c in CATEGORIES if c != "other"}, "zcat": 3}
    assert '\n              "peak": 5,\n' in text  # 2-space indent, one figure per line
    assert text == json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def test_dumps_equals_json_module_for_any_tree() -> None:
    doc = {
        "zz": [1, {"b": 2, "a": None}, []],
        "schema": 1,
        "environments": {
            "k2": {"tests": {}, "environment": {"engine": "cuda", "zzz": {"q": 1.5, "a": 'ü"\n'}}, "x": True},
            "k1": {
                "environment": {},
                "tests": {
                    "t::b": {
                        "spans": {
                            "z": {"breakdown": {"other": 1, "zcat": 3}, "start": 5, "peak": 1, "foo": {"y": [1]}},
                            "call": {},
                            "a": {"peak": 1, "allocated": 2, "reserved": None, "start": 0, "breakdown": {}},
                        },
                        "meta": {"b": 1, "a": 2},
                    },
                    "t::ü[1]": {"spans": {}},
                },
            },
        },
    }
    store = parse(json.dumps(doc).encode())
    assert store.dumps().decode() == json.dumps(store.to_dict(), indent=2, ensure_ascii=False) + "\n"


def test_bytes_do_not_depend_on_recording_order() -> None:
    tests = [f"tests/test_{i % 7}.py::test_{i}[{i}]" for i in range(60)]
    rng = random.Random(1234)
    outputs = set()
    for _ in range(5):
        order = tests[:]
        rng.shuffle(order)
        store = BaselineStore()
        for test in order:
            i = tests.index(test)
            environment = [CPU, CPU_ROUNDED, H100][i % 3]
            spans = [span(peak=i * MiB), span("fwd", peak=i), span("bwd", peak=2 * i, breakdown=full_breakdown(2 * i))]
            rng.shuffle(spans)
            store.record(environment, test, spans)
        outputs.add(store.dumps())
    assert len(outputs) == 1
    assert outputs.pop().decode() == json.dumps(store.to_dict(), indent=2, ensure_ascii=False) + "\n"


def test_saving_a_hand_ordered_file_makes_it_canonical(tmp_path: Path) -> None:
    canonical = recorded("t.py::b", "t.py::a").dumps()
    reordered = json.loads(canonical)
    env = reordered["environments"][CPU.key]
    env["tests"] = dict(reversed(list(env["tests"].items())))
    for test in env["tests"].values():
        for name, values in test["spans"].items():
            test["spans"][name] = dict(reversed(list(values.items())))
    path = write(tmp_path / "b.json", json.dumps({"environments": reordered["environments"], "schema": 1}))
    store = load(path)
    assert save(store)
    assert path.read_bytes() == canonical


def test_save_skips_identical_bytes(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    assert save(recorded("t.py::a"), path)
    before = path.stat().st_mtime_ns
    store = load(path)
    store.record(CPU, "t.py::a", [span(peak=2 * MiB), span("step", start=MiB, peak=3 * MiB)])  # same figures
    assert not save(store)
    assert path.stat().st_mtime_ns == before


# --------------------------------------------------------------------------- updating


def test_unknown_keys_survive_at_every_level(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    save(recorded("t.py::a", "t.py::b"), path)
    data = json.loads(path.read_text())
    data["generator"] = {"name": "pytest-gpumem", "version": "9.0"}
    env = data["environments"][CPU.key]
    env["owner"] = "ml-infra"
    env["environment"]["cpu_isa"] = "avx512"
    test = env["tests"]["t.py::a"]
    test["flaky"] = True
    test["spans"]["call"]["max_microbatch"] = 16  # a figure this release knows, that the new record lacks
    test["spans"]["call"]["future_count"] = 3  # a figure of a later release
    test["spans"]["call"]["start"] = 0  # as an earlier release recorded it
    test["spans"]["call"]["notes"] = {"why": "warm-up"}
    test["spans"]["step"]["requested"] = [1, 2]
    path.write_text(json.dumps(data, indent=2))

    store = load(path)
    # t.py::a ran again, measuring only "call", no microbatch search: its span set is replaced,
    # unknown keys kept, a known figure it no longer measures dropped
    store.record(CPU, "t.py::a", [span(peak=7 * MiB)])
    save(store)
    after = json.loads(path.read_text())
    assert after["generator"] == {"name": "pytest-gpumem", "version": "9.0"}
    env = after["environments"][CPU.key]
    assert env["owner"] == "ml-infra" and env["environment"]["cpu_isa"] == "avx512"
    test = env["tests"]["t.py::a"]
    assert test["flaky"] is True
    assert list(test["spans"]) == ["call"]
    call = test["spans"]["call"]
    assert call["peak"] == 7 * MiB and call["future_count"] == 3 and call["notes"] == {"why": "warm-up"}
    assert "max_microbatch" not in call
    assert store.entry(CPU.key, "t.py::a") == BaselineEntry(
        {"peak": 7 * MiB, "allocated": MiB, "reserved": None, "future_count": 3},
        start=None,  # the start an earlier release recorded is dropped: it depends on the run's order
        extra={"notes": {"why": "warm-up"}},
    )
    assert (
        env["tests"]["t.py::b"]
        == json.loads(recorded("t.py::a", "t.py::b").dumps())["environments"][CPU.key]["tests"]["t.py::b"]
    )


def test_a_breakdown_no_longer_measured_is_dropped() -> None:
    store = BaselineStore()
    store.record(CPU, "t.py::a", [span(breakdown=full_breakdown(10 * MiB))])
    store.record(CPU, "t.py::a", [span()])
    entry = store.entry(CPU.key, "t.py::a")
    assert entry is not None and entry.breakdown is None


def test_tests_that_did_not_run_keep_their_entries() -> None:
    store = recorded("t.py::a", "t.py::b", "t.py::c")
    store.record(H100, "t.py::a", [span(peak=MiB)])
    before_b = store.spans(CPU.key, "t.py::b")
    store.record(CPU, "t.py::a", [span(peak=99 * MiB)])  # only a ran (-k a)
    assert store.spans(CPU.key, "t.py::b") == before_b
    assert store.entry(H100.key, "t.py::a") == BaselineEntry({"peak": MiB, "allocated": MiB, "reserved": None})
    assert len(store) == 4


def test_several_environments_side_by_side() -> None:
    store = recorded("t.py::a", "t.py::b")
    store.record(H100, "t.py::a", [span(peak=50 * MiB)])
    store.record(CPU_ROUNDED, "t.py::a", [span(peak=51 * MiB)])
    assert store.environment_keys() == tuple(sorted([CPU.key, CPU_ROUNDED.key, H100.key]))
    assert store.environments_with("t.py::a") == tuple(sorted([CPU.key, CPU_ROUNDED.key, H100.key]))
    assert store.environments_with("t.py::a", exclude=CPU.key) == tuple(sorted([CPU_ROUNDED.key, H100.key]))
    assert store.environments_with("t.py::b", exclude=CPU.key) == ()
    assert store.environments_with("t.py::zzz") == ()
    h100 = store.entry(H100.key, "t.py::a")
    assert h100 is not None and h100.cost("peak") == 50 * MiB
    assert store.environment(H100.key) == H100


def test_environment_description_does_not_churn() -> None:
    store = BaselineStore()
    store.record(H100, "t.py::a", [span()])
    # another runner: same key (memory shown in whole GiB) but 1 MiB less reported
    twin = Environment(**{**H100.__dict__, "total_memory": H100.total_memory - MiB})  # type: ignore[operator]
    assert twin.key == H100.key
    tree = store.to_dict()
    del tree["environments"][H100.key]["environment"]["cudnn_version"]  # as if written by a release without it
    later = BaselineStore.from_dict(tree)
    later.record(twin, "t.py::b", [span()])
    described = later.to_dict()["environments"][H100.key]["environment"]
    assert described["total_memory"] == H100.total_memory  # first recorded value kept
    assert described["cudnn_version"] == "91002"  # missing field filled in
    assert list(described) == list(H100.to_dict())


def test_record_rejects_duplicate_spans_and_bad_values() -> None:
    store = BaselineStore()
    with pytest.raises(ValueError, match="two measurements of the span 'call'"):
        store.record(CPU, "t.py::a", [span(), span()])
    with pytest.raises(TypeError, match="peak: expected an int or None"):
        store.record(CPU, "t.py::a", {"call": BaselineEntry({"peak": 1.5})})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="breakdown"):
        store.record(CPU, "t.py::a", {"call": BaselineEntry({"peak": 1}, breakdown={"other": True})})
    assert len(store) == 0


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (BaselineEntry({"peak": -5}), "t.py::a [call] peak: -5 is negative: this figure is never below 0"),
        (BaselineEntry({"peak": 1}, start=-1), "t.py::a [call] start: -1 is negative"),
        (BaselineEntry({"peak": 2**63}), "t.py::a [call] peak: 9223372036854775808 is beyond 2**63 - 1"),
        (BaselineEntry({"peak": 1}, breakdown={"other": -2}), "t.py::a [call] breakdown other: -2 is negative"),
    ],
)
def test_record_refuses_figures_the_file_could_not_be_loaded_with(entry: BaselineEntry, message: str) -> None:
    """What the loader refuses is refused when recorded, so that a saved file always loads again; a signed figure
    (a net change) may be negative."""
    store = BaselineStore()
    with pytest.raises(ValueError, match=re.escape(message)):
        store.record(CPU, "t.py::a", {"call": entry})
    assert len(store) == 0
    store.record(CPU, "t.py::a", {"call": BaselineEntry({"peak": 1, "retained": -4})})
    assert parse(store.dumps()).entry(CPU.key, "t.py::a") == store.entry(CPU.key, "t.py::a")


def test_record_entries_by_span_name() -> None:
    store = BaselineStore()
    store.record(CPU, "t.py::a", {"call": BaselineEntry({"peak": 5, "max_microbatch": 8}, start=1)})
    entry = store.entry(CPU.key, "t.py::a")
    assert entry is not None and entry.costs == {"peak": 5, "max_microbatch": 8} and entry.start == 1


def test_entry_from_measurement_stores_costs() -> None:
    m = span(start=3 * MiB, peak=10 * MiB, allocated=4 * MiB)
    entry = BaselineEntry.from_measurement(m, extra_costs={"max_microbatch": 4})
    assert entry.costs == {"peak": 7 * MiB, "allocated": MiB, "reserved": None, "max_microbatch": 4}
    assert entry.start is None  # absolute: it depends on the tests that ran before


def test_remove_environment() -> None:
    store = recorded("t.py::a", "t.py::b")
    store.record(H100, "t.py::a", [span()])
    assert store.remove_environment(CPU.key) == 2
    assert store.environment_keys() == (H100.key,)
    assert store.remove_environment(CPU.key) == 0
    assert store.remove_environment("no such environment") == 0
    assert store.environment_keys() == (H100.key,)


def test_the_journal_holds_typed_changes_that_apply_onto_another_store_until_a_commit(tmp_path: Path) -> None:
    """What a store changed since it was loaded, as typed records that a save applies onto the file as
    another run left it; loading and saving commit the store, which empties its journal."""
    path = tmp_path / "base.json"
    save(recorded("t.py::a", "t.py::b"), path, force=True)
    store = load(path)
    assert store.path == path and store.fingerprint is not None and store.digest is not None
    assert store.changes == ()
    store.record(H100, "t.py::c", [span()])
    store.remove(CPU.key, "t.py::a")
    store.remove_environment("no such environment")  # changes nothing: not journaled
    store.remove_environment(H100.key)
    recorded_c = store.changes[0]
    assert isinstance(recorded_c, Recorded) and (recorded_c.environment, recorded_c.test) == (H100, "t.py::c")
    assert store.changes[1:] == (Removed(CPU.key, "t.py::a"), EnvironmentRemoved(H100.key))
    other = recorded("t.py::a", "t.py::b", "t.py::d")  # another run's file
    store.apply_changes(other)
    assert other.environment_keys() == (CPU.key,) and other.tests(CPU.key) == ("t.py::b", "t.py::d")
    assert other.changes[-3:] == store.changes  # applying journals each change on the other store too
    assert save(store) and store.changes == () and store.fingerprint is not None
    assert load(path).dumps() == store.dumps()


def test_from_dict_copies_and_round_trips() -> None:
    store = recorded("t.py::a", "t.py::b")
    tree = store.to_dict()
    tree["generator"] = {"name": "x"}
    again = BaselineStore.from_dict(tree)
    assert again.dumps() == (json.dumps(tree, indent=2, ensure_ascii=False) + "\n").encode()
    tree["environments"][CPU.key]["tests"].clear()  # the store holds a copy
    assert again.tests(CPU.key) == ("t.py::a", "t.py::b")
    assert again.path is None
    assert BaselineStore.from_dict({"schema": 1}).environment_keys() == ()


def test_to_dict_is_a_copy() -> None:
    store = recorded("t.py::a")
    store.to_dict()["environments"].clear()
    assert store.tests(CPU.key) == ("t.py::a",)


def one_span(**values: Any) -> dict[str, Any]:
    return {"schema": 1, "environments": {"k": {"tests": {"t": {"spans": {"call": values}}}}}}


@pytest.mark.parametrize(
    ("tree", "words"),
    [
        ({"schema": 2, "environments": {}}, "schema version 2"),
        (one_span(peak="1 MiB"), '["call"]["peak"]: expected an integer number of bytes'),
        (one_span(peak=float("nan")), "not JSON data"),
        (one_span(notes={1, 2}), "not JSON data"),
    ],
)
def test_from_dict_refuses_what_load_refuses(tree: dict[str, Any], words: str) -> None:
    with pytest.raises(BaselineFileError) as info:
        BaselineStore.from_dict(tree, source="generated")
    assert str(info.value).startswith("generated: ") and words in str(info.value)
    assert "git checkout" not in str(info.value)  # no file to restore


def test_dumps_refuses_nan_in_unknown_keys() -> None:
    store = BaselineStore()
    store.record(CPU, "t.py::a", {"call": BaselineEntry({"peak": 1}, extra={"ratio": float("nan")})})
    with pytest.raises(ValueError, match="JSON"):
        store.dumps()


# --------------------------------------------------------------------------- stale and prune


def test_stale_and_prune_in_the_current_environment() -> None:
    store = recorded("tests/a.py::gone", "tests/a.py::kept", "tests/a.py::deselected")
    store.record(H100, "tests/a.py::gone", [span()])
    collected = {"tests/a.py::kept", "tests/a.py::deselected", "tests/a.py::new"}  # -k deselection still collects
    stale = store.stale(collected, CPU.key)
    assert stale == [StaleEntry(CPU.key, "tests/a.py::gone", ("call", "step"))]
    assert store.prune(stale) == 1
    assert store.tests(CPU.key) == ("tests/a.py::deselected", "tests/a.py::kept")
    # the other environment keeps its entry: its test may exist only there
    assert store.tests(H100.key) == ("tests/a.py::gone",)
    assert store.stale(collected, None) == [StaleEntry(H100.key, "tests/a.py::gone", ("call",))]


def test_stale_only_within_the_collected_roots() -> None:
    store = recorded("tests/unit/test_a.py::x", "tests/unit/test_b.py::y", "tests/gpu/test_c.py::z", "tests/u.py::w")
    # pytest tests/unit/test_a.py: only that file was collected
    stale = store.stale({"tests/unit/test_a.py::x"}, CPU.key, roots=["tests/unit/test_a.py"])
    assert stale == []
    stale = store.stale(set(), CPU.key, roots=["./tests/unit/"])
    assert [s.test for s in stale] == ["tests/unit/test_a.py::x", "tests/unit/test_b.py::y"]  # not tests/u.py
    assert [s.test for s in store.stale(set(), CPU.key, roots=["."])] == list(store.tests(CPU.key))


def test_pruning_the_last_test_removes_its_environment() -> None:
    store = recorded("t.py::a")
    store.record(H100, "t.py::a", [span()])
    store.prune(store.stale(set(), H100.key))
    assert store.environment_keys() == (CPU.key,)
    assert not store.remove(H100.key, "t.py::a")


# --------------------------------------------------------------------------- unreadable files


def assert_error(path: Path, line: int | None, *words: str) -> BaselineFileError:
    before = path.read_bytes()
    with pytest.raises(BaselineFileError) as info:
        load(path)
    error = info.value
    message = str(error)
    assert message.startswith(f"{path}:{line}:" if line is not None else f"{path}:"), message
    assert error.line == line and error.path == path
    for word in words:
        assert word in message, message
    assert path.read_bytes() == before  # loading never touches the file
    return error


def test_conflict_markers(tmp_path: Path) -> None:
    text = recorded("t.py::a").dumps().decode().splitlines(keepends=True)
    at = next(i for i, line in enumerate(text) if '"peak"' in line)
    conflicted = [*text[:at], "<<<<<<< HEAD\n", text[at], "=======\n", text[at], ">>>>>>> feature/x\n", *text[at + 1 :]]
    path = write(tmp_path / "b.json", "".join(conflicted))
    error = assert_error(path, at + 1, "<<<<<<< HEAD", "merge conflict", "--gpumem-update-baselines")
    assert error.column == 1


def test_conflict_marker_without_label_and_diff3(tmp_path: Path) -> None:
    path = write(tmp_path / "b.json", '{\n  "schema": 1,\n||||||| base\n=======\n}\n')
    assert_error(path, 3, "|||||||")


def test_truncated_json(tmp_path: Path) -> None:
    text = recorded("t.py::a", "t.py::b").dumps().decode()
    path = write(tmp_path / "b.json", text[: len(text) // 2])
    lines = text[: len(text) // 2].count("\n") + 1
    error = assert_error(path, lines, "not valid JSON", "truncated", "git checkout --")
    assert error.column is not None


def test_empty_file(tmp_path: Path) -> None:
    assert_error(write(tmp_path / "b.json", ""), 1, "empty file")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[1, 2]", ["top level", "expected a JSON object, found an array"]),
        ('"baselines"', ["found the string 'baselines'"]),
        ("{}", ['no "schema"']),
        ('{"schema": "1"}', ["must be an integer"]),
        ('{"schema": 2, "environments": {}}', ["schema version 2", "newer", "Upgrade pytest-gpumem"]),
        ('{"schema": 0}', ["schema version 0", "older"]),
        ('{"schema": 1, "environments": []}', ['["environments"]: expected an object, found an array']),
        ('{"schema": 1, "environments": {"k": {"tests": {"t": {"spans": {"call": {"peak": NaN}}}}}}}', ["NaN"]),
    ],
)
def test_wrong_content(tmp_path: Path, text: str, words: list[str]) -> None:
    path = write(tmp_path / "b.json", text)
    with pytest.raises(BaselineFileError) as info:
        load(path)
    assert str(info.value).startswith(str(path))
    for word in words:
        assert word in str(info.value)


def test_wrong_schema_has_a_line(tmp_path: Path) -> None:
    path = write(tmp_path / "b.json", '{\n  "environments": {},\n  "schema": 3\n}\n')
    assert_error(path, 3, "schema version 3")


def test_wrong_type_is_located(tmp_path: Path) -> None:
    text = recorded("t.py::a", "t.py::b").dumps().decode()
    data = json.loads(text)
    data["environments"][CPU.key]["tests"]["t.py::b"]["spans"]["step"]["allocated"] = "1 MiB"
    text = json.dumps(data, indent=2)
    line = text.splitlines().index('              "allocated": "1 MiB",') + 1
    path = write(tmp_path / "b.json", text)
    assert_error(path, line, '["t.py::b"]["spans"]["step"]["allocated"]', "expected an integer number of bytes")


def test_bad_breakdown_is_reported(tmp_path: Path) -> None:
    doc = {"schema": 1, "environments": {"k": {"tests": {"t": {"spans": {"call": {"breakdown": {"other": 1.5}}}}}}}}
    path = write(tmp_path / "b.json", json.dumps(doc))
    assert_error(path, 1, '["breakdown"]: expected an object of integer byte counts')


def test_duplicate_keys(tmp_path: Path) -> None:
    text = '{\n  "schema": 1,\n  "environments": {\n    "k": {},\n    "k": {}\n  }\n}\n'
    assert_error(write(tmp_path / "b.json", text), 5, "'k' appears twice")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_bytes(b'{\n  "schema": 1,\n  "x": "\xff"\n}\n')
    error = assert_error(path, 3, "not UTF-8")
    assert error.column == 9


def test_a_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_bytes(b"\xef\xbb\xbf" + recorded("t.py::a").dumps())
    assert load(path).tests(CPU.key) == ("t.py::a",)


def test_unreadable_path(tmp_path: Path) -> None:
    with pytest.raises(BaselineFileError, match="cannot read the baseline file"):
        load(tmp_path)  # a folder


# --------------------------------------------------------------------------- save guards


def test_save_refuses_to_replace_a_file_it_did_not_load(tmp_path: Path) -> None:
    path = write(tmp_path / "b.json", "<<<<<<< HEAD\n")
    with pytest.raises(BaselineFileError):
        load(path)
    fresh = recorded("t.py::a")  # what a careless caller might fall back to
    with pytest.raises(BaselineFileError, match="not loaded from"):
        save(fresh, path)
    assert path.read_text() == "<<<<<<< HEAD\n"
    assert save(fresh, path, force=True)
    assert load(path).tests(CPU.key) == ("t.py::a",)


def test_save_merges_into_a_file_changed_since_load(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    save(recorded("t.py::a"), path)
    first, second = load(path), load(path)
    second.record(CPU, "t.py::b", [span()])
    assert save(second)
    first.record(CPU, "t.py::c", [span()])
    assert save(first)  # its change applied onto what the other save wrote (tests/test_baselines_reliability.py)
    assert load(path).tests(CPU.key) == ("t.py::a", "t.py::b", "t.py::c")


def test_save_to_a_missing_file_creates_folders(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "gpumem.json"
    store = load(path)
    store.record(CPU, "t.py::a", [span()])
    assert save(store)
    assert load(path).tests(CPU.key) == ("t.py::a",)
    assert save(store) is False  # unchanged since our own save


def test_save_needs_a_path() -> None:
    with pytest.raises(ValueError, match="needs a path"):
        save(BaselineStore())


def test_save_keeps_the_file_mode(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    save(recorded("t.py::a"), path)
    os.chmod(path, 0o640)
    store = load(path)
    store.record(CPU, "t.py::b", [span()])
    save(store)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_new_file_mode_follows_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        save(recorded("t.py::a"), tmp_path / "b.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o644


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failed_save_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    path = tmp_path / "b.json"
    save(recorded("t.py::a"), path)
    old = path.read_bytes()
    store = load(path)
    store.record(CPU, "t.py::b", [span()])

    def boom(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(BaselineFileError, match=f"{path}: cannot write the baseline file: No space left"):
        save(store)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["b.json"]
    assert save(store)  # the store is still usable: nothing on disk changed
    assert load(path).tests(CPU.key) == ("t.py::a", "t.py::b")


def test_save_removes_orphans_of_dead_processes_only(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    save(recorded("t.py::a"), path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = write(tmp_path / f".b.json.{dead.pid}.deadbeef.tmp", "{")
    alive = write(tmp_path / f".b.json.{os.getppid()}.cafebabe.tmp", "{")  # an in-flight save elsewhere
    old_alive = write(tmp_path / f".b.json.{os.getppid()}.0badf00d.tmp", "{")
    os.utime(old_alive, (time.time() - 2 * baselines.ORPHAN_AGE_S,) * 2)
    other_file = write(tmp_path / f".other.json.{dead.pid}.deadbeef.tmp", "{")
    store = load(path)
    store.record(CPU, "t.py::b", [span()])
    save(store)
    assert not orphan.exists() and not old_alive.exists()
    assert alive.exists() and other_file.exists()


# --------------------------------------------------------------------------- killed while saving

# The child imports pytest_gpumem.baselines without the package's __init__ (which imports
# torch): startup in milliseconds instead of seconds.
CHILD_PRELUDE = f"""
import os, sys, time, types
package = types.ModuleType("pytest_gpumem")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["pytest_gpumem"] = package
from pytest_gpumem import baselines as bl
path, marker = sys.argv[1], sys.argv[2]
env = bl.Environment(engine="cpu", torch_version="2.13", cuda_rounding=False)
"""


def run_child(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), *args])


def wait_for(marker: Path, child: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert child.poll() is None, f"the child exited early with {child.returncode}"
        assert time.monotonic() < deadline, "the child never reached the marker"
        time.sleep(0.005)


def temp_files(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
@pytest.mark.parametrize("stall_in", ["fsync", "replace"])
def test_sigkill_during_save_keeps_the_old_file(tmp_path: Path, stall_in: str) -> None:
    path = tmp_path / "gpumem.json"
    save(recorded("t.py::old"), path)
    old = path.read_bytes()
    marker = tmp_path / "stalled"
    child = run_child(
        f"""
        store = bl.load(path)
        for i in range(20_000):
            store.record(env, f"t.py::test_{{i}}", {{"call": bl.BaselineEntry({{"peak": i}}, start=0)}})
        real = os.{stall_in}
        def stall(*args):
            open(marker, "w").close()
            time.sleep(120)
            return real(*args)
        os.{stall_in} = stall
        bl.save(store)
        """,
        str(path),
        str(marker),
    )
    try:
        wait_for(marker, child)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert path.read_bytes() == old
    assert load(path).tests(CPU.key) == ("t.py::old",)
    # the killed save leaves its temp file: complete, since the kill came after the write
    (orphan,) = temp_files(tmp_path)
    assert orphan.startswith(f".gpumem.json.{child.pid}.")
    assert len(json.loads((tmp_path / orphan).read_text())["environments"][CPU.key]["tests"]) == 20_001
    # the next save removes it
    store = load(path)
    store.record(CPU, "t.py::new", [span()])
    assert save(store)
    assert temp_files(tmp_path) == []
    assert load(path).tests(CPU.key) == ("t.py::new", "t.py::old")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_sigkill_at_random_moments_never_leaves_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "gpumem.json"
    rng = random.Random(20240601)
    generations: set[int] = set()
    for attempt in range(3):
        marker = tmp_path / f"saved-{attempt}"
        child = run_child(
            """
            store = bl.load(path)
            for i in range(5_000):
                store.record(env, f"t.py::test_{i}", {"call": bl.BaselineEntry({"peak": i, "allocated": 1}, start=0)})
            tree = store.to_dict()
            generation = tree.get("generation", 0)
            while True:
                generation += 1
                tree["generation"] = generation
                bl.save(bl.BaselineStore.from_dict(tree), path, force=True)
                open(marker, "w").close()
            """,
            str(path),
            str(marker),
        )
        try:
            wait_for(marker, child)
            time.sleep(rng.uniform(0.0, 0.25))
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        data = json.loads(path.read_text(encoding="utf-8"))  # always whole
        store = load(path)
        assert len(store) == 5_000
        assert isinstance(data["generation"], int) and data["generation"] not in generations
        generations.add(data["generation"])
        assert len(temp_files(tmp_path)) <= 1
    store = load(path)
    store.record(CPU, "t.py::after", [span()])
    save(store)
    assert temp_files(tmp_path) == []


# --------------------------------------------------------------------------- the package


def test_the_package_imports_neither_torch_nor_pytest() -> None:
    code = CHILD_PRELUDE.split("path, marker")[0] + textwrap.dedent(
        """
        import pytest_gpumem.baselines.environment, pytest_gpumem.baselines.saving
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "pytest", "_pytest", "numpy"))
        assert not heavy, heavy
        assert bl.Environment(engine="cpu", torch_version="2.13").key == "cpu | torch 2.13 | cuda_rounding unknown"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_package_exports_what_the_module_did() -> None:
    """The baseline package's names (the metrics it keeps are the metric table's: data.metrics)."""
    names = {
        "ALLOCATOR_VARIABLES", "CALL_SPAN", "ENGINES", "ORPHAN_AGE_S", "SCHEMA_VERSION",
        "BaselineEntry", "BaselineFileError", "BaselineStore", "Environment", "StaleEntry", "allocator_settings",
        "load", "parse", "save",
    }  # fmt: skip
    assert names <= set(baselines.__all__)
    assert all(getattr(baselines, name) is not None for name in baselines.__all__)
    assert baselines.DEFAULT_FILENAME == "gpumem-baselines.json"
