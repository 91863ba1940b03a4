"""Time the baseline file at scale: load, compare, record and atomic save.

Run: ``python benchmarks/bench_baselines.py [N ...]`` (default 1,000, 10,000 and
100,000 test entries). Each test has a ``call`` span and one named span, both
with a breakdown, in one environment. The phases are those of a real session:

* load: read and validate the file (``baselines.load``);
* compare: for every test and span, look the baseline up and compare the
  measurement's costs (``BaselineStore.entry`` + ``verdict.compare_baseline``);
* record: store every measurement again (``--gpumem-update-baselines``);
* save: serialise and write atomically (``baselines.save``).

Target: 1,000 entries (a large real suite) in under 0.2 s in total, less than
pytest itself takes to start; 10,000 in under 2 s. The save writes with the json
module (about 40 ms of the 1,000-entry total on a 2-core VM), and happens only
when baselines are recorded. Each size runs ``--repeat`` times (default 3) and the
fastest run is shown, as ``timeit`` does: on a shared machine the slower runs
measure the neighbours.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_gpumem.baselines import BaselineStore, Environment, load, save
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.findings import parse_tolerance
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.judge.verdict import compare_baseline

MIB = 1 << 20


def _measurement(name: str, index: int, bump: int) -> Measurement:
    base = (index % 977 + 1) * MIB
    breakdown = {category: base // (k + 1) + bump for k, category in enumerate(CATEGORIES)}
    peak = sum(breakdown.values())
    return Measurement(
        name=name,
        engine="cpu",
        device="cpu",
        start=MIB,
        peak=peak,
        allocated=base + bump,
        breakdown=breakdown,
    )


def _measurements(count: int, bump: int) -> dict[str, list[Measurement]]:
    return {
        f"tests/models/test_model_{i // 100:04d}.py::test_train_step[config-{i:06d}]": [
            _measurement("call", i, bump),
            _measurement("train_step", i, bump),
        ]
        for i in range(count)
    }


def run(count: int, folder: Path) -> dict[str, float | int]:
    environment = Environment(engine="cpu", torch_version="2.13", cuda_rounding=False)
    path = folder / f"baselines-{count}.json"
    seed = BaselineStore()
    for test, spans in _measurements(count, 0).items():
        seed.record(environment, test, spans)
    path.unlink(missing_ok=True)
    save(seed, path)
    current = _measurements(count, 512)  # every figure moved: the save really writes
    tolerance = parse_tolerance("2%,1MiB")
    key = environment.key

    t0 = time.perf_counter()
    store = load(path)
    t1 = time.perf_counter()
    failed = 0
    for test, spans in current.items():
        for measurement in spans:
            entry = store.entry(key, test, measurement.name)
            others = () if entry is not None else store.environments_with(test, exclude=key)
            findings = compare_baseline(test, measurement, entry, tolerance, other_environments=others)
            failed += any(finding.failed for finding in findings)
    t2 = time.perf_counter()
    for test, spans in current.items():
        store.record(environment, test, spans)
    t3 = time.perf_counter()
    written = save(store)
    t4 = time.perf_counter()
    assert written and failed == 0
    return {
        "entries": count,
        "load s": t1 - t0,
        "compare s": t2 - t1,
        "record s": t3 - t2,
        "save s": t4 - t3,
        "total s": t4 - t0,
        "bytes": os.path.getsize(path),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("counts", nargs="*", type=int, default=[1_000, 10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the fastest is shown (default 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = [
            min((run(count, Path(folder)) for _ in range(args.repeat)), key=lambda row: row["total s"])
            for count in args.counts
        ]
    print(tabulate(rows, headers="keys", floatfmt=".3f", intfmt=","))


if __name__ == "__main__":
    main()
