"""Where one measured CPU test's time goes: the floor of a Python dispatch mode, and the rest.

Run: ``python benchmarks/bench_floor.py [--repeat 11]``

The body is the encoder suite's test (``bench_overhead.py --suite encoder``): build a 2-layer
``nn.TransformerEncoder`` (d_model 128, 4 heads, feed-forward 512, no dropout) and AdamW, then
three training steps on a batch of 8 × 64 tokens: about 2,200 operators and 600 storages. In
one process, each round runs every variant once (the order reversed every other round), and
each figure is the median of ``--repeat`` rounds:

* ``plain``: the body alone, the reference;
* ``empty dispatch mode``: under a ``TorchDispatchMode`` that only calls the operator (what
  any Python dispatch mode costs: torch's own machinery per operator);
* ``saved-tensor hooks``: under ``saved_tensors_hooks`` that return their argument;
* ``tracker``: under the storage tracker (its dispatch mode and saved-tensor hooks);
* ``tracker + timeline``: the same, keeping the timeline the HTML artifact draws;
* ``measured test``: the whole measured test as the plugin runs it (``TestRun``: the
  clean-state protocol, the tracker with its timeline, the finish and the record), the
  collector's objects frozen once before, as in a pytest session.

The difference between the first two rows is the floor that any exact per-operator tracker in
Python pays; the rows after it are what the plugin adds to it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import ENCODER_TEST_FILE

from pytest_gpumem.measurement.engines.tracker import StorageTracker
from pytest_gpumem.plugin.marker import parse_marker
from pytest_gpumem.plugin.plan import TestPlan
from pytest_gpumem.plugin.run_engines import Engines, Freezer
from pytest_gpumem.plugin.runner import TestRun


def _encoder_body() -> Callable[[], None]:
    """The encoder suite's ``train()``, from the very text ``bench_overhead.py`` writes."""
    namespace: dict[str, Any] = {}
    exec(ENCODER_TEST_FILE.format(tests=""), namespace)
    train: Callable[[], None] = namespace["train"]
    return train


body = _encoder_body()


class EmptyMode(TorchDispatchMode):
    """Calls each operator and nothing else."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no TorchDynamo wrapper around __torch_dispatch__, as the tracker's mode

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func._op(*args, **kwargs) if kwargs else func._op(*args)


def variants() -> dict[str, Callable[[], None]]:
    tracker = StorageTracker(torch.device("cpu"))

    def empty() -> None:
        with EmptyMode():
            body()

    def hooks() -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            body()

    def tracked(timeline: bool) -> Callable[[], None]:
        def run() -> None:
            tracker.start(timeline=timeline)
            try:
                body()
            finally:
                tracker.stop()

        return run

    body()  # torch imports parts of itself at the first step: before the freeze, as a suite's conftest would
    freezer = Freezer()
    freezer.start()
    engine = Engines(freezer=freezer).cpu()
    spec = parse_marker([((), {"peak": "1GiB"})])

    def measured() -> None:
        TestRun(TestPlan("bench_floor.py::test_encoder", spec), engine, environment={}).run(body)

    return {
        "plain": body,
        "empty dispatch mode": empty,
        "saved-tensor hooks": hooks,
        "tracker": tracked(False),
        "tracker + timeline": tracked(True),
        "measured test": measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeat", type=int, default=11, help="interleaved rounds; figures are medians (default 11)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = variants()
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.repeat):
        order = list(runs.items()) if round_ % 2 else list(reversed(runs.items()))
        for name, run in order:
            gc.collect()
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    plain = statistics.median(times["plain"])
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append((name, f"{median * 1e3:.2f}", f"{median / plain:.3f}", f"{(median - plain) * 1e3:+.2f}"))
    print(f"one encoder test in one process, {args.repeat} interleaved rounds, torch threads 1")
    print(tabulate(rows, headers=["variant", "ms", "× plain", "ms over plain"]))


if __name__ == "__main__":
    main()
