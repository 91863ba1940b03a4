"""One object of each serialised dataclass, every field set, for tests/test_codec.py."""

from __future__ import annotations

from typing import Any

from pytest_gpumem.baselines import Environment
from pytest_gpumem.budgets.formulas import Budget
from pytest_gpumem.data.figures import Measurement, Phase, Timeline
from pytest_gpumem.data.findings import Finding, Tolerance
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.data.site_figures import Site, SiteFigures, SiteProfile
from pytest_gpumem.diagnose.census import LiveTensor
from pytest_gpumem.diagnose.leaks import LeakCheck
from pytest_gpumem.diagnose.oom import OomReport
from pytest_gpumem.judge.limits import parse_limit
from pytest_gpumem.judge.record import TestRecord
from pytest_gpumem.judge.site_changes import SiteChange, SiteDiff
from pytest_gpumem.validate.results import Check

ROW = SiteFigures(
    Site("t.py", "f", 3, 58, "y = x @ w"),
    4096,
    1024,
    2,
    "activations",
    "forward",
    ("(8, 64) float32",),
    (("Trainer.debug[0]", 2048),),
)
PROFILE = SiteProfile((ROW,), 512, 0, 3, True, "figures differed", True)
MEASUREMENT = Measurement(
    "call",
    "cpu",
    "cpu",
    100,
    9000,
    200,
    10_000,
    50,
    100,
    8800,
    1,
    0,
    123,
    45,
    {c: i * 10 for i, c in enumerate(CATEGORIES)},
    {c: i for i, c in enumerate(CATEGORIES)},
    {"forward": Phase("forward", 100, 5000, 3000, 2), "backward": Phase("backward", 3000, 9000, 200)},
    700,
    4096,
    True,
    16,
    ("a note",),
    PROFILE,
)
TOLERANCE = Tolerance(0.29, 1 << 20)
FINDING = Finding(
    "t.py::test", "call", "peak", "baseline", "regressed", 9000, 7000, TOLERANCE, {"activations": 2000}, "grew", True
)
DIFF = SiteDiff("call", (SiteChange(ROW, 1000, None), SiteChange(ROW, None, None, "gone")), 4, True, "n")
ENVIRONMENT = Environment(
    engine="cuda",
    device_name="NVIDIA H100",
    total_memory=80 << 30,
    compute_capability="9.0",
    torch_version="2.13",
    cuda_version="12.8",
    hip_version=None,
    cudnn_version="91002",
    allocator=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),),
    cuda_rounding=None,
    labels=(("image", "cu128"),),
)
TENSOR = LiveTensor(4096, (8, 128), "float32", "activations", "x", 2, "t.py:58 f")
TIMELINE = Timeline((0, 3, 7), {c: (1, 2, 3) for c in CATEGORIES}, ((0, "forward"), (3, "backward")))


def record() -> TestRecord:
    return TestRecord(
        "t.py::test",
        [MEASUREMENT, Measurement("step", "cpu", "cpu", 0, 10, 0)],
        [FINDING],
        ["an error"],
        ENVIRONMENT.to_dict(),
        {"call": TOLERANCE.to_dict()},
        False,
        ["report"],
        TIMELINE.to_dict(),
        "snap.pickle",
        1 << 30,
        1 << 20,
        {"call": [parse_limit("peak", "2 GiB"), parse_limit("allocated", "16*psi")]},
        True,
        8,
        True,
        "leaked",
        {"call": DIFF},
    )


def samples() -> dict[str, Any]:
    """Each sample's data as the package writes it."""
    return {
        "measurement": MEASUREMENT.to_dict(),
        "measurement_bare": Measurement("step", "cuda", "cuda:0", 0, 10, 0).to_dict(),
        "timeline": TIMELINE.to_dict(),
        "timeline_thinned": TIMELINE.to_dict(2),
        "finding": FINDING.to_dict(),
        "finding_bare": Finding("t", "call", "peak", "limit", "ok").to_dict(),
        "diff": DIFF.to_dict(),
        "profile": PROFILE.to_dict(),
        "environment": ENVIRONMENT.to_dict(),
        "environment_cpu": Environment.from_dict({"engine": "cpu", "torch_version": "2.13"}).to_dict(),
        "record": record().to_dict(),
        "record_bare": TestRecord("t").to_dict(),
        "check": Check("g", "n", None, 1, 2, "d").to_dict(),
        "budget": Budget({"parameters": 40, "gradients": 40}, 10, "fp32", "AdamW", 2, 4, "cuda").to_dict(),
        "leak": LeakCheck("cpu", "cpu", 10, (20, 20), 10, True, 10, False, (TENSOR,), 1, 4096, True).to_dict(),
        "oom": OomReport(
            "cuda:0",
            "cuda",
            "OOM",
            "call",
            10,
            True,
            20,
            30,
            40,
            "forward",
            {"activations": 1},
            (TENSOR,),
            1,
            2,
            "t.py:1 f",
        ).to_dict(),
    }
