"""Shared test set-up.

In-process pytester runs restore ``sys.modules`` afterwards, so a torch module first
imported inside one (optimizers import parts of torch lazily at their first step)
would be imported again by the next and register its operators twice. One real
training step of each kind imports them all before any pytester run (as the session
is configured), and so does importing the plugin's measuring modules, which the plugin
loads lazily. A session that only collects (``--collect-only``: ``scripts/gpu-check``'s
dry run) runs no test, and skips both.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import importlib.util
import itertools
import json
import operator
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import hypothesis  # noqa: F401  (below: imported before any in-process run)
import pytest
import torch
from filelock import FileLock

import pytest_gpumem
from pytest_gpumem.baselines import Environment
from pytest_gpumem.measurement import gcfunctions
from pytest_gpumem.measurement.engines import Engine, make_engine


def _a_cache_folder_of_the_suite_s_own() -> None:
    """Saves of a baseline file take turns on a lock file in the user's cache folder
    (``XDG_CACHE_HOME``, else ``~/.cache``): the suite's thousands of temporary baseline files lock
    in a folder of its own, removed when the suite ends, never in the developer's cache, nor in
    the folders of pytester's sessions (which set ``HOME`` to their own). Sessions the tests start
    in subprocesses inherit it."""
    folder = tempfile.mkdtemp(prefix="gpumem-tests-cache-")
    os.environ["XDG_CACHE_HOME"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


_a_cache_folder_of_the_suite_s_own()


def _warm_up_lazy_torch_imports() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    for optimizer in (
        torch.optim.AdamW(model.parameters()),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ):
        for dtype in (torch.bfloat16, torch.float16):
            scaler = torch.amp.GradScaler("cpu")
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


#: One intra-op thread, here and in the processes the tests start (pytest sessions, ranks): the
#: suite's steps are small, and on two cores busy with other tests or ranks a second thread doubled
#: their CPU time without shortening them (the zoo's GPT-2 step: 22 CPU-s for 11.8 on one thread,
#: in the same wall time). The bytes the tests check do not depend on it: they pass on any core count.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def _import_every_plugin_module() -> None:
    """Import every module of the package before any in-process pytester run.

    The plugin imports its measuring machinery (and the parts of torch it uses) only when
    a test is measured. A module first imported inside an in-process run is loaded by that
    run's assertion-rewriting hook (pytest rewrites the packages of every installed
    plugin), and keeps it as its ``__loader__`` after the run: the hook holds the run's
    config, and that everything the run collected, its test modules' tensors included,
    for the rest of the suite. (Hypothesis, imported above, is such a package too.)
    """
    for module in pkgutil.walk_packages(pytest_gpumem.__path__, "pytest_gpumem."):
        # the framework adapters import their (optional, heavy) frameworks: only the tests
        # that use them do, in processes of their own
        if module.name != "pytest_gpumem.__main__" and not module.name.startswith("pytest_gpumem.integrations."):
            importlib.import_module(module.name)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--check-leftovers",
        action="store_true",
        help="fail a test that leaves tensors, threads, environment variables, the working directory "
        "or torch settings changed (a diagnostic: about 0.1 s per test)",
    )
    parser.addoption(
        "--real-ranks",
        nargs="?",
        const="check",
        choices=("check", "record"),
        help="run the distributed steps of tests/test_fake_ranks.py on real gloo ranks and check "
        "fixtures/real-ranks.json against them (about 70 CPU-seconds; CI's first run), or with "
        "--real-ranks=record write the file from them",
    )


def _xdist_controller(config: pytest.Config) -> bool:
    """Whether this process is pytest-xdist's controller: it hands the tests to its workers and runs none."""
    distributed = config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))
    return distributed and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    # what runs no test (a collection, pytest-xdist's controller) needs no warm-up for pytester's sessions
    if not config.option.collectonly and not _xdist_controller(config):
        _warm_up_lazy_torch_imports()
        _import_every_plugin_module()
        _patch_others_frozen()
        _patch_give_back_theirs()
    if config.getoption("--check-leftovers"):
        from tests._isolation import Leftovers

        config.pluginmanager.register(Leftovers(), "gpumem-test-leftovers")
    else:
        config.pluginmanager.register(Refreeze(), "gpumem-test-refreeze")


