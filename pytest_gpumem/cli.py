"""The command line: ``python -m pytest_gpumem baselines show|diff|prune|history`` and ``validate``.

Reads and edits a baseline file without pytest or torch (docs/cli.md). Exit status 0, 1 when ``diff
--fail-on-growth`` found growth, 2 for any error, which is one line on standard error, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pytest_gpumem.baselines import (
    CALL_SPAN,
    DEFAULT_FILENAME,
    BaselineEntry,
    BaselineFileError,
    BaselineStore,
    load,
    parse,
    save,
)
from pytest_gpumem.baselines.locate import locate
from pytest_gpumem.baselines.selection import SelectionError, environment_named, listed, tests_missing, tests_named
from pytest_gpumem.data.findings import Tolerance, parse_tolerance
from pytest_gpumem.data.metrics import BASELINE_METRICS, METRIC_INFO, METRICS, metric_info
from pytest_gpumem.judge.rule import baseline_status, describe_default_tolerances, tolerance_for
from pytest_gpumem.judge.site_changes import diff_sites
from pytest_gpumem.report.cells import delta_text, figure_text
from pytest_gpumem.report.site_tables import PROFILE_HEADERS, profile_rows, site_diff_rows
from pytest_gpumem.tables import markdown_table, table
from pytest_gpumem.units import format_percent

__all__ = ["main"]

PROG = "python -m pytest_gpumem"
#: The documentation, which the wheel does not ship.
DOCS_URL = "https://github.com/pytest-gpumem/pytest-gpumem/tree/main/docs"

#: Exit status: a cost grew beyond the tolerance (``diff --fail-on-growth``).
EXIT_GREW = 1
#: Exit status: bad usage, an unreadable file, a filter that matches nothing, a failed ``git show``.
EXIT_ERROR = 2


class CommandError(Exception):
    """A problem to report in one line (the message names the file or argument) before exiting with 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["validate"]:  # GPU validation: its own command line, parsed before torch is imported
        from pytest_gpumem.validate.command_line import build_parser

        options = build_parser().parse_args(arguments[1:])
        from pytest_gpumem.validate.main import run as validate

        return validate(options)
    parser, actions = _parser()
    try:
        args, _ = parser.parse_known_args(arguments)
        # Again with the action's own parser, intermixed: argparse takes no positional after an option otherwise.
        start = arguments.index(args.command, arguments.index(args.group) + 1) + 1
        namespace = argparse.Namespace(group=args.group, command=args.command)
        args = actions[args.command].parse_intermixed_args(arguments[start:], namespace)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except BaselineFileError as exc:
        message, _, hint = str(exc).partition("\n")
        _error(f"{args.command}: error: {message}", hint)
    except (CommandError, SelectionError) as exc:
        _error(f"{args.command}: error: {exc}")
    except BrokenPipeError:  # the reader went away (``| head``): not an error of ours
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        return 130
    return EXIT_ERROR


