"""The command line: ``python -m pytest_gpumem baselines show|diff|prune`` on real files and a real git repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import pytest_gpumem
from conftest import CPU_ENV as CPU
from conftest import H100_ENV as H100
from pytest_gpumem.baselines import BaselineEntry, BaselineStore, Environment, load, save
from pytest_gpumem.cli import main

MiB = 1 << 20
PACKAGE = Path(pytest_gpumem.__file__).parent
ROOT = PACKAGE.parent
TRAIN = "tests/test_train.py::test_step[tiny]"
SMALL = "tests/test_train.py::test_step[small]"
OLD = "tests/test_old.py::test_legacy"
OLD_TOO = "tests/test_old.py::TestSuite::test_more"
OLDER = "tests/test_old.py_other.py::test_x"  # a different file that shares the prefix
MICRO = "tests/test_micro.py::test_fit"


def entry(peak: int, allocated: int = 0, reserved: int | None = None, **extra: int) -> BaselineEntry:
    return BaselineEntry({"peak": peak, "allocated": allocated, "reserved": reserved, **extra}, start=0)


def baseline_file(path: Path, **changes: Any) -> Path:
    """A real baseline file: two environments, several tests and spans; ``changes`` replace tests' spans."""
    tests: dict[tuple[Environment, str], dict[str, BaselineEntry] | None] = {
        (CPU, TRAIN): {"call": entry(52 * MiB, 3 * MiB), "forward": entry(30 * MiB, 20 * MiB)},
        (CPU, SMALL): {"call": entry(410 * MiB, 24 * MiB)},
        (CPU, OLD): {"call": entry(8 * MiB)},
        (CPU, OLD_TOO): {"call": entry(9 * MiB)},
        (CPU, OLDER): {"call": entry(7 * MiB)},
        (CPU, MICRO): {"call": entry(100 * MiB, max_microbatch=16)},
        (H100, TRAIN): {"call": entry(60 * MiB, 3 * MiB, 64 * MiB)},
    }
    for name, spans in changes.items():
        environment, test = {"cpu_train": (CPU, TRAIN), "cpu_micro": (CPU, MICRO), "cpu_old": (CPU, OLD)}[name]
        tests[(environment, test)] = spans
    store = BaselineStore()
    for (environment, test), spans in tests.items():
        if spans is not None:
            store.record(environment, test, spans)
    path.unlink(missing_ok=True)
    save(store, path)
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["baselines", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder as the current directory, holding gpumem-baselines.json and the test files."""
    monkeypatch.chdir(tmp_path)
    baseline_file(tmp_path / "gpumem-baselines.json")
    return tmp_path


def rows(text: str) -> list[list[str]]:
    """The lines of ``text`` split on runs of two or more spaces, less headings, column names and rules."""
    lines = text.splitlines()
    rules = {i for i, line in enumerate(lines) if line and set(line) <= {"-", " "}}
    return [
        re.split(r"\s{2,}", line.strip())
        for i, line in enumerate(lines)
        if line.strip() and i not in rules and i + 1 not in rules and " | " not in line
    ]


# --------------------------------------------------------------------------- show


def test_show_prints_one_table_per_environment(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    code, out, err = run(capsys, "show")
    assert code == 0 and err == ""
    cpu_at, h100_at = out.index(f"{CPU.key} (6 tests)"), out.index(f"{H100.key} (1 test)")
    assert cpu_at < h100_at
    cpu, h100 = out[cpu_at:h100_at], out[h100_at:]
    header = next(line for line in cpu.splitlines() if line.startswith("test "))
    assert header.split() == ["test", "span", "peak", "allocated", "reserved", "max_microbatch"]
    table = rows(cpu)
    assert [TRAIN, "call", "52.00 MiB", "3.00 MiB", "n/a"] in table
    assert [TRAIN, "forward", "30.00 MiB", "20.00 MiB", "n/a"] in table
    assert [MICRO, "call", "100.00 MiB", "0 B", "n/a", "16"] in table  # a count, not bytes
    assert [row[0] for row in table] == sorted(row[0] for row in table)
    assert rows(h100) == [[TRAIN, "call", "60.00 MiB", "3.00 MiB", "64.00 MiB"]]
    assert "max_microbatch" not in h100


def test_show_filters_and_exact_bytes(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    code, out, _ = run(capsys, "show", "--env", "h100", "--bytes")
    assert code == 0 and CPU.key not in out
    assert rows(out) == [[TRAIN, "call", str(60 * MiB), str(3 * MiB), str(64 * MiB)]]
    code, out, _ = run(capsys, "show", "test_old", "[small]")
    assert code == 0
    assert sorted(row[0] for row in rows(out)) == sorted([OLD, OLD_TOO, OLDER, SMALL])
    assert f"{CPU.key} (4 tests)" in out and H100.key not in out  # no test of H100 matches


def test_show_markdown(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    code, out, _ = run(capsys, "show", "--markdown", "--env", "H100")
    assert code == 0
    assert out.splitlines()[0] == f"### `{H100.key}` (1 test)"
    assert f"| {TRAIN} | call |" in out and "|:-" in out


def test_markdown_escapes_bars_in_node_ids(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = BaselineStore()
    store.record(CPU, "t.py::test_mode[a|b]", {"call": entry(MiB)})
    save(store, tmp_path / "b.json")
    code, out, _ = run(capsys, "show", "--file", str(tmp_path / "b.json"), "--markdown")
    assert code == 0 and "| t.py::test_mode[a\\|b] | call |" in out


def test_show_another_file_and_an_empty_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = baseline_file(tmp_path / "elsewhere.json")
    code, out, _ = run(capsys, "show", "--file", str(path), OLD)
    assert code == 0 and [row[0] for row in rows(out)] == [OLD]  # OLD_TOO does not contain OLD
    save(BaselineStore(), tmp_path / "empty.json")
    assert run(capsys, "show", "--file", str(tmp_path / "empty.json")) == (
        0,
        f"{tmp_path / 'empty.json'} has no baselines\n",
        "",
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["show", "--file", "nope.json"], "show: error: nope.json: no such file"),
        (["show", "--env", "tpu"], "show: error: --env 'tpu' matches no environment; the keys are: 'cpu | torch"),
        (["show", "test_gone"], "show: error: TEST 'test_gone' matches no test"),
        (["show", "--env", "h100", "test_old"], "TEST 'test_old' matches no test in the chosen environments"),
    ],
)
def test_show_errors(capsys: pytest.CaptureFixture[str], here: Path, argv: list[str], words: str) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("python -m pytest_gpumem baselines ") and words in err
    assert len(err.splitlines()) == 1


def test_a_broken_file_is_reported_with_its_line_and_advice(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    path = here / "gpumem-baselines.json"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join([*lines[:5], "<<<<<<< HEAD\n", *lines[5:]]))
    before = path.read_bytes()
    for argv in (["show"], ["prune", OLD], ["diff", path.name, path.name]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, "")
        message, hint = err.splitlines()
        assert message == (
            f"python -m pytest_gpumem baselines {argv[0]}: error: gpumem-baselines.json:6:1: "
            "git conflict marker '<<<<<<< HEAD': the file has an unresolved merge conflict"
        )
        assert hint.startswith("hint: Resolve the merge conflict first")
    assert path.read_bytes() == before
    path.write_text('{"schema": 1, "environments": {"k": {"tests": {"t": {"spans": {"call": {"peak": "big"}}}}}}}')
    code, _, err = run(capsys, "show")
    assert code == 2 and 'gpumem-baselines.json:1:81: ["environments"]["k"]' in err and "expected an integer" in err


def test_usage_errors_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: python -m pytest_gpumem" in capsys.readouterr().err
    assert main(["baselines", "show", "--frobnicate"]) == 2
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err
    assert main(["baselines", "diff", "a", "b", "--tolerance", "2x"]) == 2
    assert "invalid tolerance '2x'" in capsys.readouterr().err
    assert main(["baselines", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(action in out for action in ("show", "diff", "prune"))


def test_show_loads_neither_the_history_reader_nor_its_charts(here: Path) -> None:
    """``baselines history``'s git reader and charts are imported by its handler alone: the other
    actions do not pay for them."""
    code = (
        "import sys\n"
        "from pytest_gpumem.cli import main\n"
        "assert main(['baselines', 'show']) == 0\n"
        "names = ('pytest_gpumem.baselines.history', 'pytest_gpumem.report.trend', 'pytest_gpumem.report.artifacts')\n"
        "print('loaded', [name for name in names if name in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "loaded []"


def test_the_validations_help_and_a_bad_option_answer_without_importing_torch() -> None:
    """``validate --help`` and a usage error come from the command line's parser alone: torch,
    which the validation itself needs, is not imported for them (it takes seconds)."""
    code = (
        "import sys\n"
        "from pytest_gpumem.cli import main\n"
        "for argv in (['validate', '--help'], ['validate', '--size', 'huge']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exit:\n"
        "        print('exit', exit.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m pytest_gpumem validate" in done.stdout and "--trace {mlp,reference}" in done.stdout
    assert "argument --size: invalid choice: 'huge'" in done.stderr
    assert [line for line in done.stdout.splitlines() if line.startswith("exit ")] == ["exit 0 False", "exit 2 False"]


# --------------------------------------------------------------------------- diff


def changed_file(path: Path) -> Path:
    return baseline_file(
        path,
        cpu_train={"call": entry(60 * MiB, 3 * MiB), "backward": entry(10 * MiB)},  # peak grew, forward -> backward
        cpu_micro={"call": entry(90 * MiB, max_microbatch=12)},  # peak shrank, max_microbatch fell (worse)
        cpu_old=None,  # removed
    )


def test_diff_lists_every_change(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    new = changed_file(here / "new.json")
    code, out, err = run(capsys, "diff", "gpumem-baselines.json", str(new))
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"{CPU.key} (3 tests changed)"
    assert rows(out) == [
        ["shrank", MICRO, "call", "peak", "100.00 MiB", "90.00 MiB", "-10.00 MiB", "-10.0%"],
        ["shrank", MICRO, "call", "max_microbatch", "16", "12", "-4", "-25.0%"],
        ["removed", OLD, "call", "peak", "8.00 MiB"],
        ["removed", OLD, "call", "allocated", "0 B"],
        ["removed", OLD, "call", "reserved", "n/a"],
        ["grew", TRAIN, "call", "peak", "52.00 MiB", "60.00 MiB", "+8.00 MiB", "+15.4%"],
        ["added", TRAIN, "backward", "peak", "10.00 MiB"],
        ["added", TRAIN, "backward", "allocated", "0 B"],
        ["added", TRAIN, "backward", "reserved", "n/a"],
        ["removed", TRAIN, "forward", "peak", "30.00 MiB"],
        ["removed", TRAIN, "forward", "allocated", "20.00 MiB"],
        ["removed", TRAIN, "forward", "reserved", "n/a"],
        ["costs: 1 grew, 2 shrank, 3 added, 6 removed"],
    ]
    # old and new sides in their columns: "added" has an empty old cell, "removed" an empty new one
    added = next(line for line in out.splitlines() if line.startswith("added"))
    header = next(line for line in out.splitlines() if line.startswith("change"))
    assert added[header.index("old") : header.index("new") + 3].strip() == "10.00 MiB"
    assert added.index("10.00 MiB") > header.index("old") + 2


def test_diff_exact_bytes_and_filters(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    new = changed_file(here / "new.json")
    code, out, _ = run(capsys, "diff", "gpumem-baselines.json", str(new), "--bytes", "[tiny]")
    assert code == 0
    assert ["grew", TRAIN, "call", "peak", str(52 * MiB), str(60 * MiB), f"+{8 * MiB}", "+15.4%"] in rows(out)
    assert MICRO not in out and OLD not in out
    code, out, _ = run(capsys, "diff", "gpumem-baselines.json", str(new), "--env", "h100")
    assert (code, out) == (0, "no differences\n")
    code, _, err = run(capsys, "diff", "gpumem-baselines.json", str(new), "--env", "a100")
    assert code == 2 and "--env 'a100' matches no environment" in err
    code, _, err = run(capsys, "diff", "gpumem-baselines.json", str(new), "test_gone")
    assert code == 2 and "TEST 'test_gone' matches no test" in err


def test_diff_a_cost_known_on_one_side_only(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    before, after = BaselineStore(), BaselineStore()
    before.record(H100, TRAIN, {"call": entry(MiB, 0, None)})
    after.record(H100, TRAIN, {"call": entry(MiB, 0, 2 * MiB)})
    save(before, tmp_path / "a.json")
    save(after, tmp_path / "b.json")
    code, out, _ = run(capsys, "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--fail-on-growth")
    assert code == 0  # unknown before: not a growth
    assert rows(out) == [["changed", TRAIN, "call", "reserved", "n/a", "2.00 MiB"], ["costs: 1 changed"]]


def test_diff_fail_on_growth_and_tolerance(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    new = changed_file(here / "new.json")
    code, out, err = run(capsys, "diff", "gpumem-baselines.json", str(new), "--fail-on-growth")
    assert code == 1 and "costs: 1 grew" in out
    assert err.splitlines() == [
        "2 costs got worse beyond their tolerance:",
        f"  {MICRO} [call] max_microbatch: 16 -> 12 (tolerance 0 (exact))",
        f"  {TRAIN} [call] peak: 52.00 MiB -> 60.00 MiB (tolerance 0 (exact))",
    ]
    # 15.4% growth passes a 20% tolerance; the microbatch fell by 25%, beyond it
    code, _, err = run(capsys, "diff", "gpumem-baselines.json", str(new), "--fail-on-growth", "--tolerance", "20%")
    assert code == 1 and err.splitlines()[1:] == [f"  {MICRO} [call] max_microbatch: 16 -> 12 (tolerance 20%)"]
    code, _, err = run(capsys, "diff", "gpumem-baselines.json", str(new), "--fail-on-growth", "--tolerance", "30%")
    assert (code, err) == (0, "")
    # without the option growth is reported, not failed; the same file twice has no differences
    assert run(capsys, "diff", "gpumem-baselines.json", str(new))[0] == 0
    assert run(capsys, "diff", "--fail-on-growth", str(new), str(new)) == (0, "no differences\n", "")


def test_diff_added_and_removed_environments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    only_cpu, both = BaselineStore(), BaselineStore()
    for store in (only_cpu, both):
        store.record(CPU, TRAIN, {"call": entry(MiB)})
    both.record(H100, TRAIN, {"call": entry(MiB)})
    both.record(H100, SMALL, {"call": entry(MiB)})
    save(only_cpu, tmp_path / "a.json")
    save(both, tmp_path / "b.json")
    code, out, _ = run(capsys, "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--fail-on-growth")
    assert (code, out) == (0, f"{H100.key} (added environment, 2 tests)\n\nenvironments: 1 added\n")
    code, out, _ = run(capsys, "diff", str(tmp_path / "b.json"), str(tmp_path / "a.json"))
    assert out.startswith(f"{H100.key} (removed environment, 2 tests)\n")


def git(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    return subprocess.run(["git", *args], cwd=folder, env=env, check=True, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_diff_against_a_git_revision(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    git(here, "init", "-q", "-b", "main")
    (here / "sub").mkdir()
    baseline_file(here / "sub" / "gpumem-baselines.json")
    git(here, "add", ".")
    git(here, "commit", "-q", "-m", "baselines")
    changed_file(here / "gpumem-baselines.json")
    code, out, _ = run(capsys, "diff", "main:gpumem-baselines.json", "gpumem-baselines.json", "--fail-on-growth")
    assert code == 1 and "costs: 1 grew, 2 shrank, 3 added, 6 removed" in out
    assert run(capsys, "diff", "HEAD:gpumem-baselines.json", "main:gpumem-baselines.json") == (
        0,
        "no differences\n",
        "",
    )
    os.chdir(here / "sub")  # REV:./PATH is relative to the current folder
    assert run(capsys, "diff", "main:./gpumem-baselines.json", "gpumem-baselines.json")[1] == "no differences\n"
    os.chdir(here)
    code, out, err = run(capsys, "diff", "main:missing.json", "gpumem-baselines.json")
    assert (code, out) == (2, "")
    assert err.startswith("python -m pytest_gpumem baselines diff: error: main:missing.json: git show failed: fatal:")
    assert "missing.json" in err.split("fatal:")[1]
    code, _, err = run(capsys, "diff", "no-such-rev:gpumem-baselines.json", "gpumem-baselines.json")
    assert code == 2 and "no-such-rev:gpumem-baselines.json: git show failed" in err
    code, _, err = run(capsys, "diff", "nothing.json", "gpumem-baselines.json")
    assert code == 2 and "nothing.json: no such file" in err
    code, _, err = run(capsys, "diff", "gpumem-baselines.json", "--", "--output=x:y")  # never an option of git
    assert code == 2 and "--output=x:y: no such file, and '--output=x' is not a revision" in err
    assert not (here / "x").exists()
    # a broken file at a revision is named as REV:PATH
    (here / "gpumem-baselines.json").write_text("{")
    git(here, "commit", "-q", "-am", "broken")
    code, _, err = run(capsys, "diff", "HEAD:gpumem-baselines.json", "main~1:gpumem-baselines.json")
    assert code == 2 and "error: HEAD:gpumem-baselines.json:1:2: not valid JSON" in err


# --------------------------------------------------------------------------- prune


def baseline_tests(path: Path, environment: Environment = CPU) -> tuple[str, ...]:
    return load(path).tests(environment.key)


def test_prune_node_ids_and_path_prefixes(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    path = here / "gpumem-baselines.json"
    code, out, err = run(capsys, "prune", "tests/test_old.py", SMALL)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{CPU.key}:",
        f"  removing {OLD_TOO}",
        f"  removing {OLD}",
        f"  removing {SMALL}",
        "removed the baselines of 3 tests from gpumem-baselines.json",
    ]
    assert baseline_tests(path) == (MICRO, OLDER, TRAIN)
    assert baseline_tests(path, H100) == (TRAIN,)
    expected = BaselineStore()
    for test, spans in (
        (OLDER, {"call": entry(7 * MiB)}),
        (MICRO, {"call": entry(100 * MiB, max_microbatch=16)}),
        (TRAIN, {"call": entry(52 * MiB, 3 * MiB), "forward": entry(30 * MiB, 20 * MiB)}),
    ):
        expected.record(CPU, test, spans)
    expected.record(H100, TRAIN, {"call": entry(60 * MiB, 3 * MiB, 64 * MiB)})
    assert path.read_bytes() == expected.dumps()  # the canonical file, as pytest would write it


def test_prune_in_one_environment(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    code, out, _ = run(capsys, "prune", "--env", "H100", TRAIN)
    assert code == 0
    assert out.splitlines() == [
        f"{H100.key}:",
        f"  removing {TRAIN}",
        "removed the baselines of 1 test from gpumem-baselines.json",
    ]
    assert load(here / "gpumem-baselines.json").environment_keys() == (CPU.key,)
    assert TRAIN in baseline_tests(here / "gpumem-baselines.json")


def test_prune_a_whole_environment(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    path = here / "gpumem-baselines.json"
    data = json.loads(path.read_text())
    data["environments"][H100.key]["owner"] = "ml-infra"  # unknown keys do not keep it alive
    data["environments"][CPU.key]["owner"] = "ml-infra"  # but survive where the environment stays
    data["generator"] = {"name": "pytest-gpumem"}
    path.write_text(json.dumps(data))
    code, out, _ = run(capsys, "prune", "--env", H100.key)
    assert code == 0
    assert out.splitlines() == [
        f"removing environment {H100.key!r} (1 test)",
        "removed the baselines of 1 test from gpumem-baselines.json",
    ]
    after = json.loads(path.read_text())
    assert list(after["environments"]) == [CPU.key]
    assert after["environments"][CPU.key]["owner"] == "ml-infra" and after["generator"] == {"name": "pytest-gpumem"}
    assert len(after["environments"][CPU.key]["tests"]) == 6


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["prune"], "name what to remove: TEST ..., --missing, --env KEY for a whole environment, or --all"),
        (["prune", "--missing", "--all"], "give either --missing or --all, not both"),
        (["prune", "--missing", OLD], "give either TEST ... or --missing, not both"),
        (["prune", "--env", "torch 2.13"], "--env 'torch 2.13' matches 2 environments, name one: 'cpu | torch 2.13"),
        (["prune", "--env", "a100"], "--env 'a100' matches no environment; the keys are: 'cpu | torch 2.13"),
        (["prune", "tests/test_gone.py"], "TEST 'tests/test_gone.py' matches no baseline"),
        (["prune", "tests/test_old"], "TEST 'tests/test_old' matches no baseline"),  # not a path prefix
        (["prune", OLD, "tests/test_gone.py"], "TEST 'tests/test_gone.py' matches no baseline"),
        (["prune", "--env", "h100", OLD], f"TEST {OLD!r} matches no baseline"),
        (["prune", "--file", "nope.json", OLD], "nope.json: no such file"),
        (["prune", "--missing", "--rootdir", "nowhere"], "--rootdir 'nowhere': no such folder"),
    ],
)
def test_prune_errors_change_nothing(
    capsys: pytest.CaptureFixture[str], here: Path, argv: list[str], words: str
) -> None:
    before = (here / "gpumem-baselines.json").read_bytes()
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("python -m pytest_gpumem baselines prune: error: ") and words in err
    assert (here / "gpumem-baselines.json").read_bytes() == before


def test_prune_dry_run_writes_nothing(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    path = here / "gpumem-baselines.json"
    before, mtime, files = path.read_bytes(), path.stat().st_mtime_ns, sorted(os.listdir(here))
    code, out, _ = run(capsys, "prune", "--dry-run", "--env", "h100")
    assert code == 0
    assert out.splitlines()[-1] == (
        "would remove the baselines of 1 test from gpumem-baselines.json (dry run: nothing written)"
    )
    code, out, _ = run(capsys, "prune", "--dry-run", "tests/test_old.py")
    assert code == 0 and f"  would remove {OLD}\n" in out
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
    assert sorted(os.listdir(here)) == files


def make_test_files(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("def test_x():\n    pass\n")


def test_prune_missing_files(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    make_test_files(here, "tests/test_train.py", "tests/test_micro.py")  # test_old.py and test_old.py_other.py: gone
    code, out, _ = run(capsys, "prune", "--missing")
    assert code == 0
    assert out.splitlines() == [
        f"{CPU.key}:",
        f"  removing {OLD_TOO}",
        f"  removing {OLD}",
        f"  removing {OLDER}",
        "removed the baselines of 3 tests from gpumem-baselines.json",
    ]
    assert baseline_tests(here / "gpumem-baselines.json") == (MICRO, SMALL, TRAIN)
    assert baseline_tests(here / "gpumem-baselines.json", H100) == (TRAIN,)
    assert run(capsys, "prune", "--missing") == (0, "nothing to prune\n", "")


def test_prune_missing_relative_to_the_rootdir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    project = tmp_path / "project"
    path = baseline_file(project / ".gpumem" / "baselines.json")  # not in the rootdir
    before = path.read_bytes()
    make_test_files(project, "tests/test_train.py", "tests/test_micro.py", "tests/test_old.py")
    code, _, err = run(capsys, "prune", "--missing", "--file", str(path))
    assert code == 2 and f"none of the 4 test files exists under {path.parent}: is it the rootdir?" in err
    assert path.read_bytes() == before
    code, out, _ = run(capsys, "prune", "--missing", "--file", str(path), "--rootdir", str(project))
    assert code == 0 and out.splitlines()[1:-1] == [f"  removing {OLDER}"]
    assert load(path).tests(CPU.key) == (MICRO, OLD_TOO, OLD, SMALL, TRAIN)


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_failed_write_is_reported_and_keeps_the_file(here: Path) -> None:
    path = here / "gpumem-baselines.json"
    before, files = path.read_bytes(), sorted(os.listdir(here))
    code = textwrap.dedent(
        f"""
        import resource, signal, sys, types
        sys.dont_write_bytecode = True  # a module imported under the limit would leave its .pyc cut short
        package = types.ModuleType("pytest_gpumem")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["pytest_gpumem"] = package
        from pytest_gpumem.cli import main
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # smaller than the file: even root cannot write it
        sys.exit(main(["baselines", "prune", "tests/test_old.py"]))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "python -m pytest_gpumem baselines prune: error: gpumem-baselines.json: cannot write the baseline file: "
        "File too large\nhint: Nothing was written: the file is as it was."
    )
    assert "Traceback" not in result.stderr
    assert result.stdout == f"{CPU.key}:\n  removing {OLD_TOO}\n  removing {OLD}\n"  # said before writing
    assert path.read_bytes() == before
    assert sorted(os.listdir(here)) == files  # no temporary file left


