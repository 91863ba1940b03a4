"""Distributed runs name every rank and leave no process behind.

Under ``torchrun -m pytest`` each rank's limits and verdicts are shown and written under the
rank's own span name, in every report and at every terminal width. ``gpumem.distributed``
(``run_ranks``) leaves no process alive after the test: not when a rank is stopped at the
timeout (its own subprocesses neither), not when pytest itself is terminated.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import OTHER_PLUGINS_OFF
from pytest_gpumem import DistributedError, RankContext, run_ranks
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import Limit, Tolerance
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.judge.verdict import check_limits
from pytest_gpumem.plugin.torchrun import Launch, rank_span, rename
from pytest_gpumem.report.artifacts import write_artifacts
from pytest_gpumem.report.details import failure_text, measurement_table
from pytest_gpumem.report.text import summary_rows, terminal_summary

# --------------------------------------------------------------------------- processes (Linux /proc)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for a reaper that may never come)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _descendants(root: int) -> set[int]:
    """Every live process below ``root``, by the parent ids in /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _local_rank(pid: int) -> str | None:
    """``LOCAL_RANK`` in the environment of process ``pid``; None when it has none (or is gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        name, _, value = entry.partition(b"=")
        if name == b"LOCAL_RANK":
            return value.decode()
    return None


def _wait_gone(pids: set[int], seconds: float) -> set[int]:
    """The processes of ``pids`` still alive after at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return set()
        time.sleep(0.05)
    return {pid for pid in pids if _alive(pid)}


def _kill(pids: set[int]) -> None:
    """Clean up after a failing check: only the processes this test started."""
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait_for_files(folder: Path, count: int, seconds: float) -> list[Path]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        files = sorted(folder.glob("rank*"))
        if len(files) == count and all(f.read_text().endswith("\n") for f in files):
            return files
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not start in {seconds} s: {sorted(folder.iterdir())}")


def _pids_written(files: list[Path]) -> set[int]:
    return {int(pid) for f in files for pid in f.read_text().split()}


def rank_with_a_child(rank: int, ctx: RankContext) -> None:
    """A rank that starts a subprocess of its own, writes both pids, then sleeps past any timeout."""
    child = subprocess.Popen(["sleep", "1000"])
    folder = Path(os.environ["GPUMEM_TEST_PIDS"])
    (folder / f"rank{rank}").write_text(f"{os.getpid()} {child.pid}\n")
    time.sleep(1000)


def _written(folder: Path) -> list[Path]:
    """The pid files the ranks wrote whole (a rank stopped while writing its own wrote none)."""
    return [f for f in sorted(folder.glob("rank*")) if f.read_text().endswith("\n")]


def rank_leaves_a_child(rank: int, ctx: RankContext) -> None:
    """A rank that finishes, leaving a subprocess of its own running."""
    child = subprocess.Popen(["sleep", "1000"])
    (Path(os.environ["GPUMEM_TEST_PIDS"]) / f"rank{rank}").write_text(f"{child.pid}\n")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_what_a_finished_rank_left_running_ends_with_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMEM_TEST_PIDS", str(tmp_path))
    assert len(run_ranks(rank_leaves_a_child, 2, timeout=600)) == 2
    children = _pids_written(_written(tmp_path))  # written before the ranks reported
    assert len(children) == 2
    left = _wait_gone(children, 60)  # returns as soon as they are gone
    _kill(left)
    assert left == set()


