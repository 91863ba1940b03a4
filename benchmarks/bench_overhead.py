"""What pytest-gpumem costs a suite as users write it: the same suite with and without the plugin.

Run: ``python benchmarks/bench_overhead.py [--suite tiny|encoder|transformers|noop] [--tests N] [--repeat R]
[--warm-up] [--anchors] [--cov] [--gc-collect] [--variants NAME ...] [--json PATH] [--max-seconds S] [--keep DIR]
[--no-untimed]``,
or on a CUDA GPU ``python benchmarks/bench_overhead.py --cuda [--tests 60] ...``.

The script writes a suite into a temporary folder, ``--tests`` tests in 10 files, each marked
``@pytest.mark.gpumem(peak=...)``:

* ``tiny`` (the default; 200 tests): an MLP 64 → 256 → 64, batch 32, AdamW or SGD with
  momentum by turns, a warm-up step then a second step (about 1.5 ms a test);
* ``encoder`` (40 tests): three AdamW steps of a 2-layer ``nn.TransformerEncoder`` (d_model 128,
  4 heads, feed-forward 512, batch 8 × 64 tokens, no dropout): about 2,200 operators a test;
* ``transformers`` (40 tests): the test files import ``transformers`` at collection, as test
  files of a Hugging Face model do; each test builds a 2-layer ``BertForMaskedLM`` (hidden 64)
  and runs two AdamW steps on a batch of 4 × 32 tokens;
* ``noop`` (10 tests): marked tests that run nothing and import no torch: a check of the script
  itself (its rounds, ``--max-seconds``, the JSON), not a measurement;
* ``--cuda`` (60 tests): three AdamW steps of a 2-layer ``nn.TransformerEncoder`` (d_model 256 to
  448 by test, 8 heads, batch 8 × 128 tokens) on ``cuda``, measured by the CUDA engine.

**As users write it**: the suite's conftest does nothing at import, so the first test's step
imports parts of torch lazily (an optimizer's first step imports ``torch._dynamo``, sympy and
about 800 modules), inside the measured run. The warm-up variants (``--warm-up``) run one step of
each optimizer in the conftest at import instead, before the plugin's first measured test: the
suite as the benchmarks used to write it, labelled as such.

Each variant runs the suite in a fresh interpreter, ``python -m pytest -q -p no:cacheprovider
[variant options]``, ``OMP_NUM_THREADS=1``, bytecode caches written as Python does by default:

* ``off``: ``-p no:gpumem``, the plugin is not loaded. The reference of every ratio;
* ``on``: the plugin as installed, no option (the CPU engine, or the CUDA engine with ``--cuda``);
* ``off-warm``, ``on-warm``: the same with the warm-up conftest (their ratio is on-warm / off-warm);
* ``breakdown``: ``--gpumem-breakdown`` (on CUDA the storage tracker beside the allocator; on the
  CPU the same path as ``on``);
* ``allocations``: ``--gpumem-observe=allocations`` (CPU only);
* ``loaded``: the plugin loaded, the markers dropped by the conftest: its hooks with nothing to measure;
* the anchors (``--anchors``), each with the plugin off: ``memray`` (pytest-memray's ``--memray``),
  ``profiler`` (each test call under ``torch.profiler.profile(profile_memory=True)``, the peak
  summed from its allocation events), ``memtracker`` (each test call under PyTorch's
  ``MemTracker``, its module statistics reset after each optimizer step, as it demands, the peak
  read from its snapshot) and ``dispatch`` (each test call under an empty ``TorchDispatchMode``:
  the floor of any Python per-operator tracker).

``--cov`` runs every variant under ``pytest --cov=. --cov-report=`` (pytest-cov); ``--gc-collect``
starts every test with ``gc.collect()`` (an autouse fixture, as many GPU suites have). The variants run
interleaved, ``--repeat`` rounds, the order reversed every other round, after an untimed session of
``off`` and ``on`` (the file cache, torch's first import, the bytecode caches; ``--no-untimed`` leaves it
out, and the first round pays for them: a check of the script, not a measurement); each figure is the median
of a variant's rounds, in wall seconds and in CPU seconds of the session's process (user + system,
``resource.getrusage(RUSAGE_CHILDREN)``): on a shared machine the wall time moves with the
neighbours' load, the CPU time much less. ``--max-seconds`` stops starting rounds when the next
would end past it (the first untimed runs count); ``--json`` writes every round, the medians, the
ratios, the machine and the untimed sessions. Without ``--cuda`` the default run takes about 2 to 4 minutes on a 2-core
machine.

Where the plugin is not installed (a checkout on a machine where pip cannot install it), the
sessions find it on ``PYTHONPATH`` (the repository's root) and load it with ``-p pytest_gpumem.plugin``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

FILES = 10
ROOT = Path(__file__).resolve().parents[1]

CONFTEST = textwrap.dedent(
    '''
    """Suite written by benchmarks/bench_overhead.py."""

    import contextlib
    import os

    import pytest

    CUDA = os.environ.get("GPUMEM_BENCH_CUDA") == "1"
    ANCHOR = os.environ.get("GPUMEM_BENCH_ANCHOR", "")

    if os.environ.get("GPUMEM_BENCH_WARM_UP") == "1":
        # The warm-up variant: a first Linear, backward and optimizer step of each kind at import
        # (torch imports parts of itself lazily there), before the plugin's first measured test.
        import torch

        _device = "cuda" if CUDA else "cpu"
        _model = torch.nn.Linear(4, 4).to(_device)
        _sgd = torch.optim.SGD(_model.parameters(), lr=0.1, momentum=0.9)
        for _opt in (torch.optim.AdamW(_model.parameters()), _sgd):
            _model(torch.randn(2, 4, device=_device)).pow(2).mean().backward()
            _opt.step()
        del _model, _opt, _sgd


    if os.environ.get("GPUMEM_BENCH_COLLECT") == "1":

        @pytest.fixture(autouse=True)
        def _collect_garbage_first():
            # as many GPU suites do before each test: gc.collect() (then torch.cuda.empty_cache())
            import gc

            gc.collect()
            yield


    def pytest_configure(config):
        # registered here too, so that -p no:gpumem runs without unknown-marker warnings
        config.addinivalue_line("markers", "gpumem: pytest-gpumem marker")


    def pytest_collection_modifyitems(config, items):
        if os.environ.get("GPUMEM_BENCH_UNMARKED") == "1":
            for item in items:
                item.own_markers[:] = [m for m in item.own_markers if m.name != "gpumem"]


    def _profiler():
        import torch
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        with profile(activities=activities, profile_memory=True) as prof:
            yield
        running = peak = 0
        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation:
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            stack.extend(node.children)
        for _, size in sorted(events):
            running += size
            peak = max(peak, running)


    def _memtracker():
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.optim.optimizer import register_optimizer_step_post_hook

        tracker = MemTracker()
        # MemTracker refuses a module's second forward until its statistics are reset
        hook = register_optimizer_step_post_hook(lambda *args: tracker.reset_mod_stats())
        try:
            with tracker:
                yield
        finally:
            hook.remove()
        tracker.get_tracker_snapshot("peak")


    def _dispatch():
        from torch.utils._python_dispatch import TorchDispatchMode

        class Empty(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Empty():
            yield


    ANCHORS = {"profiler": _profiler, "memtracker": _memtracker, "dispatch": _dispatch}


    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):
        if not ANCHOR:
            return (yield)
        with contextlib.contextmanager(ANCHORS[ANCHOR])():
            return (yield)
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

TRANSFORMERS_TEST_FILE = textwrap.dedent(
    '''
    """Tiny BERT training steps: the module imports transformers at collection."""

    import pytest
    import torch
    from transformers import BertConfig, BertForMaskedLM

    CONFIG = BertConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )


    def train():
        torch.manual_seed(0)
        model = BertForMaskedLM(CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, CONFIG.vocab_size, (4, 32))
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()

    {tests}
    '''
)

TRANSFORMERS_TEST = textwrap.dedent(
    """
    @pytest.mark.gpumem(peak="1GiB")
    def test_bert_{index}():
        train()
    """
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

NOOP_TEST_FILE = textwrap.dedent(
    '''
    """Marked tests that run nothing: a check of bench_overhead.py itself, not a measurement."""

    import pytest

    {tests}
    '''
)

NOOP_TEST = textwrap.dedent(
    """
    @pytest.mark.gpumem(peak="1GiB")
    def test_noop_{index}():
        pass
    """
)

#: Tests a suite has by default.
DEFAULT_TESTS = {"tiny": 200, "encoder": 40, "transformers": 40, "noop": 10, "cuda": 60}


def write_suite(folder: Path, tests: int, *, suite: str = "tiny") -> None:
    """Write ``tests`` marked training-step tests of ``suite`` (``tiny``, ``encoder``, ``transformers``
    or ``cuda``; ``noop``: marked tests that run nothing) in ``FILES`` files, and the conftest."""
    (folder / "conftest.py").write_text(CONFTEST)
    per_file = -(-tests // FILES)
    for f in range(FILES):
        indices = range(f * per_file, min(tests, (f + 1) * per_file))
        if suite == "cuda":
            body = "".join(CUDA_TEST.format(index=i, d_model=256 + 64 * (i % 4)) for i in indices)
            text = CUDA_TEST_FILE.format(tests=body)
        elif suite == "encoder":
            text = ENCODER_TEST_FILE.format(tests="".join(ENCODER_TEST.format(index=i) for i in indices))
        elif suite == "transformers":
            text = TRANSFORMERS_TEST_FILE.format(tests="".join(TRANSFORMERS_TEST.format(index=i) for i in indices))
        elif suite == "noop":
            text = NOOP_TEST_FILE.format(tests="".join(NOOP_TEST.format(index=i) for i in indices))
        else:
            body = "".join(TEST.format(index=i, optimizer="adamw" if i % 2 else "sgd-momentum") for i in indices)
            text = TEST_FILE.format(tests=body)
        (folder / f"test_steps_{f}.py").write_text(text)


@dataclass
class Variant:
    """One way of running the suite, its rounds' wall and CPU seconds."""

    name: str
    label: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    reference: str = "off"
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    figures: dict[str, str] | None = None

    def median(self, kind: str) -> float:
        return statistics.median(getattr(self, kind))


