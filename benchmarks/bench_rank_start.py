"""What starting rank processes costs: spawned, or forked warm from a server (the default on Linux).

Run: ``python benchmarks/bench_rank_start.py [--runs 5] [--repeat 3]``

Each round starts, for each start method (``PYTEST_GPUMEM_RANK_START=spawn``, then ``warm``),
a fresh interpreter that does what a test session with distributed tests does: ``--runs``
calls of ``run_ranks`` on 2 gloo ranks (a small DDP step) and as many on 2 fake ranks (a small
FSDP2 step predicted for the H100). It reports the first call's seconds, the median of the
later calls, and the CPU time of the whole interpreter with every process it started (the
servers and ranks included: the interpreter waits for its servers as it ends). The table
gives the median of ``--repeat`` rounds, spawn and warm taking turns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

from bench_overhead import timed_run
from tabulate import tabulate

SCRIPT = """
import json, sys, time
import torch
from torch import nn
from pytest_gpumem import run_ranks


def ddp(rank, ctx):
    model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
    model(torch.randn(4, 64)).sum().backward()


def fsdp(rank, ctx):
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(64, 64))
    model(torch.randn(4, 64)).sum().backward()


if __name__ == "__main__":
    runs = int(sys.argv[1])
    seconds = {}
    for name, kwargs in (("gloo", {}), ("fake", {"predict": "h100", "fake": True})):
        seconds[name] = []
        for _ in range(runs):
            began = time.perf_counter()
            run_ranks(ddp if name == "gloo" else fsdp, 2, **kwargs)
            seconds[name].append(time.perf_counter() - began)
    print(json.dumps(seconds))
"""


def one(method: str, runs: int, script: str) -> dict[str, Any]:
    """One interpreter's calls under ``method``: their seconds, and its CPU time with its processes'."""
    command = [sys.executable, script, str(runs)]
    done, _, cpu = timed_run(command, env={**os.environ, "PYTEST_GPUMEM_RANK_START": method})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    seconds: dict[str, list[float]] = json.loads(done.stdout.splitlines()[-1])
    return {"seconds": seconds, "cpu": cpu}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="run_ranks calls of each kind per interpreter (at least 2)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, spawn and warm taking turns")
    options = parser.parse_args(argv)
    if options.runs < 2 or options.repeat < 1:
        parser.error(f"--runs must be at least 2 and --repeat at least 1 (got {options.runs}, {options.repeat})")
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "ranks.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(SCRIPT)
        results: dict[str, list[dict[str, Any]]] = {"spawn": [], "warm": []}
        for _ in range(options.repeat):
            for method in results:
                results[method].append(one(method, options.runs, script))
    rows = []
    for method, rounds in results.items():
        row: list[Any] = [method]
        for kind in ("gloo", "fake"):
            row.append(statistics.median(r["seconds"][kind][0] for r in rounds))
            row.append(statistics.median(statistics.median(r["seconds"][kind][1:]) for r in rounds))
        row.append(statistics.median(r["cpu"] for r in rounds))
        rows.append(row)
    headers = ["start", "gloo: first s", "gloo: later s", "fake: first s", "fake: later s", "CPU-s, all"]
    print(f"{options.runs} calls of each kind per interpreter, median of {options.repeat} rounds")
    print(tabulate(rows, headers=headers, floatfmt=".2f"))


if __name__ == "__main__":
    main()
