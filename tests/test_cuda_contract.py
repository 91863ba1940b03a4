"""The CUDA engine's contract with the device, checked where there is no GPU.

A recording stand-in takes the place of the ``torch.cuda`` / ``torch.accelerator.memory``
functions that :class:`~pytest_gpumem.measurement.engines.cuda.CudaEngine` calls (the engine's
``_backend`` and ``_memory_api`` objects, the context and workspace kernels it launches,
``torch._C._cuda_clearCublasWorkspaces`` and NVML), and a real pytest session measures
tests "on cuda:0" through the plugin. The tests pin what one measured test costs on a GPU
(synchronizations, garbage collections and their generations, cache empties, peak resets,
workspace warm-ups and releases, NVML reads), which ``memory_stats()`` key lands in which
figure, and the calls of the emulated device limit, of the leak check and of site recording (the
allocator's history).

These are facts about OUR code, not about the driver or the caching allocator: the
stand-in's numbers are invented, distinct per key so that a figure read from the wrong
key shows. Nothing here says what a device measures; that is checked on a GPU only
(``tests/test_cuda.py``, ``python -m pytest_gpumem validate``).
"""

from __future__ import annotations

import gc
import sys
import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from pytest_gpumem import measure
from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.site_figures import SiteConfig
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.measurement.engines import Runtime, Workspaces
from pytest_gpumem.measurement.engines import cuda as cuda_engine

#: Bytes the stand-in's workspace kernels "create" when no workspace exists.
WORKSPACES = 3 * 2**20
#: The stand-in device's size.
TOTAL = 80 * 2**30

#: ``memory_stats()`` before each test's body: every key a distinct value (the real dict has
#: ~100 keys; those the engine must not read are here too, so reading one instead shows).
BEFORE = {
    "allocated_bytes.all.current": 10_000_000,
    "allocated_bytes.all.peak": 10_100_000,
    "allocated_bytes.large_pool.peak": 10_200_000,
    "allocated_bytes.small_pool.peak": 100_000,
    "active_bytes.all.peak": 10_300_000,
    "reserved_bytes.all.current": 20_000_000,
    "reserved_bytes.all.peak": 20_100_000,
    "requested_bytes.all.current": 9_000_000,
    "requested_bytes.all.peak": 9_100_000,
    "num_alloc_retries": 3,
    "num_ooms": 1,
}
#: ``memory_stats()`` while and after the body runs: what the test "did" to the device.
AFTER = {
    "allocated_bytes.all.current": 11_000_000,
    "allocated_bytes.all.peak": 15_000_000,
    "allocated_bytes.large_pool.peak": 15_500_000,
    "allocated_bytes.small_pool.peak": 150_000,
    "active_bytes.all.peak": 15_700_000,
    "reserved_bytes.all.current": 30_000_000,
    "reserved_bytes.all.peak": 31_000_000,
    "requested_bytes.all.current": 10_900_000,
    "requested_bytes.all.peak": 14_900_000,
    "num_alloc_retries": 8,
    "num_ooms": 3,
}
#: What the stand-in's NVML says: (device memory used by all processes, by this process).
NVML = (40_000_000, 35_000_000)


