"""CPU and fake ranks started warm: forked from a server that imported what every rank imports
(``pytest_gpumem.diagnose.warm_ranks``), not spawned as new interpreters.

The figures are the spawned ranks' (``tests/test_fake_ranks.py`` compares fake ranks with the
recorded real ranks, CI's ``--real-ranks`` run compares real ranks with the same file); these
tests check what else could differ: the modules a rank has imported when its function starts,
the environment it sees, which server forks it, and that no server outlives its process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from rank_steps import PROCESS_REPORTS, describes_its_process

from pytest_gpumem import run_ranks
from pytest_gpumem.diagnose import warm_ranks
from pytest_gpumem.diagnose.distributed import RANK_START

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks start warm on Linux")

FAKE = {"predict": "h100", "fake": True}
#: multiprocessing's forkserver client and this package's server code, in a warm rank only
WARM_ONLY = {"multiprocessing.forkserver", "multiprocessing.popen_forkserver", "pytest_gpumem.diagnose.warm_ranks"}


def _reports(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("rank*.json"))]


@pytest.fixture
def reports(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder the ranks report to, the same in every test of this process."""
    folder = tmp_path_factory.getbasetemp() / "rank-reports"
    folder.mkdir(exist_ok=True)
    monkeypatch.setenv(PROCESS_REPORTS, str(folder))
    monkeypatch.setenv(RANK_START, "warm")
    return folder


