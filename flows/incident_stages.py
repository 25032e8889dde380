"""The incident flow's stages, each a function over one ``Incident``: what the flow knows so
far (its settings, bundle, Slack thread and ledger memory; the symptom, the diagnosis, the
resume plan; what was done). ``flows/incident_response.py`` calls them in order.

A stage does I/O only through the tasks in ``tasks/`` and decides nothing itself: the
decisions (the rapid-response matrix, the approval policy, whether to resume) are the pure
functions of ``spikeops.response``. A diagnosis and its resume plan change together, in
``Incident.diagnosed`` (the replay's re-diagnosis replaces both there, and nowhere else).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.config import IncidentSettings
from spikeops.notify.messages import approval_markdown
from spikeops.remediation import ResumePlan, resume_plan
from spikeops.response import approval_gate, outcome_summary
from spikeops.tasks.approve import ask_approval
from spikeops.tasks.baselines import bundle_baselines
from spikeops.tasks.classify import classify_symptom
from spikeops.tasks.collect import finish_incident_collection, start_incident_collection
from spikeops.tasks.concurrency import IncidentSlots
from spikeops.tasks.diagnose import diagnose_incident, summary_line
from spikeops.tasks.incident import open_incident
from spikeops.tasks.ledger import IncidentMemory, Lineage
from spikeops.tasks.notify import tell_outcome, write_report_artifact
from spikeops.tasks.protect import protect_run
from spikeops.tasks.replay import replay_gate, tell_replay
from spikeops.tasks.resume import isolate_and_resume
from spikeops.tasks.runinfo import label_run, run_url
from spikeops.tasks.scheduler import SchedulerRef

__all__ = [
    "Incident",
    "open_stage",
    "classify_and_collect",
    "protect",
    "gather",
    "diagnose",
    "replay",
    "decide",
    "isolate_and_resume_stage",
    "tell",
]


@dataclass
class Incident:
    """One incident as the flow carries it from stage to stage."""

    settings: IncidentSettings
    slots: IncidentSlots
    logger: Any
    scheduler: SchedulerRef
    incident: str
    bundle: str
    doc: dict[str, Any]
    memory: IncidentMemory
    notifier: Any = None
    links: dict[str, str] | None = None
    symptom: dict[str, Any] = field(default_factory=dict)
    collecting: Any = None
    protection: Any = None
    stopped: bool = False
    diagnosis: dict[str, Any] = field(default_factory=dict)
    plan: ResumePlan | None = None
    gate: Any = None
    approved: bool = False
    why: str = ""
    outcome: dict[str, Any] = field(default_factory=dict)

    @property
    def job(self) -> str:
        return self.settings.job_id

    @property
    def skip(self) -> set[str]:
        return set(self.settings.skip)

    @property
    def key(self) -> str:
        """The artifacts' key suffix (Prefect wants lowercase)."""
        return self.incident.lower()

    def diagnosed(self, diagnosis: dict[str, Any]) -> None:
        """A diagnosis, and with it the resume plan, the run's label and the outcome's view
        of both."""
        self.diagnosis = diagnosis
        self.outcome["diagnosis"] = {
            k: diagnosis.get(k) for k in ("primary", "culprit_nodes", "resume_from")
        }
        label_run(
            self.job, (diagnosis.get("primary") or {}).get("cause"), cluster=self.settings.cluster
        )
        self.plan = resume_plan(diagnosis.get("actions") or [], diagnosis.get("findings") or [])
        self.outcome["remediation"] = {
            "env": self.plan.env,
            "applied": self.plan.applied,
            "for_a_person": self.plan.for_a_person,
        }

    def ask(self, gate: Any, diagnosis: dict[str, Any] | None = None) -> tuple[bool, str]:
        """Put ``gate``'s question to a person (or the policy), with what it approves."""
        plan, settings = self.plan, self.settings
        return ask_approval(
            gate,
            timeout_s=settings.approval_timeout_s,
            bundle=self.bundle,
            job_id=self.job,
            incident=self.incident,
            description=approval_markdown(
                gate.question,
                diagnosis or self.diagnosis,
                remediation=plan.describe(),
                for_a_person=plan.for_a_person,
                timeout_s=settings.approval_timeout_s,
            )
            + self.memory.approval_note(),
            notifier=self.notifier,
            logger=self.logger,
            slots=self.slots,
            links=self.links,
        )


