"""``python -m pytest_gpumem validate``: validate pytest-gpumem on a CUDA GPU and record what it saw."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from pytest_gpumem.baselines import Environment
from pytest_gpumem.validate.against import differences, load_record
from pytest_gpumem.validate.command_line import build_parser
from pytest_gpumem.validate.compare import zoo_comparison, zoo_step
from pytest_gpumem.validate.reference import (
    counter_checks,
    reference_adam,
    reference_determinism,
    reference_hand_counters,
    reference_linear,
    reference_mlp,
    reference_workspaces,
)
from pytest_gpumem.validate.render import render_terminal
from pytest_gpumem.validate.replay import replay
from pytest_gpumem.validate.results import CHECKOUT, TRACED_STEP, Check, Run, log, suite_check
from pytest_gpumem.validate.suite_record import (
    build_record,
    record_name,
    run_suite,
    suite_from,
    take_snapshot,
    write_record,
)
from pytest_gpumem.validate.zoo import zoo


def main(argv: Sequence[str] | None = None) -> int:
    """Run the validation; 0 when every check passed, 1 when one failed, 2 when it could not run."""
    return run(build_parser().parse_args(argv))


def _refuse(message: str) -> int:
    """A validation that cannot run: its message goes to stderr, and the exit status is 2."""
    print(f"gpu-validate: {message}", file=sys.stderr)
    return 2


def run(options: argparse.Namespace) -> int:
    """Run the validation the parsed ``options`` ask for (:func:`~pytest_gpumem.validate.command_line.build_parser`)."""
    recorded = None if CHECKOUT is None else CHECKOUT / "fixtures" / "recorded"
    if options.cpu_only and options.out is None:
        return _refuse("--cpu-only needs --out DIR (only a GPU run writes under fixtures/)")
    if options.cpu_only and recorded is not None and options.out.resolve().is_relative_to(recorded.resolve()):
        return _refuse(f"--cpu-only must not write under {recorded}: only a GPU run may")
    if not options.cpu_only and not torch.cuda.is_available():
        return _refuse(
            "no CUDA device is available; run on a GPU machine, or use --cpu-only --out DIR to exercise the CPU half"
        )
    try:
        models = zoo(options.size, tuple(m.strip() for m in options.models.split(",") if m.strip()))
    except ValueError as exc:
        return _refuse(str(exc))
    mlp = next((m for m in models if m.name == "mlp" and m.available), None)
    if options.trace == "mlp" and mlp is None:
        return _refuse("--trace mlp needs the mlp model in --models")
    previous = None
    if options.against is not None:
        try:
            previous = load_record(options.against)
        except (OSError, ValueError) as exc:
            return _refuse(f"--against {options.against}: {exc}")

    gpu = None if options.cpu_only else _cuda_device(options.device)
    collected = Run(device=gpu or torch.device("cpu"), size=options.size)
    environment = None if gpu is None else Environment.detect("cuda", gpu)
    folder = (options.out or recorded or Path("gpumem-validation")) / record_name(
        None if environment is None else environment.device_name, torch.__version__
    )

    suite: dict[str, Any] | None = None
    suite_log: str | None = None
    if gpu is not None and options.suite_from is not None:
        try:
            suite, suite_log = suite_from(options.suite_from, options.suite_log)
        except (OSError, ValueError) as exc:
            return _refuse(f"--suite-from {options.suite_from}: {exc}")
    elif gpu is not None and not options.skip_suite and CHECKOUT is None:
        log("the CUDA test suite runs only from a checkout of pytest-gpumem: skipped (--skip-suite)")
    elif gpu is not None and not options.skip_suite:
        log("running the CUDA test suite")
        suite, suite_log = run_suite(options.pytest_arg, options.suite_timeout)
    if suite is not None:
        collected.checks.append(suite_check(suite))

    if gpu is not None:
        torch.cuda.set_device(gpu)
        torch.empty(1, device=gpu)
    with _history(collected, gpu, options.trace == "reference", options) as taken:
        reference_linear(collected)
        reference_adam(collected)
        reference_mlp(collected)
    if gpu is not None and options.trace == "mlp" and mlp is not None:
        with _history(collected, gpu, True, options) as taken, collected.guard("reference", "the traced MLP step"):
            collected.add(zoo_step(mlp, "fp32", gpu, "cuda", name=TRACED_STEP))
    snapshot_bytes, snapshot_stats, snapshot_info = taken or (None, None, None)
    reference_hand_counters(collected)
    available = [m for m in models if m.available]
    if available:
        reference_determinism(collected, available[0])
    reference_workspaces(collected, available)
    zoo_comparison(collected, models, gpu)
    counter_checks(collected)

    stats = {
        "workloads": {name: o.stats for name, o in collected.outcomes.items() if o.stats is not None},
        "snapshot": snapshot_stats,
    }
    record = build_record(
        collected,
        mode="cpu-only" if gpu is None else "gpu",
        environment=environment,
        suite=suite,
        snapshot=snapshot_info,
        models=models,
    )
    write_record(folder, record, stats, snapshot=snapshot_bytes, suite_log=suite_log)
    log(f"replaying {folder}")
    try:
        replayed = replay(folder)
    except Exception as exc:  # a record CI could not read: say so, keep the record for inspection
        replayed = [Check("replay", "the record reads back", False, detail=f"{type(exc).__name__}: {exc}")]
    record["checks"] += [c.to_dict() for c in replayed]
    if previous is not None:
        record["against"] = differences(record, previous, options.against.name)
    files = write_record(folder, record, stats, snapshot=snapshot_bytes, suite_log=suite_log)

    print(render_terminal(record))
    print()
    print(f"record: {folder}")
    for path in files:
        print(f"  {path.name}  {path.stat().st_size:,} B")
    return 1 if any(c["passed"] is False for c in record["checks"]) else 0


@contextlib.contextmanager
def _history(run: Run, gpu: torch.device | None, record: bool, options: argparse.Namespace) -> Iterator[list[Any]]:
    """Record the allocation history of the block's workloads; the list yielded holds the snapshot, its statistics and
    description once the block ends (empty when it failed)."""
    taken: list[Any] = []
    if gpu is None or not record:
        yield taken
        return
    torch.cuda.memory._record_memory_history(max_entries=options.snapshot_entries, stacks="python")
    try:
        yield taken
    finally:
        try:
            with run.guard("reference", "memory snapshot"):
                taken.extend(take_snapshot(gpu, options.snapshot_entries, options.trace))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


def _cuda_device(spec: str) -> torch.device:
    device = torch.device(spec)
    if device.type != "cuda":
        raise SystemExit(f"gpu-validate: --device must be a CUDA device, got {spec!r}")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
