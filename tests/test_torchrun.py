"""pytest launched by torchrun: every rank measures, rank 0 gathers the records and alone writes."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from conftest import OTHER_PLUGINS_OFF
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.plugin.torchrun import Launch, launch, merge, rank_span

TEST_FILE = """
import os
import pytest
import torch

@pytest.mark.gpumem(peak="1GiB")
def test_step():
    rank = int(os.environ["RANK"])
    if os.environ.get("DIE_ON_RANK") == str(rank):
        os._exit(3)
    grow = int(os.environ.get("GROW", "0")) * rank
    x = torch.zeros(1000 + grow)
    y = x * 2
"""


def test_launch_is_read_from_torchruns_environment() -> None:
    assert launch({}) is None
    assert launch({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) is None  # one rank: a plain run
    assert launch({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == Launch(1, 4, 1)
    with pytest.raises(ValueError, match=r"RANK='4', WORLD_SIZE='4', LOCAL_RANK='0'"):
        launch({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match=r"RANK='x'"):
        launch({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert rank_span("call", 1, 2) == "call@rank1-of-2"


def _record(nodeid: str, rank: int, *, passed: bool = True) -> dict[str, object]:
    from pytest_gpumem.data.figures import Measurement

    measurement = Measurement(name=rank_span("call", rank, 2), engine="cpu", device="cpu", start=0, peak=8, allocated=8)
    env = {"engine": "cpu", "torch_version": "2.13", "cuda_rounding": False}
    return TestRecord(nodeid, measurements=[measurement], environment=env, passed=passed).to_dict()


def test_merge_puts_the_ranks_spans_side_by_side_and_records_only_complete_tests() -> None:
    merged = merge([[_record("t::a", 0), _record("t::b", 0)], [_record("t::a", 1), _record("t::b", 1, passed=False)]])
    assert [m.name for m in merged["t::a"].measurements] == ["call@rank0-of-2", "call@rank1-of-2"]
    assert merged["t::a"].recordable
    assert not merged["t::b"].recordable  # a baseline is never replaced by part of the ranks' figures
    only_rank0 = merge([[_record("t::c", 0)], []])
    assert only_rank0["t::c"].errors == ["measured on 1 of 2 ranks: not recorded"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _torchrun(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={_free_port()}",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *OTHER_PLUGINS_OFF,
        "test_ranked.py",
        *args,
        timeout=300,
    )


@pytest.mark.slow
def test_rank_zero_writes_every_ranks_baselines_and_a_rank_is_judged_by_its_own(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_ranked=TEST_FILE)
    assert _torchrun(pytester, "--gpumem-update-baselines").ret == 0
    path = pytester.path / "gpumem-baselines.json"
    first = path.read_bytes()
    (environment,) = json.loads(first)["environments"].values()
    spans = environment["tests"]["test_ranked.py::test_step"]["spans"]
    assert sorted(spans) == ["call@rank0-of-2", "call@rank1-of-2"]
    assert spans["call@rank1-of-2"]["peak"] == 8000
    # the same figures again: the same bytes, whichever rank finished first
    assert _torchrun(pytester, "--gpumem-update-baselines").ret == 0
    assert path.read_bytes() == first
    # rank 1 allocates 8 MB more (x and y): it fails, rank 0 passes, the run fails, the file is kept
    monkeypatch.setenv("GROW", "1000000")
    result = _torchrun(pytester)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*[[]call@rank1-of-2[]] peak cost 7.64 MiB regressed from baseline 7.81 KiB*"])
    assert path.read_bytes() == first


@pytest.mark.slow
def test_a_rank_that_dies_leaves_the_baseline_file_unwritten(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_ranked=TEST_FILE)
    monkeypatch.setenv("DIE_ON_RANK", "1")
    result = _torchrun(pytester, "--gpumem-update-baselines")
    assert result.ret != 0
    assert not (pytester.path / "gpumem-baselines.json").exists()
