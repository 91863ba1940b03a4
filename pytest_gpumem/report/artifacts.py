"""Artifacts of a measured test: safe file names, written atomically.

:func:`artifact_path` turns a pytest node id into a file name that stays inside
the artifact folder whatever the node id holds (parametrize ids with ``/``,
``..``, control characters, unicode, thousands of characters) and never
collides for two node ids. The page itself is drawn by :func:`~pytest_gpumem.report.html.render_html`;
:func:`write_html` writes it atomically.

All sizes are bytes.
"""

from __future__ import annotations

import errno
import hashlib
import re
from pathlib import Path

from pytest_gpumem.data.findings import failure_message
from pytest_gpumem.data.metrics import DRAWN_METRICS
from pytest_gpumem.files import write_file
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.html import render_html
from pytest_gpumem.report.sites import site_section_html

__all__ = ["MAX_NAME_LENGTH", "artifact_path", "artifact_stem", "write_artifacts", "write_html"]

# ---------------------------------------------------------------------------
# File names
# ---------------------------------------------------------------------------

#: Upper bound on the length of a file name made by :func:`artifact_path`
#: (stem and suffix). Well under the 255 bytes most file systems allow, so a
#: temporary name or a tool's own suffix still fits.
MAX_NAME_LENGTH = 150

_HASH_LENGTH = 10
_READABLE_LENGTH = 110  # readable part of a stem; + "-" + hash = 121 at most
_MAX_SUFFIX_LENGTH = MAX_NAME_LENGTH - _READABLE_LENGTH - 1 - _HASH_LENGTH
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_DOT_RUNS = re.compile(r"\.{2,}")
_SUFFIX = re.compile(r"(?:\.[A-Za-z0-9_-]+)*")
_WINDOWS_RESERVED = frozenset(
    {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(10)), *(f"LPT{i}" for i in range(10))}
)


def artifact_stem(nodeid: str) -> str:
    """A file-name stem for the test ``nodeid``: readable, safe and unique.

    The stem is the node id with every run of characters outside
    ``[A-Za-z0-9._-]`` replaced by ``_`` (runs of dots by one dot, leading and
    trailing ``._-`` dropped, the middle of a very long id cut out), then ``-``
    and the first 10 hex digits of the SHA-1 of the full node id (UTF-8). The
    hash keeps distinct node ids apart, also on case-insensitive file systems;
    the stem is the same on every run and machine. It is ASCII, never starts
    with a dot or a dash, is never a Windows device name (``CON``, ``NUL``...),
    and is at most 121 characters long.

    >>> artifact_stem("tests/test_train.py::test_step[cuda-bf16]")
    'tests_test_train.py_test_step_cuda-bf16-0bd031a728'
    """
    digest = hashlib.sha1(nodeid.encode("utf-8", "surrogatepass"), usedforsecurity=False).hexdigest()
    readable = _DOT_RUNS.sub(".", _UNSAFE.sub("_", nodeid)).strip("._-")
    if len(readable) > _READABLE_LENGTH:
        head = _READABLE_LENGTH * 2 // 3
        tail = _READABLE_LENGTH - head - 1
        readable = f"{readable[:head].rstrip('._-')}_{readable[-tail:].lstrip('._-')}"
    if readable.split(".", 1)[0].upper() in _WINDOWS_RESERVED:
        readable = "_" + readable
    digest = digest[:_HASH_LENGTH]
    return f"{readable}-{digest}" if readable else digest


def artifact_path(directory: Path, nodeid: str, suffix: str) -> Path:
    """Where the artifact of test ``nodeid`` with ``suffix`` (e.g. ``".html"``) goes.

    The result is ``directory`` (resolved to an absolute path) joined with
    :func:`artifact_stem` and ``suffix``: one path component directly inside
    ``directory``, at most :data:`MAX_NAME_LENGTH` characters long. Nothing is
    created. ``suffix`` is empty or dot-separated parts of ``[A-Za-z0-9_-]``
    (``".html"``, ``".snapshot.pickle"``) of at most 18 characters.

    Raises :class:`ValueError` for any other suffix, and when the path would
    not lie directly inside ``directory`` once resolved (for instance a
    symbolic link already sitting at that name and pointing elsewhere).
    """
    if len(suffix) > _MAX_SUFFIX_LENGTH or not _SUFFIX.fullmatch(suffix):
        raise ValueError(
            f"artifact suffix {suffix!r} is not allowed: use dot-separated parts of letters, digits, '_' and '-' "
            f"such as '.html', at most {_MAX_SUFFIX_LENGTH} characters"
        )
    base = Path(directory).resolve()
    path = base / f"{artifact_stem(nodeid)}{suffix}"
    if path.parent != base or path.resolve().parent != base:
        raise ValueError(f"artifact path {str(path)!r} for {nodeid!r} escapes {str(base)!r}")
    return path


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def write_html(path: Path, html: str) -> None:
    """Write ``html`` to ``path`` as UTF-8 (:func:`~pytest_gpumem.files.write_file`: atomically, a
    symbolic link written through, a device or FIFO never renamed over)."""
    write_file(path, html.encode("utf-8"))


def write_artifacts(record: TestRecord, directory: Path) -> list[str]:
    """Write the HTML memory timeline of ``record``'s call; returns the artifact paths (with its snapshot).

    Lines drawn across the chart (absolute, as the chart is): the emulated device
    limit, and the call's limits, budgets and baselines on ``peak`` and ``allocated``
    (they bound costs: drawn at the call's start plus the bound).

    Raises ``OSError`` whose message names the page and why it could not be written (a folder,
    or a symbolic link pointing elsewhere, at its name; a full disk; permissions).
    """
    call = record.measurements[0]
    lines: dict[str, int] = {} if record.device_limit is None else {"device limit": record.device_limit}
    for finding in record.findings:
        if finding.span != call.name or finding.reference is None or finding.metric not in DRAWN_METRICS:
            continue
        lines[f"{finding.kind} {finding.metric}"] = finding.reference + call.start
    details = [failure_message([f for f in record.findings if f.failed])] if record.failed else []
    details += record.reports
    # under torchrun the call is the rank's (call@rank1-of-2): each rank writes a page of its own
    nodeid = record.nodeid if call.name == "call" else f"{record.nodeid}@{call.name}"
    try:
        path = artifact_path(directory, nodeid, ".html")
    except ValueError:
        shown = Path(directory).resolve() / f"{artifact_stem(nodeid)}.html"
        raise OSError(
            errno.EEXIST,
            f"could not write the artifact page {shown}: a symbolic link is at its name, pointing outside "
            f"{Path(directory).resolve()}; remove it",
        ) from None
    page = render_html(
        title=record.nodeid,
        measurement=call,
        timeline=record.timeline_of_call(),
        lines=lines,
        details=details,
        sections=[section] if (section := site_section_html(record)) else [],
    )
    try:
        write_html(path, page)
    except OSError as exc:
        raise OSError(exc.errno, f"could not write the artifact page {path}: {exc.strerror or exc}") from None
    return [str(path)] + ([record.snapshot] if record.snapshot else [])
