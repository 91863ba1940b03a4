"""Every file the plugin writes is written, never swapped in at the user's path.

A regular file is replaced atomically; a symbolic link is written through (the link stays, its
target gets the new text); a device is written into (it stays a device: ``--gpumem-json=/dev/null``
as root must not leave a regular file at /dev/null); a FIFO is written into when someone reads
it, and refused with a warning when nobody does (never renamed over, never waited on forever).
The device here is a twin of /dev/null made in the test's folder (``mknod``, root only), so a
regression cannot break the machine's own /dev/null.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from conftest import run
from pytest_gpumem.baselines import load, save
from pytest_gpumem.files import move_file, write_file

SUITE = """
import pytest, torch


@pytest.mark.gpumem
def test_one():
    torch.ones(100)
"""


def _null_device(folder: Path) -> Path:
    """A character device like /dev/null (1, 3) in ``folder``; skips where mknod is not allowed."""
    path = folder / "null"
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, AttributeError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path


def _reader(fifo: Path, got: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(fifo, "rb") as stream:
            got.append(stream.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_symbolic_link_is_written_through(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert write_file(link, b"new") == target
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]  # no temporary left


def test_a_device_is_written_into_and_stays_a_device(tmp_path: Path) -> None:
    device = _null_device(tmp_path)
    write_file(device, b"report")
    assert stat.S_ISCHR(device.stat().st_mode)
    temporary = tmp_path / "snapshot.tmp"
    temporary.write_bytes(b"pickle")
    move_file(temporary, device)
    assert stat.S_ISCHR(device.stat().st_mode) and not temporary.exists()


def test_a_fifo_is_written_into_when_read_and_refused_when_not(tmp_path: Path) -> None:
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="a FIFO that no process reads: not replaced") as raised:
        write_file(fifo, b"nobody reads")
    assert raised.value.filename == str(fifo)
    got: list[bytes] = []
    thread = _reader(fifo, got)
    while not got and thread.is_alive():
        try:
            write_file(fifo, b"read")
            break
        except OSError:  # the reader has not opened it yet
            continue
    thread.join(10)
    assert got == [b"read"] and stat.S_ISFIFO(fifo.stat().st_mode)


def test_reports_go_through_links_and_into_devices_and_fifos(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_r=SUITE)
    device = _null_device(pytester.path)
    target = pytester.path / "kept" / "report.json"
    target.parent.mkdir()
    target.write_text("{}")
    link = pytester.path / "report.json"
    link.symlink_to(target)
    fifo = pytester.path / "summary.fifo"
    os.mkfifo(fifo)
    result = run(pytester, f"--gpumem-json={link}", f"--gpumem-markdown={device}")
    result.assert_outcomes(passed=1)
    assert link.is_symlink() and json.loads(target.read_text())["tests"][0]["nodeid"] == "test_r.py::test_one"
    assert stat.S_ISCHR(device.stat().st_mode)
    result = run(pytester, f"--gpumem-markdown={fifo}")  # nobody reads it: a warning, the FIFO stays
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    text = " ".join(result.stdout.str().split())
    assert f"could not write the Markdown report {fifo}: is a FIFO that no process reads" in text
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_symbolic_link_to_the_baseline_file_stays_a_link(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_r=SUITE)
    real = pytester.path / "data" / "baselines.json"
    real.parent.mkdir()
    link = pytester.path / "gpumem-baselines.json"
    link.symlink_to(real)
    result = run(pytester, "--gpumem-update-baselines", f"--gpumem-baselines={link}")
    result.assert_outcomes(passed=1)
    assert link.is_symlink() and "test_r.py::test_one" in real.read_text()
    store = load(link)
    assert save(store, link) is False  # unchanged: nothing written
    assert link.is_symlink()