# --------------------------------------------------------------------------- as a program


def test_python_m_pytest_gpumem(here: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest_gpumem", "baselines"]
    shown = subprocess.run([*command, "show", "--env", "h100"], cwd=here, env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert rows(shown.stdout) == [[TRAIN, "call", "60.00 MiB", "3.00 MiB", "64.00 MiB"]]
    failed = subprocess.run([*command, "prune", "tests/nope.py"], cwd=here, env=env, capture_output=True, text=True)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert "prune: error: TEST 'tests/nope.py' matches no baseline" in failed.stderr


def test_the_command_line_imports_neither_torch_nor_pytest(here: Path) -> None:
    # The package root imports torch-heavy modules; load only the command line's own modules.
    code = textwrap.dedent(
        f"""
        import sys, types
        package = types.ModuleType("pytest_gpumem")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["pytest_gpumem"] = package
        from pytest_gpumem.cli import main
        assert main(["baselines", "show"]) == 0
        assert main(["baselines", "prune", "--dry-run", "tests/test_old.py"]) == 0
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "pytest", "_pytest", "numpy"))
        assert not heavy, heavy
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert TRAIN in result.stdout


def test_a_closed_pipe_is_not_an_error(here: Path) -> None:
    store = BaselineStore()
    for i in range(3000):
        store.record(CPU, f"tests/test_many.py::test_{i}", {"call": entry(i * MiB)})
    path = here / "many.json"
    save(store, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    reader = subprocess.Popen(
        [sys.executable, "-m", "pytest_gpumem", "baselines", "show", "--file", str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert reader.stdout is not None and reader.stderr is not None
    assert reader.stdout.readline().startswith(CPU.key.encode())
    reader.stdout.close()  # as `| head -1` does
    err = reader.stderr.read().decode()
    assert reader.wait() == 0
    assert "Traceback" not in err and "BrokenPipe" not in err


# --------------------------------------------------------------------------- prune refuses to empty the file by mistake


@pytest.mark.parametrize("pattern", ["", " ", "/", ".", "./", ".//", "*", "**", "tests", "tests/"])
def test_prune_refuses_a_pattern_that_matches_every_test(
    capsys: pytest.CaptureFixture[str], here: Path, pattern: str
) -> None:
    """An unset shell variable (``prune "$TEST"``), the current folder, a glob, or a folder that holds
    every test: each would remove every baseline, GPU environments included."""
    path = here / "gpumem-baselines.json"
    before = path.read_bytes()
    code, out, err = run(capsys, "prune", pattern)
    assert (code, out) == (2, "")
    assert f"TEST {pattern!r} matches every test in the file" in err and "--all" in err
    assert path.read_bytes() == before


def test_prune_refuses_an_empty_environment(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    path = here / "gpumem-baselines.json"
    before = path.read_bytes()
    for text in ("", "  "):
        code, out, err = run(capsys, "prune", "--env", text)
        assert (code, out) == (2, "") and "--env: empty" in err
    assert path.read_bytes() == before


def test_prune_all_removes_every_baseline_when_asked(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    path = here / "gpumem-baselines.json"
    code, out, _ = run(capsys, "prune", "--all", "--env", "h100")
    assert code == 0 and out.splitlines()[-1] == "removed the baselines of 1 test from gpumem-baselines.json"
    assert load(path).environment_keys() == (CPU.key,)
    code, out, _ = run(capsys, "prune", "tests", "--all", "--dry-run")
    assert code == 0 and out.splitlines()[-1].startswith("would remove the baselines of 6 tests")
    code, out, _ = run(capsys, "prune", "--all")
    assert code == 0 and out.splitlines()[-1] == "removed the baselines of 6 tests from gpumem-baselines.json"
    assert len(load(path)) == 0


def test_a_whole_node_id_is_never_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A file with one test: naming it removes every baseline, and is what was asked."""
    store = BaselineStore()
    store.record(CPU, OLD, {"call": entry(1)})
    save(store, tmp_path / "one.json")
    code, out, _ = run(capsys, "prune", "--file", str(tmp_path / "one.json"), OLD)
    assert code == 0 and out.splitlines()[-1].startswith("removed the baselines of 1 test")