# Below the test above: in file order its ranks have started this process's gloo server, and this test's
# first, short timeout finds it warm.
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_stopped_at_the_timeout_takes_its_subprocesses_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ranks start a subprocess, then sleep past the timeout. On a loaded machine the ranks may
    not even start before a short timeout: the run is tried again with a longer one until both
    had started (the event the check needs), never asserting how fast a machine is."""
    handler = signal.getsignal(signal.SIGTERM)
    for timeout in (5, 15, 60, 240, 480):
        folder = tmp_path / f"timeout-{timeout}"
        folder.mkdir()
        monkeypatch.setenv("GPUMEM_TEST_PIDS", str(folder))
        with pytest.raises(DistributedError, match=f"did not finish within {timeout} s"):
            run_ranks(rank_with_a_child, 2, timeout=timeout)
        files = _written(folder)
        pids = _pids_written(files)
        if len(files) == 2:
            break
        _kill(_wait_gone(pids, 60))  # a rank that started too late: stopped all the same
    else:
        pytest.fail("the ranks did not start within 480 s, four times")
    assert len(pids) == 4  # two ranks, a `sleep` each
    left = _wait_gone(pids, 60)  # returns as soon as they are gone
    _kill(left)
    assert left == set()
    assert signal.getsignal(signal.SIGTERM) == handler  # the handler of the run is gone with it
    assert multiprocessing.active_children() == []


#: The conftest of a pytest that a test stops from outside: every thread's stack on SIGUSR1,
#: into a file of its own (pytest captures the standard streams).
STACKS_ON_SIGUSR1 = """
import faulthandler, signal
STACKS = open("stacks.txt", "w")
faulthandler.register(signal.SIGUSR1, file=STACKS, all_threads=True)
"""


QUIET_ADDOPTS = " ".join(("-p", "no:cacheprovider", *OTHER_PLUGINS_OFF))


def _interruptible_child() -> None:
    """Give a child the default SIGINT: a shell runs a background job (CI's script, say) with
    SIGINT ignored, children inherit that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


SLEEPING_RANKS = """
import os
import subprocess
import time
from pathlib import Path

import pytest


def ranks_sleep(rank, ctx):
    child = subprocess.Popen(["sleep", "1000"])
    folder = Path(os.environ["GPUMEM_TEST_PIDS"])
    (folder / f"rank{rank}").write_text(f"{os.getpid()} {child.pid}\\n")
    time.sleep(1000)


@pytest.mark.gpumem(device="cpu")
def test_ranks_sleep(gpumem):
    gpumem.distributed(ranks_sleep, world_size=2, timeout=600)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("how", "status"),
    [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL), (signal.SIGINT, 2)],
    ids=["SIGTERM", "SIGKILL", "SIGINT"],
)
def test_no_process_outlives_a_pytest_that_is_stopped_while_ranks_run(
    tmp_path: Path, how: signal.Signals, status: int
) -> None:
    """pytest stopped from outside while its ranks run: the ranks, their own subprocesses and
    multiprocessing's resource tracker all end within seconds (SIGKILL: no handler can run in
    pytest; the ranks notice their parent is gone. SIGINT, to pytest alone: the ranks are in
    groups of their own, pytest stops them)."""
    (tmp_path / "test_sleeping.py").write_text(SLEEPING_RANKS)
    (tmp_path / "conftest.py").write_text(STACKS_ON_SIGUSR1)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    env = {**os.environ, "GPUMEM_TEST_PIDS": str(pids_dir), "PYTEST_ADDOPTS": QUIET_ADDOPTS}
    output = tmp_path / "output.txt"
    with output.open("w") as out:
        pytest_process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "test_sleeping.py", "-q"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_interruptible_child,
        )
    started: set[int] = set()
    try:
        files = _wait_for_files(pids_dir, 2, 600)  # returns as soon as both wrote
        started = _descendants(pytest_process.pid)
        assert _pids_written(files) <= started  # the ranks and their `sleep`s, with the resource tracker
        assert len(started) >= 5
        os.kill(pytest_process.pid, how)
        try:
            pytest_process.wait(300)  # a hang, not a speed: it returns as soon as pytest has ended
        except subprocess.TimeoutExpired:  # say where it is stuck: every thread's stack, and its output
            os.kill(pytest_process.pid, signal.SIGUSR1)
            time.sleep(2)
            stacks = (tmp_path / "stacks.txt").read_text(errors="replace")
            processes = {pid: _command(pid) for pid in _descendants(pytest_process.pid)}
            pytest.fail(
                f"pytest did not end within 300 s of {how.name}; its processes: {processes}\n"
                f"its threads:\n{stacks}\nits output:\n{output.read_text(errors='replace')[-4000:]}"
            )
        left = _wait_gone(started, 120)  # returns as soon as they are gone
        assert pytest_process.returncode == status  # pytest still ends as the signal ends it
    finally:
        if pytest_process.poll() is None:
            pytest_process.kill()
            pytest_process.wait()
        _kill(_descendants(pytest_process.pid) | started)
    assert left == set()


# --------------------------------------------------------------------------- rank spans in the reports


def _rank_record(nodeid: str, peak: int, limit: int, where: Launch) -> TestRecord:
    """A record as a rank's pytest makes it, before it is renamed for the rank."""
    call = Measurement(name="call", engine="cpu", device="cpu", start=0, peak=peak, allocated=peak)
    findings = check_limits(nodeid, call, [Limit("peak", limit, f"{limit}B")])
    tolerances = {"call": Tolerance(0.0, 0).to_dict()}
    record = TestRecord(nodeid, [call], findings, environment={"engine": "cpu"}, tolerances=tolerances)
    return rename(record, where)


