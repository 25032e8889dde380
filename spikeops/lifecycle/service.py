"""One cluster's node lifecycle, end to end: what ``spikeops nodes ...`` and the node-lifecycle
flow call. The decisions are ``spikeops.lifecycle.plan``'s; this module does the I/O around
them: the scheduler (reads, reboots, releases, reasons), the ledger (every step recorded), SSH
(validation) and Slack (each outcome, with its evidence).

Safety, as everywhere in spikeops (docs/schedulers.md): only nodes spikeops drained are
rebooted, validated or released (NHC's rule: the scheduler's own verdicts, ``policy.py``);
nothing is released without a passing validation recorded since its drain, unless a person
forces it with a reason (``force-release``, audited); a node marked for replacement is never
released by spikeops on its own.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spikeops.config import ClusterConfig, SpikeopsConfig, lifecycle_policy, load_config
from spikeops.errors import InputError
from spikeops.inventory import fold_nodes
from spikeops.lifecycle.checks import CHECKS, DEFAULT_ALLREDUCE, DEFAULT_TIMEOUTS, CheckContext
from spikeops.lifecycle.plan import Step, incident_of_reason, next_step
from spikeops.lifecycle.record import NodeRecord
from spikeops.lifecycle.validate import Validation

__all__ = ["ClusterLife", "NodeView", "NodeOutcome", "who", "choose_cluster"]


def who() -> str:
    """The person at the command line (``sudo`` keeps who it was)."""
    try:
        name = os.environ.get("SUDO_USER") or getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in a container
        name = os.environ.get("USER") or "unknown"
    return name


def choose_cluster(config: SpikeopsConfig, name: str | None) -> ClusterConfig:
    if name is None:
        if len(config.clusters) != 1:
            raise InputError("name the cluster (--cluster): " + (", ".join(config.clusters) or
                                                                   f"none configured in {config.path or 'spikeops.toml'}"))
        name = next(iter(config.clusters))
    cluster = config.clusters.get(name)
    if cluster is None:
        raise InputError(f"cluster {name!r} is not configured in {config.path or 'spikeops.toml'}")
    return cluster


@dataclass
class NodeView:
    """A node as the lifecycle sees it: the scheduler's view, the ledger's record, the next step."""

    node: str
    scheduler_node: Any
    record: NodeRecord
    step: Step

    def to_json(self, now: datetime | None = None) -> dict[str, Any]:
        sched = self.scheduler_node
        return {"node": self.node, "scheduler_state": getattr(sched, "state", None),
                "reason": getattr(sched, "reason", None), "lifecycle": self.record.state(now),
                "next": self.step.to_json(),
                "convictions": len(self.record.convictions())}


@dataclass
class NodeOutcome:
    """What one lifecycle action did to one node (``outcome`` as the scheduler's: done,
    nothing-to-do, refused, failed, dry-run; validations: passed or failed)."""

    node: str
    action: str
    outcome: str
    detail: str
    validation: Validation | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.action} {self.node}: {self.outcome} ({self.detail})"

    def to_json(self) -> dict[str, Any]:
        out = {"node": self.node, "action": self.action, "outcome": self.outcome, "detail": self.detail, **self.extra}
        if self.validation is not None:
            out["validation"] = self.validation.to_json()
        return out


def _scheduler_nodes(scheduler: Any) -> dict[str, Any]:
    return scheduler.show_nodes()[0] if hasattr(scheduler, "show_nodes") else scheduler.nodes()


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


class ClusterLife:
    """The lifecycle of one configured cluster (module docstring). ``by`` is who acts: a
    person at the command line, or ``spikeops node-lifecycle``."""

    def __init__(self, config: SpikeopsConfig, cluster: ClusterConfig, *, by: str, dry_run: bool = False,
                 log_path: str | Path | None = None, scheduler: Any = None, ledger: Any = None) -> None:
        from spikeops.schedulers import open_scheduler
        from spikeops.schedulers.base import default_log_path

        self.config, self.cluster, self.by, self.dry_run = config, cluster, by, dry_run
        self.name = cluster.name
        self.policy = lifecycle_policy(cluster)
        self.scheduler = scheduler or open_scheduler(cluster.scheduler, log_path=log_path or default_log_path(),
                                                     dry_run=dry_run, state_dir=cluster.scheduler_state_dir)
        self._ledger = ledger

    @classmethod
    def open(cls, config_path: str | None, cluster: str | None, **kwargs: Any) -> ClusterLife:
        config = load_config(config_path)
        return cls(config, choose_cluster(config, cluster), **kwargs)

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def ledger(self) -> Any:
        if self._ledger is None:
            from spikeops.ledger.store import Ledger

            self._ledger = Ledger(self.config.ledger_url)
        return self._ledger

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()

    def __enter__(self) -> ClusterLife:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def note(self, node: str, kind: str, result: str, detail: str, *, incident: str | None = None,
             cause: str | None = None, evidence: Any = None, by: str | None = None) -> None:
        """One event of the node's record (nothing is written in a dry run)."""
        if self.dry_run:
            return
        self.ledger.node_event({"cluster": self.name, "node": node, "kind": kind, "result": result,
                                "by": (by or self.by)[:200], "detail": detail[:4000], "for_incident": incident,
                                "cause": cause, "evidence": evidence})

    def tell(self, node: str, key: str, text: str) -> dict[str, Any]:
        """One Slack message about a node (each its own: a folder per message under the
        incidents directory's ``_nodes/CLUSTER/NODE/``, where the outbox lands offline)."""
        from spikeops.notify import SlackNotifier

        import re

        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", node).lstrip(".") or "_"  # a node name is never a path
        folder = Path(self.config.incidents_dir).expanduser() / "_nodes" / self.name / safe / f"{key}-{stamp}"
        delivery = SlackNotifier(folder, channel=self.cluster.slack_channel).stage(key, text)
        return {"posted": delivery.posted, "error": delivery.error, "folder": str(folder)}

    # -- reading ------------------------------------------------------------------------------
    def nodes_now(self) -> dict[str, Any]:
        return _scheduler_nodes(self.scheduler)

    def records(self, nodes: Iterable[str]) -> dict[str, NodeRecord]:
        rows = self.ledger.cluster_node_events(self.name, list(nodes))
        return {node: NodeRecord.from_rows(node, self.name, events) for node, events in rows.items()}

    def record(self, node: str) -> NodeRecord:
        return self.records([node])[node]

    def _incident_open(self, scheduler_node: Any) -> bool:
        incident = incident_of_reason(getattr(scheduler_node, "reason", None))
        if not incident:
            return False
        row = self.ledger.incident(incident)
        return row is not None and row.get("cause") is None

    def survey(self, nodes: Sequence[str] | None = None, *, now: datetime | None = None) -> list[NodeView]:
        """The nodes spikeops drained (or exactly ``nodes``), with their record and next step."""
        now = now or _now()
        state = self.nodes_now()
        if nodes is None:
            names = sorted(name for name, node in state.items() if node.drained_by_spikeops)
        else:
            strangers = [n for n in nodes if n not in state]
            if strangers:
                raise InputError(f"not in the cluster {self.name}: {fold_nodes(strangers)}")
            names = list(nodes)
        records = self.records(names)
        return [NodeView(name, state.get(name), records[name],
                         next_step(records[name], state.get(name), self.policy, now,
                                   incident_open=self._incident_open(state.get(name))))
                for name in names]

    # -- keeping the record true ----------------------------------------------------------------
    def observe(self, views: Sequence[NodeView]) -> list[str]:
        """What happened since the last look, into the ledger: a node spikeops drained that the
        ledger holds no open cycle for (its incident's entry not written yet, or a drain older
        than the ledger), and a reboot that ended. Returns one line per change."""
        lines = []
        for view in views:
            node = view.scheduler_node
            if node is None or not node.drained_by_spikeops:
                continue
            cycle = view.record.cycle()
            if not cycle or cycle[-1].kind in ("release", "force-release") or view.record.last_drain() is None:
                incident = incident_of_reason(node.reason)
                self.note(view.node, "drain", "seen", f"found drained by spikeops: {node.reason}", incident=incident,
                          by="spikeops lifecycle")
                lines.append(f"{view.node}: drained by spikeops ({node.reason}), now in the ledger")
            pending = view.record.pending_reboot()
            if pending is not None:
                lines.extend(self._reboot_progress(view.node, pending))
        return lines

    def _reboot_progress(self, node: str, pending: Any) -> list[str]:
        before = (pending.evidence or {}).get("boot_before") if isinstance(pending.evidence, dict) else None
        status, detail = self.scheduler.reboot_status(node, before)
        if status == "rebooting":
            return []
        result = {"done": "done", "failed": "failed"}.get(status, "failed")
        self.note(node, "reboot", result, detail, incident=pending.incident, cause=pending.cause,
                  evidence={"boot_before": before, "status": status}, by="spikeops lifecycle")
        if status == "done":
            self.tell(node, "rebooted", f"{node} ({self.name}) rebooted and is back drained: {detail}. It is validated "
                                        "next (docs/lifecycle.md)")
        else:
            self.tell(node, "reboot-failed", f"{node} ({self.name}): the reboot did not complete ({detail}). It stays "
                                             "out of service; a person looks at it")
        return [f"{node}: reboot {result} ({detail})"]

    # -- acting ---------------------------------------------------------------------------------
    def reboot(self, nodes: Sequence[str], *, why: str = "", approved_by: str | None = None) -> list[NodeOutcome]:
        """Reboot nodes spikeops drained into their drain (the scheduler refuses any other)."""
        records = self.records(nodes)
        outcomes = []
        for node in nodes:
            record = records[node]
            conviction = record.cycle_conviction()
            evidence = record.conviction_evidence()
            cause = conviction.cause if conviction is not None else "node"
            incident = conviction.incident if conviction is not None else None
            reason = f"{cause} reboot" + (f" ({', '.join(f'Xid {x}' for x in evidence.xids)})"
                                          if evidence and evidence.xids else "")
            result = self.scheduler.reboot([node], reason, incident)[0]
            outcome = NodeOutcome(node, "reboot", result.outcome, result.detail)
            if result.outcome == "done":
                by = self.by + (f" (approved by {approved_by})" if approved_by else "")
                because = why or (evidence.reset if evidence and evidence.reset else "") or result.detail
                self.note(node, "reboot", "requested", because, incident=incident, cause=cause,
                          evidence={"boot_before": result.extra.get("boot_before")}, by=by)
                self.tell(node, "reboot", f"{node} ({self.name}) is rebooting into its drain: "
                                          f"{evidence.describe() if evidence else cause}"
                                          + (f" ({evidence.reset})" if evidence and evidence.reset else "")
                                          + (f"; approved by {approved_by}" if approved_by else ""))
                pending = self.record(node).pending_reboot()
                if pending is not None:  # a scheduler that reboots at once (the local one) is done already
                    for line in self._reboot_progress(node, pending):
                        outcome.detail += f"; {line}"
            outcomes.append(outcome)
        return outcomes

    def _context(self, record: NodeRecord, peer: str | None, inventory: Any) -> CheckContext:
        conviction = record.cycle_conviction()
        drain_smi = None
        if conviction is not None and conviction.incident:
            row = self.ledger.incident(conviction.incident)
            bundle = Path(str(row["bundle"])) if row and row.get("bundle") else None
            if bundle is not None and "/" not in record.node and not record.node.startswith("."):
                try:
                    drain_smi = (bundle / "nodes" / record.node / "nvidia-smi-q.txt").read_text(
                        encoding="utf-8", errors="replace") or None
                except OSError:
                    drain_smi = None
        marks = [e.moment() for e in (record.last_drain(), record.rebooted()) if e is not None]
        since = max((m for m in marks if m is not None), default=None)
        timeouts = {**DEFAULT_TIMEOUTS, "control": self.cluster.control_timeout_s,
                    **(self.cluster.validation_timeouts or {})}
        return CheckContext(node=record.node, gpus_expected=inventory.gpus_per_node, drain_smi=drain_smi,
                            evidence=record.conviction_evidence(), since=since, rebooted=record.rebooted() is not None,
                            control_command=self.cluster.control_command, peer=peer,
                            allreduce_command=tuple(self.cluster.allreduce_command or DEFAULT_ALLREDUCE),
                            allreduce_min_busbw=self.cluster.allreduce_min_busbw, timeouts=timeouts)

    def _peer(self, node: str, inventory: Any) -> str | None:
        """An idle node in service, in the inventory, to run the AllReduce with."""
        try:
            idle = [n for n in self.scheduler.idle_nodes() if n != node and n in set(inventory.nodes)]
        except Exception:  # noqa: BLE001 - no peer is a check that cannot run, not a crash
            return None
        return sorted(idle)[0] if idle else None

    def validate(self, nodes: Sequence[str], *, say: Callable[[str], None] | None = None,
                 notify: bool = False) -> list[NodeOutcome]:
        """Run the cluster's checks on each node spikeops drained; every validation is recorded
        (``validate`` ``started``, then ``passed`` or ``failed`` with each check's result)."""
        from spikeops.collect.ssh import Connector
        from spikeops.inventory import load_inventory, resolve_targets
        from spikeops.lifecycle.validate import validate_node
        from spikeops.schedulers.policy import rebooting

        inventory = load_inventory(self.cluster.inventory)
        state = self.nodes_now()
        checks = list(self.cluster.validation or CHECKS)
        records = self.records(nodes)
        outcomes: list[NodeOutcome] = []
        connector = Connector(inventory.ssh.connect_timeout)
        try:
            for node in nodes:
                current = state.get(node)
                if current is None:
                    outcomes.append(NodeOutcome(node, "validate", "refused", f"not in the cluster {self.name}"))
                    continue
                if not current.drained_by_spikeops:
                    owner = current.reason or "no reason"
                    outcomes.append(NodeOutcome(node, "validate", "refused", f"{current.state} ({owner}): not drained "
                                                "by spikeops, left alone (validation runs stress tests on the node)"))
                    continue
                if rebooting(current):
                    outcomes.append(NodeOutcome(node, "validate", "refused", f"{current.state}: a reboot is in progress"))
                    continue
                if node not in inventory.nodes:
                    outcomes.append(NodeOutcome(node, "validate", "refused", f"not in the inventory "
                                                f"{self.cluster.inventory}: spikeops connects only to listed nodes"))
                    continue
                record = records[node]
                conviction = record.cycle_conviction()
                incident = conviction.incident if conviction is not None else incident_of_reason(current.reason)
                ctx = self._context(record, self._peer(node, inventory), inventory)
                if self.dry_run:
                    outcomes.append(NodeOutcome(node, "validate", "dry-run", f"would run {', '.join(checks)}"
                                                + (f" (AllReduce with {ctx.peer})" if ctx.peer else "")))
                    continue
                self.note(node, "validate", "started", f"checks: {', '.join(checks)}", incident=incident)
                target = resolve_targets(inventory, [node])[node]
                validation = validate_node(connector, target, ctx, checks, say=say)
                result = "passed" if validation.passed else "failed"
                self.note(node, "validate", result, validation.summary(), incident=incident,
                          cause=conviction.cause if conviction else None, evidence=validation.to_json())
                outcome = NodeOutcome(node, "validate", result, validation.summary(), validation=validation)
                outcomes.append(outcome)
                if notify:
                    self.tell(node, f"validation-{result}", _validation_message(self.name, validation))
        finally:
            connector.close()
        return outcomes

    def release(self, nodes: Sequence[str], *, force: bool = False, reason: str | None = None,
                approved_by: str | None = None, notify: bool = False) -> list[NodeOutcome]:
        """Put nodes back in service: only with a passing validation since their drain and no
        replacement mark, unless ``force`` with a ``reason`` (recorded as ``force-release``)."""
        if force and not (reason and reason.strip()):
            raise InputError("--force needs --reason: who overrode the validation, and why, goes into the ledger")
        records = self.records(nodes)
        state = self.nodes_now()
        outcomes: list[NodeOutcome] = []
        now = _now()
        for node in nodes:
            record = records[node]
            current = state.get(node)
            if current is None:
                outcomes.append(NodeOutcome(node, "release", "refused", f"not in the cluster {self.name}"))
                continue
            why_not = None
            if current.drained_by_spikeops:
                why_not = _release_gate(record, self.policy, now)
            if why_not is not None and not force:
                outcomes.append(NodeOutcome(node, "release", "refused", why_not))
                continue
            result = self.scheduler.release([node])[0]
            outcome = NodeOutcome(node, "release", result.outcome, result.detail)
            if result.outcome == "done":
                conviction = record.cycle_conviction()
                incident = conviction.incident if conviction else None
                passed = record.passed()
                if why_not is not None:
                    detail = f"forced: {reason.strip()} (overrode: {why_not})"
                    self.note(node, "force-release", "done", detail, incident=incident)
                    outcome.detail = detail
                    self.tell(node, "force-release", f"{node} ({self.name}) was put back in service by {self.by} "
                                                     f"WITHOUT a passing validation: {reason.strip()} (overrode: {why_not})")
                else:
                    by = self.by + (f" (approved by {approved_by})" if approved_by else "")
                    detail = f"validation passed at {passed.time}" if passed else "released"
                    self.note(node, "release", "done", detail, incident=incident, by=by)
                    if notify:
                        self.tell(node, "released", f"{node} ({self.name}) is back in service: its validation passed "
                                                    f"at {passed.time if passed else '?'}"
                                                    + (f"; approved by {approved_by}" if approved_by else ""))
            outcomes.append(outcome)
        return outcomes

    def decline(self, node: str, action: str, by: str, why: str) -> None:
        """A person's no to a reboot or a release: recorded, so it is not asked again in this
        cycle (the reboot is skipped, validation alone judges; the release waits for a person)."""
        record = self.record(node)
        conviction = record.cycle_conviction()
        self.note(node, action, "declined", why, incident=conviction.incident if conviction else None, by=by)

    def mark_replace(self, node: str, why: str) -> NodeOutcome:
        """A repeat offender: its drain reason says so, the ledger records ``replace``, Slack is
        told; it is never released automatically."""
        record = self.record(node)
        counted = [c.incident for c in record.convictions()]
        result = self.scheduler.set_reason([node], f"REPLACE: {why}"[:200])[0]
        outcome = NodeOutcome(node, "replace", result.outcome, result.detail)
        if result.outcome in ("done", "nothing-to-do"):
            self.note(node, "replace", "marked", why, evidence={"convictions": counted},
                      incident=(record.cycle_conviction().incident if record.cycle_conviction() else None))
            self.tell(node, "replace", f"{node} ({self.name}) is MARKED FOR REPLACEMENT: {why}. It stays drained; "
                                       f"spikeops will not release it (`spikeops nodes history {node}`)")
        return outcome