#: Not loading the plugin, whether installed (the ``gpumem`` entry point) or named in PYTEST_PLUGINS.
OFF = ["-p", "no:gpumem", "-p", "no:pytest_gpumem.plugin"]
WARM = {"GPUMEM_BENCH_WARM_UP": "1"}


def all_variants(*, cuda: bool) -> dict[str, Variant]:
    """Every variant by name (see the module's docstring)."""
    engine = "the CUDA engine" if cuda else "the CPU engine"
    on = ["--gpumem-require-gpu"] if cuda else []
    found = [
        Variant("off", "off (-p no:gpumem)", OFF),
        Variant("on", f"on ({engine})", on),
        Variant("off-warm", "off, warm-up conftest", OFF, WARM, reference="off-warm"),
        Variant("on-warm", f"on ({engine}), warm-up conftest", on, WARM, reference="off-warm"),
        Variant("breakdown", "on --gpumem-breakdown", [*on, "--gpumem-breakdown"]),
        Variant("loaded", "loaded, unmarked", [], {"GPUMEM_BENCH_UNMARKED": "1"}),
        Variant("memray", "pytest-memray --memray", [*OFF, "--memray"]),
        Variant("profiler", "torch.profiler(profile_memory) per test", OFF, {"GPUMEM_BENCH_ANCHOR": "profiler"}),
        Variant("memtracker", "MemTracker per test", OFF, {"GPUMEM_BENCH_ANCHOR": "memtracker"}),
        Variant("dispatch", "empty TorchDispatchMode per test", OFF, {"GPUMEM_BENCH_ANCHOR": "dispatch"}),
    ]
    if not cuda:
        found.append(Variant("allocations", "on --gpumem-observe=allocations", ["--gpumem-observe=allocations"]))
    return {variant.name: variant for variant in found}


