"""Where a measured CUDA test's cost goes, operation by operation (a GPU is needed, but for ``--dry-run``).

Run: ``python benchmarks/probe_cuda.py [--alone] [--ablate [--suite DIR | --tests N]] [--rounds R] [--max-seconds S]
[--json PATH]``.

Two probes:

* ``--alone``: each operation the plugin may do around a CUDA test, timed by itself (median of
  ``--calls`` calls, wall and CPU microseconds): ``torch.cuda.is_available()``, ``device_count()``,
  the workspace warm-up kernels, ``empty_cache()`` with the refill it causes (a 64 MiB block made
  again), ``memory_stats()``, ``memory_allocated()``, ``reset_peak_memory_stats()``,
  ``synchronize()``, the NVML read, a full ``gc.collect()``;
* ``--ablate``: ablation sessions over ``--suite DIR`` (a suite that ``bench_overhead.py --cuda --keep
  DIR`` wrote) or over a CUDA suite of ``--tests`` tests (20 by default) written for the probe,
  interleaved: ``off`` (``-p no:gpumem``), ``on``, and ``on`` with one operation switched off at a
  time through the CUDA engine's patch points (the seams the contract tests' stand-in replaces):
  ``warm-up``, ``empty_cache``, ``nvml``, ``synchronize``, ``collections`` (the plugin's own garbage
  collections), ``saved-tensors`` (the saved-tensor counter). What a session gains without an
  operation is that operation's cost. The figures of an ablated session are not meant to be right.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import OFF, Variant, run_session, write_suite

#: Operations switched off in the ablation sessions: name → how (the plugin module below applies it).
ABLATIONS = ("warm-up", "empty_cache", "nvml", "synchronize", "collections", "saved-tensors")

ABLATE_PLUGIN = '''
"""Loaded with -p by probe_cuda.py: switches one operation of the CUDA engine off (GPUMEM_ABLATE)."""

import os

from pytest_gpumem.measurement import collector
from pytest_gpumem.measurement.engines import cuda, saved

WHAT = os.environ.get("GPUMEM_ABLATE", "")
if WHAT == "warm-up":
    cuda._workspace_kernels = lambda device: None
    cuda._initialize = lambda device: None
elif WHAT == "empty_cache":
    cuda.CudaEngine.empty_cache = lambda self: None
elif WHAT == "nvml":
    cuda.nvml_memory = lambda device: (None, None)
elif WHAT == "synchronize":
    cuda.CudaEngine.synchronize = lambda self: None
elif WHAT == "collections":
    collector.collect = lambda *args, **kwargs: 0
elif WHAT == "saved-tensors":
    saved.SavedTensors.start = lambda self: None
'''


def timed(call: Callable[[], object], calls: int, sync: Callable[[], object]) -> tuple[float, float]:
    """Median wall and CPU microseconds of ``call`` (the device synchronized after each)."""
    walls, cpus = [], []
    for _ in range(calls):
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        sync()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6


def alone(calls: int) -> dict[str, dict[str, float]]:
    """Each suspected operation timed by itself."""
    import torch

    from pytest_gpumem.measurement.engines import cuda

    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)
    cuda._workspace_kernels(device)
    sync = torch.cuda.synchronize
    block = 64 * 2**20

    def empty_and_refill() -> None:
        torch.empty(block, dtype=torch.uint8, device=device)  # made and freed: cached
        torch.cuda.empty_cache()
        torch.empty(block, dtype=torch.uint8, device=device)  # the refill a test's body then pays

    def cached() -> None:
        torch.empty(block, dtype=torch.uint8, device=device)
        torch.empty(block, dtype=torch.uint8, device=device)

    probes: dict[str, Callable[[], object]] = {
        "torch.cuda.is_available()": torch.cuda.is_available,
        "torch.cuda.device_count()": torch.cuda.device_count,
        "workspace warm-up kernels": lambda: cuda._workspace_kernels(device),
        "two 64 MiB blocks from the cache (reference)": cached,
        "empty_cache() and a 64 MiB refill": empty_and_refill,
        "memory_stats()": lambda: torch.cuda.memory_stats(device),
        "memory_allocated()": lambda: torch.cuda.memory_allocated(device),
        "reset_peak_memory_stats()": lambda: torch.cuda.reset_peak_memory_stats(device),
        "synchronize()": sync,
        "NVML read (memory info and processes)": lambda: cuda.nvml_memory(device),
        "gc.collect() (full)": gc.collect,
    }
    found = {}
    for name, call in probes.items():
        wall, cpu = timed(call, calls, sync)
        found[name] = {"wall_us": wall, "cpu_us": cpu}
        print(f"{name:48s} wall {wall:9.1f} us   CPU {cpu:9.1f} us")
    return found


def ablations(suite: Path, rounds: int, max_seconds: float | None) -> dict[str, Any]:
    """Interleaved sessions over ``suite``: off, on, and on without each operation in turn."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpumem-ablate-") as plugins:
        (Path(plugins) / "gpumem_ablate.py").write_text(ABLATE_PLUGIN)
        path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), plugins) if p)
        runs = [Variant("off", "off", OFF), Variant("on", "on", ["--gpumem-require-gpu"])]
        runs += [
            Variant(
                name,
                f"on, without {name}",
                ["--gpumem-require-gpu", "-p", "gpumem_ablate"],
                {"GPUMEM_ABLATE": name, "PYTHONPATH": path},
            )
            for name in ABLATIONS
        ]
        done = 0
        for index in range(rounds):
            if max_seconds is not None and done and (time.perf_counter() - began) / done * (done + 1) > max_seconds:
                break
            for variant in runs if index % 2 == 0 else runs[::-1]:
                wall, cpu = run_session(suite, variant, cov=False, cuda=True, junit=None)
                variant.wall.append(wall)
                variant.cpu.append(cpu)
            done += 1
    if not done:
        return {}
    on = runs[1]
    print(f"\nablation sessions over {suite} ({done} interleaved rounds; medians, seconds)")
    print(f"{'variant':32s} {'CPU s':>8s} {'wall s':>8s} {'CPU − on':>9s}")
    for variant in runs:
        delta = variant.median("cpu") - on.median("cpu")
        print(f"{variant.label:32s} {variant.median('cpu'):8.2f} {variant.median('wall'):8.2f} {delta:+9.2f}")
    return {v.name: {"cpu_s": v.cpu, "wall_s": v.wall} for v in runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--alone", action="store_true", help="time each suspected operation by itself")
    parser.add_argument("--calls", type=int, default=50, help="calls of each operation timed alone (default 50)")
    parser.add_argument("--ablate", action="store_true", help="ablation sessions: one operation off at a time")
    parser.add_argument("--suite", type=Path, default=None, help="a CUDA suite (bench_overhead.py --cuda --keep)")
    parser.add_argument("--tests", type=int, default=20, help="tests of the suite written when --suite is not given")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of ablation sessions (default 1)")
    parser.add_argument("--max-seconds", type=float, default=None, help="start no round that would end past this")
    parser.add_argument("--json", type=Path, default=None, help="write what was measured here")
    parser.add_argument("--dry-run", action="store_true", help="check the options; run nothing (no GPU needed)")
    options = parser.parse_args(argv)
    if not options.alone and not options.ablate:
        parser.error("nothing to probe: give --alone, --ablate or both")
    if min(options.calls, options.rounds, options.tests) < 1:
        parser.error(
            f"--calls, --rounds and --tests must be at least 1 (got {options.calls}, {options.rounds}, {options.tests})"
        )
    if options.suite is not None and not (options.suite / "conftest.py").is_file():
        parser.error(f"--suite {options.suite}: no suite there (bench_overhead.py --cuda --keep DIR writes one)")
    if options.dry_run:
        ablate = f"ablations over {options.suite or f'{options.tests} tests'}" if options.ablate else ""
        print(f"probes: {'alone ' if options.alone else ''}{ablate}")
        return
    import torch

    if not torch.cuda.is_available():
        parser.error("no CUDA device is available")
    found: dict[str, Any] = {}
    if options.alone:
        found["alone"] = alone(options.calls)
    if options.ablate and options.suite is not None:
        found["ablations"] = ablations(options.suite, options.rounds, options.max_seconds)
    elif options.ablate:
        with tempfile.TemporaryDirectory(prefix="gpumem-probe-") as folder:
            write_suite(Path(folder), options.tests, suite="cuda")
            found["ablations"] = ablations(Path(folder), options.rounds, options.max_seconds)
    if options.json is not None:
        options.json.write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main()
