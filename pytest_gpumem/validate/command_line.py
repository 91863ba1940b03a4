"""The command line of ``python -m pytest_gpumem validate``, parsed without importing torch."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["MODELS", "SIZES", "build_parser"]

#: Zoo model names, in table order (:mod:`pytest_gpumem.validate.zoo`).
MODELS: tuple[str, ...] = ("mlp", "block", "gpt2", "llama")

#: Size names: ``"small"`` for a GPU record, ``"tiny"`` for tests.
SIZES: tuple[str, ...] = ("small", "tiny")


def build_parser() -> argparse.ArgumentParser:
    """The validation's argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m pytest_gpumem validate",
        description=(
            "Validate pytest-gpumem on a CUDA GPU and record what it saw (in a checkout: under "
            "fixtures/recorded/; installed: under ./gpumem-validation/ unless --out says where)."
        ),
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="folder in which the record folder <gpu-model>-torch<version>/ is written "
        "(default: fixtures/recorded; required with --cpu-only)",
    )
    parser.add_argument(
        "--cpu-only",
        "--dry-run",
        dest="cpu_only",
        action="store_true",
        help="run only what needs no GPU (CPU half of the zoo, references on the CPU engine); GPU figures are n/a",
    )
    parser.add_argument("--device", default="cuda", help="the CUDA device (default: cuda, the current one)")
    parser.add_argument("--size", choices=SIZES, default="small", help="zoo and reference sizes (default: small)")
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated zoo models (default: {','.join(MODELS)}; those whose package is missing are skipped)",
    )
    parser.add_argument("--skip-suite", action="store_true", help="do not run the CUDA test suite")
    parser.add_argument("--suite-timeout", type=float, default=300.0, help="seconds for the CUDA suite (default 300)")
    parser.add_argument("--pytest-arg", action="append", default=[], help="an extra argument for the CUDA suite")
    parser.add_argument(
        "--suite-from",
        type=Path,
        metavar="JUNIT_XML",
        help="the CUDA suite already ran on this machine (`pytest tests -m cuda --junitxml=FILE`): record its result "
        "from that JUnit XML file instead of running it again",
    )
    parser.add_argument("--suite-log", type=Path, help="with --suite-from: that run's output, kept in the record")
    parser.add_argument("--snapshot-entries", type=int, default=2_000, help="allocation history kept in the snapshot")
    parser.add_argument(
        "--trace",
        choices=("mlp", "reference"),
        default="mlp",
        help="what the memory snapshot's allocation history covers: the zoo MLP's fp32 training step "
        "(default: mlp) or the reference workloads (reference)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="a committed record folder (e.g. fixtures/recorded/nvidia-h100-80gb-hbm3-torch2.11): "
        "the figures of the workloads both records hold are compared, and the differences listed",
    )
    return parser
