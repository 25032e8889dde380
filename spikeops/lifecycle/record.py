"""A node's record in the ledger, read as its life after a drain (shared/spec/ledger.md).

The ledger keeps events, oldest first: convictions (``convict``, with the evidence and whether a
reset can clear it), doubts cast on them (``doubt``), and the lifecycle: ``drain``, ``reboot``
(``requested``, then ``done`` or ``failed``; ``declined`` by a person), ``validate``
(``started``, then ``passed`` or ``failed``), ``release`` (``done``, or ``declined`` by a
person), ``force-release`` and ``replace``. This module is pure: from those
events it tells the node's state, the cycle it is in (everything since its last drain), the
convictions that count against it, and whether it has earned its release.

The states (ledger.md): ``drained`` (waiting: for its reboot, its validation, or a person),
``rebooting``, ``validating``, ``failed-validation``, ``releasable`` (its last validation since
the drain passed), ``replace`` (a repeat offender: never released automatically) and
``released``; None while the ledger holds no lifecycle event of the node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from spikeops.lifecycle.faults import ConvictionEvidence

__all__ = ["STATES", "LIFECYCLE_KINDS", "PASSED", "Event", "NodeRecord", "node_state", "lemon_convictions",
           "STALE_VALIDATION_S"]

STATES = ("drained", "rebooting", "validating", "failed-validation", "releasable", "replace", "released")
LIFECYCLE_KINDS = ("drain", "reboot", "validate", "release", "force-release", "replace")
#: A ``validate`` event's result when every check passed.
PASSED = "passed"
#: A validation ``started`` longer ago than this never finished (its process died): failed.
STALE_VALIDATION_S = 6 * 3600


@dataclass(frozen=True)
class Event:
    """One ledger row of a node (``spikeops.ledger.schema.node_events``)."""

    time: str
    kind: str
    result: str | None = None
    by: str | None = None
    detail: str | None = None
    incident: str | None = None
    cause: str | None = None
    evidence: Any = None
    cluster: str | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Event:
        return cls(str(row.get("time") or ""), str(row.get("kind") or ""), row.get("result"), row.get("by"),
                   row.get("detail"), row.get("for_incident") or row.get("incident_id"), row.get("cause"),
                   row.get("evidence"), row.get("cluster"))

    def moment(self) -> datetime | None:
        from spikeops.timeparse import parse_any

        return parse_any(self.time) if self.time else None


def _state_of(event: Event, now: datetime | None) -> str:
    result = str(event.result or "")
    if event.kind == "drain":
        return "drained"
    if event.kind == "reboot":
        return "rebooting" if result == "requested" else "drained"
    if event.kind == "validate":
        if result == PASSED:
            return "releasable"
        if result == "started":
            moment = event.moment()
            if now is not None and moment is not None and now - moment > timedelta(seconds=STALE_VALIDATION_S):
                return "failed-validation"
            return "validating"
        return "failed-validation"
    if event.kind in ("release", "force-release"):
        return "released"
    return "replace"


def _changes_state(event: Event) -> bool:
    """A person's no to a release leaves the node where it was."""
    return not (event.kind in ("release", "force-release") and event.result == "declined")


def node_state(events: Iterable[Event], now: datetime | None = None) -> str | None:
    """The state the lifecycle events leave the node in (module docstring). A ``replace``
    mark holds until the node is released (by a person) or drained again."""
    state = None
    for event in events:
        if event.kind not in LIFECYCLE_KINDS or not _changes_state(event):
            continue
        following = _state_of(event, now)
        if state == "replace" and following not in ("released",) and event.kind != "drain":
            continue
        state = following
    return state


def lemon_convictions(convictions: Iterable[Event], *, window_s: int, now: datetime,
                      doubted: Iterable[str] = ()) -> list[Event]:
    """The convictions within ``window_s`` before ``now`` that count: one per incident, and
    none that a later recurrence put in doubt (the lemon rule counts evidence, not suspicion)."""
    cutoff = now - timedelta(seconds=window_s)
    seen, out = set(), []
    doubted = set(doubted)
    for event in convictions:
        moment = event.moment()
        if moment is None or moment < cutoff or moment > now + timedelta(minutes=5):
            continue
        key = event.incident or event.time
        if key in seen or key in doubted:
            continue
        seen.add(key)
        out.append(event)
    return out