def _release_gate(record: NodeRecord, policy: Any, now: datetime) -> str | None:
    """Why a node spikeops drained may not be released now (None: it may)."""
    from spikeops.lifecycle.record import lemon_convictions

    marked = record.marked_replace()
    if marked is not None:
        return f"marked for replacement ({marked.detail}): a repeat offender is never released without --force"
    counted = lemon_convictions(record.convictions(), window_s=policy.lemon_window_s, now=now,
                                doubted=record.doubted_incidents())
    if len(counted) >= policy.lemon_threshold:
        return (f"{len(counted)} convictions within {policy.lemon_window_s // 86400} days "
                f"({', '.join(str(c.incident) for c in counted)}): a repeat offender, to be replaced")
    if record.passed() is not None:
        return None
    last = record.last_validation()
    pending = record.pending_reboot()
    if pending is not None:
        return "its reboot has not finished, and it has not been validated since"
    if last is None:
        return "no validation since its drain: run `spikeops nodes validate` first"
    if last.result == "passed":
        return f"its last validation ({last.time}) is older than its last reboot or conviction"
    return f"its last validation since the drain did not pass ({last.time}: {(last.detail or '')[:200]})"


def _validation_message(cluster: str, validation: Validation) -> str:
    """A validation's outcome, with its evidence, for Slack."""
    head = (f"{validation.node} ({cluster}) passed validation" if validation.passed else
            f"{validation.node} ({cluster}) FAILED validation: it stays drained")
    lines = [head + f" ({validation.seconds:.0f} s)"]
    for check in validation.checks:
        lines.append(f"- {check.name}: {check.verdict}, {check.detail[:300]}")
        if check.verdict not in ("passed", "skipped") and check.tail.strip():
            tail = [line for line in check.tail.strip().splitlines() if line.strip()][-3:]
            lines.extend(f"    > {line[:200]}" for line in tail)
    for note in validation.notes:
        lines.append(f"({note})")
    return "\n".join(lines)

