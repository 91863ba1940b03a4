"""``python -m pytest_gpumem baselines history``: the baseline file's figures in each commit, as tables, sparklines, an
HTML page and CI exports."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines import DEFAULT_FILENAME
from pytest_gpumem.baselines.history import HistoryError, read_history
from pytest_gpumem.baselines.selection import listed
from pytest_gpumem.cli import CommandError
from pytest_gpumem.cli import _check_texts as check_texts
from pytest_gpumem.data.metrics import METRIC_INFO
from pytest_gpumem.report import trend
from pytest_gpumem.report.artifacts import write_html

__all__ = ["add_history", "run"]


def add_history(sub: Any, common: Callable[[argparse.ArgumentParser], None], file_help: str) -> argparse.ArgumentParser:
    """Add the ``history`` action to the ``baselines`` actions ``sub``; returns its parser."""
    history: argparse.ArgumentParser = sub.add_parser(
        "history",
        help="the figures of every commit of the baseline file (git): a table, sparklines, an HTML page, exports",
        description=(
            "Read the baseline file's git history (git log --follow, git show) and print each commit's figures per "
            "test and span, with the commit, date and subject. Commits whose file cannot be read are skipped, and "
            "said so."
        ),
    )
    history.add_argument("--file", type=Path, default=Path(DEFAULT_FILENAME), metavar="PATH", help=file_help)
    common(history)
    history.add_argument(
        "--metric",
        action="append",
        choices=list(METRIC_INFO),
        help="a metric to show (repeat for several; default: each one the file holds)",
    )
    history.add_argument("--max-count", type=int, metavar="N", help="only the newest N commits of the file")
    history.add_argument("--sparklines", action="store_true", help="one sparkline per test, span and metric")
    history.add_argument("--bytes", action="store_true", help="show exact byte counts instead of KiB / MiB / GiB")
    history.add_argument("--markdown", action="store_true", help="print Markdown tables")
    history.add_argument("--html", type=Path, metavar="PATH", help="write a page with a chart per test and span")
    history.add_argument(
        "--export",
        nargs=2,
        action="append",
        default=[],
        metavar=("FORMAT", "PATH"),
        help="write the newest commit's figures: github-benchmark (github-action-benchmark's "
        "customSmallerIsBetter JSON) or openmetrics (GitLab's metrics report); repeat for both",
    )
    history.set_defaults(handler=run)
    return history


def run(args: argparse.Namespace) -> int:
    """Print the history, write the page and the exports asked for; returns the exit status (0)."""
    formats = {"github-benchmark": trend.github_benchmark_json, "openmetrics": trend.openmetrics}
    for kind, _ in args.export:
        if kind not in formats:
            raise CommandError(f"--export {kind!r}: the formats are {', '.join(formats)}")
    if args.max_count is not None and args.max_count < 1:
        raise CommandError(f"--max-count {args.max_count}: give 1 or more commits")
    try:
        history = read_history(args.file, max_count=args.max_count)
    except HistoryError as exc:
        raise CommandError(str(exc)) from None
    series = trend.select(history, args.tests, args.env)
    check_texts(args.tests, (test for _, test, _ in history.series()))
    if args.env is not None and not series:
        raise CommandError(f"--env {args.env!r} matches no environment; the keys are: {listed(history.environments())}")
    metrics = trend.metrics_of(history, series, args.metric or ())
    for skipped in history.skipped:
        print(f"skipped {skipped.commit.short} ({skipped.commit.subject}): {skipped.reason}", file=sys.stderr)
    for version in history.versions:
        if version.note:
            print(f"read {version.commit.short}: {version.note}", file=sys.stderr)
    render = trend.sparklines if args.sparklines else trend.history_table
    print(render(history, series, metrics, exact=args.bytes, markdown=args.markdown) or "no baselines in any commit")
    outputs = [(args.html, trend.history_html(history, series, metrics))] if args.html else []
    for kind, path in args.export:
        try:
            outputs.append((Path(path), formats[kind](history, series, metrics)))
        except ValueError as exc:
            raise CommandError(f"--export {kind}: {exc}") from None
    for path, text in outputs:
        try:
            write_html(path, text)
        except OSError as exc:
            raise CommandError(f"{path}: cannot write: {exc.strerror or exc}") from None
        print(f"wrote {path}")
    return 0
