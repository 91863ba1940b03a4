"""What CI reads beyond pytest's own output: the run's failure as a JUnit test case, and pytest-html extras."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from pytest_gpumem.data.metrics import metric_info
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.report.artifacts import index_figures
from pytest_gpumem.report.html import html_text

__all__ = ["add_html_extras", "junit_failure"]


def junit_failure(config: pytest.Config, message: str, near: Path) -> None:
    """Write ``message`` into pytest's JUnit XML file as the failed test case ``gpumem::run``, in the file ``near``."""
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pragma: no cover - a pytest without it writes no JUnit file we know
        return
    xml = config.stash.get(xml_key, None)
    if xml is None:
        return
    try:
        file = near.relative_to(config.rootpath).as_posix()
    except ValueError:
        file = near.name
    for when, outcome, longrepr in (("call", "failed", message), ("teardown", "passed", None)):
        report = pytest.TestReport(
            nodeid="gpumem::run",
            location=(file, None, "gpumem run"),
            keywords={},
            outcome=outcome,  # type: ignore[arg-type]
            longrepr=longrepr,
            when=when,  # type: ignore[arg-type]
            user_properties=[("gpumem.failure", message.splitlines()[0])] if when == "teardown" else [],
        )
        xml.pytest_runtest_logreport(report)


def add_html_extras(report: pytest.TestReport, record: TestRecord, page: str | None, html_report: str | None) -> None:
    """Add the call's figures and a link to its page (relative to ``html_report``) to pytest-html's extras."""
    extras = importlib.import_module("pytest_html.extras")  # optional: only when pytest-html runs
    cells = "".join(
        f"<td>{html_text(metric)}</td><td>{html_text(metric_info(metric).format(value))}</td>"
        for metric, value in index_figures(record).items()
        if value is not None
    )
    verdict = "memory failed" if record.failed else "memory ok"
    added = [extras.html(f'<div class="gpumem">gpumem, {verdict}, costs: <table><tr>{cells}</tr></table></div>')]
    if page is not None:
        href = Path(page).as_uri()
        if html_report:
            href = os.path.relpath(page, Path(html_report).resolve().parent).replace(os.sep, "/")
        added.append(extras.url(href, name="gpumem memory timeline"))
    report.extras = [*getattr(report, "extras", []), *added]  # type: ignore[attr-defined]  # pytest-html reads it
