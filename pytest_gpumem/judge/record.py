"""What the plugin learnt about one test (:class:`TestRecord`), its wire format, and when it fails on memory."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_gpumem.baselines import Environment
from pytest_gpumem.codec import Coded, coded, from_data
from pytest_gpumem.data.figures import Measurement, Timeline
from pytest_gpumem.data.findings import Finding, Tolerance
from pytest_gpumem.data.metrics import CATEGORIES
from pytest_gpumem.judge.limits import LimitSpec
from pytest_gpumem.judge.site_changes import SiteDiff

__all__ = ["TIMELINE_SAMPLES", "RecordStore", "TestRecord", "memory_failed"]

#: Most samples of a timeline kept in a test's record (for the HTML artifact).
TIMELINE_SAMPLES = 512


def memory_failed(errors: Sequence[str], findings: Iterable[Finding]) -> bool:
    """The one rule for a test that fails on memory: an error, or a finding that fails."""
    return bool(errors) or any(finding.failed for finding in findings)


@dataclass(frozen=True)
class TestRecord(Coded):
    """What the plugin learnt about one test call; sizes are bytes, spans are keyed by name (``"call"`` the marker's).

    A record is not changed once made: :func:`dataclasses.replace` makes another. ``measurements`` holds the ``call``
    span first; ``errors`` fail the test by themselves; ``environment`` is None when
    it did not measure; ``workspaces`` are library workspaces held in every reading (never in a cost); ``asked`` holds
    the limits as written, which the judge resolves; ``leak_report`` joins ``reports`` when ``retained`` fails.
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
        return memory_failed(self.errors, self.findings)

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

    def timeline_of_call(self) -> Timeline:
        """The call's timeline, empty when none was recorded."""
        return Timeline((), {c: () for c in CATEGORIES}) if self.timeline is None else Timeline.from_dict(self.timeline)

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
    """A run's judged records by node id, each kept as JSON text that the garbage collector never traverses; it hands
    out copies, and a change is kept by :meth:`put` or an :meth:`edit` block."""

    def __init__(self, records: Iterable[TestRecord] = ()) -> None:
        self._texts: dict[str, str] = {}
        #: each record's environment key and workspace bytes, known without decoding every record
        self._environments: dict[str, tuple[str | None, int | None]] = {}
        for record in records:
            self.put(record)

    def put(self, record: TestRecord) -> None:
        """Keep ``record`` as it is now, in place of the one of its node id (if any)."""
        self._texts[record.nodeid] = record.to_json(timeline=False)
        self._environments[record.nodeid] = (record.environment_key, record.workspaces)

    def decoded(self, nodeid: str) -> TestRecord:
        """A new copy of the record of ``nodeid`` (``KeyError`` where there is none)."""
        return TestRecord.from_json(self._texts[nodeid])

    def decoded_all(self) -> list[TestRecord]:
        """A new copy of every record, in the order they were first kept."""
        return [TestRecord.from_json(text) for text in self._texts.values()]

    def failed_in_pytest(self, nodeid: str) -> None:
        """Keep the record of ``nodeid`` as a test that failed (in a phase after its call)."""
        self.put(replace(self.decoded(nodeid), passed=False))

    def remove(self, nodeid: str) -> None:
        del self._texts[nodeid]
        del self._environments[nodeid]

    def nodeids(self) -> list[str]:
        return list(self._texts)

    def environments(self) -> dict[str, int | None]:
        """The records' environment keys, sorted, each with the workspace bytes its device held."""
        found: dict[str, int | None] = {}
        for key, workspaces in self._environments.values():
            if key is not None and found.get(key) is None:
                found[key] = workspaces
        return dict(sorted(found.items()))

    def __contains__(self, nodeid: object) -> bool:
        return nodeid in self._texts

    def __len__(self) -> int:
        return len(self._texts)