def open_stage(
    settings: IncidentSettings, slots: IncidentSlots, logger: Any, lineage: Lineage
) -> Incident:
    """The bundle (a rerun continues it), the Slack thread, and the ledger's memory: the
    lineage's earlier incidents into history.json, this one into the ledger."""
    from spikeops.notify import SlackNotifier

    scheduler = SchedulerRef(settings.scheduler, settings.scheduler_state_dir, settings.dry_run)
    incident, bundle = open_incident(
        settings.job_id,
        settings.run_dir,
        settings.incidents_dir,
        scheduler,
        settings.incident_id,
        settings.alert,
    )
    notifier = (
        None if "notify" in settings.skip else SlackNotifier(bundle, channel=settings.slack_channel)
    )
    links = {"flow_run": url} if (url := run_url()) else None
    memory = IncidentMemory(
        settings, lineage, incident, bundle, notifier=notifier, logger=logger, links=links
    )
    memory.opened()
    doc = json.loads((Path(bundle) / "incident.json").read_text())
    return Incident(
        settings,
        slots,
        logger,
        scheduler,
        incident,
        bundle,
        doc,
        memory,
        notifier,
        links,
        outcome={"incident": incident, "bundle": bundle, "actions": []},
    )


def classify_and_collect(state: Incident) -> None:
    """The symptom first (a tenth of a second of CPU, before the collection's threads compete
    for it), then the collection starts: the nodes answer while the run is protected, and
    nothing waits for them until the diagnosis. The thread opens with the symptom."""
    settings = state.settings
    state.symptom = state.outcome["symptom"] = classify_symptom(state.bundle)
    if "collect" not in state.skip:
        state.collecting = start_incident_collection(
            settings.inventory,
            state.job,
            state.bundle,
            list(state.doc["job"]["nodes"] or []),
            state.incident,
            dask_scheduler=settings.dask_scheduler,
        )
    label_run(state.job, state.symptom["symptom"], cluster=settings.cluster)
    if state.notifier:
        state.notifier.open(
            state.doc,
            symptom=state.symptom["symptom"],
            spike_step=state.symptom["spike_step"],
            links=state.links,
        )


def protect(state: Incident) -> None:
    """The seed's matrix: stop at once for a NaN (beside the collection: a job's grace can be
    long), watch a single spike, keep a hung job alive until its stacks are collected."""
    if "protect" in state.skip:
        return
    settings = state.settings
    state.protection = protect_run(
        state.job,
        state.scheduler,
        state.bundle,
        state.incident,
        state.symptom,
        run_dir=settings.run_dir,
        observe_steps=settings.observe_steps,
        observe_timeout_s=settings.observe_timeout_s,
        notifier=state.notifier,
    )
    if state.protection.observed is not None:
        state.outcome["observed"] = state.protection.observed


def gather(state: Incident) -> None:
    """The collection's results, then a hung job's stop, and the nodes' baselines beside them
    (counters are read as growth since the last healthy capture)."""
    if state.collecting is not None:
        finish_incident_collection(state.collecting, notifier=state.notifier)
    if state.protection is not None:
        state.protection.collected(state.notifier)
    if state.settings.baseline_dir:
        nodes = list(state.doc["job"]["nodes"] or [])
        state.logger.info(
            "baselines: %s",
            "; ".join(bundle_baselines(state.settings.baseline_dir, state.bundle, nodes)),
        )


def diagnose(state: Incident) -> None:
    """The four layers, the checkpoint to resume from, the thread told; then the stop settles
    (nothing is decided before the job is stopped)."""
    state.diagnosed(
        diagnose_incident(
            state.bundle,
            state.settings.checkpoint_root,
            dry_run=state.settings.dry_run,
            artifact_key=f"findings-{state.key}"[:100],
        )
    )
    state.logger.info("diagnosis: %s", summary_line(state.diagnosis))
    if state.notifier:
        state.notifier.diagnosis(state.diagnosis, state.doc, links=state.links)
    if state.protection is not None:
        done, state.stopped = state.protection.settle(state.notifier)
        state.outcome["actions"] += done


