"""The run's options: the ``--gpumem-*`` options (each with an ini setting) and their :class:`Settings`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
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
    """One ``--gpumem-NAME`` option and its ini setting ``gpumem_NAME``; a ``flag`` takes no value, another is read by
    ``parse`` (None: a path, checked as one)."""

    name: str
    help: str
    flag: bool = False
    default: str = ""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None

    @property
    def dest(self) -> str:
        """The option's destination and its ini setting's name: ``gpumem_update_baselines``."""
        return "gpumem_" + self.key

    @property
    def key(self) -> str:
        """The name its value has when read: ``update_baselines``."""
        return self.name.replace("-", "_")

    @property
    def flag_name(self) -> str:
        return f"--gpumem-{self.name}"

    @property
    def ini_help(self) -> str:
        """The ini setting's help (``pytest --help``): the option's, naming the option that overrides it."""
        text = self.help.rstrip(".")
        kind = "true or false; " if self.flag else ""
        return f"{text[:1].upper()}{text[1:]} ({kind}{self.flag_name} overrides it)."


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


#: Every option, in ``--help`` order.
OPTIONS: tuple[Option, ...] = (
    Option(
        "device",
        "device measured tests run on: auto (CUDA when available, else CPU), cpu, cuda or cuda:N. Default: auto.",
        default="auto",
        metavar="DEVICE",
        parse=parse_device,
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
        parse=parse_observe,
    ),
    Option(
        "predict",
        "CPU engine: report what this GPU would show (h100): its caching allocator's blocks and segments "
        "and its library workspaces, from the CPU run's allocations. Ignored on CUDA.",
        metavar="GPU",
        parse=parse_predict,
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
        parse=parse_tolerance,
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
        parse=parse_size,
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
        parse=parse_sites_mode,
    ),
    Option(
        "sites-rerun-limit",
        "the longest first call, in seconds, after which a test that failed on memory is not run again for "
        "its sites (the failure says how to get them). Default: 10.",
        default="10",
        metavar="SECONDS",
        parse=parse_seconds,
    ),
    Option(
        "sites-include",
        "comma-separated packages whose frames count as your code for sites (e.g. transformers); by "
        "default only files under the rootdir do.",
        metavar="PKGS",
        parse=_packages,
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
    fake: bool
    leak_check: bool
    artifacts: Path
    artifacts_all: bool
    snapshot: bool
    sites: str
    sites_rerun_limit: float
    site_config: SiteConfig
    baselines: BaselineOptions
    predict: str | None = None
    device_limit: int | None = None

    @classmethod
    def read(cls, value: Callable[[str], Any], rootpath: Path, cache_dir: Callable[[], Path] | None = None) -> Settings:
        """The settings: each the command line's value, else the ini file's; paths relative to ``rootpath``."""
        flags = {option.key: bool(value(option.dest)) for option in OPTIONS if option.flag}
        disable = flags["disable"] = flags["disable"] or _env_flag(DISABLE_ENV)
        update = flags["update_baselines"]
        if disable and update:
            raise OptionError(
                "--gpumem-update-baselines cannot run with --gpumem-disable (or "
                f"{DISABLE_ENV}): nothing is measured, so nothing could be recorded"
            )
        values: dict[str, Any] = {}
        for option in OPTIONS:
            if option.flag:  # read above
                continue
            given = value(option.dest)
            text = ("" if given is None else str(given).strip()) or option.default
            if not text:
                continue
            try:
                if option.parse is not None:
                    values[option.key] = option.parse(text)
                    continue
                # a path, checked before any test runs, so that a report is not lost at the end
                where = rootpath / Path(text).expanduser()  # an absolute path stays as it is
                folder, written = option.name == "artifacts", option.name != "baselines" or update
                problem = None if disable else unwritable(where, folder=folder, written=written)
                if problem is not None:
                    raise ValueError(problem)
                values[option.key] = where
            except ValueError as exc:  # SpecError and SizeError too
                raise OptionError(f"{option.flag_name} / ini {option.dest}: {exc}") from None
        own = {field.name for field in fields(cls)} - {"artifacts", "baselines"}
        return cls(
            **{key: found for key, found in {**flags, **values}.items() if key in own},
            artifacts=values.get("artifacts") or (cache_dir() if cache_dir else rootpath / ".gpumem-artifacts"),
            site_config=SiteConfig(str(rootpath), values.get("sites_include", ())),
            baselines=BaselineOptions(
                path=values.get("baselines", rootpath / DEFAULT_FILENAME),
                tolerance=values.get("tolerance"),
                update=update,
                strict=flags["strict"],
                prune=flags["prune"],
                json_path=values.get("json"),
                markdown_path=values.get("markdown"),
                step_summary=not flags["no_step_summary"],
                generator=f"pytest-gpumem {__version__}",
            ),
        )


def _env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value; another value is an error."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise OptionError(f"{name}={os.environ[name]!r}: expected 1, true, yes or on (or 0, false, no, off)")
