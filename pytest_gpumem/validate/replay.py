"""Replaying a record on any machine: the figures it holds judged again by today's code."""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines import Environment
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.measurement.engines.cuda import reading_from_stats
from pytest_gpumem.report.details import measurement_table
from pytest_gpumem.report.text import markdown_report, summary_rows
from pytest_gpumem.units import format_size
from pytest_gpumem.validate.compare import zoo_figures
from pytest_gpumem.validate.results import (
    PROTOCOL,
    RECORD_FILE,
    SCHEMA,
    SNAPSHOT_FILE,
    STATS_FILE,
    SUITE_LOG,
    Check,
    agreeing,
    reserved_slack,
)
from pytest_gpumem.validate.suite_record import load_snapshot


@dataclass
class Loaded:
    """A record folder read back: ``record.json``, the ``memory_stats()`` dumps, the snapshot (if any)."""

    folder: Path
    record: dict[str, Any]
    stats: dict[str, Any]
    snapshot: dict[str, Any] | None

    @property
    def gpu(self) -> bool:
        return bool(self.record.get("mode") == "gpu")

    def measurements(self) -> dict[str, Measurement]:
        return {name: Measurement.from_dict(w["measurement"]) for name, w in self.record["workloads"].items()}


def load_record(folder: Path) -> Loaded:
    """Read a record folder written by :func:`write_record`."""
    record = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    if record.get("schema") != SCHEMA:
        raise ValueError(f"{folder / RECORD_FILE}: schema {record.get('schema')!r}, this script reads {SCHEMA}")
    stats_path = folder / STATS_FILE
    stats = json.loads(stats_path.read_text(encoding="utf-8")) if stats_path.exists() else {}
    snapshot_path = folder / SNAPSHOT_FILE
    snapshot = load_snapshot(snapshot_path) if snapshot_path.exists() else None
    return Loaded(folder, record, stats, snapshot)


def replay_stats(loaded: Loaded) -> list[Check]:
    """Each raw ``memory_stats()`` dump, read by ``reading_from_stats``, gives the recorded figures."""
    checks = []
    dumps: Mapping[str, Any] = loaded.stats.get("workloads") or {}
    measurements = loaded.measurements()
    if loaded.gpu and not dumps:
        checks.append(Check("replay", "a GPU record holds memory_stats() dumps", False, detail="none found"))
    for name, stats in dumps.items():
        m = measurements.get(name)
        if m is None:
            checks.append(Check("replay", f"{name}: dump of a recorded workload", False, detail="no such workload"))
            continue
        reading = reading_from_stats(stats)
        pairs = (
            ("peak", reading.peak, m.peak),
            ("reserved", reading.highest.get("reserved"), m.reserved),
            ("requested", reading.highest.get("requested_peak"), m.requested_peak),
            ("allocated", int(stats.get("allocated_bytes.all.current", -1)), m.allocated),
        )
        title = f"{name}: reading_from_stats(dump) = recorded peak / reserved / requested / allocated"
        checks.append(agreeing("replay", title, pairs, "recorded"))
    return checks


def replay_environment(loaded: Loaded) -> list[Check]:
    """``Environment.from_dict`` of each recorded environment gives back the recorded key."""
    checks = []
    for field_name in ("environment", "cpu_environment"):
        data, key = loaded.record.get(field_name), loaded.record.get(f"{field_name}_key")
        if data is None:
            if loaded.gpu and field_name == "environment":
                checks.append(Check("replay", "a GPU record holds its environment", False))
            continue
        rebuilt = Environment.from_dict(data)
        same = rebuilt.key == key and rebuilt.to_dict() == data
        checks.append(
            Check("replay", f"{field_name}: Environment.from_dict(...).key = recorded key", same, detail=rebuilt.key)
        )
    if loaded.gpu:
        engine = (loaded.record.get("environment") or {}).get("engine")
        checks.append(
            Check("replay", "the GPU record's environment is a cuda one", engine == "cuda", detail=str(engine))
        )
    return checks


def replay_report(loaded: Loaded) -> list[Check]:
    """The report renders the recorded measurements: every figure formatted, n/a where unknown."""
    measurements = loaded.measurements()
    records = [TestRecord(f"gpu-validate::{name}", [m]) for name, m in measurements.items()]
    rows = summary_rows(records)
    problems = []
    for record in records:
        m = record.measurements[0]
        shown = {row[2]: row[3] for row in rows if row[0] == record.nodeid and row[1] == m.name}
        for metric in ("peak", "allocated", "reserved"):
            value = m.figure(metric)
            if value is None and metric in shown:
                problems.append(f"{m.name}: {metric} unknown but shown as {shown[metric]!r}")
            elif value is not None and shown.get(metric) != format_size(value):
                problems.append(f"{m.name}: {metric} {value} shown as {shown.get(metric)!r}")
    table = measurement_table(list(measurements.values()))
    problems += [f"{name}: missing from the measurement table" for name in measurements if name not in table]
    markdown = markdown_report(records, header=str(loaded.record.get("environment_key") or ""))
    body = [line for line in markdown.splitlines() if line.startswith("| gpu-validate::")]
    if len(body) != len(rows):
        problems.append(f"Markdown report: {len(body)} rows for {len(rows)} figures")
    again = {name: Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) for name, m in measurements.items()}
    problems += [f"{name}: JSON round trip changed it" for name in measurements if again[name] != measurements[name]]
    return [
        Check(
            "replay",
            f"report renders {len(measurements)} recorded measurement(s) ({len(rows)} figures)",
            not problems and bool(measurements),
            detail="; ".join(problems[:5]) or ("" if measurements else "no measurements"),
        )
    ]


