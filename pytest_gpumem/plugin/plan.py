"""A measured test's plan: its settings, and their conflicts, decided in one place (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_gpumem.data.site_figures import SiteConfig
from pytest_gpumem.measurement.observe import choose_observe, observe_conflict
from pytest_gpumem.plugin.marker import GpumemSpec

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.plugin.options import Settings

__all__ = ["PlanError", "RunOptions", "TestPlan", "choose_device", "plan_test", "sites_mode"]


@dataclass(frozen=True)
class RunOptions:
    """What the run asks of every measured test."""

    leak_check: bool = False  #: check every test for leaks (as ``retained="0B"`` does)
    snapshots: Path | None = None  #: folder for CUDA memory snapshots (``--gpumem-snapshot``)
    device_limit: int | None = None  #: the emulated device size (bytes) of tests whose marker names none
    sites: SiteConfig | None = None  #: record where storages are made, so chosen
    reports: bool = True  #: the leak and out-of-memory reports (False: a second run's stay the first run's)


class PlanError(Exception):
    """The test cannot run as it asks: skipped (``skip``: its device is not there) or failed (a run that demands a GPU,
    conflicting settings)."""

    def __init__(self, reason: str, *, skip: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.skip = skip


@dataclass(frozen=True)
class TestPlan:
    """What one measured test asks for, with the run's options applied; a :class:`TestRun` carries it out."""

    __test__ = False  # a name pytest would otherwise collect

    nodeid: str
    spec: GpumemSpec = field(default_factory=GpumemSpec)  #: the marker: limits, tolerance, min_microbatch
    device: torch.device | None = None  #: None: the engine's own
    breakdown: bool = False
    observe: str = "operators"
    predict: str | None = None
    fake: bool = False
    sites: str = "rerun"  #: the sites mode: "rerun", "always" or "off"
    options: RunOptions = field(default_factory=RunOptions)

    @property
    def device_limit(self) -> int | None:
        """The emulated device size this test runs under: its marker's, else the run's."""
        return self.spec.device_limit if self.spec.device_limit is not None else self.options.device_limit

    @property
    def reserved(self) -> bool:
        """Whether a limit reads ``reserved`` (the allocator's cache is emptied before the start)."""
        return any(limit.metric == "reserved" for limit in self.spec.limits)

    @property
    def leak_check(self) -> bool:
        """Whether the run snapshots the storages at its start and confirms a leak at its end."""
        checked = self.options.leak_check or any(limit.metric == "retained" for limit in self.spec.limits)
        return checked and self.options.reports

    def second_run(self, sites: SiteConfig | None) -> TestPlan:
        """The plan of the run again with ``sites``, whose reports stay the first run's."""
        return replace(self, options=replace(self.options, sites=sites, snapshots=None, reports=False))

    def with_marker(self, now: GpumemSpec) -> TestPlan:
        """The plan with what a marker added during the test may still change: its limits and tolerance."""
        spec = replace(self.spec, limits=now.limits, tolerance=now.tolerance, min_microbatch=now.min_microbatch)
        return replace(self, spec=spec)


def choose_device(wanted: str, *, require_gpu: bool = False, worker: int | None = None) -> torch.device:
    """The device a test measures on (xdist's ``worker`` *i* on GPU *i mod N*), or a :class:`PlanError`."""
    import torch

    from pytest_gpumem.measurement.engines import cuda_available, cuda_device_count, resolve_device

    has_cuda = cuda_available()
    if wanted == "auto" and not has_cuda:
        if require_gpu:
            raise PlanError("--gpumem-require-gpu: no CUDA device is available", skip=False)
        return torch.device("cpu")
    device = None if wanted == "auto" else torch.device(wanted)
    if device is not None and device.type != "cuda":
        return device
    count = cuda_device_count()  # 0 without CUDA
    if wanted in ("auto", "cuda") and worker is not None and count > 1:
        return torch.device("cuda", worker % count)
    if device is not None and (device.index or 0) >= count:
        plural = "s" if count != 1 else ""
        reason = f"gpumem: device {wanted!r} is not available ({count} CUDA device{plural} visible)"
        raise PlanError(reason, skip=not require_gpu)
    return resolve_device(wanted)


def sites_mode(spec: GpumemSpec, settings: Settings) -> str:
    """The test's sites mode: its marker's, else the run's."""
    return spec.sites or settings.sites


def plan_test(nodeid: str, spec: GpumemSpec, settings: Settings, *, worker: int | None = None) -> TestPlan:
    """The plan of the test ``nodeid`` marked ``spec`` in a run of ``settings``, on the GPU of ``worker``; a
    :class:`PlanError` when its device is not there or its settings conflict."""
    try:
        device = choose_device(spec.device or settings.device, require_gpu=settings.require_gpu, worker=worker)
    except PlanError as exc:  # a run that demands a GPU fails the test, naming it; else it is skipped
        raise PlanError(exc.reason if exc.skip else f"{nodeid}: {exc.reason}", skip=exc.skip) from None
    predict = spec.predict or settings.predict
    run_limit = None if settings.device_limit is None else f"--gpumem-device-limit={settings.device_limit}"
    limit = None if spec.device_limit is not None else run_limit  # the marker's own: checked at collection
    conflict = observe_conflict(spec.observe, predict=predict, limit=limit)
    if conflict is not None:
        raise PlanError(f"{nodeid}: {conflict}", skip=False)
    needs_limit = spec.device_limit is not None or settings.device_limit is not None
    observe = choose_observe(spec.observe, default=settings.observe, predict=predict, limit=needs_limit)
    # --gpumem-fake applies to the predicted tests; a marker's fake=True needs a prediction
    fake = (spec.fake if spec.fake is not None else settings.fake and predict is not None) and device.type == "cpu"
    if fake and predict is None:
        needs = "fake=True needs a prediction: predict= on the marker or --gpumem-predict"
        raise PlanError(f"{nodeid}: {needs}", skip=False)
    mode = sites_mode(spec, settings)
    # sites on the first run: with "always", on a baseline update, and on fake tensors
    sites = mode == "always" or (mode != "off" and (settings.baselines.update or fake))
    options = RunOptions(
        leak_check=settings.leak_check,
        snapshots=settings.artifacts if settings.snapshot else None,
        device_limit=settings.device_limit,
        sites=settings.site_config if sites else None,
    )
    return TestPlan(
        nodeid,
        spec,
        device=device,
        breakdown=spec.breakdown if spec.breakdown is not None else settings.breakdown,
        observe=observe,
        predict=predict,
        fake=fake,
        sites=mode,
        options=options,
    )
