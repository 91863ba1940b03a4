"""A distributed training step inside one test: ``world_size`` ranks, each measured on its own.

:func:`run_ranks` starts the ranks as PyTorch's own multi-process tests do: processes as made
with ``torch.multiprocessing``'s ``spawn`` start method (on Linux, CPU and fake ranks are forked
from a server that has imported what every rank imports: :mod:`pytest_gpumem.diagnose.warm_ranks`),
each initialising the default process group (``gloo`` on the CPU, ``nccl`` on CUDA) over a TCP
store on this machine.
Each rank runs ``fn(rank, ctx)`` inside :func:`pytest_gpumem.measure` on its device and sends
its :class:`~pytest_gpumem.data.figures.Measurement` back. A rank that raises, dies or is still
running at the timeout fails the whole run with that rank's report, and no rank process is
left behind.

With ``predict=`` each rank's figures are a GPU's, predicted on the CPU engine. With
``fake=True`` as well no rank process is started: one process runs the ranks one after another,
each on fake tensors (:mod:`pytest_gpumem.measurement.engines.fake`) and over PyTorch's fake
process group (the ``"fake"`` backend: collectives that move no data, whose outputs the step
allocates as it does on real ranks), so a sharded step of any size is predicted per rank, for
any world size, without its memory or its ranks. DistributedDataParallel runs there too
(:mod:`pytest_gpumem.diagnose.fake_ddp`): its gradients' all-reduce is in place, as on real
ranks, and the checks and bookkeeping it does on values are kept out of the fake tensors.

No process outlives the run: each rank runs in a process group of its own, with the processes
it starts, and the whole group is stopped, whether the run ends, fails or times out. A rank
also ends its group as soon as the process that started it is gone (pytest killed from
outside), and a SIGTERM sent to pytest while the ranks run stops them before pytest ends.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from pytest_gpumem.data.figures import Measurement
from pytest_gpumem.data.sites import SiteConfig
from pytest_gpumem.diagnose.rank_processes import die_with_parent, ended, own_group, rank_processes

__all__ = ["DistributedError", "RankContext", "run_ranks"]

#: Seconds a run may take, all ranks together, unless the caller says otherwise.
DEFAULT_TIMEOUT = 300.0
#: The longest a run may be given (seconds): a week.
MAX_TIMEOUT = 7 * 24 * 3600

#: The environment variable that chooses how CPU and fake rank processes start: ``warm`` (the
#: default, on Linux: forked from a server that has imported what a rank imports) or ``spawn``.
RANK_START = "PYTEST_GPUMEM_RANK_START"

#: The environment variable that is empty in CPU and fake rank processes: they see no GPU, as on
#: the machine without one where their figures are the same (see ``_without_gpus``).
HIDE_GPUS = "CUDA_VISIBLE_DEVICES"


class DistributedError(RuntimeError):
    """One or more ranks failed, died or timed out; ``reports`` maps each such rank to what happened
    (a rank whose peer failed often fails too, in a collective, after it)."""

    def __init__(self, message: str, reports: dict[int, str]) -> None:
        super().__init__(message)
        self.message = message
        self.reports = reports

    def __str__(self) -> str:
        return "\n\n".join([self.message, *self.reports.values()])


@dataclass
class RankContext:
    """What ``fn(rank, ctx)`` gets in each rank.

    Attributes:
        rank: this process's rank.
        world_size: the number of ranks.
        device: the ``torch.device`` this rank measures (put its model and batch there).
        backend: the process group's backend (``"gloo"``, ``"nccl"``; ``"fake"`` with ``fake=True``).
    """

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
        """Register this rank's modules and optimizers for the breakdown, the phases and Ψ
        (the rank's own, sharded, trainable parameters)."""
        if self._recorder is None:
            raise RuntimeError("RankContext.track() works only while the rank function runs")
        self._recorder.track(*objects)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _device_for(rank: int, device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", rank)
    return torch.device(device)


def _measured_rank(
    rank: int,
    world_size: int,
    backend: str,
    where: torch.device,
    timeout: float,
    fn: Callable[[int, RankContext], Any],
    predict: str | None,
    sites: SiteConfig | None = None,
    **init: Any,
) -> Measurement:
    """Initialise the default process group as ``rank``, run ``fn`` inside :func:`measure`, end the group."""
    import torch.distributed as dist

    from pytest_gpumem.measurement.active import measure

    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=max(timeout, 1.0)), **init
    )
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


