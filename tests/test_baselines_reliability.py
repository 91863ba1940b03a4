"""The baseline file keeps every entry: concurrent updates merge under a lock, a module skipped
at import keeps its baselines, a symbolic link is written through, any node id can be stored,
and a file that cannot be read is the same clean error whatever is wrong with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from conftest import run
from pytest_gpumem.baselines import BaselineEntry, BaselineFileError, BaselineStore, Environment, load, save, saving
from tests._sessions_xdist import warm_workers

pytest_plugins = ["pytester"]

#: The environment the plugin's CPU sessions here record under (the running torch's version).
CPU = Environment.detect("cpu", cuda_rounding=False)
ENTRY = BaselineEntry({"peak": 1024, "allocated": 512, "reserved": None}, start=0)


def recorded(path: Path, *tests: str) -> Path:
    store = load(path)
    for test in tests:
        store.record(CPU, test, {"call": ENTRY})
    save(store)
    return path


def names_in(path: Path) -> list[str]:
    return list(load(path).tests(CPU.key))


def leftovers(folder: Path) -> list[str]:
    """Temporary files a save left behind."""
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


# --------------------------------------------------------------------------- concurrent saves

# One process of a concurrent update: it loads the file, waits until the other process has
# loaded it too, records its test, and saves. Its writes wait (up to WAIT seconds) until the
# other process is about to write as well: without a lock, both have checked the file on disk
# before either replaces it.
SAVER = """
import sys, time
from pathlib import Path
from pytest_gpumem.baselines import BaselineEntry, Environment, load, save, saving

path, folder, me, other = sys.argv[1:]
WAIT = 2.0

def meet(what, timeout):
    Path(folder, f"{what}-{me}").touch()
    deadline = time.monotonic() + timeout
    while not Path(folder, f"{what}-{other}").exists() and time.monotonic() < deadline:
        time.sleep(0.005)

write = saving._atomic_write

def write_when_both_write(target, data):
    meet("write", WAIT)
    write(target, data)

saving._atomic_write = write_when_both_write
store = load(path)
meet("loaded", 60)
env = Environment(engine="cpu", torch_version="2.13", cuda_rounding=False)
store.record(env, f"t.py::{me}", {"call": BaselineEntry({"peak": 1, "allocated": 1, "reserved": None}, start=0)})
print(save(store))
"""


@pytest.mark.slow
def test_two_processes_saving_at_the_same_moment_keep_both_entries(tmp_path: Path) -> None:
    path = recorded(tmp_path / "b.json", "t.py::old")
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    sync = tmp_path / "sync"
    sync.mkdir()
    savers = [
        subprocess.Popen(
            [sys.executable, str(script), str(path), str(sync), me, other],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me, other in (("a", "b"), ("b", "a"))
    ]
    outputs = [saver.communicate(timeout=120) for saver in savers]
    assert [saver.returncode for saver in savers] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["True", "True"]  # both wrote, and neither was overwritten
    assert names_in(path) == ["t.py::a", "t.py::b", "t.py::old"]
    assert leftovers(tmp_path) == []


SYNCED_SUITE = """
import os, time
from pathlib import Path

import pytest, torch


@pytest.mark.gpumem
def test_a():
    torch.ones(100)


@pytest.mark.gpumem
def test_b():
    torch.ones(200)


def test_sync():
    # both sessions have read the baseline file (at collection) before either writes it
    Path(os.environ["SYNC_ME"]).touch()
    deadline = time.monotonic() + 120
    while not Path(os.environ["SYNC_OTHER"]).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""