def replay_zoo(loaded: Loaded) -> list[Check]:
    """Each zoo row's figures, ratios and explanation follow from its measurements (a GPU record has GPU ones)."""
    measurements = loaded.measurements()
    checks = []
    for row in loaded.record.get("zoo", []):
        if row.get("skipped"):
            continue
        again = zoo_figures(row, measurements)
        differing = [key for key in again if again[key] != row.get(key)]
        if loaded.gpu and not (row.get("gpu") and row.get("gpu_tensors")):
            differing.append("no GPU measurement")
        checks.append(
            Check(
                "replay",
                f"zoo {row['model']} {row['precision']}: figures, ratios and gap explanation recomputed",
                not differing,
                detail=", ".join(differing),
            )
        )
    return checks


def replay_snapshot(loaded: Loaded) -> list[Check]:
    """The snapshot's segments add up to the reserved and allocated bytes of the stats read with it."""
    info = loaded.record.get("snapshot")
    if info is None:
        return [Check("replay", "a GPU record holds a memory snapshot", False)] if loaded.gpu else []
    if loaded.snapshot is None:
        return [Check("replay", f"snapshot file {info.get('file')} is there", False)]
    stats = loaded.stats.get("snapshot") or {}
    index = info.get("device_index")
    segments = [s for s in loaded.snapshot.get("segments", []) if s.get("device", index) == index]
    pairs = (
        ("reserved", sum(int(s["total_size"]) for s in segments), stats.get("reserved_bytes.all.current")),
        ("allocated", sum(int(s["allocated_size"]) for s in segments), stats.get("allocated_bytes.all.current")),
        ("segments", len(segments), stats.get("segment.all.current")),
    )
    return [
        agreeing(
            "replay",
            "snapshot segments = reserved / allocated / segment count of the stats read with it",
            pairs,
            "stats",
        )
    ]


_SUITE_ASSERT = re.compile(r"^E\s+AssertionError: assert (\d+) == (.+)$")
_OPERATORS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def _arithmetic(text: str) -> int:
    """The value of an integer expression of numbers, + - * // and parentheses (from a pytest log)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp):
            left, right = value(node.left), value(node.right)
            if type(node.op) in _OPERATORS:
                return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"not an integer expression: {text!r}")

    return value(ast.parse(text, mode="eval").body)


def rejudge(loaded: Loaded) -> list[Check]:
    """The record's own checks, judged by this release's protocol where the recorded data allows.

    For a protocol 1 record the determinism check and CUDA suite failures whose only excess is the recorded cuBLAS
    workspace are judged again; every other check stands as recorded.
    """
    record = loaded.record
    checks = [Check.from_dict(c) for c in record["checks"]]
    if record.get("protocol", 1) >= PROTOCOL:
        return checks
    measurements = loaded.measurements()
    workspace = record["figures"].get("cublas_workspace")
    judged: list[Check] = []
    for check in checks:
        if check.passed is not False:
            judged.append(check)
        elif check.group == "determinism":
            first, second = measurements["determinism.run-1"], measurements["determinism.run-2"]
            keys = ("start", "peak", "allocated", "requested_peak", "saved_activations")
            same = all(getattr(first, k) == getattr(second, k) for k in keys)
            costs = (first.cost("reserved"), second.cost("reserved"))
            within = None not in costs and abs(costs[0] - costs[1]) <= reserved_slack(first, second)  # type: ignore[operator]
            detail = f"protocol 1 record judged again: reserved cost {costs[0]} vs {costs[1]}"
            judged.append(Check(check.group, check.name, same and within, check.measured, check.expected, detail))
        elif check.group == "suite":
            path = loaded.folder / SUITE_LOG
            log = path.read_text(encoding="utf-8") if path.exists() else ""
            matches = [_SUITE_ASSERT.match(line) for line in log.splitlines()]
            excesses = [int(match[1]) - _arithmetic(match[2]) for match in matches if match]
            failed = (record.get("suite") or {}).get("failures")
            explained = bool(excesses) and len(excesses) == failed and all(e == workspace for e in excesses)
            detail = (
                f"protocol 1 record judged again: {len(excesses)} failure(s), each over by {excesses}; "
                f"the cuBLAS workspace a span's first matmul made is {workspace} B"
            )
            judged.append(Check(check.group, check.name, explained, check.measured, check.expected, detail))
        else:
            judged.append(check)
    return judged


def replay(folder: Path) -> list[Check]:
    """Every replay check of a record folder (what ``tests/test_replay.py`` asserts)."""
    loaded = load_record(folder)
    return [
        *replay_stats(loaded),
        *replay_environment(loaded),
        *replay_report(loaded),
        *replay_zoo(loaded),
        *replay_snapshot(loaded),
    ]
