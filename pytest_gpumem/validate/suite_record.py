"""The CUDA test suite, the memory snapshot, and the record written from them (machine paths made placeholders)."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import pickle
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import pytest_gpumem
from pytest_gpumem.baselines import Environment
from pytest_gpumem.validate.render import render_markdown
from pytest_gpumem.validate.results import (
    CHECKOUT,
    PROTOCOL,
    RECORD_FILE,
    RECORD_FILES,
    SCHEMA,
    SNAPSHOT_FILE,
    SNAPSHOT_LIMIT,
    STATS_FILE,
    SUITE_LOG,
    SUITE_LOG_LIMIT,
    SUMMARY_FILE,
    Run,
)
from pytest_gpumem.validate.zoo import ZooModel

# --------------------------------------------------------------------------- the CUDA suite


def plugin_installed() -> bool:
    """True when pytest finds the plugin through the ``pytest11`` entry point (pytest-gpumem is installed)."""
    try:
        points = importlib.metadata.entry_points(group="pytest11")
    except Exception:
        return False
    return any(point.value.split(":")[0].strip() == "pytest_gpumem.plugin" for point in points)


def suite_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The suite's environment: the checkout first on ``PYTHONPATH`` and, when the plugin is not installed, named in
    ``PYTEST_PLUGINS`` (which reaches every process)."""
    env = dict(environ)
    assert CHECKOUT is not None, "the CUDA suite runs from a checkout"
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *filter(None, [environ.get("PYTHONPATH")])])
    if not plugin_installed():
        plugins = [p for p in environ.get("PYTEST_PLUGINS", "").split(",") if p.strip()]
        if "pytest_gpumem.plugin" not in plugins:
            env["PYTEST_PLUGINS"] = ",".join([*plugins, "pytest_gpumem.plugin"])
    return env


_SUITE_ARGS = ("-m", "pytest", "tests", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs")


def run_suite(extra: Sequence[str], timeout: float) -> tuple[dict[str, Any], str]:
    """Run ``pytest tests -m cuda`` from the checkout; its counts (from junit XML) and its output."""
    with tempfile.TemporaryDirectory(prefix="gpu-validate-") as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, *_SUITE_ARGS, f"--junitxml={junit}", *extra]
        began = time.monotonic()
        env = suite_environment(os.environ)
        try:
            done = subprocess.run(command, cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=timeout)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            code = None
            output = _text(exc.stdout) + _text(exc.stderr) + f"\n[gpu-validate] timed out after {timeout:.0f} s\n"
        counts = _junit_counts(_junit_suites(junit))
    shown = ["python", *(c if not c.startswith("--junitxml") else "--junitxml=<tmp>" for c in command[1:])]
    summary: dict[str, Any] = {
        "command": " ".join(shown),
        "exit_code": code,
        "seconds": round(time.monotonic() - began, 1),
        **counts,
        "log": SUITE_LOG,
    }
    return summary, output


