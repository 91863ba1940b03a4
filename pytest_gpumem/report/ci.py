"""The judgement where CI reads it: JUnit properties, GitHub Actions ``::error`` annotations at the line that grew, and
the step summary's size cap. No pytest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pytest_gpumem.data.findings import failure_message
from pytest_gpumem.data.metrics import COUNT_METRICS, METRICS
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.text import worst_status

__all__ = [
    "MAX_ANNOTATIONS",
    "STEP_SUMMARY_LIMIT",
    "Annotation",
    "capped_summary",
    "failure_annotations",
    "first_line",
    "junit_properties",
    "run_annotation",
    "workspace",
]

#: GitHub's limit on a step summary file (1 MiB); the plugin's part keeps the file under it.
STEP_SUMMARY_LIMIT = 1024 * 1024
#: Most ``::error`` annotations a run prints (GitHub shows 10 of each kind a step).
MAX_ANNOTATIONS = 10


def first_line(record: TestRecord) -> str:
    """The first line of a test's memory failure: its first error, else its first broken check ("" if none)."""
    if record.errors:
        return f"gpumem: {record.errors[0]}".splitlines()[0]
    message = failure_message(f for f in record.findings if f.failed)
    return message.splitlines()[0] if message else ""


def junit_properties(record: TestRecord) -> list[tuple[str, str | int]]:
    """The judged figures as JUnit properties: ``PREFIX.METRIC.`` ``measured``, ``cost``, ``limit``, ``budget``,
    ``baseline`` (each when known) and ``status`` (the worst check, ``unchecked`` when none), and ``gpumem.failure``.
    PREFIX is ``gpumem`` for the test call, ``gpumem[NAME]`` for a span."""
    properties: list[tuple[str, str | int]] = []
    for measurement in record.measurements:
        prefix = "gpumem" if measurement.name == "call" else f"gpumem[{measurement.name}]"
        findings = [f for f in record.findings if f.span == measurement.name]
        for metric in METRICS + COUNT_METRICS:
            judged = [f for f in findings if f.metric == metric]
            measured = measurement.figure(metric)
            if measured is None and not judged:
                continue
            known = {"measured": measured, "cost": measurement.cost(metric)}
            for kind in ("limit", "budget", "baseline"):
                known[kind] = next((f.reference for f in judged if f.kind == kind and f.reference is not None), None)
            properties += [(f"{prefix}.{metric}.{key}", value) for key, value in known.items() if value is not None]
            properties.append((f"{prefix}.{metric}.status", worst_status(judged)))
    failure = first_line(record) if record.failed else ""
    if failure:
        properties.append(("gpumem.failure", failure))
    return properties


@dataclass(frozen=True)
class Annotation:
    """One ``::error`` workflow command: a file (relative to the workspace) and line, a title, a message."""

    file: str
    line: int
    title: str
    message: str

    def command(self) -> str:
        """The line GitHub Actions reads from the job's output."""
        where = f"file={_property(self.file)}," if self.file else ""
        where += f"line={self.line}," if self.file and self.line else ""
        return f"::error {where}title={_property(self.title)}::{_data(self.message)}"


def _data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def _in_workspace(path: Path, workspace: Path | None) -> str:
    """``path`` relative to the workspace when it lies in it, else as it is."""
    try:
        return path.resolve().relative_to((workspace or Path.cwd()).resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _site_line(record: TestRecord, rootdir: Path) -> tuple[str, int, str] | None:
    """The rootdir's line that grew most against the baseline, else the largest peak site of a span that broke a limit;
    None when no site names a rootdir file with its line."""
    broken = [f for f in record.findings if f.failed]
    candidates = []
    for finding in broken:
        changes = record.site_changes.get(finding.span)
        if finding.kind == "baseline" and changes is not None:
            grown = [c.figures.site for c in changes.at("peak") if c.status != "gone" and c.delta("peak") > 0]
            candidates += [(site, "the line whose tensors grew most") for site in grown]
    for finding in broken:
        measurement = next((m for m in record.measurements if m.name == finding.span), None)
        if measurement is not None and measurement.sites is not None:
            candidates += [(f.site, "the line that held the most at the peak") for f in measurement.sites.sites]
    for site, why in candidates:
        if not site.pseudo and site.line and (rootdir / site.file).is_file():
            return site.file, site.line, why
    return None


def failure_annotations(
    record: TestRecord, location: tuple[str, int] | None, rootdir: Path, workspace: Path | None
) -> list[Annotation]:
    """The ``::error`` annotation of a test that failed on memory: at the line that grew, else at the test's
    ``location``; none when it did not fail."""
    if not record.failed:
        return []
    message = "\n".join(f"gpumem: {error}" for error in record.errors)
    broken = failure_message(f for f in record.findings if f.failed)
    message = "\n".join(part for part in (message, broken) if part)
    site = _site_line(record, rootdir)
    if site is not None:
        file, line, why = site
        message += f"\n({why}: {file}:{line})"
    elif location is not None:
        file, line = location
    else:
        return []
    return [Annotation(_in_workspace(rootdir / file, workspace), line, f"gpumem: {record.nodeid}", message)]


def run_annotation(message: str, file: Path | None, workspace: Path | None) -> Annotation:
    """The annotation of a run that fails where no test does (strict stale baselines), at the baseline ``file``."""
    return Annotation("" if file is None else _in_workspace(file, workspace), 0, "gpumem: the run fails", message)


def workspace() -> Path | None:
    """GitHub's workspace (``$GITHUB_WORKSPACE``), which annotation paths are relative to."""
    found = os.environ.get("GITHUB_WORKSPACE")
    return Path(found) if found else None


def capped_summary(markdown: str, room: int) -> tuple[bytes, bool]:
    """The Markdown to append to a step summary with ``room`` bytes left: whole, or cut at a line with a note (open
    ``<details>`` closed), and whether it was cut; empty when not even the note fits."""
    data = markdown.encode("utf-8", "backslashreplace")
    if len(data) <= room:
        return data, False
    note = (
        "\n\n**The gpumem report was cut here: GitHub's step summary holds 1 MiB.** The whole report is "
        "in the files of `--gpumem-markdown` and `--gpumem-json`.\n"
    )
    closing = "\n</details>\n"
    reserve = len(note.encode()) + len(closing)
    if room < reserve + 1:
        return b"", True
    cut = data[: room - reserve]
    cut = cut[: cut.rfind(b"\n") + 1] if b"\n" in cut else b""
    text = cut.decode("utf-8", "ignore")
    opened = text.count("<details>") - text.count("</details>")
    return (text + closing * opened + note).encode("utf-8"), True
