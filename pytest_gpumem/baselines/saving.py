"""Writing a baseline file atomically: :func:`save`, its temporary files and their orphans."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pytest_gpumem.baselines.loading import digest, fingerprint, parse, read
from pytest_gpumem.baselines.store import BaselineStore, Fingerprint
from pytest_gpumem.baselines.validation import BaselineFileError
from pytest_gpumem.files import temporary_pid, write_file

__all__ = ["LOCK_TIMEOUT_S", "ORPHAN_AGE_S", "lock_path", "save"]

_HINT_SAVE = "Nothing was written. Load the file again (a fresh pytest run does) before recording baselines into it."
_HINT_WRITE = "Nothing was written: the file is as it was."
_HINT_FOLDER = " Check that its folder exists and is writable."
_HINT_MERGE = "Nothing was written: the file is as it was. Check that it is a readable file."

#: How long a save waits for another process's save of the same file to end (seconds).
LOCK_TIMEOUT_S = 60.0

#: Temp files older than this (seconds) are removed by the next save even if their writer may live.
ORPHAN_AGE_S = 24 * 3600


def save(store: BaselineStore, path: str | os.PathLike[str] | None = None, *, force: bool = False) -> bool:
    """Write ``store`` to ``path`` (default: the file it was loaded from) atomically, under :func:`lock_path`; True
    when written, False when the bytes would not change.

    When the file changed since it was read, this store's changes are applied onto it and the store holds the merge.
    :class:`BaselineFileError` leaves the file as it was; unless ``force`` (no merge), so does a file the store was not
    loaded from.
    """
    target = store.path if path is None else Path(path)
    if target is None:
        raise ValueError("save() needs a path for a store that was not loaded from a file")
    ours = store.path is not None and os.path.abspath(store.path) == os.path.abspath(target)
    real = Path(os.path.realpath(target))  # through symbolic links: the file that is replaced
    with _locked(target, real):
        try:
            current: Fingerprint | None = fingerprint(os.stat(real))
        except FileNotFoundError:
            current = None
        except OSError as exc:
            raise _cannot_write(target, exc) from None
        merged: BaselineStore | None = None
        if not force and current is not None:
            if not ours:
                raise BaselineFileError(
                    target, "refusing to overwrite a baseline file this store was not loaded from", hint=_HINT_SAVE
                )
            if current != store.fingerprint:
                merged, current, on_disk = _merge(store, target, real)
        data = (store if merged is None else merged).dumps()
        new_digest = digest(data)
        if merged is not None and new_digest == on_disk:  # the other run wrote what this one would
            store.commit(target, current, on_disk, merged=merged)
            return False
        if merged is None and ours and current == store.fingerprint and new_digest == store.digest:
            return False  # unchanged (a digest is set only with a fingerprint: the file is there)
        if current is not None:
            _check_writable(target, real)
        try:
            _atomic_write(real, data)
            written = fingerprint(os.stat(real))
        except OSError as exc:
            raise _cannot_write(target, exc) from None
    store.commit(target, written, new_digest, merged=merged)
    return True


def _merge(store: BaselineStore, target: Path, real: Path) -> tuple[BaselineStore, Fingerprint, bytes]:
    """The file on disk now with ``store``'s changes applied; its fingerprint and digest as read."""
    try:
        found, data = read(real)
    except OSError as exc:
        raise BaselineFileError(
            target, f"cannot read the baseline file to merge into it: {exc.strerror or exc}", hint=_HINT_MERGE
        ) from None
    fresh = parse(data, target)
    store.apply_changes(fresh)
    return fresh, found, digest(data)


def lock_path(path: str | os.PathLike[str]) -> Path:
    """The lock file that saves of the baseline file ``path`` take turns on, in the user's cache folder (nothing beside
    the baseline file to commit); it stays after a save, or two saves could lock two different files."""
    real = os.path.realpath(path)
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:32]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(real))[:40].lstrip(".")
    return _cache_folder() / "pytest-gpumem" / "locks" / f"{readable}-{digest}.lock"


def _cache_folder() -> Path:
    """The user's cache folder (not created here)."""
    configured = os.environ.get("XDG_CACHE_HOME", "").strip()
    if configured and os.path.isabs(configured):
        return Path(configured)
    if sys.platform == "win32":  # pragma: no cover
        local = os.environ.get("LOCALAPPDATA", "").strip()
        if local:
            return Path(local)
    if sys.platform == "darwin":  # pragma: no cover
        return Path.home() / "Library" / "Caches"
    return Path.home() / ".cache"


@contextlib.contextmanager
def _locked(target: Path, real: Path) -> Iterator[None]:
    """Hold the lock of ``real`` (the file a save of ``target`` replaces): :func:`lock_path`."""
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cannot_write(target, exc) from None
    lock_file = lock_path(real)
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise BaselineFileError(
            target,
            f"cannot write the baseline file: cannot create the folder of its lock file {lock_file.parent}: "
            f"{exc.strerror or exc}",
            hint=_HINT_WRITE + " Set XDG_CACHE_HOME to a folder you can write.",
        ) from None
    from filelock import FileLock, Timeout  # here: only a run that writes baselines pays its import

    lock = FileLock(str(lock_file), timeout=LOCK_TIMEOUT_S)
    try:
        held = lock.acquire()
    except Timeout:
        raise BaselineFileError(
            target,
            f"another process has been saving it for {LOCK_TIMEOUT_S:g} s (it holds the lock file {lock_file})",
            hint="Nothing was written. Run the update again once the other run has ended.",
        ) from None
    except OSError as exc:  # a symbolic link at its name (refused, never followed), permissions
        raise BaselineFileError(
            target,
            f"cannot write the baseline file: cannot create its lock file {lock_file}: {exc.strerror or exc}",
            hint=_HINT_WRITE + " Remove what is at the lock file's name if it is not a plain file.",
        ) from None
    with held:  # released on leaving
        yield


def _check_writable(target: Path, real: Path) -> None:
    """Refuse to replace a file its owner made read-only (even where the folder would allow it)."""
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return
    if not mode & 0o222 or not os.access(real, os.W_OK):
        raise BaselineFileError(
            target,
            "the baseline file is read-only",
            hint=f"Nothing was written. Make it writable (`chmod u+w {target}`) to record baselines into it.",
        )


def _cannot_write(target: Path, exc: OSError) -> BaselineFileError:
    folder = exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EEXIST)
    return BaselineFileError(
        target,
        f"cannot write the baseline file: {exc.strerror or exc}",
        hint=_HINT_WRITE + (_HINT_FOLDER if folder else ""),
    )


def _atomic_write(target: Path, data: bytes) -> None:
    """Write the baseline file with :func:`~pytest_gpumem.files.write_file` (its folder exists: :func:`_locked`)."""
    _remove_orphans(target)
    write_file(target, data, durable=True)


def _remove_orphans(target: Path) -> None:
    """Remove temp files a killed save of ``target`` left behind: their process is gone, or they are old."""
    try:
        names = os.listdir(target.parent)
    except OSError:  # pragma: no cover
        return
    now = time.time()
    for name in names:
        pid = temporary_pid(target, name)
        if pid is None:
            continue
        orphan = target.parent / name
        try:
            old = now - orphan.stat().st_mtime > ORPHAN_AGE_S
        except OSError:
            continue
        if old or (pid != os.getpid() and not _alive(pid)):
            with contextlib.suppress(OSError):
                orphan.unlink()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (always True on Windows, where we cannot ask safely)."""
    if sys.platform == "win32":  # pragma: no cover - os.kill(pid, 0) would terminate the process there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but belongs to someone else
        pass
    return True
