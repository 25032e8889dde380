"""The incident flow: the seed's pipeline, one stage per call.

preflight -> open the incident -> classify the symptom -> collect the evidence (started here,
gathered before the diagnosis) -> protect the run -> diagnose -> decide (the approval gate) ->
isolate and resume -> tell.

Each stage lives in ``tasks/`` under its name; the decisions (the rapid-response matrix, the
approval policy, whether to resume) are pure functions in ``spikeops.response``. Every stage
is idempotent on its own terms, so a rerun of the same incident (same ``incident_id``)
continues rather than repeats. Nodes are drained only when the diagnosis convicts them and a
person approves (or the policy auto-approves a confident hardware fault); a job is resumed
only from a checkpoint that verified; ``dry_run`` runs everything read-only.
"""

# No `from __future__ import annotations` here: a served run receives the flow object pickled
# (deployments/warm_start.py), and string annotations would be resolved against the pickled
# function's globals, which hold only the names its code uses (not `Annotated`, not the types).

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from spikeops.config import CLUSTER_NAME, JOB_ID, IncidentSettings
from spikeops.notify.messages import approval_markdown
from spikeops.remediation import resume_plan
from spikeops.response import approval_gate, outcome_summary
from spikeops.tasks.approve import ask_approval
from spikeops.tasks.baselines import bundle_baselines
from spikeops.tasks.classify import classify_symptom
from spikeops.tasks.collect import finish_incident_collection, start_incident_collection
from spikeops.tasks.concurrency import IncidentSlots
from spikeops.tasks.diagnose import diagnose_incident, summary_line
from spikeops.tasks.incident import open_incident
from spikeops.tasks.ledger import IncidentMemory, Lineage, find_lineage
from spikeops.tasks.notify import tell_failure, tell_outcome, write_report_artifact
from spikeops.tasks.preflight import incident_settings, preflight
from spikeops.tasks.protect import protect_run
from spikeops.tasks.replay import replay_gate, tell_replay
from spikeops.tasks.resume import isolate_and_resume
from spikeops.tasks.runinfo import current_run, incident_id_for, label_run, run_url
from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["IncidentOverrides", "incident_response", "STAGES"]

STAGES = ("protect", "collect", "diagnose", "isolate", "resume", "notify")
DESCRIPTION = """Respond to a loss spike or NaN in one training job: protect the run, collect the evidence
from every node, diagnose it layer by layer, drain the nodes the evidence convicts and resume from
the newest verified checkpoint, telling Slack at every step. Give the cluster and the job id;
everything else comes from spikeops.toml. Nothing is drained or resumed without approval unless
the cluster's policy says so."""


class IncidentOverrides(BaseModel):
    """Optional: each field replaces what spikeops.toml says for the cluster, for this run only."""

    inventory: str | None = Field(None, description="cluster inventory file (docs/inventory.md)")
    run_dir: str | None = Field(None, description="the job's spikeops.train files (metrics.jsonl...)")
    checkpoint_root: str | None = Field(None, description="directory holding the job's checkpoints")
    incidents_dir: str | None = Field(None, description="where incident bundles are written")
    incident_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
                                    description="continue an existing incident (an idempotent rerun)")
    scheduler: Literal["slurm", "local"] | None = None
    scheduler_state_dir: str | None = Field(None, description="the local scheduler's state directory")
    dry_run: bool = Field(False, description="read-only: say what would be done, do nothing")
    skip: list[Literal["protect", "collect", "isolate", "resume", "notify"]] = Field(default_factory=list)
    approval: Literal["always", "auto-hardware", "never"] | None = Field(
        None, description="always: a person approves every drain and resume; auto-hardware: confident hardware "
        "convictions are drained without asking; never: never drain")
    approval_timeout_s: int | None = Field(None, ge=1, le=7 * 86400, description="how long a person has to answer")
    slack_channel: str | None = None
    observe_steps: int | None = Field(None, ge=0, le=10_000, description="after a single spike: steps to watch")
    observe_timeout_s: int | None = Field(None, ge=0, le=86_400, description="... and the most seconds to wait")
    baseline_dir: str | None = Field(None, description="per-node baselines kept by the baseline deployment")
    replay: Literal["auto", "ask", "never"] | None = Field(
        None, description="re-run the spike window on the original and on other nodes before resuming")
    replay_steps: int | None = Field(None, ge=1, le=1_000_000, description="the most steps a replay may run")
    replay_timeout_s: int | None = Field(None, ge=10, le=7 * 86400, description="... and seconds for both")
    alert: dict[str, Any] = Field(default_factory=dict, description="the alert that started it (set by the receiver)")