def test_a_ranks_limit_findings_are_named_for_its_span() -> None:
    record = _rank_record("t.py::test_over", 4000, 1024, Launch(1, 2, 1))
    assert [m.name for m in record.measurements] == ["call@rank1-of-2"]
    assert [(f.span, f.status) for f in record.findings] == [("call@rank1-of-2", "exceeded")]
    assert failure_text(record).startswith("[call@rank1-of-2] peak cost 3.91 KiB exceeds the limit 1.00 KiB")


def test_the_markers_tolerance_still_covers_every_span_of_a_rank() -> None:
    call = Measurement(name="call", engine="cpu", device="cpu", start=0, peak=8, allocated=8)
    forward = Measurement(name="forward", engine="cpu", device="cpu", start=0, peak=8, allocated=8)
    tolerances = {"call": Tolerance(0.0, 0).to_dict(), "backward": Tolerance(0.5, 0).to_dict()}
    record = rename(TestRecord("t.py::test_step", measurements=[call, forward], tolerances=tolerances), Launch(0, 2, 0))
    assert record.tolerance("call@rank0-of-2") == Tolerance(0.0, 0)
    assert record.tolerance("forward@rank0-of-2") == Tolerance(0.0, 0)  # the marker's, as without torchrun
    assert record.tolerance("backward@rank0-of-2") == Tolerance(0.5, 0)


def _both_ranks() -> list[TestRecord]:
    over = [_rank_record("test_ranked.py::test_over", 4000, 1024, Launch(r, 2, r)) for r in range(2)]
    within = [_rank_record("test_ranked.py::test_within", 4000, 1 << 30, Launch(r, 2, r)) for r in range(2)]
    merged = []
    for records in (over, within):
        first, second = records
        both = first.measurements + second.measurements
        merged.append(replace(first, measurements=both, findings=first.findings + second.findings))
    return merged


def test_the_summary_shows_each_ranks_limit_and_status() -> None:
    rows = summary_rows(_both_ranks())
    peaks = [(row[0], row[1], row[5], row[-1]) for row in rows if row[2] == "peak"]
    assert peaks == [
        ("test_ranked.py::test_over", "call@rank0-of-2", "1.00 KiB", "exceeded"),
        ("test_ranked.py::test_over", "call@rank1-of-2", "1.00 KiB", "exceeded"),
        ("test_ranked.py::test_within", "call@rank0-of-2", "1.00 GiB", "ok"),
        ("test_ranked.py::test_within", "call@rank1-of-2", "1.00 GiB", "ok"),
    ]


@pytest.mark.parametrize("width", [200, 80, 60, 44, 30])
def test_the_rank_of_a_span_stays_visible_at_any_width(width: int) -> None:
    lines = terminal_summary(_both_ranks(), width=width)
    assert lines is not None
    for line in lines.splitlines():
        assert len(line) <= width
    for rank in (0, 1):
        assert sum(f"@rank{rank}-of-2" in line for line in lines.splitlines()) == 4  # two tests, peak and allocated
    figures = measurement_table(_both_ranks()[0].measurements, width=width)
    assert all(len(line) <= width for line in figures.splitlines())
    assert [line.split()[0][-11:] for line in figures.splitlines() if "@rank" in line] == [
        "@rank0-of-2",
        "@rank0-of-2",
        "@rank1-of-2",
        "@rank1-of-2",
    ]


