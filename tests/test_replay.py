"""Replay of recorded GPU data on the CPU: the parts of the plugin that interpret it.

``python -m pytest_gpumem validate`` on a GPU machine writes ``fixtures/recorded/<gpu>-torch<x.y>/``:
``record.json`` (the plugin's measurements, PyTorch's counters, the environment, the zoo
table), ``memory_stats.json`` (raw ``memory_stats()`` dumps) and ``snapshot.pickle``. For every
such folder the tests below check, in normal CI without a GPU, that

* ``engines.cuda.reading_from_stats`` reads each raw dump as the figures the plugin recorded;
* ``Environment.from_dict`` rebuilds the recorded environment and its key;
* the report renders every recorded measurement (sizes formatted, n/a where unknown) and the
  JSON round trip keeps it;
* the zoo table's ratios and gap explanations follow from the recorded measurements;
* the snapshot's segments add up to the stats read with it.

Without recorded folders those tests do not exist (nothing is skipped). The loaders and
checks themselves are tested on a record the script's ``--cpu-only`` mode writes here.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import pytest_gpumem
from pytest_gpumem.validate.replay import (
    Loaded,
    load_record,
    rejudge,
    replay,
    replay_environment,
    replay_report,
    replay_snapshot,
    replay_stats,
    replay_zoo,
)
from pytest_gpumem.validate.results import PROTOCOL, RECORD_FILE, STATS_FILE, SUITE_LOG, Check
from pytest_gpumem.validate.suite_record import load_snapshot, recorded_folders, scrub_paths

ROOT = Path(__file__).resolve().parents[1]
RECORDED = recorded_folders(ROOT / "fixtures" / "recorded")

Replay = Callable[[Loaded], list[Check]]
REPLAYS: dict[str, Replay] = {
    "stats": replay_stats,
    "environment": replay_environment,
    "report": replay_report,
    "zoo": replay_zoo,
    "snapshot": replay_snapshot,
}


#: Failures a committed record holds that were fixed after the run that wrote it, by record: the
#: failed checks as the record states them, and why they failed. A record is never edited; a
#: failure not listed here fails the test.
FIXED_SINCE: dict[str, tuple[list[str], str]] = {
    "nvidia-h200-torch2.11": (
        [
            "CUDA test suite (pytest tests -m cuda): 15 test(s), 1 failed, 0 error(s), 0 skipped, exit 1, "
            "57.9 s: python -m pytest tests -m cuda (its JUnit XML: cuda-tests.xml)"
        ],
        "tests/test_cuda.py::test_sites_on_cuda_name_the_line_that_grew_with_its_blocks_to_the_byte: "
        "the sites replayed from the allocator's history summed the sizes the code asked for (136 B "
        "of scalars) where the allocator holds 512-byte blocks (1,536 B); traces.py rounds each "
        "block since, and the test passed on the same H200 in the next run",
    )
}


def failures(checks: list[Check]) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in checks if c.passed is not True]


# Only real GPU runs write fixtures/recorded/; until one has, there is nothing to parametrize
# over, and these tests are not defined (rather than skipped).
if RECORDED:

    @pytest.fixture(scope="module", params=RECORDED, ids=[folder.name for folder in RECORDED])
    def recorded(request: pytest.FixtureRequest) -> Loaded:
        return load_record(request.param)

    @pytest.mark.parametrize("aspect", list(REPLAYS))
    def test_recorded_data_replays(recorded: Loaded, aspect: str) -> None:
        """Each aspect of each GPU record: at least one check, and every check passes."""
        assert recorded.gpu, f"{recorded.folder}: only GPU runs belong in fixtures/recorded/"
        checks = REPLAYS[aspect](recorded)
        assert checks
        assert failures(checks) == []

    def test_recorded_run_passed(recorded: Loaded) -> None:
        """The GPU run that wrote the record passed its own checks (suite, references, counters),
        judged by this release's clean-state protocol where the record predates it; a failure the
        record holds is one :data:`FIXED_SINCE` names, with the fix and the run that showed it."""
        checks = rejudge(recorded)
        assert {"suite", "reference", "determinism", "counters", "replay"} <= {c.group for c in checks}
        failed = [f"{c.name}: {c.detail}" for c in checks if c.passed is False]
        assert failed == FIXED_SINCE.get(recorded.folder.name, ([], ""))[0]
        assert recorded.record["figures"]["cublas_workspace"] is not None


# --------------------------------------------------------------------------- the loaders, on a CPU-only record


@pytest.fixture
def cpu_record(cpu_only_run: tuple[Any, Path]) -> Path:
    """A record written by ``python -m pytest_gpumem validate --cpu-only --size tiny`` (its run's
    checks: test_validate.py), read where it was written."""
    return cpu_only_run[1]


@pytest.fixture
def copy(cpu_record: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(cpu_record, tmp_path / cpu_record.name))


def edit(folder: Path, change: Callable[[dict[str, Any]], None]) -> Loaded:
    path = folder / RECORD_FILE
    record = json.loads(path.read_text(encoding="utf-8"))
    change(record)
    path.write_text(json.dumps(record), encoding="utf-8")
    return load_record(folder)


@pytest.mark.slow
def test_loader_reads_a_cpu_only_record(cpu_record: Path) -> None:
    loaded = load_record(cpu_record)
    assert not loaded.gpu and loaded.snapshot is None
    assert loaded.stats == {"workloads": {}, "snapshot": None}
    measurements = loaded.measurements()
    assert {"zoo.mlp.fp32.cpu", "zoo.mlp.bf16.cpu", "reference.linear-init"} <= set(measurements)
    for name, m in measurements.items():
        assert m.name == name and m.engine == "cpu" and m.reserved is None
        assert m.to_dict() == loaded.record["workloads"][name]["measurement"]


@pytest.mark.slow
def test_every_replay_of_a_cpu_only_record_passes(cpu_record: Path) -> None:
    loaded = load_record(cpu_record)
    results = {aspect: replay(loaded) for aspect, replay in REPLAYS.items()}
    assert results["stats"] == [] and results["snapshot"] == []  # no GPU: no dumps, no snapshot
    assert [c.name for c in results["environment"]] == [
        "cpu_environment: Environment.from_dict(...).key = recorded key"
    ]
    models = {row["model"] for row in loaded.record["zoo"] if not row.get("skipped")}
    assert len(results["report"]) == 1 and len(results["zoo"]) == 2 * len(models) > 0  # each model × fp32, bf16
    assert failures([c for checks in results.values() for c in checks]) == []
    assert [c.to_dict() for c in replay(cpu_record)] == [c.to_dict() for aspect in REPLAYS for c in results[aspect]]


@pytest.mark.slow
def test_replay_catches_a_key_that_does_not_match_its_environment(copy: Path) -> None:
    loaded = edit(copy, lambda r: r.update(cpu_environment_key="cpu | torch 2.13 | cuda_rounding off"))
    (check,) = replay_environment(loaded)
    assert check.passed is False and check.detail.endswith("cuda_rounding on")


@pytest.mark.slow
def test_replay_catches_zoo_figures_that_do_not_follow_from_the_measurements(copy: Path) -> None:
    def grow(record: dict[str, Any]) -> None:
        record["zoo"][0]["figures"]["cpu"]["peak"] += 512

    checks = replay_zoo(edit(copy, grow))
    assert [c.passed for c in checks] == [False] + [True] * (len(checks) - 1) and len(checks) > 1
    assert checks[0].detail == "figures"


@pytest.mark.slow
def test_replay_catches_a_report_that_loses_a_figure(copy: Path) -> None:
    def unknown_reserved(record: dict[str, Any]) -> None:  # a CUDA-only figure on a CPU measurement
        record["workloads"]["zoo.mlp.fp32.cpu"]["measurement"]["reserved"] = 3 * 2**20

    (check,) = replay_report(edit(copy, unknown_reserved))
    assert check.passed  # shown as the 3.00 MiB it is
    (check,) = replay_report(edit(copy, lambda r: r.update(workloads={})))
    assert check.passed is False and check.detail == "no measurements"


@pytest.mark.slow
def test_a_gpu_record_must_hold_its_gpu_data(copy: Path) -> None:
    """A record that says it is a GPU run without dumps, environment or snapshot fails its replay."""
    loaded = edit(copy, lambda r: r.update(mode="gpu"))
    assert failures(replay_stats(loaded)) == ["a GPU record holds memory_stats() dumps: none found"]
    assert "a GPU record holds its environment: " in failures(replay_environment(loaded))
    assert failures(replay_snapshot(loaded)) == ["a GPU record holds a memory snapshot: "]


@pytest.mark.slow
def test_a_dump_of_an_unknown_workload_fails(copy: Path) -> None:
    stats = {"workloads": {"no-such-workload": {"allocated_bytes.all.peak": 0}}, "snapshot": None}
    (copy / STATS_FILE).write_text(json.dumps(stats), encoding="utf-8")
    (check,) = replay_stats(load_record(copy))
    assert check.passed is False and check.detail == "no such workload"


def test_snapshot_loader_reads_plain_data_and_refuses_classes(tmp_path: Path) -> None:
    plain = {"lists": [1, "two", 3.0, None, True], "nested": {"tuple": (4, 5)}}
    (tmp_path / "plain.pickle").write_bytes(pickle.dumps(plain))
    assert load_snapshot(tmp_path / "plain.pickle") == plain
    (tmp_path / "class.pickle").write_bytes(pickle.dumps({"lists": [Path("x")]}))
    with pytest.raises(pickle.UnpicklingError, match="refusing pathlib"):
        load_snapshot(tmp_path / "class.pickle")


def test_recorded_folders_are_those_with_a_record(tmp_path: Path) -> None:
    for name in ("b-torch2.13", "a-torch2.13", "notes"):
        (tmp_path / name).mkdir()
    for name in ("b-torch2.13", "a-torch2.13"):
        (tmp_path / name / RECORD_FILE).write_text("{}")
    assert recorded_folders(tmp_path) == [tmp_path / "a-torch2.13", tmp_path / "b-torch2.13"]
    assert recorded_folders(tmp_path / "missing") == []


@pytest.mark.slow
@pytest.mark.parametrize(("measured", "passed"), [(110, True), (111, False)])
def test_a_protocol_1_suite_failure_passes_only_when_the_workspace_explains_it(
    copy: Path, measured: int, passed: bool
) -> None:
    """A record made before workspaces were kept: a suite failure over by exactly the recorded
    workspace is what the protocol now moves out of the cost; any other excess still fails."""

    def old(record: dict[str, Any]) -> None:
        record.pop("protocol", None)
        record["figures"]["cublas_workspace"] = 10
        record["suite"] = {"failures": 1}
        record["checks"].append({"group": "suite", "name": "CUDA test suite", "passed": False})

    (copy / SUITE_LOG).write_text(f"E       AssertionError: assert {measured} == ((2 * 50) + 0)\n")
    (suite,) = [c for c in rejudge(edit(copy, old)) if c.group == "suite"]
    assert suite.passed is passed
    assert f"each over by [{measured - 100}]" in suite.detail
    current = edit(copy, lambda record: record.update(protocol=PROTOCOL))
    recorded = [Check.from_dict(c) for c in current.record["checks"]]
    assert rejudge(current) == recorded  # a record of the current protocol stands as recorded


# --------------------------------------------------------------------------- no machine's paths


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for entry in value.values() for text in _strings(entry)]
    if isinstance(value, (list, tuple)):
        return [text for entry in value for text in _strings(entry)]
    return []


#: An absolute path: a "/" that starts a word, followed by a folder name.
_ABSOLUTE = re.compile(r"(?:^|[\s'\"(=:])(/[A-Za-z_.][^\s'\"]*)")


@pytest.mark.parametrize("folder", RECORDED, ids=[folder.name for folder in RECORDED])
def test_a_committed_record_names_no_folder_of_the_machine_that_made_it(folder: Path) -> None:
    """The snapshot's stack frames and the suite log name files by placeholders
    (``<checkout>/tests/test_cuda.py``, ``<site-packages>/torch/...``), never the recording machine's paths."""
    texts = _strings(load_snapshot(folder / "snapshot.pickle")) if (folder / "snapshot.pickle").exists() else []
    if (folder / SUITE_LOG).exists():
        texts += (folder / SUITE_LOG).read_text(encoding="utf-8").splitlines()
    texts += (folder / RECORD_FILE).read_text(encoding="utf-8").splitlines()
    found = sorted({match for text in texts for match in _ABSOLUTE.findall(text)})
    assert texts and not found, found[:10]
    assert any(text.startswith("<checkout>/") for text in texts)  # the frames are still there, named


