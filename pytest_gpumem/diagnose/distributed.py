"""A distributed training step inside one test: ``world_size`` ranks, each measured on its own.

:func:`run_ranks` starts rank processes as PyTorch's multi-process tests do (CPU and fake ranks forked from a warm
server on Linux), or with ``fake=True`` runs the ranks one after another in this process on fake tensors over PyTorch's
fake process group. A failing rank fails the run with its report, and no process outlives it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import pkgutil
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.site_figures import SiteConfig

__all__ = ["DistributedError", "RankContext", "run_ranks"]

#: Seconds a run may take, all ranks together, unless the caller says otherwise.
DEFAULT_TIMEOUT = 300.0
#: The longest a run may be given (seconds): a week.
MAX_TIMEOUT = 7 * 24 * 3600

#: The environment variable that chooses how CPU and fake rank processes start: ``warm`` (Linux default) or ``spawn``.
RANK_START = "PYTEST_GPUMEM_RANK_START"

#: The environment variable that is empty in CPU and fake rank processes, so they see no GPU (see ``_without_gpus``).
HIDE_GPUS = "CUDA_VISIBLE_DEVICES"


class DistributedError(RuntimeError):
    """One or more ranks failed, died or timed out; ``reports`` maps each such rank to what happened."""

    def __init__(self, message: str, reports: dict[int, str]) -> None:
        super().__init__(message)
        self.message = message
        self.reports = reports

    def __str__(self) -> str:
        return "\n\n".join([self.message, *self.reports.values()])


@dataclass
class RankContext:
    """What ``fn(rank, ctx)`` gets in each rank: its rank, the world size, its ``torch.device`` and the backend."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    _recorder: Any = field(default=None, repr=False)

    @property
    def fake(self) -> bool:
        """True where the rank runs on fake tensors over the fake process group (``fake=True``)."""
        return self.backend == "fake"

    def track(self, *objects: Any) -> None:
        """Register this rank's modules and optimizers for the breakdown, the phases and Ψ."""
        if self._recorder is None:
            raise RuntimeError("RankContext.track() works only while the rank function runs")
        self._recorder.track(*objects)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_main(
    ranks: list[int],
    world_size: int,
    port: int,
    backend: str,
    device: str,
    timeout: float,
    fn: Callable[[int, RankContext], Any],
    results: Any,
    predict: str | None,
    sites: SiteConfig | None,
    environment: dict[str, str],
) -> None:
    """The body of a rank process (started by :func:`run_ranks`): one rank, or all ``ranks`` one after another over
    the fake process group, each measured between the start and the end of the default process group."""
    if environment != dict(os.environ):  # a warm rank inherited its server's environment
        os.environ.clear()
        os.environ.update(environment)
    try:
        os.setpgid(0, 0)  # the leader of a process group of its own
        group: int | None = os.getpid()
    except (AttributeError, OSError):  # AttributeError: no process groups on this system
        group = None
    for rank in ranks:
        results.put((rank, "started", group))
    die_with_parent(group)
    fake = backend == "fake"
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        ddp_on_fake_ranks()
    else:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(ranks[0]), WORLD_SIZE=str(world_size)
        )
    for rank in ranks:
        where = torch.device("cuda", rank) if device == "cuda" else torch.device(device)
        if fake:
            _forget_earlier_ranks()
        try:
            if where.type == "cpu":
                _without_gpus()
            if where.type == "cuda":
                torch.cuda.set_device(where)
            init = {"store": FakeStore()} if fake else {}
            measurement = _measured_rank(rank, world_size, backend, where, timeout, fn, predict, sites, **init)
            results.put((rank, "ok", measurement.to_dict()))
        except BaseException as exc:  # the parent reports it: nothing may escape as a silent exit code
            error = _on_fake_ranks(exc) if fake else exc
            status = "oom" if isinstance(error, torch.OutOfMemoryError) else "error"
            results.put((rank, status, "".join(traceback.format_exception(error))))
            return