def replay(state: Incident) -> None:
    """A spike with no conclusive hardware cause is re-run on its nodes and on others; what the
    replays say is diagnosed again, and replaces the diagnosis and its plan."""
    settings = state.settings
    replayed = replay_gate(
        state.job,
        state.scheduler,
        state.bundle,
        state.incident,
        state.diagnosis,
        policy=settings.replay,
        max_steps=settings.replay_steps,
        timeout_s=settings.replay_timeout_s,
        stopped=state.stopped,
        ask=state.ask,
        notifier=state.notifier,
        logger=state.logger,
        links=state.links,
    )
    if replayed is None:
        return
    state.outcome["replay"] = replayed
    if replayed["ran"]:
        state.diagnosed(
            diagnose_incident(
                state.bundle,
                settings.checkpoint_root,
                dry_run=settings.dry_run,
                artifact_key=f"findings-{state.key}"[:100],
            )
        )
        replayed["verdict"] = tell_replay(
            state.bundle, state.diagnosis, replayed, state.notifier, links=state.links
        )


def decide(state: Incident) -> None:
    """The approval gate: the cluster's policy, then the ledger's rules over it (the restart
    budget, never the same checkpoint with the same plan); asked of a person when it says so,
    while the report waits as an artifact."""
    state.memory.diagnosed(
        state.diagnosis
    )  # a suspect checkpoint quarantined, a conviction in doubt said
    can_resume = "resume" not in state.skip
    gate = approval_gate(
        state.settings.approval,
        state.diagnosis,
        stopped=state.stopped,
        can_isolate="isolate" not in state.skip,
        can_resume=can_resume,
        remediation=state.plan.describe(),
        replayed=((state.outcome.get("replay") or {}).get("verdict") or {}).get("verdict"),
    )
    state.gate = state.memory.gate(
        gate, state.diagnosis, state.plan.env, stopped=state.stopped, can_resume=can_resume
    )
    if state.gate.ask:
        write_report_artifact(
            state.bundle, state.diagnosis, state.doc, key=f"report-{state.key}"[:100]
        )
    state.approved, state.why = state.ask(state.gate)
    if state.gate.action is not None:
        state.outcome["approval"] = state.why
    if state.gate.action == "isolate" and not state.approved and state.notifier:
        state.notifier.stage("isolate", f"not isolated: {state.why}", links=state.links)


def isolate_and_resume_stage(state: Incident) -> None:
    """Drain what the approved diagnosis convicts, and resume without it from the verified
    checkpoint with the plan's environment."""
    plan = state.plan
    done = isolate_and_resume(
        state.job,
        state.scheduler,
        state.bundle,
        state.incident,
        state.diagnosis,
        state.gate,
        state.approved,
        state.why,
        stopped=state.stopped,
        can_resume="resume" not in state.skip,
        env=plan.env,
        remediation=plan.describe(),
        for_a_person=plan.for_a_person,
        notifier=state.notifier,
        links=state.links,
    )
    state.outcome["actions"] += done["actions"]
    state.stopped = done["stopped"]
    for name in ("resumed", "rolled_back"):
        if done[name]:
            state.outcome[name] = done[name]


def tell(state: Incident) -> dict[str, Any]:
    """The outcome, its cost and ledger entry, the report and the thread's summary."""
    outcome, plan = state.outcome, state.plan
    outcome["summary"] = outcome_summary(outcome.get("resumed"), stopped=state.stopped)
    outcome["lost"] = state.memory.close(outcome, stopped=state.stopped)
    tell_outcome(
        state.bundle,
        state.notifier,
        state.diagnosis,
        state.doc,
        summary=outcome["summary"],
        resumed=(outcome.get("resumed") or {}).get("outcome") in ("done", "nothing-to-do"),
        recommended=plan.applied + plan.for_a_person,
        artifact_key=f"report-{state.key}"[:100],
        links=state.links,
    )
    return outcome
