"""Session overhead of the plugin: a suite of small training-step tests, with and without pytest-gpumem.

Run: ``python benchmarks/bench_overhead.py [--tests 200] [--repeat 3] [--keep DIR]``,
or on a CUDA GPU ``python benchmarks/bench_overhead.py --cuda [--tests 60] [--repeat 3]``.

The script writes a suite into a temporary folder: ``--tests`` tests in 10 files,
each marked ``@pytest.mark.gpumem(peak="1GiB")`` and running a tiny training step
on the CPU: an MLP 64 → 256 → 64, batch 32, AdamW or SGD with momentum by turns, a
warm-up step then a second step (about 1.5 ms a test). The suite's conftest runs one
step of each optimizer at import, as the first test of a real suite would, so the
lazy imports of torch (over a second) are outside the tests in every variant. Each
variant runs the suite in a fresh interpreter:
``python -m pytest -q -p no:cacheprovider [variant options]``:

* ``off``: ``-p no:gpumem``, the plugin is not loaded. The reference.
* ``on``: the plugin as installed, no option: every test is measured by the CPU
  engine (the storage tracker's dispatch mode and ``saved_tensors_hooks``, the
  clean-state protocol, the return watch).
* ``on --gpumem-breakdown``: the breakdown flag. On CUDA it adds the storage tracker
  beside the allocator; on the CPU engine the tracker *is* the engine, so the flag
  changes nothing there, and this row shows it. "Breakdown off" in the target is
  therefore the ``on`` row.
* ``loaded, unmarked``: the plugin loaded, the markers dropped by the suite's
  conftest (``GPUMEM_BENCH_UNMARKED=1``): the cost of importing the plugin and of
  its hooks with nothing to measure.
The variants run interleaved, ``--repeat`` rounds, the order reversed every other
round, and each figure is the median of a variant's rounds, so a neighbour's load on
a shared machine moves every variant alike. A variant that took over
``--slow`` seconds in the first round is not run again: its ratio is far from the
target and the noise of one run (a few %) does not change the verdict; this keeps
the script under five minutes. ``× off`` is the session overhead; the target is
``on`` ≤ 1.15 × ``off`` on the CPU. ``ms/test`` is ``(variant - off) / tests``. Python
writes its bytecode caches as by default (``PYTHONDONTWRITEBYTECODE`` is unset for the
sessions, and the first two variants run once before the timed rounds).

``--suite encoder`` writes the realistic CPU suite instead: ``--tests`` tests (40 by
default), each three AdamW training steps of a 2-layer ``nn.TransformerEncoder``
(d_model 128, 4 heads, batch 8 × 64 tokens, about 1,800 operators a test), marked
``@pytest.mark.gpumem(peak="1GiB")``.

``--cuda`` writes a GPU suite instead: ``--tests`` tests (60 by default), each three
AdamW training steps of a 2-layer ``nn.TransformerEncoder`` (d_model from 256 to 448
by test, 8 heads, batch 8 × 128 tokens) on ``cuda``, marked
``@pytest.mark.gpumem(peak="8GiB")``, with the variants off, on (the caching
allocator, saved-tensor counting) and on ``--gpumem-breakdown`` (the storage tracker
beside it). The target there is on ≤ 1.05 × off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

FILES = 10

CONFTEST = textwrap.dedent(
    '''
    """Suite written by benchmarks/bench_overhead.py."""

    import os

    import torch

    torch.manual_seed(0)

    # A first Linear, first backward and first optimizer step import parts of torch lazily
    # (over a second): done here, once, as a real suite's first test would, so that every
    # test below is a steady-state test.
    _model = torch.nn.Linear(4, 4)
    for _opt in (torch.optim.AdamW(_model.parameters()), torch.optim.SGD(_model.parameters(), lr=0.1, momentum=0.9)):
        _model(torch.randn(2, 4)).pow(2).mean().backward()
        _opt.step()
    del _model, _opt


    def pytest_configure(config):
        # registered here too, so that -p no:gpumem runs without unknown-marker warnings
        config.addinivalue_line("markers", "gpumem: pytest-gpumem marker")


    def pytest_collection_modifyitems(config, items):
        if os.environ.get("GPUMEM_BENCH_UNMARKED") == "1":
            for item in items:
                item.own_markers[:] = [m for m in item.own_markers if m.name != "gpumem"]
    '''
)

TEST_FILE = textwrap.dedent(
    '''
    """Tiny training steps, each measured by pytest-gpumem."""

    import pytest
    import torch
    from torch import nn


    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()


    def train(optimizer):
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(32, 64), torch.randn(32, 64)
        step(model, opt, x, y)  # warm-up: optimizer state
        assert step(model, opt, x, y) > 0

    {tests}
    '''
)

TEST = textwrap.dedent(
    """
    @pytest.mark.gpumem(peak="1GiB")
    def test_step_{index}():
        train("{optimizer}")
    """
)

ENCODER_TEST_FILE = textwrap.dedent(
    '''
    """2-layer TransformerEncoder training steps on the CPU, each measured by pytest-gpumem."""

    import pytest
    import torch
    from torch import nn


    def train():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 64, 128)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()

    {tests}
    '''
)

ENCODER_TEST = textwrap.dedent(
    """
    @pytest.mark.gpumem(peak="1GiB")
    def test_encoder_{index}():
        train()
    """
)

CUDA_CONFTEST = textwrap.dedent(
    '''
    """GPU suite written by benchmarks/bench_overhead.py --cuda."""

    import torch

    torch.manual_seed(0)

    # The first CUDA kernels, matmuls, backward and optimizer step load libraries and import
    # parts of torch lazily: done once here, as a real suite's first test would.
    _layer = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 1, enable_nested_tensor=False
    ).cuda()
    _opt = torch.optim.AdamW(_layer.parameters())
    _layer(torch.randn(2, 8, 64, device="cuda")).pow(2).mean().backward()
    _opt.step()
    torch.cuda.synchronize()
    del _layer, _opt


    def pytest_configure(config):
        config.addinivalue_line("markers", "gpumem: pytest-gpumem marker")
    '''
)

CUDA_TEST_FILE = textwrap.dedent(
    '''
    """2-layer TransformerEncoder training steps on CUDA, each measured by pytest-gpumem."""

    import pytest
    import torch
    from torch import nn


    def train(d_model):
        torch.manual_seed(d_model)
        layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 128, d_model, device="cuda")
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
        torch.cuda.synchronize()

    {tests}
    '''
)

CUDA_TEST = textwrap.dedent(
    """
    @pytest.mark.gpumem(peak="8GiB")
    def test_encoder_{index}():
        train({d_model})
    """
)


def write_suite(folder: Path, tests: int, *, cuda: bool = False, suite: str = "mlp") -> None:
    """Write ``tests`` marked training-step tests in ``FILES`` files and a conftest (the GPU suite
    with ``cuda``; on the CPU, ``suite`` is ``"mlp"`` or ``"encoder"``)."""
    (folder / "conftest.py").write_text(CUDA_CONFTEST if cuda else CONFTEST)
    per_file = -(-tests // FILES)
    for f in range(FILES):
        indices = range(f * per_file, min(tests, (f + 1) * per_file))
        if cuda:
            body = "".join(CUDA_TEST.format(index=i, d_model=256 + 64 * (i % 4)) for i in indices)
            (folder / f"test_steps_{f}.py").write_text(CUDA_TEST_FILE.format(tests=body))
        elif suite == "encoder":
            body = "".join(ENCODER_TEST.format(index=i) for i in indices)
            (folder / f"test_steps_{f}.py").write_text(ENCODER_TEST_FILE.format(tests=body))
        else:
            body = "".join(TEST.format(index=i, optimizer="adamw" if i % 2 else "sgd-momentum") for i in indices)
            (folder / f"test_steps_{f}.py").write_text(TEST_FILE.format(tests=body))


@dataclass
class Variant:
    """One way of running the suite, and its wall times."""

    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    figures: dict[str, str] | None = None


#: Not loading the plugin, whether installed (the ``gpumem`` entry point) or named in PYTEST_PLUGINS.
OFF = ["-p", "no:gpumem", "-p", "no:pytest_gpumem.plugin"]


def variants(*, cuda: bool = False) -> list[Variant]:
    if cuda:
        return [
            Variant("off (-p no:gpumem)", OFF),
            Variant("on (CUDA engine)", ["--gpumem-require-gpu"]),
            Variant("on --gpumem-breakdown", ["--gpumem-require-gpu", "--gpumem-breakdown"]),
        ]
    return [
        Variant("off (-p no:gpumem)", OFF),
        Variant("on (default: CPU engine)", []),
        Variant("on --gpumem-breakdown", ["--gpumem-breakdown"]),
        Variant("on --gpumem-observe=allocations", ["--gpumem-observe=allocations"]),
        Variant("loaded, unmarked", [], {"GPUMEM_BENCH_UNMARKED": "1"}),
    ]


def junit_figures(path: Path) -> dict[str, str]:
    """``{"nodeid property": value}`` of every ``gpumem.*`` junit property in ``path``."""
    figures = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name", "").startswith("gpumem"):
                figures[f"{case.get('name')} {prop.get('name')}"] = prop.get("value", "")
    return figures


def run_session(folder: Path, variant: Variant, junit: Path | None) -> float:
    """Wall seconds of one pytest session over ``folder`` in a fresh interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # bytecode caches as Python writes them by default: with PYTHONDONTWRITEBYTECODE set, pytest
    # would rewrite and compile the plugin's modules (assertion rewriting) in every session
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTEST_ADDOPTS", None)
    env.update({k: v for k, v in variant.env.items() if k != "GPUMEM_BENCH_PYTHONPATH"})
    if "GPUMEM_BENCH_PYTHONPATH" in variant.env:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *variant.args]
    if junit is not None:
        command.append(f"--junitxml={junit}")
    started = time.perf_counter()
    result = subprocess.run([*command, str(folder)], cwd=folder, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--tests", type=int, default=None, help="number of generated tests (default 200; 60 with --cuda)"
    )
    parser.add_argument("--cuda", action="store_true", help="the GPU suite: TransformerEncoder steps on cuda")
    parser.add_argument(
        "--suite",
        choices=("mlp", "encoder"),
        default="mlp",
        help="the CPU suite: tiny MLP steps (default) or 2-layer TransformerEncoder steps (40 tests by default)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; figures are medians (default 3)")
    parser.add_argument("--slow", type=float, default=None, help="slower than this (s): run once (30; 600 --cuda)")
    parser.add_argument("--keep", type=Path, default=None, help="write the suite here and keep it")
    options = parser.parse_args()
    if options.tests is None:
        options.tests = 60 if options.cuda else 40 if options.suite == "encoder" else 200
    if options.slow is None:
        options.slow = 600.0 if options.cuda else 30.0

    runs = variants(cuda=options.cuda)
    with tempfile.TemporaryDirectory(prefix="gpumem-bench-") as tmp:
        folder = options.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        write_suite(folder, options.tests, cuda=options.cuda, suite=options.suite)
        for variant in runs[:2]:  # the file cache, torch's first import, the bytecode caches
            run_session(folder, variant, None)
        for round_index in range(options.repeat):
            order = runs if round_index % 2 == 0 else runs[::-1]
            for variant in order:
                if variant.times and variant.times[0] > options.slow:
                    continue
                junit = Path(tmp) / "junit.xml" if variant.figures is None else None
                variant.times.append(run_session(folder, variant, junit))
                if junit is not None:
                    variant.figures = junit_figures(junit)

    reference = statistics.median(runs[0].times)
    rows = []
    for variant in runs:
        median = statistics.median(variant.times)
        rows.append(
            [
                variant.name,
                f"{median:.2f}",
                " ".join(f"{s:.2f}" for s in variant.times),
                f"{median / reference:.3f}",
                f"{(median - reference) / options.tests * 1000:+.2f}",
            ]
        )
    suite = (
        "TransformerEncoder steps on CUDA"
        if options.cuda
        else "TransformerEncoder steps on the CPU"
        if options.suite == "encoder"
        else "MLP steps on the CPU"
    )
    print(f"{options.tests} tests ({suite}), up to {options.repeat} interleaved rounds, OMP_NUM_THREADS=1")
    print(tabulate(rows, headers=["variant", "wall s", "rounds", "× off", "ms/test"], disable_numparse=True))

    on = runs[1]
    ratio = statistics.median(on.times) / reference
    target = 1.05 if options.cuda else 1.15
    print(f"\nsession overhead, on / off: {ratio:.3f} (target ≤ {target}: {'met' if ratio <= target else 'MISSED'})")


if __name__ == "__main__":
    main()