@pytest.mark.slow
def test_two_update_runs_on_disjoint_tests_keep_both(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SYNCED_SUITE)
    recorded(pytester.path / "gpumem-baselines.json", "test_suite.py::test_gone_elsewhere")
    sessions = []
    for me, other in (("a", "b"), ("b", "a")):
        env = {**os.environ, "SYNC_ME": str(pytester.path / me), "SYNC_OTHER": str(pytester.path / other)}
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]
        command += ["--gpumem-device=cpu", "--gpumem-update-baselines", "-k", f"test_{me} or sync"]
        sessions.append(
            subprocess.Popen(command, cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = [session.communicate(timeout=300)[0].decode() for session in sessions]
    assert [session.returncode for session in sessions] == [0, 0], outputs
    for output in outputs:
        assert "baselines written to" in output, output
    assert names_in(pytester.path / "gpumem-baselines.json") == [
        "test_suite.py::test_a",
        "test_suite.py::test_b",
        "test_suite.py::test_gone_elsewhere",  # a -k run never prunes
    ]
    assert not (pytester.path / "gpumem-baselines.json.lock").exists()  # nothing beside the file to commit


def test_a_save_applies_its_changes_onto_what_another_run_wrote_since(tmp_path: Path) -> None:
    path = recorded(tmp_path / "b.json", "t.py::kept", "t.py::renamed", "t.py::both")
    ours, theirs = load(path), load(path)
    theirs.record(CPU, "t.py::theirs", {"call": ENTRY})
    theirs.record(CPU, "t.py::both", {"call": BaselineEntry({"peak": 7}, start=0)})
    assert save(theirs)
    ours.record(CPU, "t.py::ours", {"call": ENTRY})
    ours.record(CPU, "t.py::both", {"call": BaselineEntry({"peak": 9}, start=0)})
    ours.prune(ours.stale({"t.py::kept", "t.py::ours", "t.py::both"}, CPU.key))  # drops t.py::renamed
    assert save(ours)
    assert names_in(path) == ["t.py::both", "t.py::kept", "t.py::ours", "t.py::theirs"]
    entry = load(path).entry(CPU.key, "t.py::both")
    assert entry is not None and entry.cost("peak") == 9  # the same test recorded twice: the later save wins
    assert ours.tests(CPU.key) == ("t.py::both", "t.py::kept", "t.py::ours", "t.py::theirs")  # it sees the merge
    assert save(ours) is False  # and saving it again changes nothing
    assert leftovers(tmp_path) == []


def test_two_runs_that_both_create_the_file_keep_both(tmp_path: Path) -> None:
    path = tmp_path / "new" / "b.json"
    first, second = load(path), load(path)  # no file yet
    first.record(CPU, "t.py::a", {"call": ENTRY})
    second.record(CPU, "t.py::b", {"call": ENTRY})
    assert save(first) and save(second)
    assert names_in(path) == ["t.py::a", "t.py::b"]


def test_a_merge_onto_a_file_broken_since_it_was_loaded_writes_nothing(tmp_path: Path) -> None:
    path = recorded(tmp_path / "b.json", "t.py::a")
    ours = load(path)
    ours.record(CPU, "t.py::b", {"call": ENTRY})
    path.write_text("<<<<<<< HEAD\n")
    with pytest.raises(BaselineFileError, match="merge conflict") as error:
        save(ours)
    assert str(path) in str(error.value)
    assert path.read_text() == "<<<<<<< HEAD\n"
    assert leftovers(tmp_path) == []


def test_a_save_waits_for_the_lock_and_says_who_holds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = recorded(tmp_path / "b.json", "t.py::a")
    assert sorted(os.listdir(tmp_path)) == ["b.json"]  # nothing beside the file that a `git add -A` would commit
    lock = saving.lock_path(path)
    assert lock.is_file() and lock.stat().st_size == 0 and tmp_path not in lock.parents
    store = load(path)
    store.record(CPU, "t.py::b", {"call": ENTRY})
    monkeypatch.setattr(saving, "LOCK_TIMEOUT_S", 0.2)
    with FileLock(str(lock)), pytest.raises(BaselineFileError, match="another process") as error:
        save(store)  # while another process is saving
    assert str(path) in str(error.value) and str(lock) in str(error.value)
    assert names_in(path) == ["t.py::a"]
    assert save(store)  # once it is free
    assert names_in(path) == ["t.py::a", "t.py::b"]


def test_the_lock_is_the_file_s_whatever_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One lock per file on disk, named by its resolved path: a symbolic link and its target, a
    relative and an absolute path, share it; two files have two."""
    path = recorded(tmp_path / "b.json", "t.py::a")
    (tmp_path / "link.json").symlink_to(path)
    monkeypatch.chdir(tmp_path)
    assert saving.lock_path(tmp_path / "link.json") == saving.lock_path(Path("b.json")) == saving.lock_path(path)
    assert saving.lock_path(tmp_path / "other.json") != saving.lock_path(path)
    assert saving.lock_path(path).parent == Path(os.environ["XDG_CACHE_HOME"], "pytest-gpumem", "locks")


@pytest.mark.skipif(not hasattr(os, "symlink") or sys.platform == "win32", reason="POSIX symbolic links")
def test_a_symbolic_link_at_the_lock_s_name_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    """A committed ``gpumem-baselines.json.lock`` link (the lock of older releases) is never opened,
    and a link planted where the lock is now is refused: its target is never truncated."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = recorded(tmp_path / "b.json", "t.py::a")
    (tmp_path / "b.json.lock").symlink_to(victim)
    recorded(path, "t.py::b")
    assert victim.read_text() == "precious"
    lock = saving.lock_path(path)
    lock.unlink()
    lock.symlink_to(victim)
    store = load(path)
    store.record(CPU, "t.py::c", {"call": ENTRY})
    with pytest.raises(BaselineFileError, match="cannot create its lock file") as error:
        save(store)
    assert str(lock) in str(error.value)
    assert victim.read_text() == "precious"
    assert names_in(path) == ["t.py::a", "t.py::b"]


# --------------------------------------------------------------------------- what is never stale

SKIPPED_AT_IMPORT = """
from pathlib import Path

import pytest, torch

pytest.importorskip(Path(__file__).with_name("library.txt").read_text().strip())


@pytest.mark.gpumem
def test_needs_the_library():
    torch.ones(100)
"""

ALWAYS = """
import pytest, torch


@pytest.mark.gpumem
def test_always():
    torch.ones(100)


@pytest.mark.gpumem
@pytest.mark.other
def test_marked():
    torch.ones(100)
"""


def skipping_suite(pytester: pytest.Pytester) -> Path:
    pytester.makeini('[pytest]\nmarkers =\n    other: a marker to deselect with -m "not other"\n')
    pytester.makepyfile(test_library=SKIPPED_AT_IMPORT, test_always=ALWAYS)
    (pytester.path / "library.txt").write_text("json")
    run(pytester, "--gpumem-update-baselines").assert_outcomes(passed=3)
    path = pytester.path / "gpumem-baselines.json"
    assert names_in(path) == [
        "test_always.py::test_always",
        "test_always.py::test_marked",
        "test_library.py::test_needs_the_library",
    ]
    return path


def test_a_module_skipped_at_import_keeps_its_baselines(pytester: pytest.Pytester) -> None:
    path = skipping_suite(pytester)
    (pytester.path / "library.txt").write_text("gpumem_no_such_library")
    before = path.read_bytes()
    pruned = run(pytester, "--gpumem-update-baselines", "--gpumem-prune")
    pruned.assert_outcomes(passed=2, skipped=1)
    assert "stale" not in pruned.stdout.str()
    assert path.read_bytes() == before
    strict = run(pytester, "--gpumem-strict")
    strict.assert_outcomes(passed=2, skipped=1)
    assert strict.ret == 0
    assert "stale" not in strict.stdout.str()


def test_a_module_that_fails_to_import_keeps_its_baselines(pytester: pytest.Pytester) -> None:
    path = skipping_suite(pytester)
    pytester.makepyfile(test_library="import gpumem_no_such_library\n" + SKIPPED_AT_IMPORT)
    before = path.read_bytes()
    stopped = run(pytester, "--gpumem-update-baselines", "--gpumem-prune")
    assert stopped.ret == pytest.ExitCode.INTERRUPTED
    going_on = run(pytester, "--gpumem-update-baselines", "--gpumem-prune", "--continue-on-collection-errors")
    going_on.assert_outcomes(passed=2, errors=1)
    assert path.read_bytes() == before


def test_a_module_a_conftest_ignores_keeps_its_baselines(pytester: pytest.Pytester) -> None:
    path = skipping_suite(pytester)
    before = path.read_bytes()
    pytester.makeconftest('collect_ignore = ["test_library.py"]  # where the library is missing\n')
    result = run(pytester, "--gpumem-update-baselines", "--gpumem-prune", "--gpumem-strict")
    result.assert_outcomes(passed=2)
    assert result.ret == 0
    assert path.read_bytes() == before
    (pytester.path / "conftest.py").unlink()
    ignored = run(pytester, "--gpumem-update-baselines", "--gpumem-prune", "--ignore=test_library.py")
    ignored.assert_outcomes(passed=2)
    assert path.read_bytes() == before
    (pytester.path / "test_library.py").unlink()  # deleted: now its baselines are stale
    deleted = run(pytester, "--gpumem-update-baselines", "--gpumem-prune")
    deleted.stdout.fnmatch_lines(["*test_library.py::test_needs_the_library*"])
    assert names_in(path) == ["test_always.py::test_always", "test_always.py::test_marked"]


@pytest.mark.parametrize("deselect", [["-k", "not marked"], ["-m", "not other"]])
def test_deselected_tests_keep_their_baselines(pytester: pytest.Pytester, deselect: list[str]) -> None:
    path = skipping_suite(pytester)
    before = path.read_bytes()
    result = run(pytester, "--gpumem-update-baselines", "--gpumem-prune", *deselect)
    result.assert_outcomes(passed=2, deselected=1)
    assert path.read_bytes() == before


@pytest.mark.slow
def test_a_module_skipped_at_import_keeps_its_baselines_under_xdist(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = skipping_suite(pytester)
    (pytester.path / "library.txt").write_text("gpumem_no_such_library")
    before = path.read_bytes()
    with warm_workers(monkeypatch):
        result = run(pytester, "--gpumem-update-baselines", "--gpumem-prune", "--gpumem-strict", "-n", "2")
    result.assert_outcomes(passed=2, skipped=1)
    assert result.ret == 0
    assert path.read_bytes() == before


# --------------------------------------------------------------------------- where the file is written


def test_a_symbolic_link_is_written_through(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    target = recorded(tmp_path / "shared" / "real.json", "t.py::a")
    (tmp_path / "repo").mkdir()
    link = tmp_path / "repo" / "b.json"
    link.symlink_to(Path("..", "shared", "real.json"))  # relative, as a repository would hold it
    recorded(link, "t.py::b")
    assert link.is_symlink() and os.readlink(link) == os.path.join("..", "shared", "real.json")
    assert names_in(target) == ["t.py::a", "t.py::b"]
    assert leftovers(tmp_path / "repo") == [] and leftovers(tmp_path / "shared") == []
    assert os.listdir(tmp_path / "shared") == ["real.json"] and os.listdir(tmp_path / "repo") == ["b.json"]


def test_a_dangling_symbolic_link_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "b.json"
    link.symlink_to(tmp_path / "data" / "real.json")
    recorded(link, "t.py::a")
    assert link.is_symlink()
    assert names_in(tmp_path / "data" / "real.json") == ["t.py::a"]


def test_a_read_only_file_is_refused_by_name(tmp_path: Path) -> None:
    path = recorded(tmp_path / "b.json", "t.py::a")
    before = path.read_bytes()
    path.chmod(0o444)
    store = load(path)
    store.record(CPU, "t.py::b", {"call": ENTRY})
    with pytest.raises(BaselineFileError, match="read-only") as error:
        save(store)
    assert str(error.value).startswith(f"{path}:")
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_a_read_only_file_fails_the_update_run_with_its_name(pytester: pytest.Pytester) -> None:
    path = skipping_suite(pytester)
    before = path.read_bytes()
    path.chmod(0o444)
    pytester.makepyfile(test_new="import pytest\n@pytest.mark.gpumem\ndef test_new():\n    pass\n")
    result = run(pytester, "--gpumem-update-baselines")
    result.assert_outcomes(passed=4)
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*could not write the baseline file: {path}: *read-only*"])
    assert "INTERNALERROR" not in result.stdout.str()
    assert path.read_bytes() == before


def test_a_folder_that_cannot_hold_the_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "not-a-folder").write_text("")
    path = tmp_path / "not-a-folder" / "b.json"
    with pytest.raises(BaselineFileError, match="cannot read the baseline file"):
        load(path)  # a run stops here, before its first test
    store = BaselineStore()
    store.record(CPU, "t.py::a", {"call": ENTRY})
    with pytest.raises(BaselineFileError, match="cannot write the baseline file") as error:
        save(store, path)
    assert str(error.value).startswith(f"{path}:")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permissions do not stop root")
def test_a_read_only_folder_is_a_clear_error(tmp_path: Path) -> None:
    path = recorded(tmp_path / "ro" / "b.json", "t.py::a")
    before = path.read_bytes()
    (tmp_path / "ro").chmod(0o555)
    try:
        store = load(path)
        store.record(CPU, "t.py::b", {"call": ENTRY})
        with pytest.raises(BaselineFileError, match="cannot write") as error:
            save(store)
        assert str(error.value).startswith(f"{path}:")
        assert path.read_bytes() == before
    finally:
        (tmp_path / "ro").chmod(0o755)


# --------------------------------------------------------------------------- node ids that are not UTF-8

NOT_UTF8 = "t_" + b"\xff".decode("utf-8", "surrogateescape") + ".py::test_x"  # a file name with the byte 0xff


def test_a_node_id_that_is_not_utf8_is_stored_escaped_and_read_back(tmp_path: Path) -> None:
    path = recorded(tmp_path / "b.json", "t.py::a", NOT_UTF8)
    text = path.read_bytes().decode("utf-8")  # strict: the file is UTF-8
    assert '"t_\\udcff.py::test_x": {' in text  # the JSON escape of the surrogate Python names the byte with
    assert names_in(path) == ["t.py::a", NOT_UTF8]
    assert save(load(path)) is False  # and it reads back to the same bytes


NAMED_TEST = """
import pytest, torch


@pytest.mark.gpumem
def test_{name}():
    torch.ones(100)
"""


@pytest.fixture
def suite_with_a_name_that_is_not_utf8(pytester: pytest.Pytester) -> str:
    try:
        with open(os.fsencode(pytester.path) + b"/test_\xff.py", "w") as handle:
            handle.write(NAMED_TEST.format(name="bytes"))
    except (OSError, UnicodeError):  # pragma: no cover - a file system that only takes UTF-8 names
        pytest.skip("this file system does not take file names that are not UTF-8")
    pytester.makepyfile(test_ok=NAMED_TEST.format(name="ok"))
    return "test_" + b"\xff".decode("utf-8", "surrogateescape") + ".py::test_bytes"


def test_a_test_file_named_with_bytes_that_are_not_utf8_is_recorded_and_matched(
    pytester: pytest.Pytester, suite_with_a_name_that_is_not_utf8: str
) -> None:
    odd = suite_with_a_name_that_is_not_utf8
    written = run(pytester, "--gpumem-update-baselines", "--gpumem-json=report.json", "--gpumem-markdown=report.md")
    written.assert_outcomes(passed=2)
    assert written.ret == 0
    written.stdout.fnmatch_lines(["baselines written to *gpumem-baselines.json"])
    path = pytester.path / "gpumem-baselines.json"
    assert names_in(path) == ["test_ok.py::test_ok", odd]
    report = json.loads((pytester.path / "report.json").read_bytes().decode("utf-8"))
    assert sorted(test["nodeid"] for test in report["tests"]) == ["test_ok.py::test_ok", odd]
    # its underscore escaped for Markdown (the lone surrogate is no letter): rendered as test_\udcff.py::test_bytes
    assert "test\\_\\udcff.py::test_bytes" in (pytester.path / "report.md").read_bytes().decode("utf-8")
    matched = run(pytester, "--gpumem-strict", "--gpumem-update-baselines", "--gpumem-prune")
    matched.assert_outcomes(passed=2)
    matched.stdout.fnmatch_lines(["baselines unchanged in *gpumem-baselines.json"])
    assert run(pytester, "--gpumem-strict").ret == 0  # neither new nor stale: the same test


# --------------------------------------------------------------------------- files that cannot be read

DEEP = 100_000


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("[" * DEEP + "]" * DEEP, "nested"),
        ('{"a": ' * DEEP + "1" + "}" * DEEP, "nested"),
        ('{"schema": 1, "x": ' + "[" * DEEP + "]" * DEEP + "}", "nested"),
        ('{"schema": 1, "x": ' + "[" * 900 + "]" * 900 + "}", "nested"),  # parses, but could not be written back
        ('{"schema": 1, "environments": {}, "x": 1' + "0" * 5000 + "}", "number"),
        ('{"schema": 1, "environments": {}, "x": 1e999}', "number"),
        ('{"schema": 1, "environments": {}, "x": -1e999}', "number"),
        (b'{"schema": 1, "x": "\xff"}', "not UTF-8"),
        ("", "empty file"),
    ],
    ids=["array", "object", "unknown-key", "unknown-key-900", "long-integer", "inf", "minus-inf", "bytes", "empty"],
)
def test_a_file_that_cannot_be_read_is_a_clean_error(tmp_path: Path, content: str | bytes, words: str) -> None:
    path = tmp_path / "b.json"
    data = content.encode() if isinstance(content, str) else content
    path.write_bytes(data)
    with pytest.raises(BaselineFileError, match=words) as error:
        load(path)
    assert str(error.value).startswith(f"{path}")
    assert "Restore it from version control" in str(error.value) or "Correct it by hand" in str(error.value)
    assert path.read_bytes() == data


def test_a_folder_is_a_clean_error(tmp_path: Path) -> None:
    with pytest.raises(BaselineFileError, match="cannot read the baseline file") as error:
        load(tmp_path)
    assert str(error.value).startswith(f"{tmp_path}:")


def test_moderately_nested_unknown_keys_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    nested = {"k": [[[{"deeper": [1, 2, {"x": None}]}]]]}
    path.write_text(json.dumps({"schema": 1, "environments": {}, "future": nested}))
    store = load(path)
    store.record(CPU, "t.py::a", {"call": ENTRY})
    assert save(store)
    assert json.loads(path.read_text())["future"] == nested


def test_a_deeply_nested_file_stops_the_run_cleanly(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_one=NAMED_TEST.format(name="one"))
    path = pytester.path / "gpumem-baselines.json"
    path.write_text("[" * DEEP)
    for args in ((), ("--gpumem-update-baselines",)):
        result = run(pytester, *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        output = result.stdout.str() + result.stderr.str()
        assert "INTERNALERROR" not in output and "RecursionError" not in output
        assert f"gpumem baselines: {path}" in output and "nested" in output
        assert path.read_text() == "[" * DEEP


def test_the_store_survives_from_dict_with_deep_values() -> None:
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(BaselineFileError, match="nested"):
        BaselineStore.from_dict({"schema": 1, "environments": {}, "x": deep})


def test_a_killed_saves_temporary_file_goes_whatever_the_files_name_and_no_other_name_stops_a_save(
    tmp_path: Path,
) -> None:
    """A temporary file of a process that is gone is removed at the next save, also beside a file whose name is over
    the 100 characters the temporary name keeps of it; a name that only looks like one (a pid in digits that are not
    ASCII's) is left alone, and the save goes on."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(done.stdout)  # a process that has ended
    for name in ("b.json", "b" * 120 + ".json"):
        path = recorded(tmp_path / name, "t.py::a")
        orphan = tmp_path / f".{path.name[:100]}.{gone}.0a1b2c3d.tmp"
        lookalike = tmp_path / f".{path.name[:100]}.²³.0a1b2c3d.tmp"
        orphan.write_bytes(b"{}")
        lookalike.write_bytes(b"{}")
        recorded(path, "t.py::b")
        assert not orphan.exists() and lookalike.exists()
        assert names_in(path) == ["t.py::a", "t.py::b"]
        lookalike.unlink()