#: Environments that baseline tests record under (as an H100 with torch 2.13 would describe itself).
CPU_ENV = Environment(engine="cpu", torch_version="2.13", cuda_rounding=False)

#: The suite's other pytest plugins, which a pytest the tests start (torchrun's ranks, one sent a
#: signal) does not need: each costs every process its import.
OTHER_PLUGINS_OFF = tuple(f"-pno:{name}" for name in ("hypothesispytest", "xdist", "randomly", "anyio", "timeout"))
H100_ENV = Environment(
    engine="cuda",
    device_name="NVIDIA H100 80GB HBM3",
    total_memory=85_045_870_592,
    compute_capability="9.0",
    torch_version="2.13",
    cuda_version="12.8",
    cudnn_version="91002",
    allocator=(),
)


def _pinned(args: tuple[str, ...], device: str | None) -> tuple[str, ...]:
    base = ("-p", "no:cacheprovider", "-W", "ignore::UserWarning")
    return (*base, *(() if device is None else (f"--gpumem-device={device}",)), *args)


def run(
    pytester: pytest.Pytester, *args: str, device: str | None = "cpu", plugins: Sequence[object] = ()
) -> pytest.RunResult:
    """A pytest session in this process: fast, but tensors that earlier sessions left
    alive count in its figures; use :func:`run_fresh` to assert absolute figures.

    The session measures on ``device`` (the CPU engine, whatever the machine has: these
    suites allocate CPU tensors); None leaves the device to the session's own options.
    """
    return pytester.runpytest_inprocess(*_pinned(args, device), plugins=list(plugins))


def run_fresh(pytester: pytest.Pytester, *args: str, device: str | None = "cpu") -> pytest.RunResult:
    """:func:`run` in a process of its own: nothing else is allocated when it starts. The process
    is forked from one that has imported torch and pytest (``tests/_warm_sessions.py``): it starts
    as a new interpreter would once it had imported them, without paying for the imports again."""
    from tests._warm_sessions import runpytest_warm

    return runpytest_warm(pytester, *_pinned(args, device))


def needs(*packages: str) -> None:
    """Skip unless ``packages`` are installed, without importing them: importing a framework in
    the suite's own process (lightning's import makes tensors and threads) would change what
    later tests measure; the tests that use one run it in processes of their own."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")


def forget_last_failure() -> None:
    """Drop what pytest keeps of an earlier failure until the next test's call (its frames hold tensors)."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


