"""The differential check of "measure without disturbing": a corpus of user-style tests
(``fixtures/corpus``: copies, checkpoints, EMA and SWA, torch.func, saved-tensor hooks,
checkpointing, a user's dispatch mode and tensor subclass, hooks, torch.compile, the garbage
collector's view, unittest, xfail, skip, fixtures that fail, a per-test timeout, async tests,
threads, DataLoader workers, two gloo ranks, and tests that fail on memory) runs in fresh
interpreters with the plugin off (``-p no:gpumem``), with every test marked, and with every
test using the ``gpumem`` fixture (tracking its models). Each test's outcome and the facts it
records must be the same in the three runs, but for the memory verdicts the corpus asks for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fixtures" / "corpus"

#: the verdicts the corpus asks for: (outcome without the plugin, outcome with it)
VERDICTS = {
    "test_memory_verdicts.py::test_over_its_limit": ("passed", "failed"),
    "test_memory_verdicts.py::test_over_its_limit_and_skips_when_run_again": ("passed", "failed"),
    "test_memory_verdicts.py::test_xfail_over_its_limit": ("xpassed", "xfailed"),
}


def _run(folder: Path, mode: str) -> dict[str, dict[str, object]]:
    results = folder / f"results-{mode}.json"
    env = {
        **os.environ,
        "CORPUS_MODE": mode,
        "CORPUS_RESULTS": str(results),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTEST_GPUMEM_DEVICE": "",
    }
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q"]
    args += ["-p", "no:gpumem"] if mode == "off" else ["--gpumem-device=cpu"]
    done = subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert "INTERNALERROR" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert results.is_file(), done.stdout + done.stderr
    return json.loads(results.read_text())  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_users_suite_behaves_the_same_with_the_plugin_on(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    shutil.copytree(CORPUS, folder)
    off = _run(folder, "off")
    assert len(off) >= 35 and set(VERDICTS) <= set(off)
    for mode in ("marked", "fixture"):
        on = _run(folder, mode)
        assert sorted(on) == sorted(off), mode
        differences = []
        for nodeid, without in off.items():
            expected = dict(without)
            if nodeid in VERDICTS:
                assert without["outcome"] == VERDICTS[nodeid][0], (nodeid, without)
                expected["outcome"] = VERDICTS[nodeid][1]
            if on[nodeid] != expected:
                differences.append(f"{nodeid}: {without} without the plugin, {on[nodeid]} {mode}")
        assert not differences, "\n".join(differences)
