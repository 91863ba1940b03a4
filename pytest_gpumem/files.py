"""Writing the plugin's files: a regular file replaced atomically, a link written through, a device or FIFO into."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import sys
from pathlib import Path

__all__ = ["move_file", "temporary_pid", "unwritable", "write_file"]


def write_file(path: str | os.PathLike[str], data: bytes, *, durable: bool = False) -> Path:
    """Write ``data`` to ``path`` as the module says, making missing folders (``durable``: fsynced); returns the path
    written."""
    target, found = _target(path)
    if found is not None and not stat.S_ISREG(found.st_mode):
        _write_into(target, found.st_mode, data)
    else:
        _replace(target, data, None if found is None else stat.S_IMODE(found.st_mode), durable=durable)
    return target


def _target(path: str | os.PathLike[str]) -> tuple[Path, os.stat_result | None]:
    """The file ``path`` names (through a symbolic link) and its status; None where nothing is there yet."""
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    try:
        return target, os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        return target, None


def _write_into(target: Path, mode: int, data: bytes) -> None:
    """Write into something that is no regular file, or refuse it."""
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
    if stat.S_ISCHR(mode):
        flags = os.O_WRONLY
    elif stat.S_ISFIFO(mode):
        flags = os.O_WRONLY | os.O_NONBLOCK  # no reader: ENXIO at once, instead of waiting forever
    else:
        raise OSError(errno.EINVAL, "is neither a regular file, a device nor a FIFO: not replaced", str(target))
    try:
        fd = os.open(target, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, "is a FIFO that no process reads: not replaced", str(target)) from None
        raise
    with os.fdopen(fd, "wb") as handle:
        if flags & os.O_NONBLOCK:  # a FIFO's reader is there: wait for it to read the rest
            os.set_blocking(fd, True)
        handle.write(data)


def move_file(temporary: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Put the complete file ``temporary`` (beside ``path``) at ``path`` as :func:`write_file` would."""
    target, found = _target(path)
    if found is None or stat.S_ISREG(found.st_mode):
        os.replace(temporary, target)
        return
    try:
        _write_into(target, found.st_mode, Path(temporary).read_bytes())
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def _temporary_prefix(target: Path) -> str:
    return f".{target.name[:100]}."


def temporary_pid(target: Path, name: str) -> int | None:
    """The id of the process that made ``name``, a temporary file :func:`write_file` makes beside ``target``; None
    for any other name."""
    found = re.fullmatch(re.escape(_temporary_prefix(target)) + r"([0-9]+)\.[^.]*\.tmp", name)
    return None if found is None else int(found[1])


def _replace(target: Path, data: bytes, mode: int | None, *, durable: bool) -> None:
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = -1
    while fd < 0:  # until the name is new: 32 random bits collide almost never
        temporary = folder / f"{_temporary_prefix(target)}{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with contextlib.suppress(FileExistsError):
            fd = os.open(temporary, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            if mode is not None and hasattr(os, "fchmod"):
                os.fchmod(handle.fileno(), mode)
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if durable and sys.platform != "win32":
        with contextlib.suppress(OSError):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def unwritable(path: Path, *, folder: bool = False, written: bool = True) -> str | None:
    """Why ``path`` cannot be written as a file (``folder``: made as a folder; ``written=False``: only the kind), or
    None; a missing parent folder is made on writing."""
    if path.is_dir() and not folder:
        return f"{path} is a directory: give a file name"
    if path.exists() and not path.is_dir() and folder:
        return f"{path} is a file: give a folder"
    if not written:
        return None
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{path} cannot be created: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{path} cannot be written: the folder {existing} is not writable"
    return None
