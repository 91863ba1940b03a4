"""What loading the plugin costs a pytest session: ``import pytest`` vs ``import pytest, pytest_gpumem.plugin``.

Each variant is a fresh interpreter; the two run interleaved (order swapped every round) and
each figure is the median of its rounds. The bound the layout keeps: the plugin adds at most
0.3 s to ``import pytest`` (it imports no torch: tests/test_layout.py checks that).

    python benchmarks/bench_import.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from tabulate import tabulate

VARIANTS = {
    "import pytest": "import pytest",
    "import pytest, pytest_gpumem.plugin": "import pytest, pytest_gpumem.plugin",
}


def once(code: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            times[name].append(once(VARIANTS[name]))
    base = statistics.median(times[names[0]])
    rows = [
        (name, f"{statistics.median(values):.3f}", f"{statistics.median(values) - base:+.3f}", args.rounds)
        for name, values in times.items()
    ]
    print(tabulate(rows, headers=["variant", "median s", "over import pytest (s)", "rounds"], disable_numparse=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