def _measured_rank(
    rank: int,
    world_size: int,
    backend: str,
    where: torch.device,
    timeout: float,
    fn: Callable[[int, RankContext], Any],
    predict: str | None,
    sites: SiteConfig | None,
    **init: Any,
) -> Measurement:
    """Start the default process group as ``rank``, run ``fn`` inside :func:`measure`, end the group (the rank's
    recorder and engine are garbage once it returns, before the next fake rank starts)."""
    # torch._dynamo: what DDP and FSDP import at their first use (a second a rank): a warm rank has it
    import torch.distributed as dist
    from torch import _dynamo  # noqa: F401

    from pytest_gpumem.measurement.active import measure

    timeout_delta = timedelta(seconds=max(timeout, 1.0))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout_delta, **init)
    try:
        ctx = RankContext(rank, world_size, where, backend)
        with measure(f"rank{rank}", device=where, predict=predict, fake=backend == "fake", sites=sites) as span:
            ctx._recorder = span.recorder
            try:
                fn(rank, ctx)
            finally:
                ctx._recorder = None
        return span.measurement
    finally:
        dist.destroy_process_group()


def _forget_earlier_ranks() -> None:
    """Clear the caches in which DTensor keeps what an earlier rank of this process computed.

    They are keyed by value and equal-shaped meshes compare equal across ranks, so a later rank would get results
    holding the earlier rank's meshes (``tests/test_fake_ranks.py`` checks it).
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    caches = (
        "torch.distributed.tensor._sharding_prop:ShardingPropagator._propagate_tensor_meta_cached",
        "torch.distributed.tensor._redistribute:_gen_transform_infos",
        "torch.distributed.tensor._redistribute:clear_redistribute_planner_cache",
        "torch.distributed.tensor._collective_utils:MeshTopoInfo.build_from_mesh",
    )
    for name in caches:
        try:
            found = pkgutil.resolve_name(name)
        except (ImportError, AttributeError):
            continue
        getattr(found, "cache_clear", found)()


def _on_fake_ranks(exc: BaseException) -> BaseException:
    """``exc``, or an error that says why where a known limit of the fake process group raised it."""
    from pytest_gpumem.measurement.engines.fake import FakeModeError

    if isinstance(exc, FakeModeError):  # says why already (a value the step reads, a hook refused)
        return exc
    frames = traceback.extract_tb(exc.__traceback__)
    if any(frame.filename.replace(os.sep, "/").endswith("torch/nn/parallel/distributed.py") for frame in frames):
        error = FakeModeError(DDP_ON_FAKE_RANKS)
        error.__cause__ = exc
        return error
    return exc


def run_ranks(
    fn: Callable[[int, RankContext], Any],
    world_size: int = 2,
    *,
    backend: str | None = None,
    device: str = "cpu",
    timeout: float = DEFAULT_TIMEOUT,
    predict: str | None = None,
    fake: bool = False,
    ranks: Iterable[int] | None = None,
    sites: SiteConfig | None = None,
) -> list[Measurement]:
    """Run ``fn(rank, ctx)`` in ``world_size`` ranks; one :class:`Measurement` per rank, in rank order.

    ``fn`` is a module-level function (pickled to each rank). ``device`` is ``"cpu"`` or ``"cuda"`` (rank ``r`` on
    ``cuda:r``); ``backend`` defaults to ``"nccl"`` on CUDA, else ``"gloo"``; ``timeout`` is seconds for the whole run.
    ``predict`` (a GPU name) predicts each rank's figures on the CPU engine; with it, ``fake`` runs the ``ranks``
    (default: all) in this process over the fake process group. ``sites`` records where bytes are made.

    Raises ``ValueError`` for a bad argument, ``TypeError`` when ``fn`` cannot be sent, :class:`DistributedError` when a
    rank raised, ran out of memory, died or timed out.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(
            f"timeout must be a positive, finite number of seconds (at most {MAX_TIMEOUT:,}: a week), got {timeout!r}"
        )
    if predict is not None:
        from pytest_gpumem.targets import parse_predict

        predict = parse_predict(predict)  # a ValueError naming the known GPUs
        if device != "cpu":
            raise ValueError(
                f"predict={predict!r} runs the ranks on the CPU engine: device must be 'cpu', got {device!r}"
            )
    wanted = _wanted_ranks(world_size, fake, predict, backend, ranks)
    if device == "cuda":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > available:
            raise ValueError(
                f"world_size={world_size} needs {world_size} CUDA devices, this machine has {available}: "
                "use fewer ranks, or device='cpu' (gloo) to run every rank on the CPU engine"
            )
    chosen = "fake" if fake else backend or ("nccl" if device == "cuda" else "gloo")
    if chosen not in ("gloo", "nccl", "mpi", "ucc", "xccl", "fake"):
        raise ValueError(f"backend {chosen!r} is not a torch.distributed backend")
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"the rank function {name} cannot be sent to the rank processes ({exc}): "
            "define it at module level (it is pickled and sent to each rank process)"
        ) from None
    import torch.multiprocessing as mp

    warm = _starts_warm(chosen if device == "cpu" else device)
    environment = dict(os.environ)
    if device == "cpu":  # CPU and fake ranks run as on a machine without a GPU (see _without_gpus)
        environment[HIDE_GPUS] = ""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    figures: dict[int, Measurement] = {}
    reports: dict[int, str] = {}
    groups: dict[int, int | None] = {}
    batches = [wanted] if fake else [[rank] for rank in wanted]  # the ranks of each process: fake ranks share one
    owner = {rank: i for i, batch in enumerate(batches) for rank in batch}
    deadline = time.monotonic() + timeout

    def take(wait: float) -> bool | None:
        """File the next rank's message; True when it reports a failure, None when none came within ``wait`` s."""
        try:
            rank, status, payload = results.get(timeout=wait)
        except queue.Empty:
            return None
        if status == "started":
            groups[owner[rank]] = payload
            return False
        if status == "ok":
            figures[rank] = Measurement.from_dict(payload)
            return False
        kind = "ran out of memory" if status == "oom" else "raised"
        reports.setdefault(rank, f"rank {rank} {kind}:\n{payload}")
        return True

    def silent(processes: list[Any]) -> list[int]:
        """Ranks whose process ended without a message."""
        return [
            rank
            for rank in wanted
            if rank not in figures and rank not in reports and not processes[owner[rank]].is_alive()
        ]

    with rank_processes(groups) as processes:
        make: Callable[..., Any] = context.Process
        if warm:
            from pytest_gpumem.diagnose.warm_ranks import WarmProcess

            make = functools.partial(WarmProcess, chosen)
        for batch in batches:
            args = (batch, world_size, port, chosen, device, timeout, fn, results, predict, sites, environment)
            process = make(target=_rank_main, args=args, daemon=True)
            process.start()
            processes.append(process)
        failed: bool | None = False
        while not failed and len(figures) + len(reports) < len(wanted):
            failed = take(0.2)
            if failed is None:  # a rank that ended may still have its message on its way
                failed = bool(silent(processes)) and take(1.0) is not False
            if not failed and time.monotonic() > deadline:
                late = [rank for rank in wanted if rank not in figures]
                reports.update({rank: f"rank {rank} did not finish within {timeout:g} s" for rank in late})
                failed = True
        if failed:  # the others may wait on the failed rank forever: collect what is on its way, stop them
            grace = time.monotonic() + 1.0
            while time.monotonic() < grace and len(figures) + len(reports) < len(wanted):
                take(0.1)
            for rank in silent(processes):  # died without a word: its peers' errors follow
                reports[rank] = f"rank {rank} {ended(processes[owner[rank]].exitcode)}"
    if reports:
        ordered = dict(sorted(reports.items()))
        if fake:  # the ranks run one after another: only the first that failed has a story
            first = next(rank for rank in wanted if rank in ordered)
            ordered = {first: ordered[first]}
        names = ", ".join(map(str, ordered))
        raise DistributedError(f"{len(ordered)} of {len(wanted)} ranks failed (rank {names})", ordered)
    return [figures[rank] for rank in wanted]


