"""What sites cost: the attribution pass against a measured step without sites, and the sessions.

Part 1, in one process: a 2-layer TransformerEncoder training step (AdamW), its CPU time per step
when not measured, measured (a passing test: no sites), and measured with sites recorded (the
attribution pass: a baseline update, or a failing test's second run), as multiples of the
unmeasured step. ``--device cuda`` does the same on a GPU, where sites are the caching allocator's
history with Python stacks, replayed at the span's end.

Part 2, pytest sessions of the encoder suite of ``bench_overhead.py`` (fresh interpreters,
interleaved): a passing run, a baseline update with sites (the default) and without
(``--gpumem-sites=off``), and with ``--main REV`` the passing run of that revision's package
(``git archive``), for "the plain passing run is unchanged". CPU time is the child processes'
(``resource.getrusage``), beside wall time.

    python benchmarks/bench_sites.py [--repeat 7] [--sessions 3] [--tests 40] [--main main] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import timed_run, write_suite

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.data.site_figures import SiteConfig
    from pytest_gpumem.measurement.engines import make_engine
    from pytest_gpumem.measurement.recorder import Recorder


def _import_torch() -> None:
    """Torch and the plugin's measuring modules, imported once the options parse (``--help`` needs neither)."""
    global torch, SiteConfig, make_engine, Recorder
    import torch

    from pytest_gpumem.data.site_figures import SiteConfig
    from pytest_gpumem.measurement.engines import make_engine
    from pytest_gpumem.measurement.recorder import Recorder


def encoder(device: torch.device) -> Callable[[], None]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 32, 64, device=device)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # Adam's state, lazy imports
    return step


def one_step(device: torch.device, step: Callable[[], None], variant: str) -> float:
    """CPU seconds of one step (with a GPU: wall seconds, synchronized), measured as ``variant`` says:
    the step inside an open span (with sites: and the span's sites read at its end)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    if variant == "plain":
        sync()
        started = clock()
        step()
        sync()
        return clock() - started
    engine = ENGINES.setdefault(device, make_engine(device))
    recorder = Recorder(engine, sites=SiteConfig(str(Path(__file__).resolve().parent)) if variant == "sites" else None)
    recorder.begin()  # the clean-state protocol (a collection, a scan): every measured test pays it, sites or not
    sync()
    started = clock()
    state = recorder.open("call")
    step()
    measurement = recorder.close(state)
    sync()
    elapsed = clock() - started
    recorder.end()
    assert (measurement.sites is not None) == (variant == "sites")
    return elapsed


ENGINES: dict[torch.device, Any] = {}


def part_one(device: torch.device, repeat: int) -> None:
    step = encoder(device)
    times: dict[str, list[float]] = {"plain": [], "measured": [], "sites": []}
    for round_ in range(repeat):
        order = list(times) if round_ % 2 == 0 else list(reversed(times))
        for variant in order:
            times[variant].append(one_step(device, step, variant))
    plain = statistics.median(times["plain"])
    rows = [
        [variant, f"{statistics.median(values) * 1e3:.1f}", f"{statistics.median(values) / plain:.2f}"]
        for variant, values in times.items()
    ]
    clock = "wall ms (synchronized)" if device.type == "cuda" else "CPU ms"
    print(f"\nOne encoder training step on {device}, {repeat} interleaved rounds, medians")
    print(tabulate(rows, headers=["variant", clock, "× plain"]))


def session(folder: Path, args: list[str], pythonpath: str | None) -> tuple[float, float]:
    """Wall and CPU seconds (the child's) of one pytest session over ``folder``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTEST_ADDOPTS", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpumem-device=cpu", *args, "."]
    result, wall, cpu = timed_run(command, cwd=folder, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return wall, cpu


def part_two(tests: int, rounds: int, main: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "suite"
        folder.mkdir()
        write_suite(folder, tests, suite="encoder")
        variants: dict[str, tuple[list[str], str | None]] = {
            "passing run": ([], None),
            "update, sites (default)": (["--gpumem-update-baselines"], None),
            "update, --gpumem-sites=off": (["--gpumem-update-baselines", "--gpumem-sites=off"], None),
        }
        if main is not None:
            old = Path(tmp) / "main"
            old.mkdir()
            archive = subprocess.run(["git", "archive", main, "pytest_gpumem"], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            variants[f"passing run, {main}'s package"] = ([], str(old))
        session(folder, ["--gpumem-update-baselines"], None)  # the baselines the passing runs compare with
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for round_ in range(rounds):
            names = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for name in names:
                args, path = variants[name]
                results[name].append(session(folder, args, path))
                if "update" in name:  # the passing runs compare with the same file every time
                    session(folder, ["--gpumem-update-baselines"], None)
        base = statistics.median(cpu for _, cpu in results["passing run"])
        rows = []
        for name, values in results.items():
            wall = statistics.median(w for w, _ in values)
            cpu = statistics.median(c for _, c in values)
            rows.append(
                [name, f"{wall:.2f}", f"{cpu:.2f}", f"{cpu / base:.3f}", " ".join(f"{c:.2f}" for _, c in values)]
            )
        print(f"\nSessions of the encoder suite ({tests} tests), {rounds} interleaved rounds, medians")
        print(tabulate(rows, headers=["variant", "wall s", "CPU s", "CPU × passing", "CPU s by round"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds of part 1 (default 7; 0: leave it out)")
    parser.add_argument("--sessions", type=int, default=3, help="rounds of part 2 (default 3; 0: leave it out)")
    parser.add_argument("--tests", type=int, default=40, help="tests of the session suite (default 40)")
    parser.add_argument("--main", default=None, metavar="REV", help="also run REV's package (git archive)")
    parser.add_argument("--device", default="cpu", help="part 1's device: cpu or cuda (default cpu)")
    options = parser.parse_args()
    _import_torch()
    torch.set_num_threads(1)
    if options.repeat:
        part_one(torch.device(options.device), options.repeat)
    if options.sessions:
        part_two(options.tests, options.sessions, options.main)


if __name__ == "__main__":
    main()
