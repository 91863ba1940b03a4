"""Sites end to end: a small real model and a training step in a pytest session, its baseline
recorded with sites, then three regressions (an fp32 copy of the logits kept, the batch doubled,
an eval pass without ``no_grad``): each failure names the file and line that grew, its category
and phase, and the site's bytes equal the growth to the byte (CPU engine)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import recorded_folder, run
from pytest_gpumem.baselines import load
from pytest_gpumem.data.site_figures import OTHER_SITES, SITES_BUDGET, SiteProfile
from tests._sessions_xdist import warm_workers

pytest_plugins = ["pytester"]

F32 = 4
BATCH, SEQ, VOCAB, WIDTH = 4, 16, 96, 32

MODEL = """\
import torch


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.up(x)
        h = torch.nn.functional.gelu(h)
        return x + self.down(h)


class Tiny(torch.nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.block = Block(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        x = self.block(x)
        return self.head(x)
"""

TEST = f"""\
import os

import pytest
import torch

from tinymodel import Tiny

REGRESSION = os.environ.get("SITES_REGRESSION", "")


@pytest.mark.gpumem
def test_step(gpumem):
    torch.manual_seed(0)
    model = Tiny({VOCAB}, {WIDTH})
    opt = torch.optim.AdamW(model.parameters())
    gpumem.track(model, opt)
    batch = {2 * BATCH} if REGRESSION == "batch" else {BATCH}
    idx = torch.randint(0, {VOCAB}, (batch, {SEQ}))
    if REGRESSION == "eval":
        evaluated = model(idx)
    else:
        with torch.no_grad():
            evaluated = model(idx)
    for _ in range(2):
        logits = model(idx)
        if REGRESSION == "copy":
            kept = logits.detach().float().clone()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del evaluated
"""


def _line(source: str, text: str) -> int:
    """The number of the line of ``source`` that holds ``text`` (once)."""
    found = [number for number, line in enumerate(source.splitlines(), 1) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


@pytest.fixture(scope="module")
def recorded() -> dict[str, bytes]:
    """The baseline file of :func:`suite`'s test, as the first test of the module that asks records it."""
    return {}


@pytest.fixture
def suite(pytester: pytest.Pytester, recorded: dict[str, bytes]) -> pytest.Pytester:
    """The model and its test, with their baseline file (sites included): recorded by a session
    once a module, written into each test's folder (it names no path, so it is the same in each)."""
    pytester.makepyfile(tinymodel=MODEL, test_train=TEST)
    pytester.syspathinsert()
    baselines = pytester.path / "gpumem-baselines.json"
    if "baselines" not in recorded:
        result = run(pytester, "--gpumem-update-baselines")
        result.assert_outcomes(passed=1)
        recorded["baselines"] = baselines.read_bytes()
    else:
        baselines.write_bytes(recorded["baselines"])
    return pytester


def _regressed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, regression: str, *args: str
) -> tuple[pytest.RunResult, dict[str, Any]]:
    monkeypatch.setenv("SITES_REGRESSION", regression)
    report = pytester.path / "report.json"
    result = run(pytester, f"--gpumem-json={report}", *args)
    result.assert_outcomes(failed=1)
    return result, json.loads(report.read_text())["tests"][0]


def _peak_growth(test: dict[str, Any]) -> int:
    finding = next(f for f in test["findings"] if f["metric"] == "peak" and f["span"] == "call")
    assert finding["status"] == "regressed"
    return int(finding["delta"])


def _changes(test: dict[str, Any]) -> list[dict[str, Any]]:
    return test["site_changes"]["call"]["changes"]


def test_a_kept_fp32_copy_of_the_logits_is_named_with_its_line_category_phase_and_bytes(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one row a site
    result, test = _regressed(suite, monkeypatch, "copy")
    growth = _peak_growth(test)
    copy_bytes = BATCH * SEQ * VOCAB * F32
    assert growth == copy_bytes  # alive at the peak: it is the whole growth
    new = [c for c in _changes(test) if c["status"] == "new"]
    assert len(new) == 1
    site = new[0]["site"]
    line = _line(TEST, "kept = logits.detach()")
    assert (site["file"], site["line"], site["function"]) == ("test_train.py", line, "test_step")
    assert (site["category"], site["phase"]) == ("temporaries", "forward")
    assert new[0]["delta"]["peak"] == copy_bytes
    assert site["examples"][0] == f"({BATCH}, {SEQ}, {VOCAB}) float32"
    assert sum(c["delta"]["peak"] for c in _changes(test)) == growth
    text = result.stdout.str()
    assert "at the peak, against the baseline (sites by growth):" in text
    row = next(line for line in text.splitlines() if "new since the baseline" in line)
    assert f"test_train.py:{line} test_step" in row and "kept = logits.detach().float().clone()" in row
    assert "sites from a second run" in text


def test_a_doubled_batch_names_the_widest_activation_and_the_sites_add_up_to_the_growth(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, test = _regressed(suite, monkeypatch, "batch")
    growth = _peak_growth(test)
    changes = _changes(test)
    assert sum(c["delta"]["peak"] for c in changes) == growth
    by_growth = sorted(changes, key=lambda c: -c["delta"]["peak"])
    widest = [c for c in by_growth if c["site"]["code"] == "h = self.up(x)"]
    assert len(widest) == 1
    site = widest[0]["site"]
    where = ("tinymodel.py", _line(MODEL, "h = self.up(x)"), "Block.forward")
    assert (site["file"], site["line"], site["function"]) == where
    assert (site["category"], site["phase"]) == ("activations", "forward")
    assert widest[0]["delta"]["peak"] == BATCH * SEQ * 4 * WIDTH * F32  # one more batch of the 4x-wide activation
    assert widest[0]["status"] == "changed"


def test_an_eval_pass_without_no_grad_names_the_activations_its_graph_keeps(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, test = _regressed(suite, monkeypatch, "eval")
    growth = _peak_growth(test)
    changes = _changes(test)
    assert sum(c["delta"]["peak"] for c in changes) == growth
    gelu = next(c for c in changes if c["site"]["code"] == "h = torch.nn.functional.gelu(h)")
    assert (gelu["site"]["line"], gelu["site"]["category"], gelu["site"]["phase"]) == (
        _line(MODEL, "h = torch.nn.functional.gelu(h)"),
        "activations",
        "forward",
    )
    # saved by the eval graph (its output is kept alive with it): one batch of the 4x-wide activation
    assert gelu["delta"]["peak"] == BATCH * SEQ * 4 * WIDTH * F32
    assert all(c["site"]["category"] == "activations" for c in changes if c["delta"]["peak"] > 0)


def test_quiet_shows_the_largest_change_in_one_line_and_verbose_shows_every_site(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    quiet, _ = _regressed(suite, monkeypatch, "batch", "-q")
    lines = [line for line in quiet.stdout.lines if "against the baseline" in line]
    assert len(lines) == 2  # peak and allocated: one line each
    assert "sites by growth" in lines[0] and "+" in lines[0]
    default, test = _regressed(suite, monkeypatch, "batch")
    verbose, _ = _regressed(suite, monkeypatch, "batch", "-v")
    shown = [line for line in default.stdout.lines if "more with -v" in line]
    assert shown, default.stdout.str()
    peak_changes = [c for c in _changes(test) if c["delta"]["peak"]]
    assert f"({len(peak_changes)} of " in verbose.stdout.str()
    assert "more with -v" not in verbose.stdout.str().split("at the end")[0]


def test_code_moved_without_changing_memory_passes_and_stores_the_same_sites(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    baselines = suite.path / "gpumem-baselines.json"
    before = baselines.read_text()
    # unrelated edits: lines added above every function, the two classes swapped in their file
    header = "# a comment\n# another\n\n\n"
    blocks = MODEL.split("\n\n\nclass ")
    moved = header + blocks[0] + "\n\n\nclass " + blocks[2].rstrip() + "\n\n\nclass " + blocks[1].rstrip() + "\n"
    suite.makepyfile(tinymodel=moved, test_train=header + TEST)
    report = suite.path / "report.json"
    run(suite, "--gpumem-sites=always", f"--gpumem-json={report}").assert_outcomes(passed=1)
    test = json.loads(report.read_text())["tests"][0]
    assert test["site_changes"]["call"]["changes"] == []  # compared, and nothing changed
    assert test["measurements"][0]["sites"]["sites"][0]["line"] > 0
    run(suite, "--gpumem-update-baselines").assert_outcomes(passed=1)
    assert baselines.read_text() == before  # the stored sites did not move with the lines


def test_the_baseline_file_grows_by_at_most_3_kib_a_test_and_reads_back(suite: pytest.Pytester) -> None:
    baselines = suite.path / "gpumem-baselines.json"
    with_sites = len(baselines.read_bytes())
    run(suite, "--gpumem-update-baselines", "--gpumem-sites=off").assert_outcomes(passed=1)
    without = len(baselines.read_bytes())
    assert 0 < with_sites - without <= SITES_BUDGET + 64  # the sites' text, its key and indent
    run(suite, "--gpumem-update-baselines").assert_outcomes(passed=1)
    store = load(baselines)
    key = store.environment_keys()[0]
    entry = store.entry(key, "test_train.py::test_step")
    assert entry is not None
    profile = entry.sites
    assert isinstance(profile, SiteProfile) and profile.sites
    assert all(not s.site.line and s.site.offset >= 0 for s in profile.sites)  # offsets, never lines
    raw = json.loads(baselines.read_text())
    stored = raw["environments"][key]["tests"]["test_train.py::test_step"]["spans"]["call"]["sites"]
    assert list(stored) == sorted(stored)  # one line per site, in key order: a change is a one-line diff
    assert not any(str(Path.cwd()) in value or "0x" in value for value in stored.values())
    assert OTHER_SITES not in stored or stored[OTHER_SITES].startswith("peak=")


def test_a_baseline_without_sites_compares_as_before_and_the_failure_shows_the_largest_sites(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(suite, "--gpumem-update-baselines", "--gpumem-sites=off").assert_outcomes(passed=1)
    result, test = _regressed(suite, monkeypatch, "copy")
    assert "site_changes" not in test
    assert _peak_growth(test) == BATCH * SEQ * VOCAB * F32
    text = result.stdout.str()
    assert "at the peak, the largest sites:" in text
    assert "sites from a second run" in text


def test_sites_off_runs_no_second_run(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result, test = _regressed(suite, monkeypatch, "copy", "--gpumem-sites=off")
    assert "site_changes" not in test and "sites" not in test["measurements"][0]
    assert "sites from a second run" not in result.stdout.str()
    assert "against the baseline" not in result.stdout.str()


def test_a_limit_failure_shows_the_largest_sites_at_the_peak(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.gpumem(peak="1KiB")
        def test_big():
            small = torch.ones(64)
            big = torch.ones(1024, 1024)
            del small, big
        """
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "at the peak, the largest sites:" in text
    row = next(line for line in text.splitlines() if "big = torch.ones(1024, 1024)" in line)
    assert "4.00 MiB" in row and "test_big" in row


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpumem-sites=sometimes"], "--gpumem-sites / ini gpumem_sites: sites='sometimes' is not one of"),
        (["--gpumem-sites-include=no_such_package_here"], "no package or module named 'no_such_package_here'"),
    ],
)
def test_bad_sites_options_are_usage_errors(pytester: pytest.Pytester, args: list[str], words: str) -> None:
    pytester.makepyfile("def test_nothing(): pass")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert words in result.stderr.str()


def test_a_bad_sites_marker_keyword_is_a_collection_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpumem(sites="maybe")
        def test_x():
            pass
        """
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)
    assert "sites='maybe' is not one of" in result.stdout.str()


RECORDED = recorded_folder("h100")


def test_a_recorded_h100_trace_replays_to_the_allocators_counter_and_names_its_python_sites() -> None:
    """The committed H100 snapshot (Python stacks, the trace's last entries): replayed from the
    bytes it implies at its start, the trace ends at the allocator's own ``allocated`` count read
    with it, the blocks it leaves alive are the snapshot's active blocks (address and size), and the
    sites at its peak add up to that peak, named from the frames of the validation package's reference workloads."""
    from pytest_gpumem.measurement.engines.traces import replay_moments, replay_trace
    from pytest_gpumem.validate.suite_record import load_snapshot

    snapshot = load_snapshot(RECORDED / "snapshot.pickle")
    stats = json.loads((RECORDED / "memory_stats.json").read_text())["snapshot"]
    index = json.loads((RECORDED / "record.json").read_text())["snapshot"]["device_index"]
    events = snapshot["device_traces"][index]
    allocs = sum(int(e["size"]) for e in events if e["action"] == "alloc")
    frees = sum(int(e["size"]) for e in events if e["action"] == "free_requested")
    start = stats["allocated_bytes.all.current"] - allocs + frees
    end = replay_moments(events, start, {"end": len(events) - 1})["end"]
    assert end.allocated == stats["allocated_bytes.all.current"]
    active = {
        block["address"]: block["size"]
        for segment in snapshot["segments"]
        if segment.get("device", index) == index
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }
    assert end.blocks and {addr: size for addr, (size, _) in end.blocks.items()}.items() <= active.items()

    def name_of(filename: str) -> str | None:
        validation = filename.startswith("<checkout>/pytest_gpumem/validate/")
        return filename.removeprefix("<checkout>/") if validation else None

    peaks, _ = replay_trace(events, name_of, start=start, windows=[0])  # not stamped: one window
    found = peaks[0]
    allocated, highest = start, start
    for event in events:
        allocated += int(event["size"]) if event["action"] == "alloc" else 0
        allocated -= int(event["size"]) if event["action"] == "free_requested" else 0
        highest = max(highest, allocated)
    assert sum(counts.total for _, _, counts, _, _ in found if counts is not None) == highest
    named = [site for site, _, _, _, _ in found if site.file == "pytest_gpumem/validate/reference.py"]
    assert named and all(site.function and site.line > 0 for site in named)


@pytest.mark.slow
def test_an_out_of_memory_report_names_the_line_that_failed_and_where_each_live_tensor_was_made(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    source = """
        import pytest, torch

        @pytest.mark.gpumem(device_limit="6MiB")
        def test_too_big():
            first = torch.ones(1024, 1024)
            second = torch.ones(1024, 1024)
            del first, second
        """
    pytester.makepyfile(test_oom_site=source)
    lines = textwrap.dedent(source).strip("\n").splitlines()
    second = lines.index("    second = torch.ones(1024, 1024)") + 1
    first = lines.index("    first = torch.ones(1024, 1024)") + 1
    # a default run: the failing test runs again with sites, whose table names the line that
    # held the memory; the out-of-memory report stays the first run's
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert f"test_oom_site.py:{first} test_too_big" in text and "sites from a second run" in text
    # sites in the run itself: the report names the line whose allocation failed, and where each
    # live tensor was made
    result = run(pytester, "--gpumem-sites=always")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert f"at:        test_oom_site.py:{second} test_too_big" in text
    row = next(line for line in text.splitlines() if line.startswith("4.00 MiB") and "made at" not in line)
    assert row.rstrip().endswith(f"test_oom_site.py:{first} test_too_big")


@pytest.mark.slow
def test_a_leak_report_names_where_each_leaked_tensor_was_made(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    pytester.makepyfile(
        test_leak_site="""
        import pytest, torch

        CACHE = []

        def remember(n):
            CACHE.append(torch.zeros(n))

        @pytest.mark.gpumem(retained="0B")
        def test_leaks():
            remember(4096)
        """
    )
    # a default run: the failing test runs again with sites; its lines are named in the failure,
    # the leak report stays the first run's (a second run leaks into CACHE again)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "test_leak_site.py:6 remember" in text and "held by" in text and "made at" not in text
    assert "test_leak_site.CACHE[0]" in text
    # sites in the run itself: the leak report says where each leaked tensor was made
    result = run(pytester, "--gpumem-sites=always")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "made at" in text
    row = next(line for line in text.splitlines() if line.startswith("16.00 KiB"))
    assert "test_leak_site.py:6 remember" in row  # the line in remember() that made it


@pytest.mark.slow  # leak confirmations: full collections of the whole process
def test_a_second_run_confirms_no_leak_and_starts_with_the_collector_frozen_again(
    pytester: pytest.Pytester, nothing_frozen: None
) -> None:
    """The second run of a leaking test only names its lines: the leak report is the first run's,
    so the second neither snapshots the storages nor confirms a leak (a census and three full
    collections of the whole process). The first run's leak check gave the collector's frozen
    objects back; they are frozen again before the second run, as between tests, so that its
    collections walk what it makes. (A contract on the plugin's own calls: counted by wrapping
    them in the session's conftest.)"""
    pytester.makeconftest(
        """
        import pytest
        from pytest_gpumem.plugin import runner

        @pytest.fixture(autouse=True, scope="session")
        def _counted():
            confirm, snapshot = runner.confirm_leak, runner.snapshot_storages

            def counted(name, call):
                def wrapper(*args, **kwargs):
                    with open("calls.txt", "a") as out:
                        out.write(name + "\\n")
                    return call(*args, **kwargs)
                return wrapper

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(runner, "confirm_leak", counted("confirm", confirm))
                patch.setattr(runner, "snapshot_storages", counted("snapshot", snapshot))
                yield
        """
    )
    pytester.makepyfile(
        test_leak_twice="""
        import gc
        import pytest, torch

        CACHE = []

        from pytest_gpumem.measurement import gcfunctions  # gc's own: its wrapper would give them back

        @pytest.mark.gpumem(retained="0B")
        def test_leaks():
            with open("frozen.txt", "a") as out:
                out.write(f"{gcfunctions.get_freeze_count()}\\n")
            CACHE.append(torch.zeros(4096))
        """
    )
    result = run(pytester, "--gpumem-json=report.json")
    result.assert_outcomes(failed=1)
    assert (pytester.path / "calls.txt").read_text().split() == ["snapshot", "confirm"]
    first, second = (int(n) for n in (pytester.path / "frozen.txt").read_text().split())
    assert first > 0 and second > 0  # 0 for the second: every collection of it walks the whole process
    (test,) = json.loads((pytester.path / "report.json").read_text())["tests"]
    call = test["measurements"][0]
    assert call["sites"]["second_run"] is True
    assert "test_leak_twice.CACHE[0]" in result.stdout.str()  # the first run's report: CACHE[0], not [1]


def test_baselines_show_and_diff_print_the_stored_sites(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytest_gpumem.cli import main

    baselines = suite.path / "gpumem-baselines.json"
    old = suite.path / "old.json"
    old.write_bytes(baselines.read_bytes())
    monkeypatch.setenv("SITES_REGRESSION", "copy")
    run(suite, "--gpumem-update-baselines").assert_outcomes(passed=1)
    capsys.readouterr()
    assert main(["baselines", "show", "--file", str(baselines), "--sites", "--bytes"]) == 0
    shown = capsys.readouterr().out
    line = _line(TEST, "kept = logits.detach()")
    offset = line - _line(TEST, "@pytest.mark.gpumem")  # from the function's first line: its decorator
    row = next(text for text in shown.splitlines() if text.startswith(f"test_train.py:test_step+{offset} "))
    copy_bytes = BATCH * SEQ * VOCAB * F32
    assert "kept = logits.detach().float().clone()" in row and "temporaries" in row and str(copy_bytes) in row
    assert main(["baselines", "diff", str(old), str(baselines), "--sites", "--bytes"]) == 0
    diffed = capsys.readouterr().out
    assert "test_train.py::test_step [call] sites by growth" in diffed
    row = next(text for text in diffed.splitlines() if text.startswith(f"test_train.py:test_step+{offset} "))
    assert "new since the baseline" in row and f"+{copy_bytes}" in row


def test_a_fake_mode_prediction_that_does_not_fit_names_its_sites_in_the_predicted_blocks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    pytester.makepyfile(
        test_fit="""
        import pytest, torch

        class MLP(torch.nn.Module):
            def __init__(self, width):
                super().__init__()
                self.up = torch.nn.Linear(width, 8 * width)
                self.down = torch.nn.Linear(8 * width, width)

            def forward(self, x):
                return self.down(torch.relu(self.up(x)))

        @pytest.mark.gpumem(predict="h100", fake=True, peak="64MiB")
        def test_fits(gpumem):
            model = MLP(2048)
            opt = torch.optim.AdamW(model.parameters())
            gpumem.track(model, opt)
            model(torch.randn(512, 2048)).sum().backward()
            opt.step()
        """
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "at the peak, the largest sites:" in text
    row = next(line for line in text.splitlines() if "self.up = torch.nn.Linear(width, 8 * width)" in line)
    # the weight and the bias, each in whole 512-byte blocks of the predicted H100 allocator
    assert "128.06 MiB" in row and "parameters" in row and "test_fit.py:6 MLP.__init__" in row
    assert "(16384, 2048) float32" in row


@pytest.mark.parametrize(
    ("fake", "mode"), [(True, "rerun"), (False, "rerun"), (True, "off")], ids=["fake", "real", "fake-off"]
)
def test_a_failing_test_on_fake_tensors_records_its_sites_in_its_only_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, fake: bool, mode: str
) -> None:
    """On fake tensors the first run records the sites (a few percent of a fake step): a test
    that fails on memory runs its call once, and its failure names the line with no "second
    run". The same test on real tensors records none in its first run and runs its call again;
    with ``--gpumem-sites=off`` a fake test records none either."""
    monkeypatch.setenv("COLUMNS", "200")
    pytester.makepyfile(
        test_fit=f"""
        import pytest, torch

        @pytest.mark.gpumem(predict="h100", fake={fake}, peak="1MiB")
        def test_step(gpumem):
            with open("calls.txt", "a") as out:
                out.write("call\\n")
            model = torch.nn.Linear(1024, 1024)
            gpumem.track(model)
            model(torch.randn(64, 1024)).sum().backward()
        """
    )
    result = run(pytester, "--gpumem-json=report.json", f"--gpumem-sites={mode}")
    result.assert_outcomes(failed=1)
    calls = (pytester.path / "calls.txt").read_text().split()
    assert calls == (["call"] if fake else ["call", "call"])
    failure = result.stdout.str().split("exceeds the limit 1.00 MiB (1MiB)", 1)[1]
    (test,) = json.loads((pytester.path / "report.json").read_text())["tests"]
    (call,) = [m for m in test["measurements"] if m["name"] == "call"]
    if mode == "off":
        assert "largest sites" not in failure and call.get("sites") is None
        return
    assert "at the peak, the largest sites:" in failure
    assert "test_fit.py:7 test_step" in failure  # the Linear's weight and bias
    assert ("sites from a second run" in failure) is not fake
    assert call["sites"]["second_run"] is not fake


@pytest.mark.slow
def test_with_transformers_included_the_site_is_in_the_models_own_code(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    pytester.makepyfile(
        test_hf="""
        import pytest, torch
        from transformers import GPT2Config, GPT2LMHeadModel

        @pytest.mark.gpumem
        def test_step(gpumem):
            config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
            model = GPT2LMHeadModel(config)
            gpumem.track(model)
            idx = torch.randint(0, 64, (2, 16))
            model(idx, labels=idx).loss.backward()
        """
    )
    report = pytester.path / "report.json"
    run(pytester, "--gpumem-sites=always", "--gpumem-sites-include=transformers", f"--gpumem-json={report}")
    sites = json.loads(report.read_text())["tests"][0]["measurements"][0]["sites"]["sites"]
    files = {site["file"] for site in sites}
    assert "transformers/models/gpt2/modeling_gpt2.py" in files
    activations = [s for s in sites if s["category"] == "activations"]
    outside = {s["code"] for s in activations if not s["file"].startswith("transformers/")}
    assert activations and outside <= {"idx = torch.randint(0, 64, (2, 16))"}  # the input, saved by the embedding
    run(pytester, "--gpumem-sites=always", f"--gpumem-json={report}")
    sites = json.loads(report.read_text())["tests"][0]["measurements"][0]["sites"]["sites"]
    assert {site["file"] for site in sites} <= {"test_hf.py", ""}  # not included: the test's own lines


def rank_step(rank: int, ctx: Any) -> None:
    """A rank that keeps a tensor of its own size (rank 1 twice rank 0's)."""
    import torch

    ctx.kept = torch.ones(1024 * (rank + 1))  # the line each rank's sites name
    torch.ones(64).sum()


@pytest.mark.slow
def test_each_rank_records_its_own_sites() -> None:
    from pytest_gpumem import run_ranks
    from pytest_gpumem.data.site_figures import SiteConfig

    config = SiteConfig(str(Path(__file__).resolve().parent))
    line = _line(Path(__file__).read_text(), "# the line each" + " rank's sites name")
    for rank, measurement in enumerate(run_ranks(rank_step, 2, sites=config)):
        assert measurement.sites is not None
        kept = next(s for s in measurement.sites.sites if s.site.line == line)
        assert (kept.site.file, kept.site.function) == ("test_sites.py", "rank_step")
        assert kept.peak == 1024 * (rank + 1) * F32


def test_the_markdown_report_and_the_html_artifact_carry_the_sites_table(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    markdown = suite.path / "report.md"
    artifacts = suite.path / "artifacts"
    _regressed(suite, monkeypatch, "copy", f"--gpumem-markdown={markdown}", f"--gpumem-artifacts={artifacts}")
    text = markdown.read_text()
    assert "### Sites" in text
    line = _line(TEST, "kept = logits.detach()")
    row = next(r for r in text.splitlines() if f"test_train.py:{line} test_step" in r)
    assert "+24.00 KiB" in row and "new since the baseline" in row and "kept = logits.detach().float().clone()" in row
    page = next(p for p in artifacts.glob("*.html") if p.name != "index.html").read_text()
    assert 'class="card sites"' in page and "baseline run" in page and "this run" in page
    assert f'data-site="test_train.py:{line} test_step"' in page


@pytest.mark.slow
def test_under_xdist_the_worker_runs_the_failing_test_again_with_sites(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    with warm_workers(monkeypatch):  # forked from a process that has imported torch
        _, test = _regressed(suite, monkeypatch, "copy", "-n", "1")
    new = [c for c in _changes(test) if c["status"] == "new"]
    assert len(new) == 1 and new[0]["delta"]["peak"] == BATCH * SEQ * VOCAB * F32


def test_a_second_run_whose_figures_differ_says_so_and_keeps_the_first_runs_figures(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.fixture(scope="module")
        def trained():
            model = torch.nn.Linear(64, 64)
            return model, torch.optim.AdamW(model.parameters())

        @pytest.mark.gpumem(peak="1KiB")
        def test_step(trained):
            model, opt = trained
            model(torch.ones(8, 64)).sum().backward()
            opt.step()  # Adam's state: made by the first run, already there in the second (a module's fixture)
        """
    )
    report = pytester.path / "report.json"
    result = run(pytester, f"--gpumem-json={report}")
    result.assert_outcomes(failed=1)
    assert "the second run's figures differ (peak cost" in result.stdout.str()
    test = json.loads(report.read_text())["tests"][0]
    finding = next(f for f in test["findings"] if f["metric"] == "peak")
    sites = test["measurements"][0]["sites"]
    assert sites["second_run"] and "the first run's" in sites["note"]
    assert str(finding["measured"]) in sites["note"]  # the figure shown is the first run's


def test_a_baseline_file_with_a_bad_site_is_refused_naming_the_file_the_site_and_the_value(
    suite: pytest.Pytester,
) -> None:
    baselines = suite.path / "gpumem-baselines.json"
    before = baselines.read_text()
    tree = json.loads(before)
    key = next(iter(tree["environments"]))
    sites = tree["environments"][key]["tests"]["test_train.py::test_step"]["spans"]["call"]["sites"]
    site = next(iter(sites))
    sites[site] = "peak=lots end=0 n=1 activations forward"
    baselines.write_text(json.dumps(tree, indent=2))
    result = run(suite)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    error = result.stderr.str()
    assert "gpumem-baselines.json:" in error and site in error and "'peak=lots end=0 n=1" in error
    assert run(suite, "--gpumem-update-baselines").ret == pytest.ExitCode.USAGE_ERROR  # never overwritten
    assert json.loads(baselines.read_text())["environments"][key]["tests"]["test_train.py::test_step"]["spans"]["call"][
        "sites"
    ][site].startswith("peak=lots")


XFAIL_OOM = """
import pytest, torch


def ran(name):
    with open("runs.txt", "a") as out:
        out.write(name + "\\n")


@pytest.mark.xfail(raises=torch.OutOfMemoryError, strict=True)
@pytest.mark.gpumem(device_limit="1MiB")
def test_expected():
    ran("expected")
    torch.ones(1 << 20)


@pytest.mark.xfail(raises=ValueError)
@pytest.mark.gpumem(device_limit="1MiB")
def test_another_error_expected():
    ran("another")
    torch.ones(1 << 20)
"""


@pytest.mark.parametrize(
    ("args", "outcomes", "runs"),
    [
        ([], {"xfailed": 1, "failed": 1}, ["expected", "another", "another"]),
        (["--runxfail"], {"failed": 2}, ["expected", "expected", "another", "another"]),
    ],
    ids=["xfail", "runxfail"],
)
@pytest.mark.slow  # out-of-memory reports, each a census of the live tensors
def test_an_out_of_memory_error_its_xfail_mark_expects_is_not_run_again(
    pytester: pytest.Pytester, args: list[str], outcomes: dict[str, int], runs: list[str]
) -> None:
    """An ``xfail`` test that runs out of memory as its mark expects is reported as expected, with
    no sites to show: its call is not run a second time. Another error than the one expected
    fails the test, and ``--runxfail`` reports every failure: those run again to name the lines."""
    pytester.makepyfile(test_xfail_oom=XFAIL_OOM)
    result = run(pytester, *args)
    result.assert_outcomes(**outcomes)
    assert (pytester.path / "runs.txt").read_text().split() == runs
    assert result.stdout.str().count("sites from a second run") == outcomes["failed"]