@pytest.fixture
def say(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    """A line on the terminal as the test runs, past pytest's capture: what a test of more than
    30 seconds is doing, so that no minute of the suite is silent."""

    def write(text: str) -> None:
        with capsys.disabled():
            print(f"\n{request.node.nodeid}: {text}", flush=True)

    return write


@pytest.fixture(autouse=True)
def _as_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sessions these tests run print as on a developer's terminal, wherever the suite runs:
    with ``CI`` or ``BUILD_NUMBER`` set, pytest prints whole failure messages in its short
    summary (not one line each), which the tests reading a session's output would count twice."""
    for name in ("CI", "BUILD_NUMBER"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytest's ``pytester``, whose sessions run their tests in file order even when this suite
    runs shuffled (``-p randomly``): their output is read in that order. Hypothesis's plugin is
    left out of them too: it imports hypothesis inside each run, whose modules would then keep
    the run alive. (``pytester`` clears ``PYTEST_ADDOPTS`` when it starts: set it after.)
    A session it starts is no xdist worker even when this test runs in one: the plugin reads
    ``PYTEST_XDIST_WORKER`` to choose a worker's GPU, and the inner run would inherit it."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:randomly -p no:hypothesispytest")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    return pytester


def recorded_folder(gpu: str) -> Path:
    """The folder of the record the prediction target ``gpu`` is checked against (``targets.json``)."""
    from pytest_gpumem.targets import target

    record = target(gpu).record
    assert record is not None
    return Path(__file__).resolve().parents[1] / record


@pytest.fixture
def recorded_h100() -> Path:
    """The folder of the record the H100 prediction target is checked against."""
    return recorded_folder("h100")


def once_for_the_workers(request: pytest.FixtureRequest, name: str, make: Callable[[], Any]) -> Any:
    """``make()``, whose answer is JSON, once a run: under pytest-xdist the first worker that asks
    makes it, under a file lock in the run's shared temporary folder, and writes its answer there
    for the other workers to read (a fixture of a wider scope is otherwise made in each worker)."""
    if not hasattr(request.config, "workerinput"):
        return make()
    factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    answer = factory.getbasetemp().parent / f"{name}.json"
    with FileLock(f"{answer}.lock"):
        if not answer.is_file():
            answer.write_text(json.dumps(make()), encoding="utf-8")
        return json.loads(answer.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def cpu_only_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``python -m pytest_gpumem validate --cpu-only --size tiny --against <the H100 record>`` run
    once, as a user would run it, from another folder: its output and record folder (the tests of
    the validation read them; the tests of the replay read copies of the record). Once for all
    the workers of a run (:func:`once_for_the_workers`)."""

    def run() -> dict[str, Any]:
        out = tmp_path_factory.mktemp("record")
        command = [sys.executable, "-m", "pytest_gpumem", "validate", "--cpu-only", "--out", str(out)]
        command += ["--size", "tiny", "--against", str(recorded_folder("h100"))]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, cwd=out)
        folders = [path for path in out.iterdir() if path.is_dir()]
        assert len(folders) == 1, (done.stdout, done.stderr)
        kept = {"args": done.args, "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
        return {"done": kept, "folder": str(folders[0])}

    answer = once_for_the_workers(request, "cpu-only-run", run)
    return subprocess.CompletedProcess(**answer["done"]), Path(answer["folder"])


@pytest.fixture
def forget_compiled_code() -> Iterator[None]:
    """Reset TorchDynamo before and after a test that compiles: its caches keep the tensors
    compiled code closed over, and other tests in the same process assert absolute figures."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def nothing_frozen() -> Iterator[None]:
    """The process with no frozen objects, before and after the test: this suite freezes what is
    alive before each test (a speed-up only, :func:`refreeze`), and freezing it again would freeze
    whatever tests made since; the collector's thresholds as they were, after."""
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


@pytest.fixture
def cpu_engine() -> Engine:
    """A fresh CPU engine after its clean-state protocol (the tracker not started)."""
    forget_last_failure()
    engine = make_engine("cpu")
    engine.clean()
    return engine


class _Mark:
    """An object that each :func:`refreeze` freezes with the rest: while it is frozen, objects are."""


_MARK = _Mark()
_marked = False  # a refreeze froze the mark (before that it may be in any generation)


def _mark_frozen() -> bool:
    """Whether the mark is frozen: it is in none of the generations that ``gc.get_objects()``
    lists. Listing those costs ~25 ns an object, few while the suite's freeze holds; counting
    the frozen ones (``gc.get_freeze_count()`` before Python 3.13) walks them all, 25 to 40 ms."""
    return _marked and not any(map(operator.is_, gcfunctions.get_objects(), itertools.repeat(_MARK)))


def _patch_others_frozen() -> None:
    """The plugin asks :func:`~pytest_gpumem.measurement.collector.others_frozen` as each in-process
    session starts its collector: with the mark frozen (and the interpreter holding nothing frozen
    of its own) the answer is yes without counting the frozen objects; else the plugin's own."""
    from pytest_gpumem.measurement import collector

    counted = collector.others_frozen

    @functools.wraps(counted)
    def others_frozen() -> bool:
        return (_mark_frozen() and collector.interpreter_frozen() == 0) or counted()

    collector.others_frozen = others_frozen


class _After:
    """An object made after each :func:`refreeze`, never frozen by it: frozen, someone froze since."""


#: What the suite froze, for a census: weak references to the modules and tensors among the frozen
#: objects (as the plugin's collector remembers its own, :func:`frozen.references`); whether they
#: are all of them (nothing else froze objects since everything was last given back); the object
#: made after the last refreeze; whether the plugin holds the references as its own.
_suite_refs: list[Any] = []
_complete = False
_after = _After()
_lent = False
_lending = True  # off for a test that asks for :func:`census_gives_back_the_suites_freeze`


def _frozen_by_the_suite_alone() -> bool:
    """Whether the suite's freeze holds (the mark frozen) and nobody froze since (the object made
    after it not frozen): one pass over what is not frozen."""
    mark = after = False
    for obj in gcfunctions.get_objects():
        if obj is _MARK:
            mark = True
        elif obj is _after:
            after = True
    return _marked and not mark and after


def _patch_give_back_theirs() -> None:
    """A census in one of the suite's in-process sessions (a failing test's, a leak check's) must see
    every tensor, and gives back what someone else froze, for good
    (:func:`~pytest_gpumem.measurement.frozen.give_back_theirs`): every collection after it walks the
    whole process (0.3 to 0.4 s each; three in such a test and the next refreeze). When what is
    frozen is the suite's freeze alone, the suite lends the plugin the modules and tensors it
    remembered as it froze them instead, as the plugin's own collector remembers what it freezes
    (:func:`~pytest_gpumem.measurement.frozen.known`): the census finds the same tensors, and the
    objects stay frozen. Else the plugin's own."""
    from pytest_gpumem.measurement import frozen

    given_back = frozen.give_back_theirs

    @functools.wraps(given_back)
    def give_back_theirs() -> None:
        global _lent
        if _lending and _complete and not frozen.known() and _frozen_by_the_suite_alone():
            frozen.adopt(_suite_refs)
            _lent = True
        else:
            given_back()

    frozen.give_back_theirs = give_back_theirs


def _end_the_loan() -> None:
    """The plugin forgets the references the suite lent it (a session that thawed forgot them already)."""
    global _lent
    if _lent:
        from pytest_gpumem.measurement import frozen

        frozen.forget()
        _lent = False


def _remember_then_freeze() -> None:
    """``gc.freeze()``, the modules and tensors among what it freezes remembered first (all alive, as
    after a collection: :func:`_patch_give_back_theirs`)."""
    global _complete, _after
    from pytest_gpumem.measurement import frozen

    _end_the_loan()
    objects = gc.get_objects()
    if not any(map(operator.is_, objects, itertools.repeat(_MARK))):  # the suite's freeze holds
        if _complete and not any(map(operator.is_, objects, itertools.repeat(_after))):
            _complete = False  # someone froze objects since: they are not remembered
    else:  # everything was given back (or this is the first freeze): remember it all
        _suite_refs.clear()
        _complete = True
    if _complete:
        # the plugin's own function, whose parameters held by a remembered module get no weak reference
        remembered = [ref for ref in _suite_refs if ref() is not None]
        if remembered:  # what is remembered is frozen: out of ``objects``, but in an earlier ``references``
            known = {id(ref()) for ref in remembered}
            objects = [obj for obj in objects if id(obj) not in known]
            del known
        _suite_refs[:] = [*remembered, *frozen.references(objects, remembered)]
        del remembered
    del objects
    gc.freeze()
    _after = _After()


@pytest.fixture
def census_gives_back_the_suites_freeze() -> Iterator[None]:
    """A census in this test gives back what the suite froze, as it gives back what a user's conftest
    froze (the suite's references are not lent: :func:`_patch_give_back_theirs`)."""
    global _lending
    _lending = False
    yield
    _lending = True


def refreeze() -> None:
    """Collect garbage, then freeze what is alive (``gc.freeze()``), as the plugin does before
    its first measured test: the full collections that the engines run in a test then walk only
    what that test made.

    This suite does it before every test, not once: a census of live tensors (an out-of-memory
    report, a leak's holders) gives frozen objects back to the collector, and modules imported
    lazily by a test (sympy, transformers, TorchDynamo) stay in its sight, so that without it
    every later collection walks the whole process (0.3 s for a measured test that takes 0.02 s alone).
    What earlier tests left alive is frozen too: a reference cycle of theirs that dies later is
    not freed (memory only), and a tensor of theirs is out of ``gc.get_objects()``'s sight,
    which no test reads across tests. The modules and tensors among what it freezes are remembered,
    for a census in the test to find without giving the frozen objects back
    (:func:`_patch_give_back_theirs`)."""
    global _marked
    gc.collect()
    _remember_then_freeze()
    _marked = True


class Refreeze:
    """:func:`refreeze` before each test (``--check-leftovers`` does it itself), but a test that
    starts with nothing frozen (:func:`nothing_frozen`): it would give everything back at once, and
    after a test that gave everything back (the collector's own tests, one after another) the
    refreeze is a full collection of the whole process (0.25 to 0.3 s) for nothing."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        _end_the_loan()
        if "nothing_frozen" not in getattr(item, "fixturenames", ()):
            refreeze()
        try:
            return (yield)
        finally:
            _end_the_loan()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` need a CUDA device: skipped with a reason without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none is available here)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
