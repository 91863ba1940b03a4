"""The baseline file's history in git: each commit's figures, per environment, test and span (this module runs git)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines.loading import parse
from pytest_gpumem.baselines.validation import BaselineFileError

__all__ = ["Commit", "Figures", "History", "HistoryError", "Skipped", "Version", "read_history", "run_git"]

#: (environment key, test node id, span) → metric → recorded cost (None: n/a)
Figures = dict[tuple[str, str, str], dict[str, int | None]]

_SEPARATOR = "\x1e"  # between commits in the log
_FIELD = "\x1f"  # between a commit's fields


class HistoryError(Exception):
    """The history cannot be read at all (no git, not in a repository, a file git never had)."""


@dataclass(frozen=True)
class Commit:
    """One commit: its hash, committer date (ISO 8601, with its offset) and subject line."""

    sha: str
    date: str
    subject: str

    @property
    def short(self) -> str:
        """The first 10 hex digits of the hash."""
        return self.sha[:10]

    @property
    def day(self) -> str:
        """The date without the time (``2026-11-28``)."""
        return self.date[:10]


@dataclass(frozen=True)
class Version:
    """The baseline file as one commit left it: its path then, and its figures."""

    commit: Commit
    path: str
    figures: Figures
    #: how it was read when not by this release's loader (another schema version); None otherwise
    note: str | None = None


@dataclass(frozen=True)
class Skipped:
    """A commit of the file whose version could not be read, and why."""

    commit: Commit
    reason: str


@dataclass
class History:
    """The file's versions, oldest first, and the commits skipped."""

    file: Path
    versions: list[Version] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def environments(self) -> list[str]:
        """Every environment key in any version, sorted."""
        return sorted({key[0] for version in self.versions for key in version.figures})

    def series(self) -> list[tuple[str, str, str]]:
        """Every (environment, test, span) in any version: sorted, ``call`` first among a test's spans."""
        keys = {key for version in self.versions for key in version.figures}
        return sorted(keys, key=lambda key: (key[0], key[1], key[2] != "call", key[2]))

    @property
    def latest(self) -> Version | None:
        """The newest version read; None when none was."""
        return self.versions[-1] if self.versions else None


def lenient_figures(tree: Any) -> Figures:
    """The figures of a baseline file of another schema version, read by shape alone (``ValueError`` otherwise)."""
    figures: Figures = {}
    for environment, env in _object_at(tree, "environments", 'no "environments" object').items():
        for test, raw in _object_at(env, "tests", f'environment {environment!r} has no "tests" object').items():
            for span, values in _object_at(raw, "spans", f'test {test!r} has no "spans" object').items():
                if not isinstance(values, Mapping):
                    raise ValueError(f"span {span!r} of {test!r} is not an object")
                figures[(environment, test, span)] = {
                    metric: value
                    for metric, value in values.items()
                    if metric != "start" and (value is None or type(value) is int)
                }
    return figures


def _object_at(value: Any, key: str, problem: str) -> Mapping[str, Any]:
    """The object under ``key`` of ``value``; ``ValueError(problem)`` when there is none."""
    found = value.get(key) if isinstance(value, Mapping) else None
    if not isinstance(found, Mapping):
        raise ValueError(problem)
    return found


def read_version(data: bytes, name: str) -> tuple[Figures, str | None]:
    """The figures in the bytes of one version (``name`` names it in errors), and a note when read leniently."""
    try:
        store = parse(data, name)
    except BaselineFileError as exc:
        if "schema version" not in str(exc):  # only another schema's file is read again, by its shape
            raise
        try:
            tree = json.loads(data.decode("utf-8-sig"))
        except (RecursionError, ValueError):  # json gives up on deep nesting with a RecursionError
            raise exc from None
        schema = tree.get("schema") if isinstance(tree, Mapping) else None
        if type(schema) is not int:
            raise
        try:
            return lenient_figures(tree), f"schema version {schema}, read by its shape"
        except ValueError as shape:
            raise ValueError(f"schema version {schema} in another shape ({shape})") from None
    figures = {
        (environment, test, span): dict(entry.costs)
        for environment in store.environment_keys()
        for test in store.tests(environment)
        for span, entry in store.spans(environment, test).items()
    }
    return figures, None


def run_git(file: Path | str, folder: Path | None, *args: str) -> bytes:
    """``git ARGS``'s output, run in ``folder`` (None: here); a :class:`HistoryError` naming ``file`` if it fails."""
    try:
        done = subprocess.run(["git", *args], cwd=folder, capture_output=True, check=False)
    except OSError as exc:
        raise HistoryError(f"{file}: cannot run git: {exc.strerror or exc}") from None
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        raise HistoryError(f"{file}: git {args[0]} failed: {lines[0] if lines else f'exit {done.returncode}'}")
    return done.stdout


def read_history(path: str | os.PathLike[str], *, max_count: int | None = None) -> History:
    """The versions of the baseline file at ``path`` in git, oldest first (the newest ``max_count`` when given);
    versions of another schema are read by shape, the unreadable ones skipped with why."""
    file = Path(path)
    folder = file.parent.resolve()  # "." for a bare name
    if not folder.is_dir():
        raise HistoryError(f"{file}: no such folder {folder}")
    top = Path(run_git(file, folder, "rev-parse", "--show-toplevel").decode().strip())
    relative = (folder / file.name).relative_to(top.resolve()).as_posix()
    log = ["log", "--follow", "--name-only", f"--format={_SEPARATOR}%H{_FIELD}%cI{_FIELD}%s", "-z"]
    if max_count is not None:
        log.append(f"--max-count={max_count}")
    output = run_git(file, top, *log, "--", relative).decode("utf-8", errors="replace")
    history = History(file)
    for chunk in reversed(output.split(_SEPARATOR)[1:]):
        header, _, names = chunk.partition("\x00")  # the header, then the file's name in that commit
        sha, date, subject = ([*header.strip("\n").split(_FIELD), "", ""])[:3]
        commit = Commit(sha, date, subject)
        then = next((name.strip("\n") for name in names.split("\x00") if name.strip("\n")), relative)
        try:
            data = subprocess.run(["git", "show", f"{sha}:{then}"], cwd=top, capture_output=True, check=True).stdout
            history.versions.append(Version(commit, then, *read_version(data, f"{commit.short}:{then}")))
        except subprocess.CalledProcessError:
            history.skipped.append(Skipped(commit, f"the commit has no {then} (it was deleted or moved)"))
        except BaselineFileError as exc:
            history.skipped.append(Skipped(commit, str(exc).partition("\n")[0]))
        except ValueError as exc:
            history.skipped.append(Skipped(commit, f"{commit.short}:{then}: {exc}"))
    if not history.versions and not history.skipped:
        raise HistoryError(f"{file}: git has no commit of this file (commit it first)")
    return history
