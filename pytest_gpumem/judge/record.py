"""What the plugin learnt about one test: the :class:`TestRecord`, its wire format, and the
one rule for "this test failed on memory".

A record is made where the test ran (an xdist worker, or the only process) and
travels to the process that judges it (the controller) as JSON-ready data in
the test report (``report.gpumem``). No torch, no pytest.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_gpumem.baselines import Environment
from pytest_gpumem.codec import Coded, coded, from_data
from pytest_gpumem.data.figures import Measurement, Timeline
from pytest_gpumem.data.findings import Finding, Tolerance
from pytest_gpumem.judge.limits import LimitSpec
from pytest_gpumem.judge.sites import SiteDiff

__all__ = ["TIMELINE_SAMPLES", "RecordStore", "TestRecord"]

#: Most samples of a timeline kept in a test's record (for the HTML artifact).
TIMELINE_SAMPLES = 512


@dataclass
class TestRecord(Coded):
    """What the plugin learnt about one test call. Sizes are bytes.

    Attributes:
        nodeid: the test's pytest node id.
        measurements: the ``call`` span first, then each named span in the order they closed.
        findings: limits, budgets and baselines, checked by the judge.
        errors: problems that fail the test by themselves (a budget using Ψ with nothing
            tracked, an unreadable baseline file).
        environment: :meth:`Environment.to_dict` of where it ran; None when it did not measure.
        tolerances: baseline tolerance by span name (``"call"`` for the marker's) as
            ``{"relative", "absolute"}``; absent: the run's default.
        passed: whether the test's own code passed (before any memory verdict).
        reports: texts to add to a failure: the out-of-memory report, the leaked tensors.
        timeline: the call span's timeline (thinned) for the HTML artifact.
        snapshot: the path of a CUDA memory snapshot written for this test.
        device_limit: the emulated device size the test ran under.
        workspaces: bytes of the library workspaces the device held in every reading of
            the test (created by the clean-state protocol; in ``start``, never in a cost);
            None where there are none (the CPU engine).
        asked: the limits and budgets of each span by span name (``"call"`` for the marker's),
            as written; the judge (:func:`~pytest_gpumem.judge.judgement.judge`) decides which
            apply (:func:`~pytest_gpumem.judge.judgement.limits_of`), resolves and checks them.
        leak_check: the run checks every test for leaks (``--gpumem-leak-check``): the call's
            ``retained`` must be 0 unless the marker bounds it.
        min_microbatch: the marker's lower bound on the largest microbatch that fits.
        ranks_measured: the test measured ranks (``gpumem.distributed``): each rank's span asked
            for the marker's span limits (``peak``, ``allocated``, ``reserved``) instead of the call.
        leak_report: the confirmed leak check's report (the leaked tensors), for the judge to
            add to :attr:`reports` when the ``retained`` check fails; None when no leak was checked.
        site_changes: by span name, the sites whose bytes changed against the site profile
            stored with the span's baseline (:func:`~pytest_gpumem.judge.sites.diff_sites`);
            only for spans whose figures carry sites and whose baseline has them.
    """

    __test__ = False  # a name pytest would otherwise collect
    _codec_order = ("nodeid", "measurements", "asked")

    nodeid: str
    measurements: list[Measurement] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    environment: dict[str, Any] | None = None
    tolerances: dict[str, dict[str, float | int]] = field(default_factory=dict)
    passed: bool = True
    reports: list[str] = field(default_factory=list)
    #: already JSON-ready (``Timeline.to_dict``): written as it is, not walked value by value
    timeline: dict[str, Any] | None = field(default=None, metadata=coded(write=lambda data: data))
    snapshot: str | None = None
    device_limit: int | None = None
    workspaces: int | None = None
    asked: dict[str, list[LimitSpec]] = field(default_factory=dict)
    leak_check: bool = False
    min_microbatch: int | None = None
    ranks_measured: bool = False
    leak_report: str | None = None
    site_changes: dict[str, SiteDiff] = field(default_factory=dict, metadata=coded(omit=True))

    @property
    def failed(self) -> bool:
        """The test fails on memory: an error, or a finding that fails (see :attr:`Finding.failed`)."""
        return bool(self.errors) or any(finding.failed for finding in self.findings)

    @property
    def recordable(self) -> bool:
        """Its figures may become baselines: the test's code passed, nothing failed on memory, it measured."""
        return self.passed and not self.failed and self.environment is not None

    @property
    def environment_key(self) -> str | None:
        return None if self.environment is None else Environment.from_dict(self.environment).key

    def tolerance(self, span: str) -> Tolerance | None:
        """The baseline tolerance of ``span``: its own, else the marker's; None for the run's default."""
        given = self.tolerances.get(span) or self.tolerances.get("call")
        return None if given is None else Tolerance.from_dict(given)

    def set_tolerance(self, span: str, tolerance: Tolerance) -> None:
        self.tolerances[span] = tolerance.to_dict()

    def timeline_of_call(self) -> Timeline:
        """The call's timeline, empty when none was recorded."""
        return Timeline.empty() if self.timeline is None else Timeline.from_dict(self.timeline)

    # -- wire format ------------------------------------------------------------------

    def to_json(self, *, timeline: bool = True) -> str:
        """:meth:`to_dict` as compact JSON text (without the call's timeline: ``timeline=False``)."""
        data = (self if timeline or self.timeline is None else replace(self, timeline=None)).to_dict()
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TestRecord:
        """Read what :meth:`to_json` wrote."""
        return from_data(cls, json.loads(text))


class RecordStore:
    """A run's judged records by node id, each kept as the JSON text of :meth:`TestRecord.to_dict`.

    A string holds no references: the garbage collector never traverses it, where a record's
    dozens of lists, dicts and objects would be traversed by every full collection for the rest
    of the run (the plugin collects twice a test). So the store hands out copies, and says so:
    :meth:`decoded` and :meth:`decoded_all` decode one, a change is kept by :meth:`put` (a whole
    record) or made in an :meth:`edit` block. The call's timeline is not kept: it is drawn only
    in a test's own artifact, written before the run ends, and nothing after reads it.
    """

    def __init__(self, records: Iterable[TestRecord] = ()) -> None:
        self._texts: dict[str, str] = {}
        #: each record's environment key and workspace bytes (strings and ints: nothing to traverse),
        #: so that the run's environments are known without decoding every record
        self._environments: dict[str, tuple[str | None, int | None]] = {}
        for record in records:
            self.put(record)

    def put(self, record: TestRecord) -> None:
        """Keep ``record`` as it is now, in place of the one of its node id (if any)."""
        self._texts[record.nodeid] = record.to_json(timeline=False)
        self._environments[record.nodeid] = (record.environment_key, record.workspaces)

    def decoded(self, nodeid: str) -> TestRecord:
        """A new copy of the record of ``nodeid`` (raises ``KeyError`` where there is none): a change
        to it is not kept unless it is :meth:`put` again (or made in an :meth:`edit` block)."""
        return TestRecord.from_json(self._texts[nodeid])

    def decoded_all(self) -> list[TestRecord]:
        """A new copy of every record, in the order they were first kept."""
        return [TestRecord.from_json(text) for text in self._texts.values()]

    @contextlib.contextmanager
    def edit(self, nodeid: str) -> Iterator[TestRecord]:
        """The record of ``nodeid``, decoded, for the ``with`` block to change; kept again as the block
        ends without an error. Raises ``KeyError`` where there is none."""
        record = self.decoded(nodeid)
        yield record
        self.put(record)

    def remove(self, nodeid: str) -> None:
        del self._texts[nodeid]
        del self._environments[nodeid]

    def nodeids(self) -> list[str]:
        return list(self._texts)

    def environments(self) -> dict[str, int | None]:
        """The environment keys of the records, sorted, each with the workspace bytes its device
        held (the first record's that knows them)."""
        found: dict[str, int | None] = {}
        for key, workspaces in self._environments.values():
            if key is not None and found.get(key) is None:
                found[key] = workspaces
        return dict(sorted(found.items()))

    def __contains__(self, nodeid: object) -> bool:
        return nodeid in self._texts

    def __len__(self) -> int:
        return len(self._texts)
