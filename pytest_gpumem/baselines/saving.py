"""Writing a baseline file atomically: :func:`save`, its temporary files and their orphans."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import sys
import time
from pathlib import Path

from pytest_gpumem.baselines.loading import digest, fingerprint
from pytest_gpumem.baselines.store import BaselineStore
from pytest_gpumem.baselines.validation import BaselineFileError

__all__ = ["ORPHAN_AGE_S", "save"]

_HINT_SAVE = "Nothing was written. Load the file again (a fresh pytest run does) before recording baselines into it."

#: Temp files older than this (seconds) are removed by the next save even if their writer may live.
ORPHAN_AGE_S = 24 * 3600


def save(store: BaselineStore, path: str | os.PathLike[str] | None = None, *, force: bool = False) -> bool:
    """Write ``store`` to ``path`` (default: the file it was loaded from) atomically; True when written.

    The bytes go to a temporary file in the same folder, are flushed and
    fsynced, then ``os.replace`` puts them in place, so a reader, a crash or a
    kill at any moment sees either the old file or the new one, never a mix.
    On any error the temporary file is removed and the old file is intact. A
    kill (SIGKILL, power loss) between creating and renaming the temporary file
    can leave it behind as ``.<name>.<pid>.<random>.tmp``; the next save
    removes such orphans once their process is gone (or after a day).

    Nothing is written when the bytes would not change. Unless ``force`` is
    true, raises :class:`BaselineFileError` instead of overwriting a file that
    this store was not loaded from, or that changed on disk since it was loaded
    (another run saved it, or it was edited): the store would otherwise
    silently drop the entries it never saw. Creates missing parent folders.
    """
    if path is None and store.path is None:
        raise ValueError("save() needs a path for a store that was not loaded from a file")
    target = Path(path) if path is not None else store.path
    assert target is not None
    data = store.dumps()
    ours = store.path is not None and _same_path(store.path, target)
    try:
        current: tuple[int, int, int, int] | None = fingerprint(os.stat(target))
    except FileNotFoundError:
        current = None
    if not force and current is not None:
        if not ours:
            raise BaselineFileError(
                target,
                "refusing to overwrite a baseline file this store was not loaded from",
                hint=_HINT_SAVE,
            )
        if current != store._fingerprint:
            raise BaselineFileError(target, "the file changed on disk since it was loaded", hint=_HINT_SAVE)
    new_digest = digest(data)
    if ours and current is not None and current == store._fingerprint and new_digest == store._digest:
        return False
    _atomic_write(target, data)
    store.path = target
    store._fingerprint = fingerprint(os.stat(target))
    store._digest = new_digest
    return True


def _atomic_write(target: Path, data: bytes) -> None:
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    _remove_orphans(target)
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None  # a new file: 0o666 less the umask, as open() would give it
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        temp = folder / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(temp, flags, 0o666)
            break
        except FileExistsError:  # pragma: no cover - 32 random bits collided
            continue
    try:
        with os.fdopen(fd, "wb") as handle:
            if mode is not None and hasattr(os, "fchmod"):
                os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened."""
    if sys.platform == "win32":  # pragma: no cover
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def _remove_orphans(target: Path) -> None:
    """Remove temp files a killed save of ``target`` left behind: their process is gone, or they are old."""
    prefix = f".{target.name}."
    try:
        names = os.listdir(target.parent)
    except OSError:  # pragma: no cover
        return
    now = time.time()
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        parts = name[len(prefix) : -len(".tmp")].split(".")
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        orphan = target.parent / name
        try:
            old = now - orphan.stat().st_mtime > ORPHAN_AGE_S
        except OSError:
            continue
        if old or (int(parts[0]) != os.getpid() and not _alive(int(parts[0]))):
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
    except OSError:
        return True  # it exists but belongs to someone else
    return True


def _same_path(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)