def _failure(rank: int, exc: BaseException) -> tuple[int, str, str]:
    """The message a rank sends when ``exc`` ended it."""
    oom = isinstance(exc, torch.OutOfMemoryError)
    return (rank, "oom" if oom else "error", "".join(traceback.format_exception(exc)))


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    device: str,
    timeout: float,
    fn: Callable[[int, RankContext], Any],
    results: Any,
    predict: str | None = None,
    sites: SiteConfig | None = None,
    environment: dict[str, str] | None = None,
) -> None:
    """The body of one rank process (started by :func:`run_ranks`)."""
    _adopt_environment(environment)
    group = own_group()
    results.put((rank, "started", group))
    die_with_parent(group)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    where = _device_for(rank, device)
    try:
        if where.type == "cpu":
            _without_gpus()
        if where.type == "cuda":
            torch.cuda.set_device(where)
        measurement = _measured_rank(rank, world_size, backend, where, timeout, fn, predict, sites)
        results.put((rank, "ok", measurement.to_dict()))
    except BaseException as exc:  # the parent reports it: nothing may escape as a silent exit code
        results.put(_failure(rank, exc))


def _forget_earlier_ranks() -> None:
    """Clear the caches in which DTensor keeps what an earlier rank of this process computed.

    Its sharding propagation (the Python cache and the C++ fast path's), redistribution plans and
    mesh topologies are cached by value, and device meshes of equal shape compare equal across
    ranks: a later rank would be handed results that hold the earlier rank's meshes instead of
    computing its own, as its own process would. Every rank starts as if it were the first
    (``tests/test_fake_ranks.py`` checks a rank run alone against the same rank run after others).
    """
    import importlib

    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    caches = (
        ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached"),
        ("torch.distributed.tensor._redistribute", "_gen_transform_infos"),
        ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
        ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh"),
    )
    for module_name, path in caches:
        try:
            found: Any = importlib.import_module(module_name)
            for part in path.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            continue
        clear = getattr(found, "cache_clear", found)
        clear()


def _fake_ranks_main(
    ranks: list[int],
    world_size: int,
    timeout: float,
    fn: Callable[[int, RankContext], Any],
    results: Any,
    predict: str,
    sites: SiteConfig | None = None,
    environment: dict[str, str] | None = None,
) -> None:
    """The body of the one process that runs ``ranks`` over the fake process group, one after another."""
    _adopt_environment(environment)
    group = own_group()
    for rank in ranks:
        results.put((rank, "started", group))
    die_with_parent(group)
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from pytest_gpumem.diagnose.fake_ddp import ddp_on_fake_ranks

    ddp_on_fake_ranks()
    try:
        _without_gpus()
    except RuntimeError as exc:
        results.put(_failure(ranks[0], exc))
        return
    for rank in ranks:
        _forget_earlier_ranks()
        try:
            measurement = _measured_rank(
                rank, world_size, "fake", torch.device("cpu"), timeout, fn, predict, sites, store=FakeStore()
            )
        except BaseException as exc:
            results.put(_failure(rank, _on_fake_ranks(exc)))
            return
        results.put((rank, "ok", measurement.to_dict()))