@flow(name="incident-response", description=DESCRIPTION, log_prints=True,
      on_failure=[tell_failure], on_crashed=[tell_failure])
def incident_response(
    job_id: Annotated[str, Field(title="Job id", pattern=JOB_ID.pattern, description="the scheduler's job id")],
    cluster: Annotated[str | None, Field(title="Cluster", pattern=CLUSTER_NAME.pattern,
                                         description="one of the clusters of spikeops.toml")] = None,
    overrides: Annotated[IncidentOverrides | None, Field(title="Overrides (optional)")] = None,
) -> dict[str, Any]:
    """One incident, end to end; returns what was found and done."""
    given = (overrides or IncidentOverrides()).model_dump()
    settings = incident_settings(job_id, cluster, given)
    if settings.incident_id is None:
        settings = replace(settings, incident_id=incident_id_for(job_id, current_run()))
    label_run(job_id, cluster=settings.cluster)
    # the lineage: a job spikeops resumed trains in its parent's checkpoint root and run directory
    settings, lineage = find_lineage(settings, given)
    bundle = Path(settings.incidents_dir).expanduser() / settings.incident_id
    preflight(settings, rerun=(bundle / "incident.json").is_file())
    with IncidentSlots(job_id, settings.max_concurrent, settings.approval_timeout_s + 3600,
                       cluster=settings.cluster) as slots:
        return _respond(settings, slots, get_run_logger(), lineage)