def _error(message: str, hint: str = "") -> None:
    print(f"{_prog()} baselines {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    with contextlib.suppress(OSError, ValueError):  # stdout without a file descriptor
        os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser of the whole command line, and each action's own parser by name."""
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="Tools for pytest-gpumem's baseline file.",
        epilog=f"Exit status: 0 success, 1 a cost grew (diff --fail-on-growth), 2 an error. Documentation: {DOCS_URL}",
    )
    commands = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")
    commands.add_parser(  # parsed by pytest_gpumem.validate.main (main() hands it over before parsing)
        "validate",
        help="check pytest-gpumem on this machine's GPU and write a record (validation.md in the documentation, below)",
        add_help=False,
    )
    group = commands.add_parser(
        "baselines",
        help="show, compare or prune the baseline file",
        description="Show, compare or prune the baseline file.",
    )
    sub = group.add_subparsers(dest="command", required=True, metavar="ACTION")

    def common(
        p: argparse.ArgumentParser,
        *,
        tests_help: str = "only tests whose node id contains one of these texts",
        env_help: str = "only environments whose key contains TEXT (case-insensitive)",
    ) -> None:
        p.add_argument("tests", nargs="*", metavar="TEST", help=tests_help)
        p.add_argument("--env", metavar="TEXT", help=env_help)

    def display(p: argparse.ArgumentParser) -> None:
        p.add_argument("--bytes", action="store_true", help="show exact byte counts instead of KiB / MiB / GiB")
        p.add_argument("--markdown", action="store_true", help="print Markdown tables (for a pull-request comment)")
        p.add_argument(
            "--sites", action="store_true", help="also the sites stored with each span (where bytes were made)"
        )

    file_help = (
        "the baseline file (default: the one pytest uses, found from the current folder up: the first folder "
        f"with a pytest configuration file (its gpumem_baselines, else {DEFAULT_FILENAME} there) or with a "
        f"{DEFAULT_FILENAME})"
    )

    show = sub.add_parser(
        "show",
        help="print the baselines, one table per environment",
        description="Print the recorded costs of every test and span, one table per environment.",
    )
    show.add_argument("--file", type=Path, metavar="PATH", help=file_help)
    common(show)
    display(show)
    show.set_defaults(handler=_show)

    diff = sub.add_parser(
        "diff",
        help="compare two versions of the baseline file",
        description=(
            "Compare two versions of the baseline file: what was added, removed or changed, per environment, "
            "test, span and metric. Each side is a path or REV:PATH, read with `git show` "
            "(main:gpumem-baselines.json; REV:./PATH for a path relative to the current folder)."
        ),
    )
    diff.add_argument("old", metavar="OLD", help="the version before: a path or REV:PATH")
    diff.add_argument("new", metavar="NEW", help="the version after: a path or REV:PATH")
    common(diff)
    diff.add_argument(
        "--fail-on-growth",
        action="store_true",
        help="exit with 1 when a cost grew beyond the tolerance (for max_microbatch: when it fell)",
    )
    diff.add_argument(
        "--tolerance",
        type=_tolerance,
        metavar="TOL",
        help=(
            "how much worse --fail-on-growth lets a cost get, as pytest's --gpumem-tolerance: '2%%', '1MiB' or "
            "'2%%,1MiB' (a size bounds byte figures only; default: each figure's own, as for pytest: "
            + describe_default_tolerances().replace("%", "%%")
            + ")"
        ),
    )
    display(diff)
    diff.set_defaults(handler=_diff)

    prune = sub.add_parser(
        "prune",
        help="remove baselines of tests, of an environment, or of tests whose file is gone",
        description=(
            "Remove baselines and write the file again (atomically); what is removed is printed before "
            "the file is written. Name the tests (node ids, or path prefixes such as tests/test_old.py), or "
            "use --missing; with --env alone, remove that whole environment; with --env and tests or "
            "--missing, remove them from that environment only. A pattern that matches every test in the "
            "file ('', '.', '/', a glob, a folder holding them all) is refused unless --all is given."
        ),
        epilog="Exit status: 0 removed (or nothing to remove), 2 an error or a refusal: nothing was written.",
    )
    prune.add_argument("--file", type=Path, metavar="PATH", help=file_help)
    common(
        prune,
        tests_help="node ids, or path prefixes (tests/test_old.py, tests/legacy), to remove",
        env_help="the environment: its whole key, or a part of it that only one key contains",
    )
    prune.add_argument(
        "--missing",
        action="store_true",
        help="remove every test whose file no longer exists under the rootdir",
    )
    prune.add_argument(
        "--rootdir",
        type=Path,
        metavar="DIR",
        help="what node ids are relative to, for --missing (default: the rootdir, the folder of the pytest "
        "configuration file the baseline file was found by; else the baseline file's folder)",
    )
    prune.add_argument(
        "--all",
        action="store_true",
        help="remove every test of the chosen environments (all of them without --env); also lets a TEST "
        "pattern match every test",
    )
    prune.add_argument("--dry-run", action="store_true", help="print what would be removed; write nothing")
    prune.set_defaults(handler=_prune)

    history = sub.add_parser(
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
    history.set_defaults(handler=_history)
    return parser, {"show": show, "diff": diff, "prune": prune, "history": history}


def _tolerance(text: str) -> Tolerance:
    try:
        return parse_tolerance(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prog() -> str:
    """The program's name in messages: ``pytest-gpumem`` when run by its console script."""
    return "pytest-gpumem" if Path(sys.argv[0]).name.startswith("pytest-gpumem") else PROG


def _baseline_file(args: argparse.Namespace) -> Path:
    """``--file``, else the file pytest uses (:func:`locate`); sets ``args.file`` and ``args.found_rootdir``."""
    args.found_rootdir = None
    if args.file is not None:
        return Path(args.file)
    found = locate(Path.cwd())
    if found.path is None:
        raise CommandError(
            f"no baseline file given and none found: no folder from {found.where_looked()} holds a pytest "
            f"configuration file (pytest.ini, pyproject.toml, tox.ini, setup.cfg) or a {DEFAULT_FILENAME}; "
            "give --file PATH"
        )
    if not found.path.exists():
        raise CommandError(f"{found.path}: no such file ({found.how}); give --file PATH for another file")
    path = found.path
    if path.parent == Path.cwd():  # named as the user would: the file in the current folder by its name
        path = Path(path.name)
    args.file, args.found_rootdir = path, found.rootdir
    return path


def _read(path: Path) -> BaselineStore:
    """The store in ``path``, which must exist (unlike for pytest, a missing file is an error here)."""
    if not path.exists():
        raise CommandError(f"{path}: no such file")
    return load(path)


def _read_side(spec: str) -> BaselineStore:
    """One side of ``diff``: a file, or ``REV:PATH`` read with ``git show``."""
    if os.path.exists(spec):
        return _read(Path(spec))
    revision, colon, path = spec.partition(":")
    if not colon or not revision or not path:
        raise CommandError(f"{spec}: no such file (write REV:PATH for a file in git)")
    if revision.startswith("-"):  # git would read it as an option
        raise CommandError(f"{spec}: no such file, and {revision!r} is not a revision")
    from pytest_gpumem.baselines.history import HistoryError, run_git

    try:
        shown = run_git(spec, None, "show", spec)
    except HistoryError as exc:
        raise CommandError(str(exc)) from None
    return parse(shown, spec)


def _environments(stores: Iterable[BaselineStore], text: str | None) -> list[str]:
    """The environment keys of ``stores`` whose key contains ``text`` (case-insensitive), sorted."""
    keys = sorted({key for store in stores for key in store.environment_keys()})
    if text is None:
        return keys
    chosen = [key for key in keys if text.casefold() in key.casefold()]
    if not chosen:
        raise CommandError(f"--env {text!r} matches no environment; the keys are: {listed(keys)}")
    return chosen


def _matches(test: str, texts: Sequence[str]) -> bool:
    return not texts or any(text in test for text in texts)


def _check_texts(texts: Sequence[str], seen: Iterable[str]) -> None:
    """Raise naming the first of ``texts`` that no node id in ``seen`` contains."""
    tests = list(seen)
    for text in texts:
        if not any(text in test for test in tests):
            raise CommandError(f"TEST {text!r} matches no test in the chosen environments")


def _metrics(entries: Iterable[BaselineEntry]) -> list[str]:
    """The metrics of ``entries``: :data:`BASELINE_METRICS`, then other figures, then the rest by name."""
    names = {metric for entry in entries for metric in entry.costs}
    known = [m for m in (*BASELINE_METRICS, *METRICS) if m in names or m in BASELINE_METRICS]
    return list(dict.fromkeys(known)) + sorted(names.difference(known))


def _table(rows: list[list[str]], headers: list[str], right_from: int, markdown: bool) -> str:
    right = range(right_from, len(headers))
    return markdown_table(headers, rows, right=right) if markdown else table(headers, rows, right=right)


def _heading(key: str, detail: str, markdown: bool) -> str:
    return f"### `{key}` ({detail})" if markdown else f"{key} ({detail})"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _show(args: argparse.Namespace) -> int:
    store = _read(_baseline_file(args))
    keys = _environments([store], args.env)
    if not keys:
        print(f"{args.file} has no baselines")
        return 0
    _check_texts(args.tests, (test for key in keys for test in store.tests(key)))
    blocks: list[str] = []
    for key in keys:
        tests = [test for test in store.tests(key) if _matches(test, args.tests)]
        if not tests:
            continue
        spans = {test: store.spans(key, test) for test in tests}
        metrics = _metrics(entry for by_name in spans.values() for entry in by_name.values())
        rows = [  # n/a: unknown; empty: not recorded
            [test, name, *(figure_text(m, entry.cost(m), args.bytes) if m in entry.costs else "" for m in metrics)]
            for test in tests
            for name, entry in spans[test].items()
        ]
        table = _table(rows, ["test", "span", *metrics], 2, args.markdown)
        blocks.append(f"{_heading(key, _count(len(tests), 'test'), args.markdown)}\n\n{table}")
        for test in tests if args.sites else ():
            for name, entry in spans[test].items():
                if entry.sites is not None:
                    sites = _table(profile_rows(entry.sites, exact=args.bytes), list(PROFILE_HEADERS), 4, args.markdown)
                    blocks.append(f"{test} [{name}] sites\n\n{sites}")
    print("\n\n".join(blocks))
    return 0


_CHANGE_KINDS = ("grew", "shrank", "changed", "added", "removed")


@dataclass(frozen=True)
class _Change:
    """One metric of one span that differs between the two sides (``None``: absent or unknown)."""

    kind: str  # "added", "removed", "grew", "shrank" or "changed" (known on one side only)
    test: str
    span: str
    metric: str
    old: int | None
    new: int | None

    def worse(self, tolerance: Tolerance) -> bool:
        """Whether the cost got worse beyond ``tolerance``: the judge's rule with the old cost as the baseline."""
        if self.old is None or self.new is None:
            return False
        return baseline_status(self.metric, self.new, self.old, tolerance) == "regressed"


def _diff(args: argparse.Namespace) -> int:
    old, new = _read_side(args.old), _read_side(args.new)
    keys = _environments([old, new], args.env)
    _check_texts(args.tests, (test for key in keys for store in (old, new) for test in store.tests(key)))
    blocks: list[str] = []
    changes: list[_Change] = []
    environments = {"added": 0, "removed": 0}
    for key in keys:
        before, after = set(old.tests(key)), set(new.tests(key))
        if not before or not after:
            count = len([t for t in before | after if _matches(t, args.tests)])
            if count:
                what = "removed" if before else "added"
                environments[what] += 1
                blocks.append(_heading(key, f"{what} environment, {_count(count, 'test')}", args.markdown))
            continue
        found = [
            change
            for test in sorted(before | after)
            if _matches(test, args.tests)
            for change in _test_changes(test, old.spans(key, test), new.spans(key, test))
        ]
        if not found:
            continue
        changes += found
        rows = [_change_row(change, args.bytes) for change in found]
        table = _table(rows, ["change", "test", "span", "metric", "old", "new", "Δ", "Δ%"], 4, args.markdown)
        tests = len({change.test for change in found})
        blocks.append(f"{_heading(key, _count(tests, 'test') + ' changed', args.markdown)}\n\n{table}")
        for test, span in dict.fromkeys((c.test, c.span) for c in found) if args.sites else ():
            earlier, later = old.entry(key, test, span), new.entry(key, test, span)
            if earlier is not None and later is not None and earlier.sites is not None and later.sites is not None:
                rows = site_diff_rows(diff_sites(span, earlier.sites, later.sites), exact=args.bytes)
                headers = ["site", "code", "change", "Δ at peak", "Δ at end"]
                blocks.append(f"{test} [{span}] sites by growth\n\n{_table(rows, headers, 3, args.markdown)}")
    kinds = {kind: sum(change.kind == kind for change in changes) for kind in _CHANGE_KINDS}
    summary = [
        f"{label}: " + ", ".join(f"{number} {kind}" for kind, number in counts.items() if number)
        for label, counts in (("environments", environments), ("costs", kinds))
        if any(counts.values())
    ]
    blocks.append("; ".join(summary) or "no differences")
    print("\n\n".join(blocks))
    tolerances = {change.metric: tolerance_for(change.metric, args.tolerance) for change in changes}
    worse = [change for change in changes if change.worse(tolerances[change.metric])]
    if args.fail_on_growth and worse:
        lines = [f"{_count(len(worse), 'cost')} got worse beyond {'its' if len(worse) == 1 else 'their'} tolerance:"]
        for change in worse:
            was, now = (figure_text(change.metric, value, args.bytes) for value in (change.old, change.new))
            tolerance = tolerances[change.metric].describe(metric_info(change.metric))
            lines.append(f"  {change.test} [{change.span}] {change.metric}: {was} -> {now} (tolerance {tolerance})")
        print("\n".join(lines), file=sys.stderr)
        return EXIT_GREW
    return 0


def _test_changes(test: str, old: Mapping[str, BaselineEntry], new: Mapping[str, BaselineEntry]) -> list[_Change]:
    changes: list[_Change] = []
    for span in sorted(old.keys() | new.keys(), key=lambda name: (name != CALL_SPAN, name)):
        before, after = old.get(span), new.get(span)
        before_costs: Mapping[str, int | None] = before.costs if before is not None else {}
        after_costs: Mapping[str, int | None] = after.costs if after is not None else {}
        for metric in _metrics(entry for entry in (before, after) if entry is not None):
            if metric not in before_costs and metric not in after_costs:
                continue
            was, now = before_costs.get(metric), after_costs.get(metric)
            if metric not in before_costs:
                kind = "added"
            elif metric not in after_costs:
                kind = "removed"
            elif was == now:
                continue
            elif was is None or now is None:
                kind = "changed"
            else:
                kind = "grew" if now > was else "shrank"
            changes.append(_Change(kind, test, span, metric, was, now))
    return changes


def _change_row(change: _Change, exact: bool) -> list[str]:
    shown_delta = percent = ""
    if change.old is not None and change.new is not None:
        delta = change.new - change.old
        shown_delta = delta_text(change.metric, delta, exact)
        percent = format_percent(delta, change.old)
    return [
        change.kind,
        change.test,
        change.span,
        change.metric,
        "" if change.kind == "added" else figure_text(change.metric, change.old, exact),
        "" if change.kind == "removed" else figure_text(change.metric, change.new, exact),
        shown_delta,
        percent,
    ]


def _prune(args: argparse.Namespace) -> int:
    if not (args.tests or args.missing or args.env is not None or args.all):
        raise CommandError("name what to remove: TEST ..., --missing, --env KEY for a whole environment, or --all")
    if args.tests and args.missing:
        raise CommandError("give either TEST ... or --missing, not both")
    if args.missing and args.all:
        raise CommandError("give either --missing or --all, not both")
    if args.env is not None and not args.env.strip():
        raise CommandError("--env: empty; name an environment (a part of its key that only it contains)")
    store = _read(_baseline_file(args))
    keys = list(store.environment_keys())
    if args.env is not None:
        keys = [environment_named(store, args.env)]
    verb = "would remove" if args.dry_run else "removing"
    lines: list[str] = []
    removed = 0
    whole = args.env is not None and not (args.tests or args.missing or args.all)
    if whole:
        (key,) = keys
        removed = len(store.tests(key))
        store.remove_environment(key)
        lines.append(f"{verb} environment {key!r} ({_count(removed, 'test')})")
    else:
        if args.missing:
            rootdir = args.rootdir or args.found_rootdir or args.file.resolve().parent
            doomed = tests_missing(store, keys, rootdir)
        elif args.tests:
            doomed = tests_named(store, keys, args.tests, everything=args.all)
        else:  # --all
            doomed = {key: list(store.tests(key)) for key in keys if store.tests(key)}
        for key in keys:
            tests = doomed.get(key, [])
            if tests:
                lines.append(f"{key}:")
                lines += [f"  {verb} {test}" for test in tests]
            for test in tests:
                store.remove(key, test)
            removed += len(tests)
    if not removed:
        print("nothing to prune")
        return 0
    print("\n".join(lines), flush=True)  # what is removed, before the file is written
    if args.dry_run:
        print(f"would remove the baselines of {_count(removed, 'test')} from {args.file} (dry run: nothing written)")
        return 0
    try:
        save(store)
    except OSError as exc:  # the file is as it was: save() writes a temporary file, then renames it
        raise CommandError(f"{args.file}: cannot write: {exc.strerror or exc}; the file is unchanged") from None
    print(f"removed the baselines of {_count(removed, 'test')} from {args.file}")
    return 0


def _history(args: argparse.Namespace) -> int:
    """Print the history, write the page and the exports asked for; returns the exit status (0)."""
    from pytest_gpumem.baselines.history import HistoryError, read_history  # git and the charts: only here
    from pytest_gpumem.report import trend
    from pytest_gpumem.report.artifacts import write_html

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
    _check_texts(args.tests, (test for _, test, _ in history.series()))
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