def _on_fake_ranks(exc: BaseException) -> BaseException:
    """``exc``, or an error that says why where a known limit of the fake process group raised it."""
    from pytest_gpumem.measurement.engines.fake import FakeModeError

    if isinstance(exc, FakeModeError):  # says why already (a value the step reads, a hook refused)
        return exc
    frames = traceback.extract_tb(exc.__traceback__)
    if any(frame.filename.replace(os.sep, "/").endswith("torch/nn/parallel/distributed.py") for frame in frames):
        from pytest_gpumem.diagnose.fake_ddp import DDP_ON_FAKE_RANKS

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
    """Run ``fn(rank, ctx)`` in ``world_size`` rank processes; one :class:`Measurement` per rank, in rank order.

    Args:
        fn: a module-level function (it is pickled and sent to each rank process).
        world_size: the number of ranks (at least 1).
        backend: the process group's backend; None: ``"nccl"`` on CUDA, else ``"gloo"``.
        device: ``"cpu"`` (every rank on the CPU engine) or ``"cuda"`` (rank ``r`` on ``cuda:r``:
            the machine needs ``world_size`` GPUs).
        timeout: seconds for the whole run; ranks still running then are stopped.
        predict: a GPU (``"h100"``): each rank's figures are that GPU's, predicted on the CPU
            engine (``device`` must be ``"cpu"``).
        fake: with ``predict``, run the ranks on fake tensors over the fake process group, one
            after another in one process (see the module's docstring); ``backend`` must be None.
        ranks: with ``fake``, the ranks to run (default: all); the result follows this order.
        sites: record where each rank's bytes are made (:mod:`pytest_gpumem.data.sites`); None: not.

    Raises:
        ValueError: a bad ``world_size``, ``device``, ``backend``, ``timeout``, ``predict``,
            ``fake`` or ``ranks``, or more ranks than CUDA devices.
        TypeError: ``fn`` cannot be sent to a rank process.
        DistributedError: a rank raised, ran out of memory, died, or did not finish in time.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if (
        not isinstance(timeout, (int, float))
        or isinstance(timeout, bool)
        or not math.isfinite(timeout)
        or not 0 < timeout <= MAX_TIMEOUT
    ):
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
    #: rank → the index of the process that runs it
    owner = dict.fromkeys(wanted, 0) if fake else {rank: rank for rank in wanted}
    deadline = time.monotonic() + timeout

    def take(message: tuple[int, str, Any]) -> bool:
        """File a rank's message; True when it reports a failure."""
        rank, status, payload = message
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
        if fake:
            starts: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
                (_fake_ranks_main, (wanted, world_size, timeout, fn, results, predict, sites, environment))
            ]
        else:
            starts = [
                (
                    _rank_main,
                    (rank, world_size, port, chosen, device, timeout, fn, results, predict, sites, environment),
                )
                for rank in wanted
            ]
        make: Callable[..., Any] = context.Process
        if warm:
            from pytest_gpumem.diagnose.warm_ranks import WarmProcess

            make = functools.partial(WarmProcess, chosen)
        for target, args in starts:
            process = make(target=target, args=args, daemon=True)
            process.start()
            processes.append(process)
        failed = False
        while not failed and len(figures) + len(reports) < len(wanted):
            try:
                failed = take(results.get(timeout=0.2))
            except queue.Empty:
                if silent(processes):  # a rank ended: its message may still be on its way
                    try:
                        failed = take(results.get(timeout=1.0))
                    except queue.Empty:
                        failed = True
            if not failed and time.monotonic() > deadline:
                for rank in wanted:
                    if rank not in figures:
                        reports[rank] = f"rank {rank} did not finish within {timeout:g} s"
                failed = True
        if failed:  # the others may wait on the failed rank forever: collect what is on its way, stop them
            grace = time.monotonic() + 1.0
            while time.monotonic() < grace and len(figures) + len(reports) < len(wanted):
                with contextlib.suppress(queue.Empty):
                    take(results.get(timeout=0.1))
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
    """Whether rank processes of ``kind`` (a backend on the CPU, or ``"cuda"``) start from a warm
    server (:mod:`pytest_gpumem.diagnose.warm_ranks`): gloo and fake ranks on Linux, unless
    :data:`RANK_START` says ``spawn``.

    Raises:
        ValueError: :data:`RANK_START` holds something other than ``warm`` or ``spawn``.
    """
    chosen = os.environ.get(RANK_START, "warm")
    if chosen not in ("warm", "spawn"):
        raise ValueError(f"the environment variable {RANK_START} must be 'warm' or 'spawn', got {chosen!r}")
    if chosen == "spawn" or not sys.platform.startswith("linux"):
        return False
    from pytest_gpumem.diagnose.warm_ranks import PRELOAD  # imports only where there is a fork server

    return kind in PRELOAD


def _without_gpus() -> None:
    """In a CPU or fake rank process: check that it sees no GPU (:data:`HIDE_GPUS` is empty in its
    environment), so that it runs as on a machine without one, where its figures were made to be
    the same: code that picks the accelerator by itself (FSDP2's default device mesh, a
    ``DeviceMesh``, ``torch.accelerator``) picks the CPU. A GPU still seen means torch read the
    device count before the rank took its environment: an error, not a silent run on the GPU."""
    if torch.cuda.is_available():
        raise RuntimeError(
            f"a CPU rank process sees {torch.cuda.device_count()} CUDA device(s) although {HIDE_GPUS} is empty "
            "in it (torch counted the devices before the rank took its environment): its step would run on "
            "the GPU, unmeasured. Please report this to pytest-gpumem with your torch version"
        )


def _adopt_environment(environment: dict[str, str] | None) -> None:
    """In a rank process: take the environment variables the run was started with (a warm rank
    was forked from a server started earlier, and inherited the server's)."""
    if environment is not None and environment != dict(os.environ):
        os.environ.clear()
        os.environ.update(environment)


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