def _respond(settings: IncidentSettings, slots: IncidentSlots, logger: Any, lineage: Lineage) -> dict[str, Any]:
    from spikeops.notify import SlackNotifier

    skip, job = set(settings.skip), settings.job_id
    links = {"flow_run": url} if (url := run_url()) else None
    scheduler = SchedulerRef(settings.scheduler, settings.scheduler_state_dir, settings.dry_run)
    # open
    incident, bundle = open_incident(job, settings.run_dir, settings.incidents_dir, scheduler,
                                     settings.incident_id, settings.alert)
    key = incident.lower()
    notifier = None if "notify" in skip else SlackNotifier(bundle, channel=settings.slack_channel)
    # remember: the lineage's earlier incidents into history.json, this one into the ledger
    memory = IncidentMemory(settings, lineage, incident, bundle, notifier=notifier, logger=logger, links=links)
    memory.opened()
    incident_doc = json.loads((Path(bundle) / "incident.json").read_text())
    # classify (a tenth of a second of CPU: done before the collection's threads compete for it)
    symptom = classify_symptom(bundle)
    # collect: started now, before the job is signalled or watched; the nodes answer while the
    # flow protects, and nothing waits for them until the diagnosis
    nodes = list(incident_doc["job"]["nodes"] or [])
    collecting = None if "collect" in skip else start_incident_collection(
        settings.inventory, job, bundle, nodes, incident, dask_scheduler=settings.dask_scheduler)
    label_run(job, symptom["symptom"], cluster=settings.cluster)
    if notifier:
        notifier.open(incident_doc, symptom=symptom["symptom"], spike_step=symptom["spike_step"], links=links)
    outcome: dict[str, Any] = {"incident": incident, "bundle": bundle, "symptom": symptom, "actions": []}
    # protect: a stop runs beside collection and diagnosis (the job's grace can be long)
    protection, stopped = None, False
    if "protect" not in skip:
        protection = protect_run(job, scheduler, bundle, incident, symptom, run_dir=settings.run_dir,
                                 observe_steps=settings.observe_steps, observe_timeout_s=settings.observe_timeout_s,
                                 notifier=notifier)
        if protection.observed is not None:
            outcome["observed"] = protection.observed
    if collecting is not None:
        finish_incident_collection(collecting, notifier=notifier)
    if protection is not None:  # a hung job was kept alive for its stacks and flight recorder
        protection.collected(notifier)
    if settings.baseline_dir:  # counters are read as growth since the nodes' last healthy capture
        logger.info("baselines: %s", "; ".join(bundle_baselines(settings.baseline_dir, bundle, nodes)))
    # diagnose
    diagnosis = diagnose_incident(bundle, settings.checkpoint_root, dry_run=settings.dry_run,
                                  artifact_key=f"findings-{key}"[:100])
    outcome["diagnosis"] = {k: diagnosis.get(k) for k in ("primary", "culprit_nodes", "resume_from")}
    label_run(job, (diagnosis.get("primary") or {}).get("cause"), cluster=settings.cluster)
    logger.info("diagnosis: %s", summary_line(diagnosis))
    if notifier:
        notifier.diagnosis(diagnosis, incident_doc, links=links)
    plan = resume_plan(diagnosis.get("actions") or [], diagnosis.get("findings") or [])
    outcome["remediation"] = {"env": plan.env, "applied": plan.applied, "for_a_person": plan.for_a_person}
    if protection is not None:  # nothing is decided before the job is stopped
        done, stopped = protection.settle(notifier)
        outcome["actions"] += done

    def ask(gate: Any, question_diagnosis: dict[str, Any] = diagnosis) -> tuple[bool, str]:
        return ask_approval(
            gate, timeout_s=settings.approval_timeout_s, bundle=bundle, job_id=job, incident=incident,
            description=approval_markdown(gate.question, question_diagnosis, remediation=plan.describe(),
                                          for_a_person=plan.for_a_person, timeout_s=settings.approval_timeout_s)
            + memory.approval_note(),
            notifier=notifier, logger=logger, slots=slots, links=links)

    # replay: a spike with no conclusive hardware cause is re-run on its nodes and on others
    replayed = replay_gate(job, scheduler, bundle, incident, diagnosis, policy=settings.replay,
                           max_steps=settings.replay_steps, timeout_s=settings.replay_timeout_s, stopped=stopped,
                           ask=ask, notifier=notifier, logger=logger, links=links)
    if replayed is not None:
        outcome["replay"] = replayed
    if replayed and replayed["ran"]:
        diagnosis = diagnose_incident(bundle, settings.checkpoint_root, dry_run=settings.dry_run,
                                      artifact_key=f"findings-{key}"[:100])
        outcome["diagnosis"] = {k: diagnosis.get(k) for k in ("primary", "culprit_nodes", "resume_from")}
        outcome["replay"]["verdict"] = tell_replay(bundle, diagnosis, replayed, notifier, links=links)
        label_run(job, (diagnosis.get("primary") or {}).get("cause"), cluster=settings.cluster)
        plan = resume_plan(diagnosis.get("actions") or [], diagnosis.get("findings") or [])
        outcome["remediation"] = {"env": plan.env, "applied": plan.applied, "for_a_person": plan.for_a_person}
    memory.diagnosed(diagnosis)  # a suspect checkpoint quarantined, a conviction in doubt said
    # decide: the policy, then the restart budget and "never the same checkpoint with the same plan"
    gate = approval_gate(settings.approval, diagnosis, stopped=stopped, can_isolate="isolate" not in skip,
                         can_resume="resume" not in skip, remediation=plan.describe())
    gate = memory.gate(gate, diagnosis, plan.env, stopped=stopped, can_resume="resume" not in skip)
    if gate.ask:  # the approver reads the report while the run waits
        write_report_artifact(bundle, diagnosis, incident_doc, key=f"report-{key}"[:100])
    approved, why = ask(gate, diagnosis)
    if gate.action is not None:
        outcome["approval"] = why
    if gate.action == "isolate" and not approved and notifier:
        notifier.stage("isolate", f"not isolated: {why}", links=links)
    # isolate and resume
    done = isolate_and_resume(job, scheduler, bundle, incident, diagnosis, gate, approved, why,
                              stopped=stopped, can_resume="resume" not in skip, env=plan.env,
                              remediation=plan.describe(), for_a_person=plan.for_a_person, notifier=notifier,
                              links=links)
    outcome["actions"] += done["actions"]
    stopped = done["stopped"]
    for field in ("resumed", "rolled_back"):
        if done[field]:
            outcome[field] = done[field]
    # tell
    outcome["summary"] = outcome_summary(outcome.get("resumed"), stopped=stopped)
    outcome["lost"] = memory.close(outcome, stopped=stopped)  # its cost, its ledger entry
    tell_outcome(bundle, notifier, diagnosis, incident_doc, summary=outcome["summary"],
                 resumed=(outcome.get("resumed") or {}).get("outcome") in ("done", "nothing-to-do"),
                 recommended=plan.applied + plan.for_a_person, artifact_key=f"report-{key}"[:100], links=links)
    return outcome