class RecordingCuda:
    """Stands in for ``torch.cuda`` and ``torch.accelerator.memory`` as the CUDA engine calls them.

    Each call is appended to :attr:`calls` by name; readings return :attr:`stats` (fixed,
    invented values). It also stands in for the engine's context set-up, its workspace
    kernels (tensors on "cuda" cannot exist on a CPU-only torch), cuBLAS's workspace release
    and NVML. Its only model of a device is the one our code assumes: releasing the
    workspaces lowers allocated bytes by :data:`WORKSPACES`, the kernels make them again.
    It pins which calls OUR code makes and how it reads them, a contract; it is never
    evidence of what a GPU measures.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stats: dict[str, int] = dict(BEFORE)
        self.workspaces_alive = True  # an earlier process step (or test) made them

    # -- torch.accelerator.memory ----------------------------------------------------------

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        self.calls.append("memory_stats")
        return dict(self.stats)

    def memory_allocated(self, device: Any = None) -> int:
        self.calls.append("memory_allocated")
        return self.stats["allocated_bytes.all.current"]

    def memory_reserved(self, device: Any = None) -> int:
        self.calls.append("memory_reserved")
        return self.stats["reserved_bytes.all.current"]

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.calls.append("reset_peak_memory_stats")

    # -- torch.cuda ------------------------------------------------------------------------

    def is_available(self) -> bool:
        self.calls.append("is_available")  # torch asks the driver at every call (cudaGetDeviceCount)
        return True

    def device_count(self) -> int:
        self.calls.append("device_count")
        return 2

    def synchronize(self, device: Any = None) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    @contextmanager
    def device(self, device: Any) -> Iterator[None]:
        self.calls.append("device")
        yield

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return TOTAL - self.stats["reserved_bytes.all.current"], TOTAL

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(name="stand-in GPU", total_memory=TOTAL, major=9, minor=0, uuid="GPU-stand-in")

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        self.calls.append("get_per_process_memory_fraction")
        return 1.0

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        self.calls.append(f"set_per_process_memory_fraction({fraction!r})")

    # -- what the engine launches on the device, and NVML ----------------------------------

    def initialize(self, device: torch.device) -> None:
        self.calls.append("initialize")

    def workspace_kernels(self, device: torch.device) -> None:
        self.calls.append("workspace_kernels")
        if not self.workspaces_alive:
            self.workspaces_alive = True
            self.stats["allocated_bytes.all.current"] += WORKSPACES

    def clear_workspaces(self) -> None:
        self.calls.append("clear_workspaces")
        if self.workspaces_alive:
            self.workspaces_alive = False
            self.stats["allocated_bytes.all.current"] -= WORKSPACES

    def nvml_memory(self, device: torch.device) -> tuple[int | None, int | None]:
        self.calls.append("nvml")
        return NVML


def _recording_collect(calls: list[str], collect: Callable[..., int]) -> Callable[..., int]:
    """``gc.collect`` that records its generation (2, a full collection, unless given), then collects.

    It counts the collections OUR code asks for; it says nothing of what they cost or free."""

    def recording(generation: int = 2) -> int:
        calls.append(f"gc.collect({generation})")
        return collect(generation)

    return recording


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> RecordingCuda:
    """Two stand-in CUDA devices for the plugin and its CUDA engine; records their calls (and ``gc.collect``'s).

    Device selection and the environment see two devices (``is_available``, ``device_count``,
    ``current_device``, ``get_device_properties``); the engine's seams (its backend and memory
    API objects, its context set-up and workspace kernels, cuBLAS's workspace release, NVML) are
    the :class:`RecordingCuda`. What the tests read from it are facts about our code's calls, never
    a device's figures."""
    return install_stand_in(monkeypatch)


def install_stand_in(monkeypatch: pytest.MonkeyPatch) -> RecordingCuda:
    """Put a :class:`RecordingCuda` in the place of the device calls, as the ``cuda`` fixture does."""
    stand_in = RecordingCuda()
    # the inner session is no xdist worker, even when this test runs in one: worker gw1 would
    # measure "cuda" on cuda:1 (worker i on GPU i mod N) and the two devices would be one
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    # device selection and the environment (outside the engine): two devices, cuda:0 current
    monkeypatch.setattr(torch.cuda, "is_available", stand_in.is_available)
    monkeypatch.setattr(torch.cuda, "device_count", stand_in.device_count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", stand_in.get_device_properties)
    # the engine's seams
    monkeypatch.setattr(cuda_engine, "_backend", lambda device: stand_in)
    monkeypatch.setattr(cuda_engine, "_memory_api", lambda: stand_in)
    monkeypatch.setattr(cuda_engine, "_initialize", stand_in.initialize)
    monkeypatch.setattr(cuda_engine, "_workspace_kernels", stand_in.workspace_kernels)
    monkeypatch.setattr(cuda_engine, "nvml_memory", stand_in.nvml_memory)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", stand_in.clear_workspaces, raising=False)
    # the collector is ours to observe: record each collection's generation
    monkeypatch.setattr(gc, "collect", _recording_collect(stand_in.calls, gc.collect))
    return stand_in


class Phases:
    """A plugin for the inner session: marks where each test begins, where its body runs, where it
    ends, and sets the stand-in's statistics to :data:`BEFORE` at each test's start and to
    :data:`AFTER` as its body begins."""

    def __init__(self, cuda: RecordingCuda) -> None:
        self.cuda = cuda

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        self.cuda.stats.update(BEFORE)
        self.cuda.calls.append(f"test {item.name}")
        try:
            return (yield)
        finally:
            self.cuda.calls.append("end")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> Generator[None, object, object]:
        self.cuda.calls.append("body")
        self.cuda.stats.update(AFTER)
        return (yield)


#: What our code calls per measured test, before its body (the clean-state protocol, the start
#: reading) and after it (the end reading, settling for ``retained``), once the device's
#: workspaces are made. Garbage collections by generation: ``gc.collect(2)`` is full.
COUNTED = (
    "synchronize",
    "empty_cache",
    "reset_peak_memory_stats",
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "workspace_kernels",
    "clear_workspaces",
    "initialize",
    "nvml",
    "gc.collect(0)",
    "gc.collect(1)",
    "gc.collect(2)",
)
START = {
    "synchronize": 2,  # settle: before and after the collection
    "gc.collect(2)": 1,  # settle
    "reset_peak_memory_stats": 2,  # the clean state; the call span's opening window
    "memory_stats": 1,  # the opening window: the start, its reserved bytes and the counters come from it
}
FINISH = {
    "synchronize": 2,  # settle
    "gc.collect(2)": 1,  # settle, before the retained reading
    "reset_peak_memory_stats": 1,  # the closing window
    "memory_stats": 1,  # the closing window: the counters come from it
    "memory_allocated": 2,  # as the test function returns; after the settle (retained)
}
#: The first measured test on a device (and thread) makes the context and the workspaces and
#: measures them: it releases them (a synchronize after), reads allocated bytes around the
#: warm-up (which waits for its kernels).
FIRST_ON_A_DEVICE = {
    "initialize": 1,
    "clear_workspaces": 1,
    "workspace_kernels": 1,
    "synchronize": 2,
    "memory_allocated": 2,
}
#: What a measured test cost before these counts were a budget (main 91e1a13), per test once
#: the workspaces were measured (and 2 driver queries, ``is_available``): 6 synchronizations, an
#: ``empty_cache()``, the context set-up and the workspace kernels, 4 ``memory_stats()``, 4
#: ``memory_allocated()`` and 1 ``memory_reserved()`` (each a ``memory_stats()`` in torch), an
#: NVML read. docs/benchmarks.md has the table.
BEFORE_COUNTS = {
    "synchronize": 6,
    "empty_cache": 1,
    "initialize": 1,
    "workspace_kernels": 1,
    "reset_peak_memory_stats": 3,
    "memory_stats": 4,
    "memory_allocated": 4,
    "memory_reserved": 1,
    "nvml": 1,
    "gc.collect(2)": 2,
}

INNER = """
import pytest

@pytest.mark.gpumem
def test_one():
    pass

@pytest.mark.gpumem
def test_two():
    pass

@pytest.mark.gpumem
def test_three():
    pass
"""


def _session(
    pytester: pytest.Pytester, cuda: RecordingCuda, *args: str, failed: int = 0
) -> tuple[dict[str, list[str]], dict[str, TestRecord]]:
    """Run the inner session on the stand-in device; returns each test's calls and its record.

    Sites are off: a failing test's second run with sites records the allocator's history through
    torch's own functions, which a CUDA build of torch has (a CPU build has none, so the run would
    differ between builds); that run is checked on a GPU (``tests/test_cuda.py``)."""
    argv = ("-p", "no:cacheprovider", "--gpumem-device=cuda", "--gpumem-sites=off", *args)
    reprec = pytester.inline_run(*argv, plugins=[Phases(cuda)])
    reports = [r for r in reprec.getreports("pytest_runtest_logreport") if r.when == "call"]
    outcomes = Counter(r.outcome for r in reports)
    assert outcomes == Counter({"passed": len(reports) - failed, "failed": failed}) - Counter(), [
        r.longreprtext for r in reports
    ]
    records = {r.nodeid.split("::")[-1]: TestRecord.from_json(r.gpumem) for r in reports}
    per_test: dict[str, list[str]] = {}
    current: list[str] | None = None
    for call in cuda.calls:
        if call.startswith("test "):
            current = per_test[call[len("test ") :]] = []
        elif call == "end":
            current = None
        elif current is not None:
            current.append(call)
    return per_test, records


def _counts(calls: list[str]) -> dict[str, int]:
    counted = Counter(call for call in calls if call in COUNTED)
    return dict(sorted(counted.items()))


def _split(calls: list[str]) -> tuple[list[str], list[str]]:
    body = calls.index("body")
    return calls[:body], calls[body + 1 :]


def _plus(*counts: dict[str, int]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)
    return dict(sorted(total.items()))


def test_what_one_measured_test_costs_on_a_gpu(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """The budget of a passing test: no driver query, no cache empty, no warm-up, no NVML read,
    one ``memory_stats()`` at the span's start and one at its end; 4 synchronizations, 2 full
    collections, 3 peak resets. The context and workspaces are made and measured once per device."""
    pytester.makepyfile(INNER)
    per_test, _ = _session(pytester, cuda)
    assert list(per_test) == ["test_one", "test_two", "test_three"]
    for name, calls in per_test.items():
        start, finish = _split(calls)
        first = name == "test_one"
        assert _counts(start) == _plus(START, FIRST_ON_A_DEVICE if first else {}), name
        assert _counts(finish) == _plus(FINISH), name
    total = _plus(*(_counts(calls) for calls in per_test.values()))
    assert total["clear_workspaces"] == total["workspace_kernels"] == total["initialize"] == 1
    later = _counts(per_test["test_two"])
    assert sum(later.values()) == 13 < sum(BEFORE_COUNTS.values()) == 24  # docs/benchmarks.md


def test_the_driver_is_asked_once_a_session(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """``torch.cuda.is_available()`` asks the driver at every call: once in a session of three
    tests, whatever the plugin asks of it per test."""
    pytester.makepyfile(INNER)
    _session(pytester, cuda)
    assert cuda.calls.count("is_available") == 1


#: The order of the device calls around a test's body (garbage collections left out: they are
#: counted above and placed below), once the device's workspaces are made.
ORDER_START = [
    "synchronize",  # settle (the collection between)
    "synchronize",
    "reset_peak_memory_stats",  # the clean state's peaks
    "memory_stats",  # the call span opens: the window before it closes; start, reserved, counters
    "reset_peak_memory_stats",
]
ORDER_FINISH = [  # allocated-byte readings left out: the end's is read where the test returns
    "memory_stats",  # the call span closes: its last window, and the counters
    "reset_peak_memory_stats",
    "synchronize",  # settle (the collection between)
    "synchronize",
]
#: The first test on a device makes the context and the workspaces and measures them: released,
#: then allocated bytes read around the warm-up.
ORDER_FIRST_START = [
    *ORDER_START[:2],
    "initialize",
    "clear_workspaces",
    "synchronize",
    "memory_allocated",
    "workspace_kernels",
    "synchronize",
    "memory_allocated",
    *ORDER_START[2:],
]
#: Calls of the device choice and the stand-in's context manager: not the protocol's order.
UNORDERED = ("device", "device_count", "is_available")


def test_the_clean_state_protocol_runs_in_order(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """Collect, create what the device keeps (the first time, measured), reset the peaks, then read
    the start; after the body: read the end, then settle for ``retained``. A start reading never
    holds the protocol's own temporaries."""
    pytester.makepyfile(INNER)
    per_test, _ = _session(pytester, cuda)
    for name, calls in per_test.items():
        start, finish = _split([call for call in calls if call not in UNORDERED])
        assert finish[-1] == "memory_allocated", name  # retained: read once the device settled
        finish = [call for call in finish if call != "memory_allocated"]
        collections = [i for i, call in enumerate(start) if call.startswith("gc.collect")]
        assert collections and all(start.index("reset_peak_memory_stats") > i > 0 for i in collections), name
        assert start[collections[0] - 1] == "synchronize" and start[collections[-1] + 1] == "synchronize", name
        collections = [i for i, call in enumerate(finish) if call.startswith("gc.collect")]
        assert collections and all(i > finish.index("reset_peak_memory_stats") for i in collections), name
        uncollected = [call for call in start if not call.startswith("gc.collect")]
        assert uncollected == (ORDER_FIRST_START if name == "test_one" else ORDER_START), name
        assert [call for call in finish if not call.startswith("gc.collect")] == ORDER_FINISH, name


def _engine_calls(cuda: RecordingCuda, run: Callable[[], object]) -> dict[str, int]:
    """The counted calls ``run`` makes on the stand-in."""
    cuda.calls.clear()
    run()
    return _counts(cuda.calls)


def test_the_cuda_engine_offers_a_runtime_and_workspaces(cuda: RecordingCuda) -> None:
    """Without ``breakdown`` no storage tracker, so no categories."""
    engine = cuda_engine.CudaEngine(torch.device("cuda", 0))
    assert isinstance(engine, Runtime) and isinstance(engine, Workspaces) and engine.categories is None


def test_workspaces_are_made_once_per_thread(cuda: RecordingCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clean state makes the context and the workspaces once per thread (the first time
    measured), not before every test; again before every test once Inductor's CUDA graph trees,
    which free them, are in the process."""
    engine = cuda_engine.CudaEngine(torch.device("cuda", 0))
    made = ("initialize", "workspace_kernels", "clear_workspaces")

    def warm_ups() -> dict[str, int]:
        found = _engine_calls(cuda, engine.clean)
        return {key: found[key] for key in made if key in found}

    assert warm_ups() == dict.fromkeys(made, 1)  # the first: measured
    assert warm_ups() == {}
    other: list[dict[str, int]] = []
    thread = threading.Thread(target=lambda: other.append(warm_ups()))
    thread.start()
    thread.join()
    assert other == [{"initialize": 1, "workspace_kernels": 1}]  # another thread: its own, not measured again
    assert warm_ups() == {}
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", ModuleType("cudagraph_trees"))
    assert warm_ups() == warm_ups() == {"initialize": 1, "workspace_kernels": 1}
    assert engine.workspaces == WORKSPACES


def test_the_cache_is_emptied_only_where_the_plan_asks(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """``empty_cache()`` before a test's start only under a device limit (or a reserved figure
    asked from an empty cache); never for a plain test. ``measure()`` empties it for ``reserved=``
    or ``device_limit=``, not otherwise."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpumem
        def test_plain():
            pass

        @pytest.mark.gpumem(device_limit="1GiB")
        def test_limited():
            pass

        @pytest.mark.gpumem(peak="1GiB", allocated="1GiB")
        def test_limits():
            pass
        """
    )
    per_test, _ = _session(pytester, cuda)
    assert {name: _counts(calls).get("empty_cache", 0) for name, calls in per_test.items()} == {
        "test_plain": 0,
        "test_limited": 1,
        "test_limits": 0,
    }

    def measured(**options: Any) -> int:
        def run() -> None:
            with measure("span", device="cuda:0", **options):
                pass

        return _engine_calls(cuda, run).get("empty_cache", 0)

    assert (measured(), measured(reserved="1GiB"), measured(device_limit="1GiB")) == (0, 1, 1)


def test_a_reserved_limit_empties_the_cache(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """A test whose marker limits ``reserved`` starts from an empty cache."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpumem(reserved="1GiB")
        def test_reserved():
            pass
        """
    )
    per_test, _ = _session(pytester, cuda)
    assert _counts(per_test["test_reserved"]).get("empty_cache", 0) == 1


def test_nvml_is_read_only_where_a_figure_needs_it(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """A measured test reads no NVML (its driver figures are n/a: no verdict uses them); a span of
    ``measure()``, whose figures are the caller's, reads it once at its end."""
    pytester.makepyfile(INNER)
    per_test, records = _session(pytester, cuda)
    assert all("nvml" not in calls for calls in per_test.values())
    call = records["test_one"].measurements[0]
    assert (call.driver_used, call.driver_process) == (None, None)
    cuda.calls.clear()
    with measure("span", device="cuda:0") as span:
        pass
    assert cuda.calls.count("nvml") == 1
    assert (span.measurement.driver_used, span.measurement.driver_process) == NVML


def test_workspaces_are_measured_once_per_device(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """Two devices in one session: each device's first test makes, releases and measures the
    workspaces, no later test does; every record carries its device's workspace bytes."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpumem
        def test_a():
            pass

        @pytest.mark.gpumem(device="cuda:1")
        def test_b():
            pass

        @pytest.mark.gpumem
        def test_c():
            pass

        @pytest.mark.gpumem(device="cuda:1")
        def test_d():
            pass
        """
    )
    per_test, records = _session(pytester, cuda)
    releases = {name: _counts(calls).get("clear_workspaces", 0) for name, calls in per_test.items()}
    assert releases == {"test_a": 1, "test_b": 1, "test_c": 0, "test_d": 0}
    warm_ups = {name: _counts(calls).get("workspace_kernels", 0) for name, calls in per_test.items()}
    assert warm_ups == {"test_a": 1, "test_b": 1, "test_c": 0, "test_d": 0}  # once per device (and thread)
    assert {name: record.workspaces for name, record in records.items()} == dict.fromkeys(records, WORKSPACES)
    assert [records[name].measurements[0].device for name in per_test] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_figures_come_from_the_right_memory_stats_keys(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """Each figure of the call span from its own key: start and allocated from
    ``memory_allocated`` (``allocated_bytes.all.current``), peak from ``allocated_bytes.all.peak``,
    reserved from ``reserved_bytes.all.peak``, the start's reserved from ``memory_reserved``,
    requested_peak from ``requested_bytes.all.peak``, retries and OOMs as differences of
    ``num_alloc_retries`` and ``num_ooms``, the driver's figures from NVML."""
    pytester.makepyfile(INNER)
    _, records = _session(pytester, cuda)
    for name, record in records.items():
        call = record.measurements[0]
        assert isinstance(call, Measurement)
        figures = {
            "engine": call.engine,
            "device": call.device,
            "start": call.start,
            "peak": call.peak,
            "allocated": call.allocated,
            "retained": call.retained,
            "reserved": call.reserved,
            "start_reserved": call.start_reserved,
            "requested_peak": call.requested_peak,
            "num_alloc_retries": call.num_alloc_retries,
            "num_ooms": call.num_ooms,
            "driver_used": call.driver_used,
            "driver_process": call.driver_process,
            "breakdown": call.breakdown,
        }
        assert figures == {
            "engine": "cuda",
            "device": "cuda:0",
            "start": BEFORE["allocated_bytes.all.current"],
            "peak": AFTER["allocated_bytes.all.peak"],
            "allocated": AFTER["allocated_bytes.all.current"],
            "retained": AFTER["allocated_bytes.all.current"] - BEFORE["allocated_bytes.all.current"],
            "reserved": AFTER["reserved_bytes.all.peak"],
            "start_reserved": BEFORE["reserved_bytes.all.current"],
            "requested_peak": AFTER["requested_bytes.all.peak"],
            "num_alloc_retries": AFTER["num_alloc_retries"] - BEFORE["num_alloc_retries"],
            "num_ooms": AFTER["num_ooms"] - BEFORE["num_ooms"],
            "driver_used": None,  # no NVML read: no figure of the test needs it
            "driver_process": None,
            "breakdown": None,  # no storage tracker without --gpumem-breakdown
        }, name
        environment = record.environment or {}
        assert (environment.get("engine"), environment.get("device_name")) == ("cuda", "stand-in GPU")
        assert record.workspaces == WORKSPACES


def test_an_emulated_device_limit_caps_the_allocator_for_the_body_only(
    pytester: pytest.Pytester, cuda: RecordingCuda
) -> None:
    """``device_limit`` on CUDA: the allocator's per-process fraction is the limit over the device's
    size, set after the start reading and put back (to the fraction read before) before the end's."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpumem(device_limit="1GiB")
        def test_limited():
            pass
        """
    )
    per_test, records = _session(pytester, cuda)
    calls = per_test["test_limited"]
    limits = [call for call in calls if "memory_fraction" in call]
    assert limits == [
        "get_per_process_memory_fraction",
        f"set_per_process_memory_fraction({2**30 / TOTAL!r})",
        "set_per_process_memory_fraction(1.0)",
    ]
    start, finish = _split(calls)
    assert start.index(limits[1]) > len(start) - 1 - start[::-1].index("memory_allocated")  # after the start
    assert finish.index(limits[2]) < finish.index("reset_peak_memory_stats")  # before the closing window
    assert records["test_limited"].device_limit == 2**30
    assert _counts(start)["empty_cache"] == 1  # the limit caps reserved bytes: the cache is returned first


@pytest.mark.slow
@pytest.mark.usefixtures("census_gives_back_the_suites_freeze")  # the closing below: the run's collector starts
def test_the_leak_check_frees_the_workspaces_on_both_sides(pytester: pytest.Pytester, cuda: RecordingCuda) -> None:
    """A positive ``retained`` under ``retained="0B"`` is confirmed as PyTorch's leak check does: up to
    three tries of settle, release the workspaces, empty the cache, read; the start compared without
    its workspaces; then the workspaces made again and the cache emptied. The driver's check reads
    ``mem_get_info`` at the start and at the end."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpumem(retained="0B")
        def test_keeps_a_megabyte():
            pass
        """
    )
    per_test, records = _session(pytester, cuda, failed=1)
    _, finish = _split(per_test["test_keeps_a_megabyte"])
    settled = finish.index("gc.collect(2)")
    check = finish[finish.index("memory_allocated", settled) + 1 :]  # after the retained reading
    protocol = [call for call in check if call in COUNTED or call in ("memory_allocated", "mem_get_info")]
    one_try = ["synchronize", "gc.collect(2)", "synchronize", "clear_workspaces", "synchronize"]
    one_try += ["synchronize", "empty_cache", "memory_allocated"]
    # and then the run's collector starts: the census gave back for good what this suite's conftest froze
    closing = ["workspace_kernels", "synchronize", "synchronize", "empty_cache", "mem_get_info", "gc.collect(2)"]
    assert protocol == [*one_try * 3, *closing]
    leaked = AFTER["allocated_bytes.all.current"] - BEFORE["allocated_bytes.all.current"]
    record = records["test_keeps_a_megabyte"]
    assert record.measurements[0].retained == leaked
    report = record.leak_report  # the record as it left the test (the judge adds it to the failure)
    assert report is not None and record.reports == []
    assert report.startswith(f"memory leak confirmed on cuda:0: 976.56 KiB ({leaked} B) retained")
    assert f"allocated at start: {BEFORE['allocated_bytes.all.current'] - WORKSPACES} B" in report
    assert cuda.workspaces_alive  # the device is back in its steady state


class _History:
    """A stand-in for ``torch.cuda.memory``'s history functions: it records the calls made to it."""

    def __init__(self, fails: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fails = fails

    def _record_memory_history(
        self,
        enabled: str | None = "all",
        context: str = "",
        stacks: str = "",
        max_entries: int = 0,
        clear_history: bool = False,
    ) -> None:
        if self.fails and enabled is not None:
            raise RuntimeError("no history on this device")
        self.calls.append(("history", (enabled, context, stacks, max_entries, clear_history)))

    def _set_memory_metadata(self, text: str) -> None:
        self.calls.append(("metadata", text))


def test_sites_on_cuda_record_the_allocators_history_stamped_by_window(cuda: RecordingCuda) -> None:
    """Sites on CUDA: the allocator's history on (this recording's events only), each window's events stamped with
    its number, the phase of each window kept, and the history off and unstamped at the end."""
    sites = cuda_engine.TraceSites(torch.device("cuda", 0), cuda)
    sites.memory = history = _History()  # type: ignore[assignment]
    sites.start(SiteConfig(root="/project"))
    prefix = sites.prefix
    assert sites.recording and prefix.startswith("gpumem") and prefix.endswith(":")
    assert history.calls == [
        ("history", ("all", "alloc", "python", cuda_engine.SITE_ENTRIES, True)),
        ("metadata", f"{prefix}1"),
    ]
    sites.set_phase("forward")
    assert sites.now() == ("end", 2)
    sites.set_phase(None)
    assert history.calls[-1] == ("metadata", f"{prefix}2") and sites.phases == {1: "forward", 2: ""}
    sites.stop()
    assert not sites.recording and history.calls[-2:] == [("metadata", ""), ("history", (None, "", "", 0, False))]
    sites.stop()  # once stopped, nothing more is asked
    assert len(history.calls) == 5 and sites.now() is None


def test_sites_on_cuda_whose_history_cannot_start_record_nothing(cuda: RecordingCuda) -> None:
    sites = cuda_engine.TraceSites(torch.device("cuda", 0), cuda)
    sites.memory = history = _History(fails=True)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="no history"):
        sites.start(SiteConfig(root="/project"))
    assert not sites.recording and sites.now() is None
    sites.stop()
    assert history.calls == []  # nothing to turn off