def _starts_warm(kind: str) -> bool:
    """Whether rank processes of ``kind`` start from a warm server: gloo and fake ranks on Linux unless
    :data:`RANK_START` says ``spawn`` (``ValueError`` for another value)."""
    chosen = os.environ.get(RANK_START, "warm")
    if chosen not in ("warm", "spawn"):
        raise ValueError(f"the environment variable {RANK_START} must be 'warm' or 'spawn', got {chosen!r}")
    if chosen == "spawn" or not sys.platform.startswith("linux"):
        return False
    from pytest_gpumem.diagnose.warm_ranks import PRELOAD  # imports only where there is a fork server

    return kind in PRELOAD


def _without_gpus() -> None:
    """In a CPU or fake rank process: check that it sees no GPU, so code that picks the accelerator itself picks the
    CPU; a GPU still seen is an error, not a silent run on the GPU."""
    if torch.cuda.is_available():
        raise RuntimeError(
            f"a CPU rank process sees {torch.cuda.device_count()} CUDA device(s) although {HIDE_GPUS} is empty "
            "in it (torch counted the devices before the rank took its environment): its step would run on "
            "the GPU, unmeasured. Please report this to pytest-gpumem with your torch version"
        )


def _wanted_ranks(
    world_size: int, fake: bool, predict: str | None, backend: str | None, ranks: Iterable[int] | None
) -> list[int]:
    """The ranks to run, checked against the other arguments."""
    if not isinstance(fake, bool):
        raise ValueError(f"fake must be True or False, got {fake!r}")
    if fake and predict is None:
        raise ValueError("fake=True needs predict= (the GPU whose figures the fake ranks predict, e.g. 'h100')")
    if fake and backend is not None:
        raise ValueError(f"fake=True runs the ranks over the fake process group: leave backend unset, got {backend!r}")
    if ranks is None:
        return list(range(world_size))
    if not fake:
        raise ValueError("ranks= chooses ranks to run with fake=True; real ranks all run (a collective waits for each)")
    try:
        chosen = list(ranks)
    except TypeError:
        raise ValueError(f"ranks must be a list of ranks in 0..{world_size - 1}, got {ranks!r}") from None
    bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"ranks must be distinct ints in 0..{world_size - 1} (world_size={world_size}), at least one, got {ranks!r}"
        )
    return chosen