@pytest.mark.parametrize("width", [80, 60, 40, 30])
@pytest.mark.parametrize("torchrun", ["", "@rank1-of-2"])
def test_the_ranks_of_gpumem_distributed_stay_visible_at_any_width(width: int, torchrun: str) -> None:
    """``gpumem.distributed``'s rank spans (``rank0-of-8``) under a long test id, also in a
    torchrun launch (``rank0-of-8@rank1-of-2``)."""
    spans = [
        Measurement(name=f"rank{r}-of-8{torchrun}", engine="cpu", device="cpu", start=0, peak=4000 * r, allocated=0)
        for r in range(8)
    ]
    nodeid = "tests/distributed/test_sharding_layouts.py::test_fsdp_keeps_a_shard[fp32-8-ranks]"
    record = TestRecord(nodeid, measurements=spans, environment={"engine": "cpu"})
    text = terminal_summary([record], width=width)
    assert text is not None
    for r in range(8):
        assert f"rank{r}-of-8{torchrun}" in text
    figures = measurement_table(spans, width=width)
    for r in range(8):
        assert f"rank{r}-of-8{torchrun}" in figures


def test_each_rank_draws_its_limits_in_an_html_artifact_of_its_own(tmp_path: Path) -> None:
    pages = []
    for rank in range(2):
        record = _rank_record("test_ranked.py::test_over", 4000, 1024, Launch(rank, 2, rank))
        (path,) = write_artifacts(record, tmp_path)
        pages.append(Path(path))
    assert pages[0] != pages[1]  # not one file that the ranks overwrite
    for rank, page in enumerate(pages):
        html = page.read_text(encoding="utf-8")
        assert f"span <b>call@rank{rank}-of-2</b>" in html
        assert 'data-line="limit peak" data-bytes="1024"' in html


# --------------------------------------------------------------------------- torchrun -m pytest

TORCHRUN_FILE = """
import pytest
import torch


@pytest.mark.gpumem(peak="1KiB")
def test_over():
    x = torch.zeros(1000)


@pytest.mark.gpumem(peak="1GiB")
def test_within():
    x = torch.zeros(1000)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_torchrun_names_each_ranks_limit_in_the_summary_and_the_json(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_ranked=TORCHRUN_FILE)
    monkeypatch.setenv("COLUMNS", "80")
    result = pytester.run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={_free_port()}",
        "--redirects=3",  # each rank's output in a file of its own: rank 0's summary whole
        "--log-dir=logs",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *OTHER_PLUGINS_OFF,
        "test_ranked.py",
        "--gpumem-json=report.json",
        "--gpumem-markdown=report.md",
        timeout=300,
    )
    assert result.ret != 0
    (rank0,) = pytester.path.glob("logs/*/attempt_0/0/stdout.log")
    summary = rank0.read_text(encoding="utf-8").split("= gpumem =")[-1].split("= short test summary info =")[0]
    # 80 columns: the test ids above their rows, every rank's row with its limit and status
    assert [line.split() for line in summary.splitlines() if " peak " in line] == [
        ["call@rank0-of-2", "peak", "3.91", "KiB", "3.91", "KiB", "1.00", "KiB", "exceeded"],
        ["call@rank1-of-2", "peak", "3.91", "KiB", "3.91", "KiB", "1.00", "KiB", "exceeded"],
        ["call@rank0-of-2", "peak", "3.91", "KiB", "3.91", "KiB", "1.00", "GiB", "new"],
        ["call@rank1-of-2", "peak", "3.91", "KiB", "3.91", "KiB", "1.00", "GiB", "new"],
    ]
    markdown = (pytester.path / "report.md").read_text(encoding="utf-8")
    for rank in (0, 1):
        assert (
            f"| test_ranked.py::test_over | call@rank{rank}-of-2 | peak | 3.91 KiB | 3.91 KiB | 1.00 KiB |" in markdown
        )
    assert "unchecked" not in summary
    assert all(len(line) <= 80 for line in summary.splitlines())
    data = json.loads((pytester.path / "report.json").read_text(encoding="utf-8"))
    limits = {
        (test["nodeid"].split("::")[1], finding["span"]): finding["status"]
        for test in data["tests"]
        for finding in test["findings"]
        if finding["kind"] == "limit"
    }
    assert limits == {
        ("test_over", rank_span("call", 0, 2)): "exceeded",
        ("test_over", rank_span("call", 1, 2)): "exceeded",
        ("test_within", rank_span("call", 0, 2)): "ok",
        ("test_within", rank_span("call", 1, 2)): "ok",
    }
    assert torch.distributed.is_available()


def rank_one_is_killed(rank: int, ctx: RankContext) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    torch.distributed.barrier()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_a_rank_killed_by_a_signal_is_reported_by_the_signals_name() -> None:
    with pytest.raises(DistributedError) as caught:
        run_ranks(rank_one_is_killed, 2, timeout=60)
    assert caught.value.reports[1] == (
        "rank 1 was killed by SIGKILL (signal 9) before reporting "
        "(SIGKILL: often the system's out-of-memory killer; see the kernel log, `dmesg`)"
    )
    assert multiprocessing.active_children() == []


RANK_ONE_IS_LATE = """
import os
import time
from pathlib import Path

