"""Artifacts of a measured test: safe file names, pages written atomically, and the run's index page."""

from __future__ import annotations

import errno
import hashlib
import re
from pathlib import Path

from pytest_gpumem.data.findings import failure_message
from pytest_gpumem.data.metrics import DRAWN_METRICS, METRICS, metric_info
from pytest_gpumem.files import write_file
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.html import html_page, html_text, render_html
from pytest_gpumem.report.site_tables import site_section_html

__all__ = [
    "INDEX_NAME",
    "MAX_NAME_LENGTH",
    "artifact_path",
    "artifact_stem",
    "render_index",
    "write_artifacts",
    "write_html",
    "write_index",
]

#: Upper bound on the length of a file name made by :func:`artifact_path`: well under 255 bytes, so a tool's suffix
#: still fits.
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
    """A file-name stem for the test ``nodeid``: readable, safe and unique, the same on every run and machine.

    The node id with runs of characters outside ``[A-Za-z0-9._-]`` replaced by ``_`` (a long middle cut out), then ``-``
    and 10 hex digits of its SHA-1, which keep ids apart on case-insensitive file systems; ASCII, at most 121
    characters, never a leading dot or dash nor a Windows device name.

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
    """Where the artifact of test ``nodeid`` with ``suffix`` goes: one path component directly inside ``directory``.

    Nothing is created. Raises :class:`ValueError` for a suffix other than dot-separated ``[A-Za-z0-9_-]`` parts (at
    most 18 characters) and when the path would not lie directly inside ``directory`` (a symbolic link at its name).
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


def write_html(path: Path, html: str) -> None:
    """Write ``html`` to ``path`` as UTF-8 with :func:`~pytest_gpumem.files.write_file`."""
    write_file(path, html.encode("utf-8"))


def write_artifacts(record: TestRecord, directory: Path) -> list[str]:
    """Write the HTML memory timeline of ``record``'s call; returns the artifact paths (with its snapshot).

    The call's limits, budgets and baselines on ``peak`` and ``allocated`` are drawn at its start plus the bound. Raises
    ``OSError`` naming the page and why it could not be written.
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


#: The file name of the run-level page in the artifact folder.
INDEX_NAME = "index.html"

_INDEX_CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; color: #1d2330;
  background: #f6f7f9; margin: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 20px 24px 32px; }
h1 { font-size: 20px; margin: 0 0 4px; }
.meta { color: #5b6474; margin: 0 0 14px; }
.card { background: #fff; border: 1px solid #dde1e7; border-radius: 8px; padding: 10px 12px; overflow-x: auto; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; font-size: 13px; }
th, td { padding: 4px 8px; border-bottom: 1px solid #eceff3; text-align: left; vertical-align: top; }
th { font-weight: 600; color: #5b6474; font-size: 12px; }
td.num, th.num { text-align: right; white-space: nowrap; }
td.test { word-break: break-all; }
.na { color: #98a0ad; }
.status { font-weight: 600; border-radius: 4px; padding: 1px 6px; font-size: 12px; }
.passed { color: #1b5e20; background: #e3f3e4; }
.failed { color: #b3261e; background: #fbe4e2; }
td.why { color: #5b6474; font-size: 12px; }
"""


def index_figures(record: TestRecord) -> dict[str, int | None]:
    """The call span's costs shown for ``record``, each figure of :data:`~pytest_gpumem.data.metrics.METRICS`."""
    if not record.measurements:
        return dict.fromkeys(METRICS)
    call = record.measurements[0]
    return {metric: call.cost(metric) for metric in METRICS}


def render_index(records: list[TestRecord], pages: dict[str, str], *, title: str = "pytest-gpumem run") -> str:
    """One self-contained page listing every measured test of ``records``: status, costs, failure line, and a link to
    its page (relative, so the folder can be moved whole)."""
    failed = sum(1 for record in records if record.failed or not record.passed)
    rows = []
    for record in sorted(records, key=lambda r: (r.passed and not r.failed, r.nodeid)):
        status = "failed" if record.failed or not record.passed else "passed"
        figures = index_figures(record)
        cells = "".join(
            f'<td class="num" title="{value:,} B">{html_text(metric_info(metric).format(value))}</td>'
            if value is not None
            else '<td class="num"><span class="na">n/a</span></td>'
            for metric, value in figures.items()
        )
        failing = [f for f in record.findings if f.failed]
        why = failure_message(failing).splitlines()[0] if failing else ""
        if not why and record.errors:
            why = record.errors[0]
        if not why and not record.passed:
            why = "the test's own code failed"
        page = pages.get(record.nodeid)
        name = html_text(record.nodeid)
        link = f'<a href="{html_text(Path(page).name)}">{name}</a>' if page else name
        rows.append(
            f'<tr data-test="{name}" data-status="{status}"><td class="test">{link}</td>'
            f'<td><span class="status {status}">{status}</span></td>{cells}<td class="why">{html_text(why)}</td></tr>'
        )
    headers = "".join(f'<th class="num">{html_text(metric)}</th>' for metric in METRICS)
    body = [
        f"<h1>{html_text(title)}</h1>",
        f'<p class="meta">{len(records)} measured tests, {failed} failed. Figures are the call\'s costs (a '
        "figure minus the call's start); a test's name links to its page where one was written.</p>",
        '<div class="card"><table>',
        f"<tr><th>test</th><th>status</th>{headers}<th>why it failed</th></tr>",
        *rows,
        "</table></div>",
    ]
    return html_page(title, _INDEX_CSS, body)


def write_index(records: list[TestRecord], directory: Path, pages: dict[str, str]) -> str:
    """Write :func:`render_index` to ``index.html`` in ``directory`` atomically; its path (``OSError`` naming it)."""
    path = Path(directory).resolve() / INDEX_NAME
    try:
        write_html(path, render_index(records, pages))
    except OSError as exc:
        raise OSError(exc.errno, f"could not write the artifact index {path}: {exc.strerror or exc}") from None
    return str(path)
