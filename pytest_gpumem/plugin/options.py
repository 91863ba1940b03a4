"""The run's options: the ``--gpumem-*`` options (each with an ini setting) and their :class:`Settings`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpumem import __version__
from pytest_gpumem.baselines import DEFAULT_FILENAME
from pytest_gpumem.data.findings import parse_tolerance
from pytest_gpumem.data.site_figures import SiteConfig, parse_sites_mode
from pytest_gpumem.files import unwritable
from pytest_gpumem.judge.rule import describe_default_tolerances
from pytest_gpumem.measurement.observe import parse_observe
from pytest_gpumem.plugin.marker import parse_device, parse_predict, parse_seconds
from pytest_gpumem.plugin.session import BaselineOptions
from pytest_gpumem.units import parse_size

__all__ = ["DISABLE_ENV", "OPTIONS", "Option", "OptionError", "Settings"]

#: The environment variable that disables the plugin as ``--gpumem-disable`` does.
DISABLE_ENV = "PYTEST_GPUMEM_DISABLE"


@dataclass(frozen=True)
class Option:
    """One ``--gpumem-NAME`` option and its ini setting ``gpumem_NAME``; a ``flag`` takes no value."""

    name: str
    help: str
    flag: bool = False
    default: str = ""
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """The option's destination and its ini setting's name: ``gpumem_update_baselines``."""
        return "gpumem_" + self.name.replace("-", "_")

    @property
    def flag_name(self) -> str:
        return f"--gpumem-{self.name}"

    @property
    def ini_help(self) -> str:
        """The ini setting's help (``pytest --help``): the option's, naming the option that overrides it."""
        text = self.help.rstrip(".")
        kind = "true or false; " if self.flag else ""
        return f"{text[:1].upper()}{text[1:]} ({kind}{self.flag_name} overrides it)."


#: Every option, in ``--help`` order.
OPTIONS: tuple[Option, ...] = (
    Option(
        "device",
        "device measured tests run on: auto (CUDA when available, else CPU), cpu, cuda or cuda:N. Default: auto.",
        default="auto",
        metavar="DEVICE",
    ),
    Option(
        "disable",
        "run every test, the gpumem fixture included, with nothing measured, judged or written "
        "(also: PYTEST_GPUMEM_DISABLE=1).",
        flag=True,
    ),
    Option("require-gpu", "fail (instead of skip) measured tests when no CUDA device is available.", flag=True),
    Option(
        "breakdown",
        "the full breakdown by category: activations told apart from temporaries, the storage tracker on CUDA.",
        flag=True,
    ),
    Option("cuda-rounding", "CPU engine: round storages up to 512-byte blocks as CUDA does.", flag=True),
    Option(
        "observe",
        "CPU engine: how memory is seen: operators (the storage tracker; default) or allocations (the CPU "
        "allocator's reports to PyTorch's profiler: torch.compile'd code runs as compiled). Ignored on CUDA.",
        default="operators",
        metavar="HOW",
    ),
    Option(
        "predict",
        "CPU engine: report what this GPU would show (h100): its caching allocator's blocks and segments "
        "and its library workspaces, from the CPU run's allocations. Ignored on CUDA.",
        metavar="GPU",
    ),
    Option(
        "fake",
        "CPU engine, with a prediction: run the predicted tests on fake tensors (shapes and dtypes, no data), "
        "so that models larger than this machine are predicted. Ignored on CUDA.",
        flag=True,
    ),
    Option("baselines", f"baseline file (default: {DEFAULT_FILENAME} at the rootdir).", metavar="PATH"),
    Option("update-baselines", "record the figures of tests that ran and passed into the baseline file.", flag=True),
    Option(
        "tolerance",
        "tolerance of baseline comparisons: '2%', '1MiB', '2%,1MiB' or '0'; a size bounds byte figures only "
        f"(default: {describe_default_tolerances()}).",
        metavar="TOL",
    ),
    Option("strict", "fail on new, improved, other-environment and stale baselines too (ratcheting CI).", flag=True),
    Option("prune", "with --gpumem-update-baselines: remove baselines of tests that no longer exist.", flag=True),
    Option("json", "write the JSON report (environment, measurements, verdicts) to PATH.", metavar="PATH"),
    Option("markdown", "write the Markdown report to PATH.", metavar="PATH"),
    Option("no-step-summary", "do not append the Markdown report to $GITHUB_STEP_SUMMARY.", flag=True),
    Option(
        "device-limit",
        "run every measured test as if the device had SIZE bytes (e.g. 24GiB); the marker's device_limit wins.",
        metavar="SIZE",
    ),
    Option("leak-check", "check every measured test for leaks (as retained='0B' does).", flag=True),
    Option(
        "artifacts",
        "folder for the HTML memory timelines of failed tests (default: gpumem-artifacts in the pytest cache).",
        metavar="DIR",
    ),
    Option("artifacts-all", "write artifacts for passing tests too.", flag=True),
    Option("snapshot", "record allocation history and write a PyTorch memory snapshot per test.", flag=True),
    Option(
        "sites",
        "when measured tests record where their bytes were made (the lines, by growth, in a failure): rerun "
        "(default: on --gpumem-update-baselines and on fake tensors, and a test that fails on memory runs its "
        "call once more with sites on), always (in every run: costs each test a frame walk per allocation) or off.",
        default="rerun",
        metavar="MODE",
    ),
    Option(
        "sites-rerun-limit",
        "the longest first call, in seconds, after which a test that failed on memory is not run again for "
        "its sites (the failure says how to get them). Default: 10.",
        default="10",
        metavar="SECONDS",
    ),
    Option(
        "sites-include",
        "comma-separated packages whose frames count as your code for sites (e.g. transformers); by "
        "default only files under the rootdir do.",
        metavar="PKGS",
    ),
)


class OptionError(ValueError):
    """An option or ini value that cannot be used; the message names both and the value."""


@dataclass(frozen=True)
class Settings:
    """The run's options, each from the command line or else its ini value."""

    device: str
    disable: bool
    require_gpu: bool
    breakdown: bool
    cuda_rounding: bool
    observe: str
    predict: str | None
    fake: bool
    device_limit: int | None
    leak_check: bool
    artifacts: Path
    artifacts_all: bool
    snapshot: bool
    baselines: BaselineOptions
    sites: str = "rerun"
    site_config: SiteConfig | None = None
    rerun_limit: float = 10.0

    @classmethod
    def read(cls, value: Callable[[str], Any], rootpath: Path, cache_dir: Callable[[], Path] | None = None) -> Settings:
        """The settings: each the command line's value, else the ini file's; paths relative to ``rootpath``."""

        def text(name: str) -> str:
            got = value(name)
            return "" if got is None else str(got).strip()

        def parsed(name: str, parse: Callable[[str], Any], default: str = "") -> Any:
            given = text(name) or default
            try:
                return parse(given) if given else None
            except ValueError as exc:  # SpecError and SizeError too
                raise OptionError(f"--{name.replace('_', '-')} / ini {name}: {exc}") from None

        update = bool(value("gpumem_update_baselines"))
        disable = bool(value("gpumem_disable")) or _env_flag(DISABLE_ENV)
        if disable and update:
            raise OptionError(
                "--gpumem-update-baselines cannot run with --gpumem-disable (or "
                f"{DISABLE_ENV}): nothing is measured, so nothing could be recorded"
            )

        def output(name: str, *, folder: bool = False, written: bool = True) -> Path | None:
            """The path ``name`` gives (relative to ``rootpath``), checked before any test runs, so that a report is not
            lost at the end."""
            found = text(name)
            if not found:
                return None
            where = rootpath / Path(found).expanduser()  # an absolute path stays as it is
            problem = None if disable else unwritable(where, folder=folder, written=written)
            if problem is not None:
                raise OptionError(f"--{name.replace('_', '-')} / ini {name}: {problem}")
            return where

        json_path = output("gpumem_json")
        markdown_path = output("gpumem_markdown")
        baselines = output("gpumem_baselines", written=update)
        artifacts = output("gpumem_artifacts", folder=True)
        if artifacts is None:
            artifacts = cache_dir() if cache_dir is not None else rootpath / ".gpumem-artifacts"
        return cls(
            device=parsed("gpumem_device", parse_device, "auto"),
            disable=disable,
            require_gpu=bool(value("gpumem_require_gpu")),
            breakdown=bool(value("gpumem_breakdown")),
            cuda_rounding=bool(value("gpumem_cuda_rounding")),
            observe=parsed("gpumem_observe", parse_observe, "operators"),
            predict=parsed("gpumem_predict", parse_predict),
            fake=bool(value("gpumem_fake")),
            device_limit=parsed("gpumem_device_limit", parse_size),
            leak_check=bool(value("gpumem_leak_check")),
            artifacts=artifacts,
            artifacts_all=bool(value("gpumem_artifacts_all")),
            snapshot=bool(value("gpumem_snapshot")),
            sites=parsed("gpumem_sites", parse_sites_mode, "rerun"),
            site_config=SiteConfig(str(rootpath), parsed("gpumem_sites_include", _packages) or ()),
            rerun_limit=parsed("gpumem_sites_rerun_limit", parse_seconds, "10"),
            baselines=BaselineOptions(
                path=baselines or rootpath / DEFAULT_FILENAME,
                tolerance=parsed("gpumem_tolerance", parse_tolerance),
                update=update,
                strict=bool(value("gpumem_strict")),
                prune=bool(value("gpumem_prune")),
                json_path=json_path,
                markdown_path=markdown_path,
                step_summary=not value("gpumem_no_step_summary"),
                generator=f"pytest-gpumem {__version__}",
            ),
        )


def _packages(text: str) -> tuple[str, ...]:
    """Comma-separated package names, each installed (found without importing it)."""
    import importlib.util

    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    for name in names:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ValueError(f"no package or module named {name!r} is installed")
    return names


def _env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value; another value is an error."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise OptionError(f"{name}={os.environ[name]!r}: expected 1, true, yes or on (or 0, false, no, off)")