import pytest
import torch


@pytest.mark.gpumem(peak="1GiB")
def test_step():
    if os.environ["RANK"] == "1":  # late until the test lets it go (or ten minutes)
        deadline = time.monotonic() + 600
        while not Path("rank0-gone").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    x = torch.zeros(1000)
"""

#: Says when a rank's session is in the gather: a file written as the plugin calls it (inside the
#: plugin's own handling of Ctrl-C, so a Ctrl-C just after the file is the same Ctrl-C).
GATHERING = """
import os

import pytest_gpumem.plugin.torchrun as torchrun

_gather = torchrun.gather_records


def gather_records(*args, **kwargs):
    open(f"gathering{os.environ['RANK']}", "w").close()
    return _gather(*args, **kwargs)


torchrun.gather_records = gather_records
"""


def _wait_until(done: Callable[[], bool], seconds: float) -> bool:
    """Wait for an event: ``done()`` true; False after ``seconds`` (a hang, never a speed)."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's redirects, /proc")
def test_ctrl_c_while_rank_zero_waits_for_the_others_ends_it_at_once_and_cleanly(tmp_path: Path) -> None:
    """Rank 0 is done and waits in the gather for rank 1 (held back until rank 0 has ended): Ctrl-C
    ends it with a line that says what was not written, no traceback, pytest's exit status 2."""
    (tmp_path / "test_late.py").write_text(RANK_ONE_IS_LATE)
    (tmp_path / "conftest.py").write_text(GATHERING)
    # the suite's other plugins stay loaded here: rank 0's interrupted exit is checked as users meet it
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTEST_ADDOPTS": "-p no:randomly -p no:cacheprovider"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}"]
    command += ["--redirects=3", "--log-dir=logs", "-m", "pytest", "test_late.py", "--gpumem-update-baselines"]
    with open(tmp_path / "torchrun.log", "wb") as log:
        launcher = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=_interruptible_child,
        )
    try:
        assert _wait_until(lambda: (tmp_path / "gathering0").exists(), 600), (tmp_path / "torchrun.log").read_text()
        (out,) = tmp_path.glob("logs/*/attempt_0/0/stdout.log")
        err = out.with_name("stderr.log")
        (rank0,) = (pid for pid in _descendants(launcher.pid) if _local_rank(pid) == "0")
        os.kill(rank0, signal.SIGINT)  # one Ctrl-C, while rank 1 has not even finished its test
        assert _wait_until(lambda: not _alive(rank0), 300), "rank 0 did not end after Ctrl-C"
        assert not (tmp_path / "gathering1").exists()  # it ended on its own, not when rank 1 arrived
        (tmp_path / "rank0-gone").touch()
        launcher.wait(300)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    output = out.read_text() + err.read_text()
    assert (
        "gpumem: interrupted while gathering the ranks' records: the baseline file and the reports were not written"
        in output
    )
    assert "Traceback" not in output and "INTERNALERROR" not in output
    assert not (tmp_path / "gpumem-baselines.json").exists()
    assert f"exitcode  : 2 (pid: {rank0})" in (tmp_path / "torchrun.log").read_text()  # pytest's "interrupted"
