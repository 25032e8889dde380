"""The incident flow: the seed's pipeline, one stage per call.

open the incident -> classify the symptom -> protect the run -> collect the evidence ->
diagnose -> decide (the approval gate) -> isolate and resume -> tell.

Each stage lives in ``tasks/`` under its name; the decisions (the rapid-response matrix, the
approval policy, whether to resume) are pure functions in ``spikeops.response``. Every stage
is idempotent on its own terms, so a rerun of the same incident (same ``incident_id``)
continues rather than repeats: the bundle is reused, a stopped job is nothing to do, a node
already drained by spikeops is nothing to do, a resume finds the job it already submitted,
and Slack continues the thread without posting a stage twice.

Safety first: nodes are drained only when the diagnosis convicts them and a person approves
(or the policy auto-approves a confident hardware fault); a job is resumed only from a
checkpoint that verified; ``dry_run`` runs everything read-only and says what it would do.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field, field_validator

from spikeops.config import JOB_ID
from spikeops.remediation import resume_plan
from spikeops.response import approval_gate, outcome_summary
from tasks.approve import Approval, ask_approval
from tasks.baselines import bundle_baselines
from tasks.classify import classify_symptom
from tasks.collect import collect_incident
from tasks.concurrency import one_incident_per_job
from tasks.diagnose import diagnose_incident
from tasks.incident import open_incident
from tasks.notify import tell_failure, tell_outcome
from tasks.protect import protect_run
from tasks.resume import isolate_and_resume
from tasks.scheduler import SchedulerRef

__all__ = ["IncidentParams", "Approval", "incident_response", "STAGES"]

STAGES = ("protect", "collect", "diagnose", "isolate", "resume", "notify")


class IncidentParams(BaseModel):
    """What the flow needs; validated, so the UI's custom-run form refuses nonsense."""

    job_id: str = Field(description="the scheduler's job id")
    inventory: str = Field(description="cluster inventory file (docs/inventory.md)")
    run_dir: str = Field(description="where the job's spikeops.train files are (metrics.jsonl, batches.jsonl...)")
    checkpoint_root: str | None = Field(None, description="directory holding the job's checkpoints")
    incidents_dir: str = Field("~/.local/state/spikeops/incidents", description="where bundles are written")
    incident_id: str | None = Field(None, description="reuse an incident (idempotent rerun); default: derived")
    scheduler: Literal["slurm", "local"] = "slurm"
    scheduler_state_dir: str | None = Field(None, description="the local scheduler's state directory")
    dry_run: bool = False
    skip: list[Literal["protect", "collect", "isolate", "resume", "notify"]] = Field(default_factory=list)
    approval: Literal["always", "auto-hardware", "never"] = Field(
        "always", description="always: a person approves every drain and every resume; auto-hardware: drains for "
        "a hardware fault at confidence >= 0.8 are auto-approved, others asked; never: never drain")
    approval_timeout_s: int = Field(3600, ge=1, le=7 * 86400)
    slack_channel: str | None = None
    observe_steps: int = Field(50, ge=0, le=10_000, description="after a single spike: steps to watch before deciding")
    observe_timeout_s: int = Field(600, ge=0, le=86_400, description="... and the most seconds to wait for them")
    baseline_dir: str | None = Field(None, description="per-node baselines kept by the baseline deployment")
    alert: dict[str, Any] = Field(default_factory=dict)

    @field_validator("job_id")
    @classmethod
    def _job(cls, value: str) -> str:
        if not JOB_ID.match(value):
            raise ValueError("job id: letters, digits and _.:+- only")
        return value

    @field_validator("incident_id")
    @classmethod
    def _incident(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$", value):
            raise ValueError("incident id: letters, digits and _.- only")
        return value


@flow(name="incident-response", log_prints=True, on_failure=[tell_failure], on_crashed=[tell_failure])
def incident_response(params: IncidentParams) -> dict[str, Any]:
    """One incident, end to end. Returns what was found and done. Incidents of one job wait
    for each other (a per-job concurrency limit); incidents of different jobs run side by side."""
    with one_incident_per_job(params.job_id, timeout_s=params.approval_timeout_s + 3600):
        return _respond(params, get_run_logger())


def _respond(params: IncidentParams, logger: Any) -> dict[str, Any]:
    from spikeops.notify import SlackNotifier

    skip = set(params.skip)
    scheduler = SchedulerRef(params.scheduler, params.scheduler_state_dir, params.dry_run)
    # open
    incident, bundle = open_incident(params.job_id, params.run_dir, params.incidents_dir, scheduler,
                                     params.incident_id, params.alert)
    key = incident.lower()
    notifier = None if "notify" in skip else SlackNotifier(bundle, channel=params.slack_channel)
    incident_doc = json.loads((Path(bundle) / "incident.json").read_text())
    # classify
    symptom = classify_symptom(bundle)
    if notifier:
        notifier.open(incident_doc, symptom=symptom["symptom"], spike_step=symptom["spike_step"])
    outcome: dict[str, Any] = {"incident": incident, "bundle": bundle, "symptom": symptom, "actions": []}
    # protect
    stopped = False
    if "protect" not in skip:
        protected = protect_run(params.job_id, scheduler, bundle, incident, symptom, run_dir=params.run_dir,
                                observe_steps=params.observe_steps, observe_timeout_s=params.observe_timeout_s,
                                notifier=notifier)
        if protected["observed"] is not None:
            outcome["observed"] = protected["observed"]
        outcome["actions"] += protected["actions"]
        stopped = protected["stopped"]
    # collect
    nodes = list(incident_doc["job"]["nodes"] or [])
    if "collect" not in skip:
        collect_incident(params.inventory, params.job_id, bundle, nodes, incident, notifier=notifier)
    if params.baseline_dir:  # counters are read as growth since the nodes' last healthy capture
        logger.info("baselines: %s", "; ".join(bundle_baselines(params.baseline_dir, bundle, nodes)))
    # diagnose
    diagnosis = diagnose_incident(bundle, params.checkpoint_root, dry_run=params.dry_run,
                                  artifact_key=f"findings-{key}"[:100])
    outcome["diagnosis"] = {k: diagnosis.get(k) for k in ("primary", "culprit_nodes", "resume_from")}
    if notifier:
        notifier.diagnosis(diagnosis, incident_doc)
    plan = resume_plan(diagnosis.get("actions") or [], diagnosis.get("findings") or [])
    outcome["remediation"] = {"env": plan.env, "applied": plan.applied, "for_a_person": plan.for_a_person}
    # decide
    gate = approval_gate(params.approval, diagnosis, stopped=stopped, can_isolate="isolate" not in skip,
                         can_resume="resume" not in skip, remediation=plan.describe())
    approved, why = ask_approval(gate, params.approval_timeout_s, notifier, logger)
    if gate.action is not None:
        outcome["approval"] = why
    if gate.action == "isolate" and not approved and notifier:
        notifier.stage("isolate", f"not isolated: {why}")
    # isolate and resume
    done = isolate_and_resume(params.job_id, scheduler, bundle, incident, diagnosis, gate, approved, why,
                              stopped=stopped, can_resume="resume" not in skip, env=plan.env,
                              remediation=plan.describe(), for_a_person=plan.for_a_person, notifier=notifier)
    outcome["actions"] += done["actions"]
    stopped = done["stopped"]
    if done["resumed"] is not None:
        outcome["resumed"] = done["resumed"]
    if done["rolled_back"]:
        outcome["rolled_back"] = done["rolled_back"]
    # tell
    outcome["summary"] = outcome_summary(outcome.get("resumed"), stopped=stopped)
    tell_outcome(bundle, notifier, diagnosis, incident_doc, summary=outcome["summary"],
                 resumed=(outcome.get("resumed") or {}).get("outcome") in ("done", "nothing-to-do"),
                 recommended=plan.applied + plan.for_a_person, artifact_key=f"report-{key}"[:100])
    return outcome