def suite_from(junit: Path, log: Path | None) -> tuple[dict[str, Any], str | None]:
    """The result of a CUDA suite that already ran, read from its JUnit XML file, and its output when given."""
    suites = _junit_suites(junit)
    if not suites:
        raise ValueError("not a JUnit XML report that pytest wrote")
    counts = _junit_counts(suites)
    failed = (counts["failures"] or 0) + (counts["errors"] or 0)
    summary: dict[str, Any] = {
        "command": f"python -m pytest tests -m cuda (its JUnit XML: {junit.name})",
        "exit_code": 1 if failed else 0 if counts["tests"] else 5,
        "seconds": round(sum(float(s.get("time", 0)) for s in suites), 1),
        **counts,
        "log": SUITE_LOG if log is not None else None,
    }
    return summary, None if log is None else log.read_text(encoding="utf-8", errors="replace")


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _junit_suites(path: Path) -> list[ElementTree.Element] | None:
    """The ``testsuite`` elements of a JUnit XML report; None without one (pytest did not start, or was killed)."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    return [root] if root.tag == "testsuite" else list(root.iter("testsuite"))


def _junit_counts(suites: list[ElementTree.Element] | None) -> dict[str, int | None]:
    keys = ("tests", "failures", "errors", "skipped")
    if suites is None:
        return dict.fromkeys(keys)
    return {key: sum(int(suite.get(key, 0)) for suite in suites) for key in keys}


# --------------------------------------------------------------------------- the snapshot


def take_snapshot(device: torch.device, entries: int, workloads: str) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    """The memory snapshot so far (pickled, cut to :data:`SNAPSHOT_LIMIT`), the ``memory_stats()`` after it, a note
    (``workloads``: what the history covers)."""
    snapshot = scrub_paths(torch.cuda.memory._snapshot())
    stats = dict(torch.cuda.memory_stats(device))
    traces = snapshot.get("device_traces") or []
    kept = [len(trace) for trace in traces]
    data = pickle.dumps(snapshot)
    while len(data) > SNAPSHOT_LIMIT and any(kept):
        kept = [n // 2 for n in kept]
        snapshot["device_traces"] = [trace[len(trace) - n :] for trace, n in zip(traces, kept, strict=True)]
        data = pickle.dumps(snapshot)
    info = {
        "file": SNAPSHOT_FILE,
        "device_index": device.index,
        "max_entries": entries,
        "trace_entries": sum(kept),
        "segments": len(snapshot.get("segments", [])),
        "bytes": len(data),
        "workloads": workloads,
    }
    return data, stats, info


class _PlainData(pickle.Unpickler):
    """Reads a pickle of plain data only (dicts, lists, strings, numbers): any class is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a memory snapshot holds plain data only")


def load_snapshot(path: Path) -> dict[str, Any]:
    """A memory snapshot written by this script, read without executing anything it could name."""
    with path.open("rb") as handle:
        data = _PlainData(handle).load()
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a memory snapshot (a {type(data).__name__})")
    return data


# --------------------------------------------------------------------------- the record


def record_name(device_name: str | None, torch_version: str) -> str:
    """The record's folder name: ``"nvidia-h100-80gb-hbm3-torch2.13"``; ``"cpu-only-torch2.13"`` without a GPU."""
    model = re.sub(r"[^a-z0-9]+", "-", (device_name or "cpu-only").lower()).strip("-") or "unknown-gpu"
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    version = f"{match[1]}.{match[2]}" if match else re.sub(r"[^0-9a-z.]+", "-", torch_version.lower())
    return f"{model}-torch{version}"


def recorded_folders(directory: Path) -> list[Path]:
    """The record folders under ``directory`` (each holds a ``record.json``), sorted by name."""
    return sorted(path.parent for path in directory.glob(f"*/{RECORD_FILE}"))


def build_record(
    run: Run,
    *,
    mode: str,
    environment: Environment | None,
    suite: Mapping[str, Any] | None,
    snapshot: Mapping[str, Any] | None,
    models: Sequence[ZooModel],
) -> dict[str, Any]:
    """The JSON-ready record of a run (``record.json``); the stats dumps go to their own file."""
    cpu_environment = Environment.detect("cpu", cuda_rounding=True)
    try:
        transformers: str | None = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    return {
        "schema": SCHEMA,
        "protocol": PROTOCOL,
        "generator": f"python -m pytest_gpumem validate (pytest-gpumem {pytest_gpumem.__version__})",
        "mode": mode,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers,
        "device": str(run.device),
        "environment": None if environment is None else environment.to_dict(),
        "environment_key": None if environment is None else environment.key,
        "cpu_environment": cpu_environment.to_dict(),
        "cpu_environment_key": cpu_environment.key,
        "size": run.size,
        "models": [m.name for m in models],
        "suite": None if suite is None else dict(suite),
        "figures": dict(run.figures),
        "checks": [c.to_dict() for c in run.checks],
        "workloads": {
            name: {"measurement": o.measurement.to_dict(), "counters": o.counters, "stats": o.stats is not None}
            for name, o in run.outcomes.items()
        },
        "zoo": run.zoo_rows,
        "snapshot": None if snapshot is None else dict(snapshot),
        "files": {},
    }


