"""False alarms of the default baseline tolerance: record baselines once, then judge N runs.

Three suites, each run in a fresh pytest session per round:

- ``demo``: the demo suite (``examples/``), as a user runs it;
- ``zoo``: one measured training step per zoo model (``pytest_gpumem/validate/zoo.py``: MLP, transformer
  block, GPT-2, Llama when ``transformers`` is installed) in fp32 and bf16;
- ``own``: the project's benchmark suite (``bench_overhead.py``'s 200 training-step tests,
  MLPs with AdamW or SGD with momentum).

Each suite records its baselines once (``--gpumem-update-baselines`` into a temporary file),
then runs ``--runs`` more times against them with the default tolerance. Every judged
figure that is not ``ok`` is a false alarm (the code did not change). The table gives, per
suite, the judged figures, the false alarms, and the largest difference from the baseline
seen in any figure (the tolerance a suite would need to stay quiet). Exits 1 on any alarm.

    python benchmarks/bench_false_alarms.py [--runs 3] [--suites demo zoo own] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]

ZOO_SUITE = textwrap.dedent(
    """
    import pytest

    from pytest_gpumem.validate.zoo import PRECISIONS, zoo

    MODELS = [model for model in zoo("small") if model.available]


    @pytest.mark.gpumem
    @pytest.mark.parametrize("precision", PRECISIONS)
    @pytest.mark.parametrize("model", MODELS, ids=lambda model: model.name)
    def test_zoo_step(gpumem, model, precision):
        step = model.build(gpumem.device, precision)
        gpumem.track(step.model, step.optimizer)
        gpumem.train_step(step.model, step.optimizer, step.batch, step.loss_fn, amp=step.amp)
    """
)


def suite_command(name: str, work: Path) -> tuple[list[str], Path]:
    """The pytest arguments of suite ``name`` and the folder it runs in."""
    if name == "demo":
        folder = work / "demo"
        shutil.copytree(ROOT / "examples", folder)
        return [str(folder)], folder
    if name == "zoo":
        folder = work / "zoo"
        folder.mkdir()
        (folder / "test_zoo.py").write_text(ZOO_SUITE)
        return [str(folder)], folder
    if name == "own":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_overhead import write_suite

        folder = work / "own"
        folder.mkdir()
        write_suite(folder, 200)
        return [str(folder)], folder
    raise SystemExit(f"unknown suite {name!r}: expected demo, zoo or own")


def run(args: list[str], cwd: Path, extra: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *extra]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def judge(report: Path) -> tuple[int, Counter[str], int, list[str]]:
    """Judged figures, statuses, the largest |cost − baseline| in bytes, and the alarms' lines."""
    data = json.loads(report.read_text())
    judged, largest, alarms = 0, 0, []
    statuses: Counter[str] = Counter()
    for test in data["tests"]:
        for finding in test["findings"]:
            if finding["kind"] != "baseline":
                continue
            judged += 1
            statuses[finding["status"]] += 1
            if finding["reference"] is not None and finding["measured"] is not None:
                largest = max(largest, abs(finding["measured"] - finding["reference"]))
            if finding["status"] != "ok":
                alarms.append(f"{test['nodeid']} {finding['span']} {finding['metric']}: {finding['status']}")
    return judged, statuses, largest, alarms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="judged runs after the recording one (default 3)")
    parser.add_argument("--suites", nargs="+", default=["demo", "zoo", "own"])
    parser.add_argument("--device", default="cpu", help="--gpumem-device of every run (default cpu)")
    args = parser.parse_args()
    rows, failed = [], False
    for name in args.suites:
        with tempfile.TemporaryDirectory(prefix=f"gpumem-alarms-{name}-") as tmp:
            work = Path(tmp)
            suite, cwd = suite_command(name, work)
            baselines = work / "baselines.json"
            common = [f"--gpumem-baselines={baselines}", f"--gpumem-device={args.device}"]
            started = time.perf_counter()
            recorded = run(suite, cwd, [*common, "--gpumem-update-baselines"])
            if recorded.returncode != 0:
                print(recorded.stdout[-3000:], recorded.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name}: the recording run failed (exit {recorded.returncode})")
            judged, largest, alarms = 0, 0, []
            for index in range(args.runs):
                report = work / f"report-{index}.json"
                result = run(suite, cwd, [*common, f"--gpumem-json={report}"])
                count, _, worst, lines = judge(report)
                judged, largest = judged + count, max(largest, worst)
                alarms += [f"run {index + 1}: {line}" for line in lines]
                if result.returncode not in (0, 1):
                    raise SystemExit(f"{name}: run {index + 1} ended with exit {result.returncode}")
            seconds = time.perf_counter() - started
            rows.append([name, args.runs, judged, len(alarms), f"{largest:,} B", f"{seconds:.0f} s"])
            for line in alarms:
                print(f"{name}: {line}")
            failed = failed or bool(alarms)
    headers = ["suite", "judged runs", "figures judged", "false alarms", "largest |Δ|", "time"]
    print(tabulate(rows, headers=headers, colalign=("left", "right", "right", "right", "right", "right")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
