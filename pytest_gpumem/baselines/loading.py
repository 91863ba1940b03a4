"""Reading a baseline file: :func:`load` and :func:`parse`, with errors located by line and column."""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines.store import BaselineStore, Fingerprint
from pytest_gpumem.baselines.validation import HINT_RESTORE, MAX_DEPTH, BaselineFileError, lower_first, validate

__all__ = ["load", "parse"]

#: A line that is a git conflict marker: the marker, then nothing or a space and a label.
_CONFLICT_MARKER = re.compile(r"^(?:<{7}|={7}|>{7}|\|{7})(?:[ \t\r].*)?$", re.MULTILINE)
_HINT_CONFLICT = (
    "Resolve the merge conflict first: keep one side of each conflicting block (for instance "
    "`git checkout --theirs -- {path}`), then run `pytest --gpumem-update-baselines` to record "
    "the tests your branch changed again."
)


def load(path: str | os.PathLike[str]) -> BaselineStore:
    """Read the baseline file at ``path`` (missing: an empty store); :class:`BaselineFileError` says why it cannot."""
    target = Path(path)
    try:
        found, data = read(target)
    except FileNotFoundError:
        store = BaselineStore()
        store.commit(target)
        return store
    except OSError as exc:
        raise BaselineFileError(
            target,
            f"cannot read the baseline file: {exc.strerror or exc}",
            hint="Check that the path names a readable file.",
        ) from None
    store = parse(data, target)
    store.commit(target, found, digest(data))
    return store


def read(path: Path) -> tuple[Fingerprint, bytes]:
    """The bytes of the file at ``path`` and its :func:`fingerprint`, read through one handle (``OSError``)."""
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())
        return fingerprint(info), handle.read()


def parse(data: bytes, path: str | os.PathLike[str] = "<baselines>") -> BaselineStore:
    """Build a store from the bytes of a baseline file (``path`` names it in errors); raises as :func:`load` does."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, column = data.count(b"\n", 0, exc.start) + 1, exc.start - data.rfind(b"\n", 0, exc.start)
        hint = HINT_RESTORE.format(path=path)
        raise BaselineFileError(path, "not UTF-8 text", line=line, column=column, hint=hint) from None
    collecting = gc.isenabled()
    gc.disable()  # hundreds of thousands of acyclic dicts: no point in collecting meanwhile
    try:
        tree = json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant, parse_float=_finite_float
        )
    except (RecursionError, ValueError, _Unreadable) as exc:  # json.JSONDecodeError is a ValueError
        raise _not_json(exc, text, path) from None
    finally:
        if collecting:
            gc.enable()
    validate(tree, text, path)
    return BaselineStore._from_tree(tree)


def _not_json(exc: Exception, text: str, path: str | os.PathLike[str]) -> BaselineFileError:
    """The error for ``text``, which :func:`json.loads` refused with ``exc``: first, a merge conflict's marker (a
    marker line is never valid JSON, so the happy path needs no scan for one)."""
    marker = _CONFLICT_MARKER.search(text)
    if marker is not None:
        return BaselineFileError(
            path,
            f"git conflict marker {marker[0].strip()[:40]!r}: the file has an unresolved merge conflict",
            line=text.count("\n", 0, marker.start()) + 1,
            column=1,
            hint=_HINT_CONFLICT.format(path=path),
        )
    restore = HINT_RESTORE.format(path=path)
    if isinstance(exc, RecursionError):
        problem = f"not a baseline file: its values are nested too deeply (more than {MAX_DEPTH} levels)"
        return BaselineFileError(path, problem, hint=restore)
    if isinstance(exc, _Unreadable):
        problem, key = exc.args
        if key is None:
            return BaselineFileError(path, problem, hint=restore)
        advice = f"Keep one of the two, or {lower_first(restore)}"
        return BaselineFileError(path, problem, line=_line_of_second(text, key), hint=advice)
    if not isinstance(exc, json.JSONDecodeError):  # an integer too long to convert: Python's advice does not apply
        return BaselineFileError(
            path, f"a number too long to be a number of bytes ({str(exc).split(':')[0]})", hint=restore
        )
    problem = "empty file" if not text.strip() else f"not valid JSON ({exc.msg}); the file may be truncated"
    return BaselineFileError(path, problem, line=exc.lineno, column=exc.colno, hint=restore)


class _Unreadable(Exception):
    """JSON no baseline file holds: ``args`` are the problem and the key that appears twice (or None)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Unreadable(f"the key {key!r} appears twice in one object (a bad merge?)", key)
            seen.add(key)
    return result


def _reject_constant(constant: str) -> Any:
    raise _Unreadable(f"{constant} is not a valid number of bytes", None)


def _finite_float(literal: str) -> float:
    """A JSON number with a fraction or exponent; one too large for a float could not be written back."""
    value = float(literal)
    if math.isinf(value):
        _reject_constant(literal if len(literal) <= 40 else literal[:37] + "...")
    return value


def _line_of_second(text: str, key: str) -> int | None:
    found = re.finditer(re.escape(json.dumps(key, ensure_ascii=False)) + r"\s*:", text)
    second = next(itertools.islice(found, 1, None), None)
    return None if second is None else text.count("\n", 0, second.start()) + 1


def fingerprint(info: os.stat_result) -> Fingerprint:
    """What tells a file apart from the one that was loaded: device, inode, size, mtime (ns)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def digest(data: bytes) -> bytes:
    """A 16-byte hash of a file's bytes, to skip saves that would not change them."""
    return hashlib.blake2b(data, digest_size=16).digest()