def _run(folder: Path, world_size: int, **kwargs: Any) -> list[dict[str, Any]]:
    """Run :func:`describes_its_process` on ``world_size`` ranks reporting to ``folder``; their reports."""
    for old in folder.glob("rank*.json"):
        old.unlink()
    run_ranks(describes_its_process, world_size, **kwargs)
    return _reports(folder)


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, FAKE], ids=["gloo", "fake"])
def test_a_warm_rank_has_imported_what_a_spawned_rank_has_and_neither_sees_a_gpu(
    kwargs: dict[str, Any], reports: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the rank's function starts, a warm rank process has imported the modules a spawned
    one has, and no other but the fork server's client; it is the server's child, not pytest's.
    Started either way, CPU and fake ranks run as on a machine without a GPU, also on one with a
    GPU: no device is visible to them, so code that picks the accelerator by itself (FSDP2's
    default mesh) picks the CPU and their figures are those of CPU-only CI. The GPU check runs
    this where CUDA is present."""
    monkeypatch.setenv(RANK_START, "spawn")
    spawned = _run(reports, 2, **kwargs)
    monkeypatch.setenv(RANK_START, "warm")
    warm = _run(reports, 2, **kwargs)
    kind = "fake" if kwargs else "gloo"
    server = warm_ranks.server_pid(kind)
    assert [r["parent"] for r in spawned] == [os.getpid()] * len(spawned)
    assert {r["parent"] for r in warm} == {server}
    for before, after in zip(spawned, warm, strict=True):
        assert set(after["modules"]) - set(before["modules"]) == WARM_ONLY
        assert set(before["modules"]) - set(after["modules"]) <= {"multiprocessing.popen_spawn_posix"}
    assert [(r["visible_gpus"], r["cuda"], r["accelerator"]) for r in spawned + warm] == [("", False, "cpu")] * 4


@pytest.mark.slow
def test_a_server_runs_one_thread_and_imports_only(reports: Path) -> None:
    """Forking is safe from a process that has run no torch operator and whose threads are
    stopped at a fork: the server imports and waits (multiprocessing's server loop), nothing else.
    With this suite's ``OMP_NUM_THREADS=1`` it has one thread (otherwise numpy's OpenBLAS keeps an
    idle pool, which OpenBLAS's fork handler stops before each fork)."""
    _run(reports, 1, **FAKE)
    server = warm_ranks.server_pid("fake")
    assert [task.name for task in Path(f"/proc/{server}/task").iterdir()] == [str(server)]


def test_a_bad_start_method_is_an_error_that_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANK_START, "fork")
    with pytest.raises(ValueError, match=r"PYTEST_GPUMEM_RANK_START must be 'warm' or 'spawn', got 'fork'"):
        run_ranks(describes_its_process, 1, **FAKE)


@pytest.mark.slow
def test_no_server_outlives_its_process_and_its_cpu_time_is_the_processs(tmp_path: Path) -> None:
    """A process that ran warm ranks waits, as it ends, for its servers: they are gone when it is,
    and their CPU time (importing torch) counts among its children's, as a spawned rank's would."""
    code = textwrap.dedent(
        f"""
        import atexit, os, resource, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})

        def last():  # registered first: runs after the package's own exit handlers
            used = resource.getrusage(resource.RUSAGE_CHILDREN)
            print(os.path.exists(f"/proc/{{server}}"), used.ru_utime + used.ru_stime > 1.0)

        atexit.register(last)
        from rank_steps import describes_its_process
        from pytest_gpumem import run_ranks
        from pytest_gpumem.diagnose.warm_ranks import server_pid

        run_ranks(describes_its_process, 1, predict="h100", fake=True)
        server = server_pid("fake")
        print(server is not None)
        """
    )
    env = {**os.environ, PROCESS_REPORTS: str(tmp_path), RANK_START: "warm"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "True"]


def _in_a_forked_child(folder: str) -> None:
    os.environ[PROCESS_REPORTS] = folder
    run_ranks(describes_its_process, 1, **FAKE)
    (Path(folder) / "server").write_text(str(warm_ranks.server_pid("fake")), encoding="utf-8")


@pytest.mark.slow
def test_a_process_forked_after_warm_ranks_ran_starts_its_own_server(reports: Path, tmp_path: Path) -> None:
    """A process forked from one whose ranks ran warm (a data loader worker, say) does not ask
    its parent's server, which is not its child: it starts its own."""
    import multiprocessing

    _run(reports, 1, **FAKE)
    parents = warm_ranks.server_pid("fake")
    child = multiprocessing.get_context("fork").Process(target=_in_a_forked_child, args=(str(tmp_path / "child"),))
    (tmp_path / "child").mkdir()
    child.start()
    child.join(300)
    assert child.exitcode == 0
    own = int((tmp_path / "child" / "server").read_text(encoding="utf-8"))
    assert own != parents
    assert _reports(tmp_path / "child")[0]["parent"] == own
    assert warm_ranks.server_pid("fake") == parents


# Last in the file: its last run starts a server for another environment, which the tests above would not reuse.
@pytest.mark.slow
def test_a_server_is_kept_while_the_environment_is_and_its_ranks_see_the_runs_environment(
    reports: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later run whose variables read at import (torch's, OpenMP's, the interpreter's) are the
    same is forked by the same server, and its rank sees the environment of its own run (here the
    test pytest says it is running, and a variable of the test's own); a run with another value
    of one of those variables gets a new server, and the old one is stopped."""
    now, home = os.environ["PYTEST_CURRENT_TEST"], os.environ.get("HOME")
    first = _run(reports, 1, **FAKE)
    server = warm_ranks.server_pid("fake")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/elsewhere.py::test_other (call)")
    monkeypatch.setenv("HOME", str(reports))
    monkeypatch.setenv("GPUMEM_TEST_ANOTHER_VARIABLE", "1")
    second = _run(reports, 1, **FAKE)
    assert warm_ranks.server_pid("fake") == server
    assert [first[0]["test"], second[0]["test"]] == [now, "tests/elsewhere.py::test_other (call)"]
    assert first[0]["parent"] == second[0]["parent"] == server
    assert [first[0]["home"], second[0]["home"]] == [home, str(reports)]
    monkeypatch.setenv("TORCH_GPUMEM_TEST_ANOTHER_ENVIRONMENT", "1")
    third = _run(reports, 1, **FAKE)
    assert warm_ranks.server_pid("fake") not in (None, server)
    assert third[0]["parent"] == warm_ranks.server_pid("fake")
    assert not Path(f"/proc/{server}").exists()  # stopped, and waited for