ANCHORS = ("memray", "profiler", "memtracker", "dispatch")


def other_variants(checkout: Path, runs: list[Variant]) -> list[Variant]:
    """The variants that measure (``on``, ``on-warm``, ``breakdown``, ``allocations``) with the plugin
    of another checkout: the same options, the package imported from there (``PYTHONPATH`` comes
    before the installed one)."""
    found = []
    for variant in runs:
        if variant.name in ("on", "on-warm", "breakdown", "allocations"):
            env = {**variant.env, "PYTHONPATH": str(checkout)}
            name = f"other{variant.name[2:]}" if variant.name.startswith("on") else f"other-{variant.name}"
            found.append(Variant(name, f"{variant.label} [{checkout.name}]", variant.args, env, variant.reference))
    return found


def choose(names: list[str] | None, *, cuda: bool, warm_up: bool, anchors: bool) -> list[Variant]:
    """The variants to run, ``off`` first (and ``off-warm`` with a warm-up variant)."""
    known = all_variants(cuda=cuda)
    wanted = list(names) if names else ["off", "on", *(["off-warm", "on-warm"] if warm_up else [])]
    if anchors and not names:
        wanted += ANCHORS
    unknown = [name for name in wanted if name not in known]
    if "memray" in wanted and importlib.util.find_spec("pytest_memray") is None:
        raise SystemExit(
            "bench_overhead.py: the memray variant needs pytest-memray (pip install --group bench: pip 25.1 or later)"
        )
    if unknown:
        raise SystemExit(f"bench_overhead.py: unknown variant(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    if "off" not in wanted:
        wanted.insert(0, "off")
    if any(known[name].reference == "off-warm" for name in wanted) and "off-warm" not in wanted:
        wanted.insert(1, "off-warm")
    ordered = ["off", *(name for name in wanted if name != "off")]
    return [known[name] for name in dict.fromkeys(ordered)]


def plugin_installed() -> bool:
    return any(entry.name == "gpumem" for entry in importlib.metadata.entry_points(group="pytest11"))


def junit_figures(path: Path) -> dict[str, str]:
    """``{"nodeid property": value}`` of every ``gpumem.*`` junit property in ``path``."""
    figures = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name", "").startswith("gpumem"):
                figures[f"{case.get('name')} {prop.get('name')}"] = prop.get("value", "")
    return figures


def timed_run(command: list[str], **kwargs: Any) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """``subprocess.run(command, **kwargs)`` with its output captured as text: the result, its wall
    seconds and its CPU seconds (user + system, of the child and every process it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_session(
    folder: Path, variant: Variant, *, cov: bool, cuda: bool, junit: Path | None, collect: bool = False
) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one pytest session over ``folder`` in a fresh interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # bytecode caches as Python writes them by default: with PYTHONDONTWRITEBYTECODE set, pytest
    # would rewrite and compile the plugin's modules (assertion rewriting) in every session
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTEST_ADDOPTS", None)
    env.update(variant.env)
    if cuda:
        env["GPUMEM_BENCH_CUDA"] = "1"
    if collect:
        env["GPUMEM_BENCH_COLLECT"] = "1"
    args = list(variant.args)
    if not plugin_installed():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
        if "no:gpumem" not in args:
            args = ["-p", "pytest_gpumem.plugin", *args]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    if cov:
        command += ["--cov=.", "--cov-report="]
    if junit is not None:
        command.append(f"--junitxml={junit}")
    result, elapsed, cpu = timed_run([*command, str(folder)], cwd=folder, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return elapsed, cpu


def machine(*, cuda: bool) -> dict[str, Any]:
    """What the figures were measured on: Python, torch, pytest, CPUs, the GPU."""
    import pytest
    import torch

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pytest": pytest.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }
    if cuda:
        found["gpu"] = torch.cuda.get_device_name(0)
        found["cuda"] = torch.version.cuda
    return found


def ratios(runs: list[Variant]) -> dict[str, dict[str, float]]:
    """Each variant's median over its reference's, for wall and CPU time."""
    by_name = {variant.name: variant for variant in runs}
    found = {}
    for variant in runs:
        reference = by_name.get(variant.reference)
        if reference is None or not variant.wall or not reference.wall:
            continue
        found[f"{variant.name}/{reference.name}"] = {
            kind: variant.median(kind) / reference.median(kind) for kind in ("wall", "cpu")
        }
    return found


def report(runs: list[Variant], options: argparse.Namespace, *, stopped: bool, rounds: int) -> dict[str, Any]:
    """Print the table and return the JSON-ready result."""
    by_name = {variant.name: variant for variant in runs}
    rows = []
    for variant in runs:
        if not variant.wall:
            rows.append([variant.label, "not run", "", "", "", "", ""])
            continue
        reference = by_name[variant.reference]
        rows.append(
            [
                variant.label,
                f"{variant.median('wall'):.2f}",
                f"{variant.median('cpu'):.2f}",
                " ".join(f"{s:.2f}" for s in variant.cpu),
                f"{variant.median('wall') / reference.median('wall'):.3f}",
                f"{variant.median('cpu') / reference.median('cpu'):.3f}",
                f"{(variant.median('cpu') - reference.median('cpu')) / options.tests * 1000:+.2f}",
            ]
        )
    cov = " under pytest --cov" if options.cov else ""
    cov += ", each test after gc.collect()" if options.gc_collect else ""
    print(f"{options.tests} tests ({SUITES[options.suite]}){cov}, {rounds} interleaved rounds, OMP_NUM_THREADS=1")
    headers = ["variant", "wall s", "CPU s", "CPU s by round", "× ref wall", "× ref CPU", "CPU ms/test"]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    print("ref: off (-p no:gpumem); the warm-up variants: off with the same warm-up conftest")
    found = ratios(runs)
    if not rounds:
        rows.clear()
    on = found.get("on/off")
    warm = found.get("on-warm/off-warm")
    if on is not None:
        line = f"\nsession overhead, on / off: CPU ×{on['cpu']:.3f}, wall ×{on['wall']:.3f}"
        if warm is not None:
            line += f"; with the warm-up conftest: CPU ×{warm['cpu']:.3f}, wall ×{warm['wall']:.3f}"
            line += f"; as users write it / warm-up: CPU {on['cpu'] / warm['cpu']:.3f}"
        print(line)
    if stopped:
        print(f"(stopped after {rounds} rounds: --max-seconds {options.max_seconds})")
    return {
        "suite": options.suite,
        "tests": options.tests,
        "cov": options.cov,
        "gc_collect": options.gc_collect,
        "cuda": options.cuda,
        "rounds": rounds,
        "stopped_by_max_seconds": stopped,
        "machine": machine(cuda=options.cuda),
        "variants": [
            {
                "name": v.name,
                "label": v.label,
                "args": v.args,
                "env": v.env,
                "reference": v.reference,
                "wall_s": v.wall,
                "cpu_s": v.cpu,
                "median_wall_s": v.median("wall") if v.wall else None,
                "median_cpu_s": v.median("cpu") if v.cpu else None,
            }
            for v in runs
        ],
        "ratios": found,
    }


SUITES = {
    "tiny": "MLP steps on the CPU",
    "encoder": "TransformerEncoder steps on the CPU",
    "transformers": "BERT steps on the CPU, transformers imported at collection",
    "noop": "marked tests that run nothing: a check of the script, not a measurement",
    "cuda": "TransformerEncoder steps on CUDA",
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--suite",
        choices=("tiny", "mlp", "encoder", "transformers", "noop"),
        default="tiny",
        help="the suite written (default tiny); noop: marked tests that run nothing, to check the script itself",
    )
    parser.add_argument("--cuda", action="store_true", help="the GPU suite: TransformerEncoder steps on cuda")
    parser.add_argument(
        "--tests",
        type=int,
        default=None,
        help="generated tests (tiny 200, encoder 40, transformers 40, noop 10, cuda 60)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; figures are medians (default 3)")
    parser.add_argument("--warm-up", action="store_true", help="add the warm-up variants (off-warm, on-warm)")
    parser.add_argument("--anchors", action="store_true", help="add pytest-memray, the profiler, MemTracker, dispatch")
    parser.add_argument("--cov", action="store_true", help="run every variant under pytest --cov=. (pytest-cov)")
    parser.add_argument(
        "--gc-collect", action="store_true", help="every test starts with gc.collect() (an autouse fixture)"
    )
    parser.add_argument("--variants", nargs="+", default=None, help="the variants by name (off is always run)")
    parser.add_argument("--json", type=Path, default=None, help="write the rounds, medians, ratios and machine here")
    parser.add_argument("--max-seconds", type=float, default=None, help="start no round that would end past this")
    parser.add_argument("--keep", type=Path, default=None, help="write the suite here and keep it")
    parser.add_argument(
        "--no-untimed",
        action="store_true",
        help="no untimed session before the rounds (the first round pays for the caches): to check the script",
    )
    parser.add_argument(
        "--other",
        type=Path,
        default=None,
        help="another checkout of pytest-gpumem: adds its measuring variants, the plugin imported from there",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the options and print the variants; run nothing (no GPU needed)"
    )
    options = parser.parse_args(argv)
    if options.suite == "mlp":
        options.suite = "tiny"
    if options.cuda:
        if options.suite != "tiny":
            parser.error("--cuda writes its own suite (TransformerEncoder steps on cuda): leave --suite out")
        options.suite = "cuda"
    if options.tests is None:
        options.tests = DEFAULT_TESTS[options.suite]
    if options.tests < 1 or options.repeat < 1:
        parser.error(f"--tests and --repeat must be at least 1 (got {options.tests} and {options.repeat})")
    if options.max_seconds is not None and options.max_seconds <= 0:
        parser.error(f"--max-seconds must be positive (got {options.max_seconds})")
    options.runs = choose(options.variants, cuda=options.cuda, warm_up=options.warm_up, anchors=options.anchors)
    if options.other is not None:
        if not (options.other / "pytest_gpumem" / "plugin").is_dir():
            parser.error(f"--other {options.other}: no pytest_gpumem package there")
        options.runs += other_variants(options.other.resolve(), options.runs)
    if options.cuda and not options.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error(
                f"--cuda: no CUDA device is available (torch {torch.__version__}: torch.cuda.is_available() is False)"
            )
    return options


def main(argv: list[str] | None = None) -> None:
    began = time.perf_counter()
    options = parse(argv)
    if options.dry_run:
        print(
            f"{options.suite} suite, {options.tests} tests, {options.repeat} rounds: "
            + ", ".join(v.name for v in options.runs)
        )
        return
    runs: list[Variant] = options.runs
    cuda = options.cuda
    rounds, stopped, longest = 0, False, 0.0

    def over(estimate: float) -> bool:
        return options.max_seconds is not None and time.perf_counter() - began + estimate > options.max_seconds

    with tempfile.TemporaryDirectory(prefix="gpumem-bench-") as tmp:
        folder = options.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        write_suite(folder, options.tests, suite=options.suite)
        first = time.perf_counter()
        untimed = [variant for variant in runs if variant.name in ("off", "on", "other")] or runs[:2]
        if options.no_untimed:
            untimed = []
        for variant in untimed:  # the file cache, torch's first import, the bytecode caches
            run_session(folder, variant, cov=options.cov, cuda=cuda, junit=None, collect=options.gc_collect)
        # a round's estimate until one is timed (none without the untimed sessions)
        longest = (time.perf_counter() - first) / len(untimed) * len(runs) if untimed else 0.0
        for round_index in range(options.repeat):
            if over(longest):
                stopped = True
                break
            started = time.perf_counter()
            for variant in runs if round_index % 2 == 0 else runs[::-1]:
                junit = Path(tmp) / "junit.xml" if variant.figures is None else None
                wall, cpu = run_session(
                    folder, variant, cov=options.cov, cuda=cuda, junit=junit, collect=options.gc_collect
                )
                variant.wall.append(wall)
                variant.cpu.append(cpu)
                if junit is not None:
                    variant.figures = junit_figures(junit)
            rounds += 1
            longest = max(longest if rounds > 1 else 0.0, time.perf_counter() - started)
    if rounds == 0:
        print(f"no round fits in --max-seconds {options.max_seconds} (the untimed runs took it)")
    result = report(runs, options, stopped=stopped, rounds=rounds)
    if options.json is not None:
        result["seconds"] = time.perf_counter() - began
        result["untimed"] = [variant.name for variant in untimed]  # the sessions run before the rounds
        options.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
