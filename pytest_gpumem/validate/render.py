"""The record as text: the terminal tables and ``summary.md``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_gpumem.tables import markdown_table, table
from pytest_gpumem.units import format_size
from pytest_gpumem.validate.results import Check, suite_check


def _shown(value: float | None, spec: str = ",") -> str:
    return "n/a" if value is None else format(value, spec)


def check_rows(checks: Sequence[Check]) -> list[list[str]]:
    return [[c.group, c.name, _shown(c.measured), _shown(c.expected), c.result, c.detail] for c in checks]


CHECK_HEADERS = ("group", "check", "measured B", "expected B", "result", "detail")
ZOO_HEADERS = (
    "model",
    "precision",
    "Ψ",
    "allocated CPU",
    "allocated GPU",
    "×",
    "peak CPU",
    "peak GPU",
    "×",
    "reserved GPU",
    "gap GPU − CPU explained",
)


def zoo_table_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    out = []
    for row in rows:
        if row.get("skipped"):
            out.append([row["model"], row["precision"], "", *["n/a"] * 7, f"skipped: {row['skipped']}"])
            continue
        figures = row.get("figures") or {}
        cpu, gpu = figures.get("cpu") or {}, figures.get("gpu") or {}
        ratio = row.get("ratio") or {}
        columns = [
            (format_size(cpu.get(metric)), format_size(gpu.get(metric)), _shown(ratio.get(metric), ".3f"))
            for metric in ("allocated", "peak")
        ]
        out.append(
            [
                row["model"],
                row["precision"],
                _shown(row.get("psi")),
                *columns[0],
                *columns[1],
                format_size(gpu.get("reserved")),
                str(row.get("explanation", "")),
            ]
        )
    return out


GAP_LEGEND = (
    "Gaps: *outside tensors* is what the caching allocator holds beyond tensor storages "
    "(cuBLAS/cuBLASLt, cuDNN and attention workspaces, and large blocks it did not split: up to "
    "1 MiB each); *tensors* is how the GPU's tensor storages (the storage tracker run on the GPU, "
    "512-byte rounding) differ from the CPU engine's, by category: step counters that AdamW keeps "
    "on the CPU when training on a GPU (optimizer_state −512 B per parameter tensor), kernels that "
    "save other tensors (SDPA's flash/efficient backends keep log-sum-exp rows instead of "
    "attention weights), autocast's different CPU and CUDA op lists, dropout masks (bool on CUDA, "
    "the activation's dtype on CPU)."
)


def _suite_line(suite: Mapping[str, Any] | None) -> str:
    return "CUDA suite: not run" if suite is None else suite_check(suite).detail


def render_terminal(record: Mapping[str, Any], *, width: int | None = None) -> str:
    """The tables printed at the end of a run, fitted to ``width`` (None: lines as long as they need)."""
    checks = [Check.from_dict(c) for c in record["checks"]]
    lines = [
        f"gpu-validate: {record['mode']} run on {record['device']}, torch {record['torch']}",
        f"environment: {record['environment_key'] or 'n/a (no GPU)'}",
        f"CPU engine:  {record['cpu_environment_key']}",
        _suite_line(record.get("suite")),
        "",
        table(CHECK_HEADERS, check_rows(checks), right=(2, 3), width=width),
        "",
        table(ZOO_HEADERS, zoo_table_rows(record["zoo"]), width=width),
    ]
    failed = [c for c in checks if c.passed is False]
    if failed:
        lines += ["", "FAILED checks:", *(f"- [{c.group}] {c.name}: {c.detail}" for c in failed)]
    return "\n".join(lines)


def render_markdown(record: Mapping[str, Any]) -> str:
    """``summary.md``: the environment, the suite, every check, the zoo table and its legend."""
    checks = [Check.from_dict(c) for c in record["checks"]]
    failed = sum(1 for c in checks if c.passed is False)
    lines = [
        f"# gpu-validate: {record['device']} ({record['mode']})",
        "",
        f"- environment: `{record['environment_key'] or 'n/a (no GPU)'}`",
        f"- CPU engine: `{record['cpu_environment_key']}`",
        f"- torch {record['torch']}, transformers {record.get('transformers') or 'not installed'}",
        f"- {_suite_line(record.get('suite'))}",
        f"- {len(checks)} checks, {failed} failed; zoo size `{record['size']}`",
        "",
        "## Checks",
        "",
        *markdown_table(CHECK_HEADERS, check_rows(checks), right=(2, 3)).splitlines(),
        "",
        "## CPU engine (CUDA rounding) vs GPU: one AdamW training step",
        "",
        *markdown_table(ZOO_HEADERS, zoo_table_rows(record["zoo"])).splitlines(),
        "",
        GAP_LEGEND,
        "",
        *_against_lines(record.get("against")),
    ]
    return "\n".join(lines)


def _against_lines(against: Mapping[str, Any] | None) -> list[str]:
    """The section comparing this record's figures with a committed record's (``--against``)."""
    if not against:
        return []
    lines = [
        f"## Against `{against['record']}`",
        "",
        f"`{against['environment']}`: {against['same']} figures equal, {len(against['differences'])} differ.",
        "",
    ]
    old, new = against.get("protocols", (None, None))
    if old != new:
        lines += [
            f"The committed record was made with clean-state protocol {old}, this one with {new}: under "
            "protocol 1 the library workspaces were freed before each start, so a span's first matrix "
            "product made them again inside its costs; protocol 2 keeps them, made before the start.",
            "",
        ]
    lines += [f"- {line}" for line in against["differences"]]
    if against["only_here"]:
        lines.append(f"- only in this record: {', '.join(against['only_here'])}")
    if against["only_there"]:
        lines.append(f"- only in `{against['record']}`: {', '.join(against['only_there'])}")
    return [*lines, ""]