@dataclass
class NodeRecord:
    """A node's events on one cluster, oldest first."""

    node: str
    cluster: str | None
    events: list[Event] = field(default_factory=list)

    @classmethod
    def from_rows(cls, node: str, cluster: str | None, rows: Iterable[Mapping[str, Any]]) -> NodeRecord:
        events = sorted((Event.from_row(r) for r in rows), key=lambda e: e.time)
        return cls(node, cluster or next((e.cluster for e in events if e.cluster), None), events)

    # -- views ----------------------------------------------------------------------------
    def lifecycle(self) -> list[Event]:
        return [e for e in self.events if e.kind in LIFECYCLE_KINDS]

    def convictions(self) -> list[Event]:
        return [e for e in self.events if e.kind == "convict"]

    def doubted_incidents(self) -> set[str]:
        """Incidents whose conviction of this node a later recurrence put in doubt."""
        out = set()
        for event in self.events:
            if event.kind != "doubt" or not event.detail:
                continue
            for conviction in self.convictions():
                if conviction.incident and conviction.incident in event.detail:
                    out.add(conviction.incident)
        return out

    def state(self, now: datetime | None = None) -> str | None:
        return node_state(self.events, now)

    def last_drain(self) -> Event | None:
        return next((e for e in reversed(self.events) if e.kind == "drain"), None)

    def cycle(self) -> list[Event]:
        """The lifecycle events since the node's last drain (its current time out of service);
        all of them when no drain was recorded (a node drained before the ledger knew it)."""
        events = self.lifecycle()
        for index in range(len(events) - 1, -1, -1):
            if events[index].kind == "drain":
                return events[index:]
        return events

    def released(self) -> bool:
        done = [e for e in self.cycle() if _changes_state(e)]
        return bool(done) and done[-1].kind in ("release", "force-release")

    def declined_release(self) -> Event | None:
        """A person's no to releasing the node after its last passing validation."""
        passed = self.passed()
        return next((e for e in reversed(self._in_cycle("release")) if e.result == "declined"
                     and (passed is None or e.time >= passed.time)), None)

    def cycle_conviction(self) -> Event | None:
        """The conviction behind the current drain: the drain's incident's, else the newest
        conviction before (or at) the drain, else the newest."""
        drain = self.last_drain()
        convictions = self.convictions()
        if drain is not None and drain.incident:
            found = [c for c in convictions if c.incident == drain.incident]
            if found:
                return found[-1]
        if drain is not None:
            before = [c for c in convictions if c.time <= drain.time]
            if before:
                return before[-1]
        return convictions[-1] if convictions else None

    def conviction_evidence(self) -> ConvictionEvidence | None:
        conviction = self.cycle_conviction()
        if conviction is None:
            return None
        evidence = ConvictionEvidence.from_json(self.node, conviction.evidence)
        if evidence.cause is None and conviction.cause:
            evidence = ConvictionEvidence(self.node, conviction.cause, evidence.xids, evidence.gpus, evidence.gpu_lost,
                                          evidence.remap_pending, evidence.summary, evidence.reset)
        return evidence

    def _in_cycle(self, kind: str) -> list[Event]:
        return [e for e in self.cycle() if e.kind == kind]

    def reboots(self) -> list[Event]:
        return self._in_cycle("reboot")

    def pending_reboot(self) -> Event | None:
        """A reboot asked in this cycle that has not ended (no ``done``/``failed`` after it)."""
        reboots = self.reboots()
        if reboots and reboots[-1].result == "requested":
            return reboots[-1]
        return None

    def rebooted(self) -> Event | None:
        """The reboot of this cycle that finished, if any."""
        return next((e for e in reversed(self.reboots()) if e.result == "done"), None)

    def validations(self) -> list[Event]:
        return [e for e in self._in_cycle("validate") if e.result != "started"]

    def last_validation(self) -> Event | None:
        validations = self.validations()
        return validations[-1] if validations else None

    def passed(self) -> Event | None:
        """The passing validation that earns a release: the last validation of this cycle,
        passed, after the cycle's last reboot, with no conviction after it."""
        last = self.last_validation()
        if last is None or last.result != PASSED:
            return None
        reboots = self.reboots()
        if reboots and reboots[-1].time > last.time:
            return None
        if any(c.time > last.time for c in self.convictions()):
            return None
        return last

    def marked_replace(self) -> Event | None:
        return next((e for e in reversed(self._in_cycle("replace"))), None)

    def waiting_since(self) -> str | None:
        """When the node's current wait began: its last reboot's end or failed validation,
        else its drain (the time its validation is counted from)."""
        for event in reversed(self.cycle()):
            if event.kind == "reboot" and event.result in ("done", "failed"):
                return event.time
            if event.kind == "validate" and event.result not in (PASSED, "started"):
                return event.time
            if event.kind == "drain":
                return event.time
        drain = self.last_drain()
        return drain.time if drain else None