def test_scrub_paths_makes_this_machines_folders_placeholders_and_keeps_what_is_shared() -> None:
    site = sysconfig.get_paths()["purelib"]
    frame = {"filename": f"{site}/torch/nn/modules/module.py", "line": 1}
    frames = [frame, frame]
    value = {
        "frames": frames,
        "again": frames,
        "stdlib": f"{sysconfig.get_paths()['stdlib']}/contextlib.py",
        "tmp": f"{tempfile.gettempdir()}/gpu-validate-abc/junit.xml",
        "elsewhere": "/opt/some/.venv/lib/python3.12/site-packages/torch/x.py and /usr/lib/python3.12/os.py",
        "mine": str(Path(pytest_gpumem.__file__).resolve()),
        "count": 3,
    }
    clean = scrub_paths(value, {"/srv/checkout": "<checkout>"})
    assert clean["frames"][0]["filename"] == "<site-packages>/torch/nn/modules/module.py"
    assert clean["frames"] is clean["again"] and clean["frames"][0] is clean["frames"][1]  # a pickle stays small
    assert clean["stdlib"] == "<python>/contextlib.py"
    assert clean["tmp"] == "<tmp>/gpu-validate-abc/junit.xml"  # wherever TMPDIR points
    assert clean["elsewhere"] == "<site-packages>/torch/x.py and <python>/os.py"
    assert clean["mine"].startswith("<checkout>") and clean["mine"].endswith("pytest_gpumem/__init__.py")
    assert clean["count"] == 3 and scrub_paths("/srv/checkout/tests/t.py", {"/srv/checkout": "<checkout>"}) == (
        "<checkout>/tests/t.py"
    )
