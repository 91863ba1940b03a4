"""A new record against a committed one: which figures of the workloads both hold differ (``validate --against``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_gpumem.validate.results import RECORD_FILE

#: The figures compared between records, as costs, so what the device held before a workload does not show as a
#: difference; NVML's figures hold the CUDA context and are left out.
COSTS = ("peak", "allocated", "requested_peak")
#: Figures compared as they are.
ABSOLUTE = ("retained", "saved_activations", "psi")


def load_record(folder: Path) -> dict[str, Any]:
    """The ``record.json`` of a record folder (or the file itself)."""
    path = folder / RECORD_FILE if folder.is_dir() else folder
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "workloads" not in data:
        raise ValueError(f"{path} is not a validation record (no workloads)")
    return data


def differences(record: Mapping[str, Any], previous: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The figures of the workloads (and the reported figures) both records hold, compared: counts and differences."""
    lines: list[str] = []
    same = 0
    ours, theirs = record["workloads"], previous["workloads"]
    # (what, its figures in this record and in the previous one, whether they are bytes)
    compared = [(w, _figures(ours[w]), _figures(theirs[w]), True) for w in sorted(set(ours) & set(theirs))]
    compared.append(("figures", record.get("figures", {}), previous.get("figures", {}), False))
    for what, now, before, in_bytes in compared:
        for figure in sorted(set(now) & set(before)):
            new, old = now[figure], before[figure]
            if new == old:
                same += 1
            elif in_bytes and isinstance(new, int) and isinstance(old, int):
                lines.append(f"{what} {figure}: {old:,} → {new:,} B ({new - old:+,} B)")
            else:
                lines.append(f"{what} {figure}: {old} → {new}")
    return {
        "record": name,
        "environment": previous.get("environment_key"),
        "protocols": [previous.get("protocol", 1), record.get("protocol", 1)],
        "same": same,
        "differences": lines,
        "only_here": sorted(set(ours) - set(theirs)),
        "only_there": sorted(set(theirs) - set(ours)),
    }


def _figures(workload: Mapping[str, Any]) -> dict[str, Any]:
    """A workload's comparable figures: costs above its start and the figures that are no readings of the device."""
    m = workload.get("measurement") or {}
    start, start_reserved = m.get("start"), m.get("start_reserved")
    figures: dict[str, Any] = {}
    if start is not None:
        figures.update({f"{key} cost": m[key] - start for key in COSTS if m.get(key) is not None})
        counters = workload.get("counters") or {}
        for key in ("max_memory_allocated", "memory_allocated"):
            if counters.get(key) is not None:
                figures[f"torch.{key} cost"] = counters[key] - start
    if m.get("reserved") is not None and start_reserved is not None:
        figures["reserved cost"] = m["reserved"] - start_reserved
    figures.update({key: m[key] for key in ABSOLUTE if m.get(key) is not None})
    return figures
