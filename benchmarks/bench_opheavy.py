"""What pytest-gpumem costs an operator-heavy suite on the CPU, against the floor of any Python
per-operator tracker: an empty ``TorchDispatchMode`` around each test.

Run: ``python benchmarks/bench_opheavy.py [--suite optim|small|both] [--repeat R] [--variants NAME ...]
[--memray-path DIR] [--other CHECKOUT] [--json PATH] [--keep DIR]``.

Two suites, each test marked ``@pytest.mark.gpumem(peak="1GiB")`` (a module's ``pytestmark``), as the
test suite of an optimizer library is written:

* ``optim`` (60 tests): an optimizer zoo. Ten ``torch.optim`` optimizers with ``foreach=False`` (SGD
  with momentum, Adam, AdamW, Adagrad, Adadelta, Adamax, NAdam, RAdam, RMSprop, ASGD), in float32 and
  bfloat16, three settings each (defaults, weight decay, a variant: Nesterov, AMSGrad, ...); each
  test makes 40 parameters of 16 x 16 and runs 5 steps of a sum-of-squares loss: thousands of tiny
  operators, each a few microseconds;
* ``small`` (60 tests): a small-tensor model: 6 blocks of ``Linear(32, 32)``, ``LayerNorm`` and
  ``GELU``, batch 4, AdamW with ``foreach=False``, 5 steps.

The variants, each a fresh interpreter (``bench_overhead.run_session``): ``off`` (``-p no:gpumem``),
``dispatch`` (the plugin off, an empty ``TorchDispatchMode`` around each test call: the floor),
``on`` (the plugin), ``breakdown`` (the plugin with ``--gpumem-breakdown``: activations told apart
from temporaries, a saved-tensor hook call per tensor autograd saves), ``profiler`` (the plugin
off, ``torch.profiler.profile(profile_memory=True)`` around each test call) and ``memray`` (the
plugin off, pytest-memray's ``--memray``; where it is not installed, ``--memray-path`` names a
folder it was installed into with ``pip install --target``).
Rounds are interleaved, the order reversed every other round; figures are medians of CPU seconds
(user + system) of the session's process. The line that matters is ``on / dispatch``: what the
plugin adds over the floor, on the same suite.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import CONFTEST, OFF, Variant, machine, run_session

OPTIM_FILE = textwrap.dedent(
    '''
    """An optimizer zoo: torch.optim optimizers, one element at a time (foreach=False)."""

    import pytest
    import torch

    pytestmark = pytest.mark.gpumem(peak="1GiB")

    OPTIMIZERS = {{
        "sgd": (torch.optim.SGD, {{"lr": 0.01, "momentum": 0.9}}, {{"nesterov": True}}),
        "adam": (torch.optim.Adam, {{"lr": 1e-3}}, {{"amsgrad": True}}),
        "adamw": (torch.optim.AdamW, {{"lr": 1e-3}}, {{"amsgrad": True}}),
        "adagrad": (torch.optim.Adagrad, {{"lr": 0.01}}, {{"lr_decay": 0.01}}),
        "adadelta": (torch.optim.Adadelta, {{"lr": 1.0}}, {{"rho": 0.95}}),
        "adamax": (torch.optim.Adamax, {{"lr": 2e-3}}, {{"betas": (0.8, 0.99)}}),
        "nadam": (torch.optim.NAdam, {{"lr": 2e-3}}, {{"decoupled_weight_decay": True}}),
        "radam": (torch.optim.RAdam, {{"lr": 1e-3}}, {{"decoupled_weight_decay": True}}),
        "rmsprop": (torch.optim.RMSprop, {{"lr": 1e-3}}, {{"centered": True, "momentum": 0.9}}),
        "asgd": (torch.optim.ASGD, {{"lr": 0.01}}, {{"t0": 1.0}}),
    }}


    def run(name, dtype, setting):
        kind, options, variant = OPTIMIZERS[name]
        options = dict(options, foreach=False)
        if setting == "weight_decay":
            options["weight_decay"] = 0.01
        elif setting == "variant":
            options.update(variant)
        torch.manual_seed(0)
        params = [torch.randn(16, 16, dtype=dtype, requires_grad=True) for _ in range(40)]
        opt = kind(params, **options)
        losses = []
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = sum((p.float() * p.float()).sum() for p in params)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert all(value == value for value in losses)


    @pytest.mark.parametrize("setting", ["default", "weight_decay", "variant"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("name", {names})
    def test_optimizer(name, dtype, setting):
        run(name, dtype, setting)
    '''
)

SMALL_FILE = textwrap.dedent(
    '''
    """A small-tensor model: many small operators a step."""

    import pytest
    import torch
    from torch import nn

    pytestmark = pytest.mark.gpumem(peak="1GiB")


    def model():
        blocks = [nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU()) for _ in range(6)]
        return nn.Sequential(*blocks, nn.Linear(32, 4))


    @pytest.mark.parametrize("seed", range({first}, {last}))
    def test_small_model(seed):
        torch.manual_seed(seed)
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
        x, y = torch.randn(4, 32), torch.randint(0, 4, (4,))
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
        assert loss.item() > 0
    '''
)

NAMES = ["sgd", "adam", "adamw", "adagrad", "adadelta", "adamax", "nadam", "radam", "rmsprop", "asgd"]


def write_suite(folder: Path, suite: str) -> int:
    """Write ``suite`` (``optim`` or ``small``) and the conftest into ``folder``; returns its number of tests."""
    (folder / "conftest.py").write_text(CONFTEST)
    if suite == "optim":
        for half, names in enumerate((NAMES[:5], NAMES[5:])):
            (folder / f"test_optim_{half}.py").write_text(OPTIM_FILE.format(names=names))
        return len(NAMES) * 2 * 3
    for part in range(6):
        (folder / f"test_small_{part}.py").write_text(SMALL_FILE.format(first=part * 10, last=part * 10 + 10))
    return 60


def variants(memray_path: Path | None) -> dict[str, Variant]:
    """Every variant by name (see the module's docstring)."""
    memray_env = {"PYTHONPATH": str(memray_path)} if memray_path is not None else {}
    found = [
        Variant("off", "off (-p no:gpumem)", OFF),
        Variant("dispatch", "empty TorchDispatchMode per test (the floor)", OFF, {"GPUMEM_BENCH_ANCHOR": "dispatch"}),
        Variant("on", "on (the CPU engine)", []),
        Variant("breakdown", "on, --gpumem-breakdown (activations told apart)", ["--gpumem-breakdown"]),
        Variant("profiler", "torch.profiler(profile_memory) per test", OFF, {"GPUMEM_BENCH_ANCHOR": "profiler"}),
        Variant("memray", "pytest-memray --memray", [*OFF, "--memray"], memray_env),
    ]
    return {variant.name: variant for variant in found}


def memray_available(memray_path: Path | None) -> bool:
    if memray_path is not None:
        return (memray_path / "pytest_memray").is_dir()
    return importlib.util.find_spec("pytest_memray") is not None


def run_suite(suite: str, runs: list[Variant], repeat: int, keep: Path | None) -> int:
    """Interleaved rounds of ``runs`` over ``suite``; returns the number of tests."""
    with tempfile.TemporaryDirectory(prefix="gpumem-opheavy-") as tmp:
        folder = keep / suite if keep is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        tests = write_suite(folder, suite)
        for variant in runs[:3]:  # untimed: the file cache, the bytecode caches
            run_session(folder, variant, cov=False, cuda=False, junit=None)
        for index in range(repeat):
            for variant in runs if index % 2 == 0 else runs[::-1]:
                wall, cpu = run_session(folder, variant, cov=False, cuda=False, junit=None)
                variant.wall.append(wall)
                variant.cpu.append(cpu)
    return tests


def report(suite: str, tests: int, runs: list[Variant]) -> dict[str, Any]:
    """Print the table and the ratios that matter; returns them for ``--json``."""
    by_name = {variant.name: variant for variant in runs}
    off, floor = by_name["off"].median("cpu"), by_name["dispatch"].median("cpu")
    rows = []
    for variant in runs:
        cpu = variant.median("cpu")
        rows.append(
            [
                variant.label,
                f"{cpu:.2f}",
                " ".join(f"{value:.2f}" for value in variant.cpu),
                f"{cpu / off:.3f}",
                f"{cpu / floor:.3f}",
                f"{(cpu - off) / tests * 1000:+.1f}",
            ]
        )
    rounds = len(runs[0].cpu)
    print(f"\n{suite}: {tests} tests, {rounds} interleaved rounds, OMP_NUM_THREADS=1, CPU seconds (user + system)")
    headers = ["variant", "CPU s", "by round", "× off", "× dispatch", "CPU ms/test vs off"]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    pairs = [on / base for on, base in zip(by_name["on"].cpu, by_name["dispatch"].cpu, strict=True)]
    ratio = by_name["on"].median("cpu") / floor
    print(
        f"plugin / empty dispatch mode: ×{ratio:.3f} (medians; per round ×{min(pairs):.3f} to ×{max(pairs):.3f}, "
        f"median of the rounds' ratios ×{statistics.median(pairs):.3f}); target ≤ ×1.15"
    )
    return {
        "suite": suite,
        "tests": tests,
        "rounds": rounds,
        "variants": {v.name: {"label": v.label, "cpu_s": v.cpu, "wall_s": v.wall} for v in runs},
        "on_over_dispatch": ratio,
        "on_over_dispatch_by_round": pairs,
        "on_over_off": by_name["on"].median("cpu") / off,
        "dispatch_over_off": floor / off,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--suite", choices=("optim", "small", "both"), default="both")
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--variants", nargs="+", default=None, help="by name; off, dispatch and on always run")
    parser.add_argument("--memray-path", type=Path, default=None, help="a folder pytest-memray was installed into")
    parser.add_argument(
        "--other", type=Path, default=None, help="another checkout: adds its plugin as the variant 'other'"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="write the suites here and keep them")
    options = parser.parse_args(argv)
    if options.repeat < 1:
        parser.error(f"--repeat must be at least 1 (got {options.repeat})")
    known = variants(options.memray_path)
    wanted = options.variants or list(known)
    if options.other is not None:
        if not (options.other / "pytest_gpumem").is_dir():
            parser.error(f"--other {options.other}: no pytest_gpumem package there")
        label = f"on [{options.other.name}]"
        known["other"] = Variant("other", label, [], {"PYTHONPATH": str(options.other.resolve())})
        wanted.append("other")
    if not options.variants and not memray_available(options.memray_path):
        print("pytest-memray is not installed: its variant is left out (--memray-path names a folder that has it)")
        wanted.remove("memray")
    unknown = [name for name in wanted if name not in known]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    names = list(dict.fromkeys(["off", "dispatch", "on", *wanted]))
    results = []
    began = time.perf_counter()
    for suite in ("optim", "small") if options.suite == "both" else (options.suite,):
        runs = [Variant(v.name, v.label, v.args, dict(v.env)) for v in (known[name] for name in names)]
        tests = run_suite(suite, runs, options.repeat, options.keep)
        results.append(report(suite, tests, runs))
    if options.json is not None:
        found = {"machine": machine(cuda=False), "seconds": time.perf_counter() - began, "suites": results}
        options.json.write_text(json.dumps(found, indent=2) + "\n")
    os.environ.pop("GPUMEM_BENCH_ANCHOR", None)


if __name__ == "__main__":
    main()