def write_record(
    folder: Path,
    record: dict[str, Any],
    stats: Mapping[str, Any],
    *,
    snapshot: bytes | None = None,
    suite_log: str | None = None,
) -> list[Path]:
    """Write the record's files into ``folder`` (replacing an earlier record there); returns them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in RECORD_FILES:
        (folder / name).unlink(missing_ok=True)
    files: dict[str, str] = {"record": RECORD_FILE, "summary": SUMMARY_FILE, "memory_stats": STATS_FILE}
    if snapshot is not None:
        (folder / SNAPSHOT_FILE).write_bytes(snapshot)
        files["snapshot"] = SNAPSHOT_FILE
    if suite_log is not None:
        tail = scrub_paths(suite_log.encode()[-SUITE_LOG_LIMIT:].decode(errors="replace"))
        (folder / SUITE_LOG).write_text(tail, encoding="utf-8")
        files["suite_log"] = SUITE_LOG
    record["files"] = files
    record.update(scrub_paths(dict(record)))
    _write_json(folder / STATS_FILE, stats)
    _write_json(folder / RECORD_FILE, record)
    (folder / SUMMARY_FILE).write_text(render_markdown(record), encoding="utf-8")
    return [folder / name for name in RECORD_FILES if (folder / name).exists()]


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- paths


#: The installation's folders and their placeholders.
_INSTALLED = {
    "purelib": "<site-packages>",
    "platlib": "<site-packages>",
    "stdlib": "<python>",
    "platstdlib": "<python>",
}


def machine_paths() -> dict[str, str]:
    """This machine's folders that a record must not name, each with its placeholder (longest first when applied)."""
    paths = sysconfig.get_paths()
    found = {paths[key]: name for key, name in _INSTALLED.items() if key in paths}
    if CHECKOUT is not None:
        found[str(CHECKOUT)] = "<checkout>"
    found[str(Path(__file__).resolve().parents[1])] = "<checkout>/pytest_gpumem"
    found[sys.prefix] = "<prefix>"
    found[tempfile.gettempdir()] = "<tmp>"
    found[str(Path.home())] = "<home>"
    return {os.path.realpath(path): name for path, name in found.items() if path and path != os.sep}


#: Folders that name a machine whatever its layout: installed packages and the standard library (before this machine's
#: prefixes) ...
_LAYOUTS = (
    (re.compile(r"(?:/[^/\s\"']+)+/site-packages(?=/)"), "<site-packages>"),
    (re.compile(r"(?:/[^/\s\"']+)*/lib/python3\.\d+(?=/)"), "<python>"),
)
#: ... and another machine's temporary folders (read after them: this machine's TMPDIR is one).
_OTHER_TMP = re.compile(r"/tmp/[^/\s\"']+")


def scrub_paths(value: Any, paths: Mapping[str, str] | None = None) -> Any:
    """``value`` (a string, or containers of them) with this machine's folders, ``paths`` and any installed-packages,
    standard-library and temporary folder made placeholders, so a record does not name its machine."""
    prefixes = sorted({**machine_paths(), **(paths or {})}.items(), key=lambda item: -len(item[0]))

    @functools.cache  # one object per text: a pickle stores a repeated frame's file once
    def clean(text: str) -> str:
        for pattern, name in _LAYOUTS:
            text = pattern.sub(name, text)
        for prefix, name in prefixes:
            text = text.replace(prefix, name)
        return _OTHER_TMP.sub("<tmp>", text)

    made: dict[int, Any] = {}  # a container shared in ``value`` (a frame list) stays shared

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            return clean(item)
        if not isinstance(item, (dict, list, tuple)):
            return item
        done = made.get(id(item))
        if done is None:
            if isinstance(item, dict):
                done = {key: walk(entry) for key, entry in item.items()}
            else:
                done = type(item)(walk(entry) for entry in item)
            made[id(item)] = done
        return done

    return walk(value)
