"""``tests/_warm_sessions.py``: a session forked from the zygote starts and ends as a session in
a new interpreter does, and nothing one session did is seen by the next."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._warm_sessions import _zygotes, runpytest_warm

SESSION = """
import atexit, os, sys, threading, time
from pathlib import Path

import torch

SEEN = Path(os.environ["SEEN"])
FIRST = not SEEN.exists()


def test_a_new_process_as_python_m_pytest_starts_it():
    import _warm_marker  # a module the previous session imported: a new process has not
    assert _warm_marker.count == 1, "a module imported by an earlier session is still imported"
    assert os.getcwd() == os.environ["EXPECTED_CWD"] == sys.path[0]
    assert os.environ["ONLY_THIS_TEST"] == "yes"
    assert torch.ones(2).sum().item() == 2.0  # torch works after the fork (its thread pool starts now)


def test_it_ends_as_an_interpreter_does():
    def later():
        time.sleep(0.2)
        SEEN.with_name("thread").write_text("joined")

    threading.Thread(target=later).start()  # not a daemon: the process waits for it
    atexit.register(lambda: SEEN.with_name("atexit").write_text("ran"))
    SEEN.write_text("seen")
    assert FIRST, "the second session fails on purpose"
"""


@pytest.mark.slow
def test_a_warm_session_starts_fresh_and_ends_as_an_interpreter_does(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytester.makepyfile(test_session=SESSION)
    pytester.makepyfile(_warm_marker="count = 0\ncount += 1\n")
    monkeypatch.setenv("SEEN", str(tmp_path / "seen"))
    monkeypatch.setenv("EXPECTED_CWD", str(pytester.path))
    monkeypatch.setenv("ONLY_THIS_TEST", "yes")

    first = runpytest_warm(pytester, "-p", "no:randomly", "-p", "no:cacheprovider")
    first.assert_outcomes(passed=2)
    zygote = _zygotes[os.getpid()].process.pid
    if Path("/proc").is_dir():  # it forks: it must run one thread (importing torch starts none)
        assert len(os.listdir(f"/proc/{zygote}/task")) == 1
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert first.stderr.str() == ""

    (tmp_path / "thread").unlink()
    second = runpytest_warm(pytester, "-p", "no:randomly", "-p", "no:cacheprovider")
    second.assert_outcomes(passed=1, failed=1)
    assert second.ret == pytest.ExitCode.TESTS_FAILED
    assert "the second session fails on purpose" in second.stdout.str()
    assert (tmp_path / "thread").read_text() == "joined"

    # the zygote imported the installed plugins, not this project's: a session that blocks it has none of it
    pytester.makepyfile(test_blocked="import sys\n\ndef test_none():\n    assert 'pytest_gpumem' not in sys.modules\n")
    blocked = runpytest_warm(pytester, "-p", "no:gpumem", "-p", "no:cacheprovider", "test_blocked.py")
    blocked.assert_outcomes(passed=1)

    usage = runpytest_warm(pytester, "--no-such-option")
    assert usage.ret == pytest.ExitCode.USAGE_ERROR
    assert "unrecognized arguments: --no-such-option" in usage.stderr.str()


@pytest.mark.slow
def test_a_variable_torch_may_read_at_import_starts_another_zygote(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote imported torch in the environment it was started in: a session asked for in
    another one (but for the variables pytester sets each test) gets a zygote started in it."""
    pytester.makepyfile(
        test_env="""
        import os, torch

        def test_threads():
            assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
        """
    )
    for threads in ("1", "2"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        runpytest_warm(pytester, "-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert os.environ["OMP_NUM_THREADS"] == "2"