# -- the rank processes, kept from outliving a run ------------------------------------------------------


#: The signal that ends a process at once (Windows has no SIGKILL: there, terminating is killing).
KILL = getattr(signal, "SIGKILL", signal.SIGTERM)


def die_with_parent(group: int | None) -> None:
    """End this rank and its group when the process that started it is gone (a thread waits on its sentinel)."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        wait([sentinel])
        if group is not None:
            with contextlib.suppress(OSError):
                os.killpg(group, KILL)
        os._exit(1)

    threading.Thread(target=watch, name="gpumem-parent-watch", daemon=True).start()


def ended(exitcode: int | None) -> str:
    """How a rank process ended before reporting, from its exit code (negative: the signal that killed it)."""
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode} before reporting"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return f"was killed by signal {-exitcode} before reporting"
    text = f"was killed by {name} (signal {-exitcode}) before reporting"
    if name == "SIGKILL":
        text += " (SIGKILL: often the system's out-of-memory killer; see the kernel log, `dmesg`)"
    return text


def signal_group(process: Any, group: int | None, signum: int) -> None:
    """Send ``signum`` to a rank's process group (it and the processes it started), else to it alone."""
    with contextlib.suppress(ProcessLookupError):
        if group is not None:
            os.killpg(group, signum)
        elif process.pid is not None:
            os.kill(process.pid, signum)


