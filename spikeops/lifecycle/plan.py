"""What to do next with a drained node: the lifecycle's decisions, pure.

``next_step`` reads the node's ledger record (``spikeops.lifecycle.record``), what the
scheduler says of it now, and the cluster's policy, and answers with one ``Step``. The rules,
in order (docs/lifecycle.md):

1. **Hands off** anything spikeops did not drain: a node drained or downed by someone else,
   or no longer drained (NHC's rule; a person released it, or never drained it).
2. A **reboot in progress** is waited for.
3. Its incident is **still open** (the drain names an incident the ledger has not closed):
   wait, up to ``OPEN_INCIDENT_WAIT_S``, for the conviction and its evidence.
4. A node **marked for replacement** waits for a person, whatever its validations say.
5. The **lemon rule**: ``lemon_threshold`` convictions within ``lemon_window`` (the ones no
   recurrence put in doubt) mark it for replacement; it is never released automatically.
6. A **passing validation** since the drain (and since its last reboot and conviction) makes it
   releasable: released with a person's yes (``release = "ask"``) or by itself (``"auto"``).
7. A **reset-class conviction** (``spikeops.lifecycle.faults``) with no reboot in this cycle is
   rebooted into its drain first (``reboot = "auto"``), after a yes (``"ask"``), or not at all
   (``"never"``: validation alone judges; likewise once a person declined it). A reboot that
   failed is a person's to look at. A release a person declined is not asked again in the cycle.
8. Otherwise it is **validated** once its wait is over: ``validate_after`` after the drain (or
   the reboot's end), doubled after each failed validation in this cycle (at most a day).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from spikeops.lifecycle.record import NodeRecord, lemon_convictions

__all__ = ["ACTIONS", "REBOOT_POLICIES", "RELEASE_POLICIES", "LifecyclePolicy", "Step", "next_step",
           "incident_of_reason", "OPEN_INCIDENT_WAIT_S", "MAX_BACKOFF_S"]

ACTIONS = ("hands-off", "await-reboot", "hold", "replace", "release", "reboot", "validate", "wait")
REBOOT_POLICIES = ("ask", "auto", "never")
RELEASE_POLICIES = ("ask", "auto")
#: How long a node waits for its incident to close (its conviction to be recorded) before it
#: is handled without it.
OPEN_INCIDENT_WAIT_S = 6 * 3600
#: The longest wait between two validations of a node that keeps failing.
MAX_BACKOFF_S = 86400


@dataclass(frozen=True)
class LifecyclePolicy:
    """A cluster's lifecycle settings (``[clusters.NAME]`` in spikeops.toml)."""

    reboot: str = "ask"
    release: str = "ask"
    validate_after_s: int = 1800
    lemon_threshold: int = 2
    lemon_window_s: int = 30 * 86400

    def __post_init__(self) -> None:
        if self.reboot not in REBOOT_POLICIES:
            raise ValueError(f"reboot must be one of {', '.join(REBOOT_POLICIES)}")
        if self.release not in RELEASE_POLICIES:
            raise ValueError(f"release must be one of {', '.join(RELEASE_POLICIES)}")


@dataclass(frozen=True)
class Step:
    """One decision: ``action`` (one of ``ACTIONS``), why, whether a person must say yes first,
    and for ``wait`` when the wait ends."""

    action: str
    why: str
    ask: bool = False
    until: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "why": self.why, "ask": self.ask,
                "until": self.until.strftime("%Y-%m-%dT%H:%M:%SZ") if self.until else None}


def incident_of_reason(reason: str | None) -> str | None:
    """The incident a spikeops drain reason names (``spikeops: gpu_xid inc-…``)."""
    for word in (reason or "").replace("(", " ").replace(")", " ").split():
        if word.startswith("inc-"):
            return word.rstrip(",;:.")
    return None


def _span(seconds: int) -> str:
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min" if seconds < 7200 else f"{seconds / 3600:g} h"


def _owner(node: Any) -> str:
    reason = f" with reason {node.reason!r}" if getattr(node, "reason", None) else ""
    return f"{node.state}{reason}: not spikeops' drain, left alone"


def next_step(record: NodeRecord, node: Any, policy: LifecyclePolicy, now: datetime, *,
              incident_open: bool = False) -> Step:
    """The next step for one node (module docstring). ``node``: the scheduler's view (None:
    not in the cluster); ``incident_open``: the incident its drain names is in the ledger and
    not closed yet."""
    from spikeops.schedulers.policy import rebooting

    if node is None:
        return Step("hands-off", "not in the scheduler's node list")
    if not node.drained_by_spikeops:
        if node.drained or node.down:
            return Step("hands-off", _owner(node))
        return Step("hands-off", f"not drained ({node.state}): someone released it, or spikeops never drained it")
    if rebooting(node):
        return Step("await-reboot", f"{node.state}: the reboot has not finished")
    if record.pending_reboot() is not None:
        return Step("await-reboot", "a reboot was asked and its end is not recorded yet")
    drain = record.last_drain()
    if incident_open and drain is not None and (moment := drain.moment()) is not None \
            and now - moment < timedelta(seconds=OPEN_INCIDENT_WAIT_S):
        return Step("hold", f"its incident {incident_of_reason(node.reason)} is still open: waiting for the "
                            "conviction and its evidence")
    if record.state(now) == "validating":
        last = record.cycle()[-1]
        return Step("hold", f"a validation started at {last.time} ({last.by}) has not finished")
    marked = record.marked_replace()
    if marked is not None:
        return Step("hold", f"marked for replacement ({marked.detail or marked.result}): a person decides")
    counted = lemon_convictions(record.convictions(), window_s=policy.lemon_window_s, now=now,
                                doubted=record.doubted_incidents())
    if len(counted) >= policy.lemon_threshold:
        days = policy.lemon_window_s / 86400
        incidents = ", ".join(f"{c.incident} ({c.cause})" for c in counted)
        return Step("replace", f"{len(counted)} convictions in {days:g} days ({incidents}): a repeat offender, "
                               f"marked for replacement (lemon_threshold {policy.lemon_threshold})")
    passed = record.passed()
    if passed is not None:
        declined = record.declined_release()
        if declined is not None:
            return Step("hold", f"its release was declined by {declined.by} at {declined.time}: a person releases it")
        return Step("release", f"validation passed at {passed.time}", ask=policy.release == "ask")
    evidence = record.conviction_evidence()
    if evidence is not None and evidence.reset and not record.reboots() and policy.reboot != "never":
        return Step("reboot", f"{evidence.describe()}: {evidence.reset}", ask=policy.reboot == "ask")
    reboots = record.reboots()
    if reboots and reboots[-1].result == "failed":
        return Step("hold", f"its reboot failed ({reboots[-1].detail}): a person looks at it")
    since = record.waiting_since()
    started = datetime.fromisoformat(since.replace("Z", "+00:00")) if since else None
    failures = sum(1 for v in record.validations() if v.result != "passed")
    wait = min(policy.validate_after_s * (2 ** failures), MAX_BACKOFF_S) if failures else policy.validate_after_s
    if started is not None and now < started + timedelta(seconds=wait):
        due = started + timedelta(seconds=wait)
        what = f"after {failures} failed validation(s)" if failures else "after its drain" + (
            " and reboot" if record.rebooted() else "")
        return Step("wait", f"validated from {due:%Y-%m-%dT%H:%M:%SZ} ({_span(wait)} {what})", until=due)
    return Step("validate", "its wait is over" if started else "drained by spikeops, never validated")