@contextlib.contextmanager
def rank_processes(groups: dict[int, int | None]) -> Iterator[list[Any]]:
    """The rank processes; on leaving, each still alive is terminated, then killed, with its process group. While they
    run, a SIGTERM kills them first, then goes to the previous handler (main thread only)."""
    processes: list[Any] = []
    # None: a handler set outside Python; none can be restored, the default is
    previous = signal.getsignal(signal.SIGTERM) or signal.SIG_DFL
    handled = threading.current_thread() is threading.main_thread() and previous != signal.SIG_IGN

    def stop(signum: int, frame: Any) -> None:
        for rank, process in enumerate(processes):
            signal_group(process, groups.get(rank), KILL)
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    if handled:
        signal.signal(signal.SIGTERM, stop)
    try:
        yield processes
    finally:
        if handled:
            signal.signal(signal.SIGTERM, previous)
        for rank, process in enumerate(processes):
            if process.is_alive():
                signal_group(process, groups.get(rank), signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for rank, process in enumerate(processes):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                signal_group(process, groups.get(rank), KILL)
                process.kill()
                process.join()
        for rank, process in enumerate(processes):  # what a rank started and left running
            if groups.get(rank) is not None:
                signal_group(process, groups[rank], KILL)


# -- DistributedDataParallel over the fake process group, in the process that runs fake ranks --------------


#: what DistributedDataParallel cannot do over the fake process group
DDP_ON_FAKE_RANKS = (
    "DistributedDataParallel ran into something the fake process group cannot give: fake ranks run DDP "
    "with its default all-reduce (gradient_as_bucket_view, bucket_cap_mb and broadcast_buffers as you "
    "set them), but not a communication hook of your own (its collectives return no values) nor "
    "find_unused_parameters=True or static_graph=True (DDP reads which parameters were used from tensor "
    "values); predict this step on real ranks (fake=False)"
)

_COMM_HOOK_ON_FAKE_RANKS = (
    "a DDP communication hook cannot run on fake ranks: the fake process group's collectives return no "
    "values for it to use; fake ranks run DDP's default all-reduce (in place, as on real ranks): drop the "
    "hook for the prediction, or predict on real ranks (fake=False)"
)


def _in_place_all_reduce(state: object, bucket: Any) -> Any:
    """DDP's all-reduce over the fake process group: the bucket itself, as a done future (as a real one yields)."""
    future: Any = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP checks a hook's annotations against its own classes; postponed ones are strings it rejects
_in_place_all_reduce.__annotations__ = {}


def ddp_on_fake_ranks() -> None:
    """Let DistributedDataParallel run in this process, which runs fake ranks only.

    The parameter-shape check across ranks is left out, the all-reduce yields the bucket in place, and the first bucket
    rebuild runs its bookkeeping on real tensors; a user's communication hook raises :class:`FakeModeError`.
    """
    import torch.nn.parallel.distributed as ddp
    from torch._C._distributed_c10d import Reducer

    from pytest_gpumem.measurement.engines.fake import FakeModeError, real_bookkeeping

    model_class = ddp.DistributedDataParallel
    if getattr(model_class, "_gpumem_fake_ranks", False):
        return
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    rebuild = Reducer._rebuild_buckets

    def rebuild_buckets(reducer: Any) -> bool:
        with real_bookkeeping():
            return bool(rebuild(reducer))

    Reducer._rebuild_buckets = rebuild_buckets  # type: ignore[method-assign,assignment]
    built = model_class.__init__
    register = model_class.register_comm_hook

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        if self.find_unused_parameters or self.static_graph:
            raise FakeModeError(DDP_ON_FAKE_RANKS)
        register(self, None, _in_place_all_reduce)

    def refuse_hook(self: Any, *args: Any, **kwargs: Any) -> None:
        raise FakeModeError(_COMM_HOOK_ON_FAKE_RANKS)

    model_class.__init__ = __init__  # type: ignore[method-assign]
    model_class.register_comm_hook = refuse_hook  # type: ignore[method-assign]
    model_class._register_builtin_comm_hook = refuse_hook  # type: ignore[method-assign]
    model_class._gpumem_fake_ranks = True  # type: ignore[attr-defined]
