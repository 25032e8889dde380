"""The incident flow: protect, snapshot, collect, diagnose, isolate (approved), resume, tell.

The stages follow the seed's rapid-response matrix. Each is a task over the core, and each
is idempotent on its own terms, so a rerun of the same incident (same ``incident_id``)
continues rather than repeats:
- the bundle is reused;
- a stopped job is nothing to do;
- a node already drained by spikeops is nothing to do;
- a resume finds the job it already submitted (``--comment``);
- Slack continues the thread and posts no stage twice.

Safety first:
- nodes are drained only when the diagnosis convicts them and a person approves (a
  ``pause_flow_run`` with a typed ``Approval`` input), unless the policy auto-approves
  high-confidence hardware faults;
- a job is resumed only from a checkpoint that verified;
- ``dry_run`` runs everything read-only and says what it would have done.
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.transactions import get_transaction, transaction
from prefect.artifacts import create_table_artifact
from prefect.input import RunInput
from pydantic import BaseModel, Field, field_validator

from spikeops.bundle import BundleWriter
from spikeops.remediation import resume_plan
from spikeops.timeparse import iso
from tasks.baselines import bundle_baselines
from tasks.checkpoints import pick_checkpoint
from tasks.collect import collect_evidence
from tasks.notify import report_artifact

__all__ = ["IncidentParams", "Approval", "incident_response", "one_incident_per_job", "job_limit_name", "STAGES"]

STAGES = ("protect", "collect", "diagnose", "isolate", "resume", "notify")
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,127}$")
#: The incident window when the job's files do not give one.
WINDOW = timedelta(hours=1)
#: The seed's rapid-response matrix: which symptoms stop the job at once.
STOP_AT_ONCE = {"instant_nan", "spike_no_recovery"}


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
        if not _JOB.match(value):
            raise ValueError("job id: letters, digits and _.:+- only")
        return value

    @field_validator("incident_id")
    @classmethod
    def _incident(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$", value):
            raise ValueError("incident id: letters, digits and _.- only")
        return value


class Approval(RunInput):
    """What the person answering the approval page types in."""

    approve: bool = Field(description="drain the culprit nodes and resume the job without them")
    approver: str = Field("", description="who decided (kept in actions.jsonl)")
    note: str = ""


def _scheduler(params: IncidentParams, bundle: Path, incident: str) -> Any:
    from spikeops.schedulers import open_scheduler

    return open_scheduler(params.scheduler, log_path=bundle / "actions.jsonl", dry_run=params.dry_run,
                          incident=incident, state_dir=params.scheduler_state_dir)


@task(name="open-incident")
def open_incident(params: IncidentParams) -> tuple[str, str]:
    """The bundle: incident.json from the job's record, and a snapshot of the job's own
    files (they rotate). Reused as it is when the incident already exists."""
    stamp = datetime.now(UTC)
    incident = params.incident_id or f"inc-{stamp:%Y%m%dT%H%M%SZ}-{params.job_id}"
    bundle = Path(params.incidents_dir).expanduser() / incident
    if (bundle / "incident.json").is_file():
        return incident, str(bundle)
    scheduler = _scheduler(params, bundle, incident)
    info = scheduler.show_job(params.job_id)
    info = info[0] if isinstance(info, tuple) else info
    run = Path(params.run_dir)
    bundle.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "ranks.jsonl", "batches.jsonl", "train.log"):
        if (run / name).is_file():
            shutil.copy2(run / name, bundle / name)
    if (run / "reference" / "batches.jsonl").is_file():
        (bundle / "reference").mkdir(parents=True, exist_ok=True)
        shutil.copy2(run / "reference" / "batches.jsonl", bundle / "reference" / "batches.jsonl")
    # The job's own description (spikeops.train writes one: max_length, ranks, resume point)
    # wins over nothing; the scheduler's node list wins over it.
    source = run / "incident.json"
    known = json.loads(source.read_text()) if source.is_file() else {}
    job: dict[str, Any] = dict(known.get("job") or {})
    job.update({"id": params.job_id, "scheduler": params.scheduler, "nodes": list(info.nodes)})
    window = known.get("window") or {"start": iso(stamp - WINDOW), "end": iso(stamp)}
    BundleWriter(bundle).write_incident({
        "incident_id": incident, "created": iso(stamp),
        "alert": params.alert or {"source": "prefect", "received": iso(stamp), "payload": {}},
        "job": job, "window": window,
    })
    return incident, str(bundle)


@task(name="classify")
def classify_symptom(bundle: str) -> dict[str, Any]:
    from spikeops.diagnosis.engine import classify_bundle

    result = classify_bundle(bundle)
    return {"symptom": result.symptom, "spike_step": result.spike_step}


@task(name="observe")
def observe(params: IncidentParams, bundle: str, spike_step: int | None) -> dict[str, Any]:
    """After a single spike the job keeps training: watch up to ``observe_steps`` more steps
    (at most ``observe_timeout_s``), refresh the bundle's metrics, and classify again. A spike
    that did not recover is then treated as one."""
    import time

    metrics = Path(params.run_dir) / "metrics.jsonl"
    target = (spike_step or 0) + params.observe_steps
    deadline = time.monotonic() + params.observe_timeout_s
    last = None
    while time.monotonic() < deadline:
        last = _last_step(metrics)
        if last is not None and last >= target:
            break
        time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
    if metrics.is_file():
        shutil.copy2(metrics, Path(bundle) / "metrics.jsonl")
    again = classify_symptom.fn(bundle)
    again["observed_until"] = _last_step(metrics)
    return again


def _last_step(path: Path) -> int | None:
    """The last logged step, read from the file's end (it may be large)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 65536))
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


@task(name="stop-job")
def stop_job(params: IncidentParams, bundle: str, incident: str) -> list[dict[str, Any]]:
    """Preserve the job's record (where the scheduler can), then stop it, signalling first
    so the job can save."""
    scheduler = _scheduler(params, Path(bundle), incident)
    done = []
    # A rerun keeps the record taken while the job ran (a second one would show it cancelled).
    if hasattr(scheduler, "preserve") and not (Path(bundle) / "scheduler" / f"job-{params.job_id}.txt").is_file():
        done.append(scheduler.preserve(params.job_id, bundle).to_json())
    done.append(scheduler.stop(params.job_id, signal="USR1", grace=10).to_json())
    return done


def _stopped(actions: list[dict[str, Any]]) -> bool:
    return any(a["action"] == "stop" and a["outcome"] in ("done", "nothing-to-do") for a in actions)


@task(name="diagnose")
def diagnose_bundle(bundle: str) -> dict[str, Any]:
    from spikeops.bundle import atomic_write
    from spikeops.diagnosis import diagnose

    document = diagnose(bundle).to_json()
    atomic_write(Path(bundle) / "diagnosis.json", (json.dumps(document, indent=2, default=str) + "\n").encode())
    return document


@task(name="isolate")
def isolate(params: IncidentParams, bundle: str, incident: str, nodes: list[str], cause: str) -> list[dict[str, Any]]:
    scheduler = _scheduler(params, Path(bundle), incident)
    done = [r.to_json() for r in scheduler.drain(nodes, cause, incident)]
    current = get_transaction()
    if current is not None:  # what the rollback must undo: only what this run drained
        current.set("isolated", {"params": params.model_dump(), "bundle": bundle, "incident": incident,
                                 "nodes": [d["target"] for d in done if d["outcome"] == "done"]})
    return done


@isolate.on_rollback
def _release_isolated(transaction: Any) -> None:
    """A later step failed (the job could not be resumed elsewhere): give the nodes back, so a
    failed incident never leaves the cluster smaller than it found it."""
    record = transaction.get("isolated", None)
    if not record or not record["nodes"]:
        return
    params = IncidentParams(**record["params"])
    scheduler = _scheduler(params, Path(record["bundle"]), record["incident"])
    scheduler.release(record["nodes"])


class ResumeFailed(RuntimeError):
    """Raised inside the isolation transaction to roll it back."""


@task(name="resume")
def resume(params: IncidentParams, bundle: str, incident: str, checkpoint: str, exclude: list[str],
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """Resubmit from ``checkpoint`` without ``exclude``, with the remediation's environment."""
    scheduler = _scheduler(params, Path(bundle), incident)
    extra: dict[str, Any] = {}
    preserved = Path(bundle) / "scheduler" / f"batch-{params.job_id}.sh"
    if params.scheduler == "slurm" and preserved.is_file():
        # the script as preserved while the job ran: Slurm forgets a finished job's script
        # once the job record is purged (MinJobAge), and a resume may come later than that
        extra["script"] = preserved
    return scheduler.resume(params.job_id, checkpoint, exclude=exclude, env=env or {}, **extra).to_json()


def _approved(params: IncidentParams, diagnosis: dict[str, Any], notifier: Any, logger: Any,
              what: str) -> tuple[bool, str]:
    """Whether a person (or the policy) approves ``what``; silence is a no."""
    from prefect.flow_runs import pause_flow_run

    primary = diagnosis.get("primary") or {}
    if params.approval == "never":
        return False, "policy: never isolate"
    if params.approval == "auto-hardware" and primary.get("layer") == "hardware" \
            and float(primary.get("confidence") or 0) >= 0.8:
        return True, f"policy: auto-approved ({primary.get('cause')}, confidence {primary.get('confidence')})"
    if notifier is not None:
        notifier.stage("approval", f"Waiting for approval to {what} (see the flow run's resume page)")
    logger.info("waiting up to %s s for approval", params.approval_timeout_s)
    try:
        answer = pause_flow_run(wait_for_input=Approval, timeout=params.approval_timeout_s)
    except Exception as exc:  # a timeout: nobody answered; never act on silence
        return False, f"no approval within {params.approval_timeout_s} s ({type(exc).__name__})"
    who = f" by {answer.approver}" if answer.approver else ""
    return bool(answer.approve), ("approved" if answer.approve else "declined") + who


def _tell_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """on_failure / on_crashed: a broken flow is never silent. Posts into the incident's
    thread (the bundle's slack.json) when the incident is known, else a new message."""
    from spikeops.notify import SlackNotifier

    raw = (flow_run.parameters or {}).get("params") or {}
    incidents = Path(str(raw.get("incidents_dir") or "~/.local/state/spikeops/incidents")).expanduser()
    incident = raw.get("incident_id") or f"failed-{flow_run.id}"
    bundle = incidents / incident
    try:
        bundle.mkdir(parents=True, exist_ok=True)
        message = str(getattr(state, "message", "") or state.name)[:500]
        SlackNotifier(bundle, channel=raw.get("slack_channel")).stage(
            f"failed-{flow_run.id}", f"incident flow {state.name.lower()} for job {raw.get('job_id')}: {message}. "
            "Nothing further will happen automatically; see the flow run.")
    except Exception:  # the hook must not fail the failure
        pass


@flow(name="incident-response", log_prints=True, on_failure=[_tell_failure], on_crashed=[_tell_failure])
def incident_response(params: IncidentParams) -> dict[str, Any]:
    """One incident, end to end. Returns what was found and done. Incidents of one job wait
    for each other (a per-job concurrency limit); incidents of different jobs run side by side."""
    logger = get_run_logger()
    with one_incident_per_job(params.job_id, timeout_s=params.approval_timeout_s + 3600):
        return _respond(params, logger)


def job_limit_name(job_id: str) -> str:
    """The global concurrency limit that serialises one job's incidents."""
    return f"spikeops-job-{job_id}"


def one_incident_per_job(job_id: str, timeout_s: float) -> Any:
    """A slot of the job's own concurrency limit (created at 1 on first use): a second alert
    about the same job, under another idempotency key, waits for the first incident to end
    instead of stopping, draining and resubmitting beside it."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    name = job_limit_name(job_id)
    with get_client(sync_client=True) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass
    return concurrency(name, occupy=1, timeout_seconds=timeout_s, strict=True)


def _respond(params: IncidentParams, logger: Any) -> dict[str, Any]:
    from spikeops.notify import SlackNotifier

    incident, bundle = open_incident(params)
    notifier = None if "notify" in params.skip else SlackNotifier(bundle, channel=params.slack_channel)
    incident_doc = json.loads((Path(bundle) / "incident.json").read_text())
    symptom = classify_symptom(bundle)
    if notifier:
        notifier.open(incident_doc, symptom=symptom["symptom"], spike_step=symptom["spike_step"])
    outcome: dict[str, Any] = {"incident": incident, "bundle": bundle, "symptom": symptom, "actions": []}
    stopped = False
    if "protect" not in params.skip and symptom["symptom"] == "single_spike" and params.observe_steps:
        watched = observe(params, bundle, symptom["spike_step"])
        outcome["observed"] = watched
        if notifier:
            notifier.stage("observe", f"single spike at step {symptom['spike_step']}: watched until step "
                           f"{watched.get('observed_until')}, now {watched['symptom']}")
        symptom = {**symptom, "symptom": watched["symptom"] or symptom["symptom"]}
    if "protect" not in params.skip and symptom["symptom"] in STOP_AT_ONCE:
        # the seed's matrix: stop at once for NaN and no recovery; a single spike keeps training
        done = stop_job(params, bundle, incident)
        outcome["actions"] += done
        stopped = _stopped(done)
        if notifier and done:
            notifier.stage("protect", "; ".join(f"{a['action']} {a['target']}: {a['outcome']}" for a in done))
    if "collect" not in params.skip:
        collected = collect_evidence(params.inventory, params.job_id, bundle,
                                     incident_doc["job"]["nodes"] or None, replace=True,
                                     artifact_key=f"collection-{incident.lower()}"[:100])
        buckets = collected.buckets()
        if notifier:
            notifier.stage("collect", f"collected {len(buckets['ok'])}/{len(collected.nodes)} nodes"
                           + "".join(f"; {k}: {len(v)}" for k, v in buckets.items() if v and k != "ok"))
    if params.baseline_dir:
        copied = bundle_baselines(params.baseline_dir, bundle, list(incident_doc["job"]["nodes"] or []))
        logger.info("baselines: %s", "; ".join(copied))
    diagnosis = diagnose_bundle(bundle)
    if params.checkpoint_root and diagnosis.get("onset_step") is not None:
        # a checkpoint that fails its checksums gets a marker (never deleted, never renamed
        # here), so neither this resume nor a person's picks it by mistake
        pick_checkpoint(params.checkpoint_root, int(diagnosis["onset_step"]), bundle=bundle,
                        quarantine=None if params.dry_run else "marker")
        diagnosis = diagnose_bundle(bundle)  # now with the verified resume point
    outcome["diagnosis"] = {"primary": diagnosis.get("primary"), "culprit_nodes": diagnosis.get("culprit_nodes"),
                            "resume_from": diagnosis.get("resume_from")}
    create_table_artifact(key=f"findings-{incident.lower()}"[:100], table=[
        {"cause": f["cause"], "layer": f["layer"], "confidence": f["confidence"],
         "nodes": ",".join(f.get("nodes") or []), "summary": f.get("summary", "")[:200]}
        for f in diagnosis.get("findings") or []] or [{"cause": "none"}])
    if notifier:
        notifier.diagnosis(diagnosis, incident_doc)
    plan = resume_plan(diagnosis.get("actions") or [], diagnosis.get("findings") or [])
    outcome["remediation"] = {"env": plan.env, "applied": plan.applied, "for_a_person": plan.for_a_person}
    culprits = list(diagnosis.get("culprit_nodes") or [])
    resume_from = diagnosis.get("resume_from")
    approved, why = (False, "")
    if culprits and "isolate" not in params.skip:
        approved, why = _approved(params, diagnosis, notifier, logger,
                                  f"drain {', '.join(culprits)} and resume without them")
        outcome["approval"] = why
        if not approved and notifier:
            notifier.stage("isolate", f"not isolated: {why}")
    # approval=always gates every action, the resume of a job with no culprit included
    resume_gated = (not culprits and params.approval == "always" and stopped and bool(resume_from)
                    and "resume" not in params.skip)
    if resume_gated:
        approved, why = _approved(params, diagnosis, notifier, logger,
                                  f"resume from {resume_from['path']} ({plan.describe()})")
        outcome["approval"] = why
    try:
        # Isolation and the resume that depends on it succeed or fail together: if the job
        # cannot be resumed without the drained nodes, the drain is rolled back.
        with transaction():
            excluded: list[str] = []
            if approved:
                drained = isolate(params, bundle, incident, culprits,
                                  (diagnosis.get("primary") or {}).get("cause", "?"))
                outcome["actions"] += drained
                excluded = [a["target"] for a in drained if a["outcome"] in ("done", "nothing-to-do", "dry-run")]
                if notifier:
                    notifier.stage("isolate", f"{why}; " + "; ".join(
                        f"drain {a['target']}: {a['outcome']}" for a in drained))
            if excluded and not stopped and "resume" not in params.skip and resume_from:
                # a convicted node was drained under a job that kept running (a single spike):
                # it must move off that node, so stop it (signal first) before resuming elsewhere
                done = stop_job(params, bundle, incident)
                outcome["actions"] += done
                stopped = _stopped(done)
            if "resume" not in params.skip and stopped:
                if resume_gated and not approved:
                    outcome["resumed"] = {"outcome": "not resumed", "detail": f"resume not approved: {why}"}
                elif resume_from and resume_from.get("path") and (not culprits or excluded):
                    done = resume(params, bundle, incident, resume_from["path"], excluded, plan.env)
                    outcome["actions"].append(done)
                    outcome["resumed"] = done
                    if notifier and done["outcome"] in ("done", "nothing-to-do", "dry-run"):
                        notifier.stage("resume", f"{done['detail']}; remediation: {plan.describe()}"
                                       + (f". Left to a person: {'; '.join(plan.for_a_person)}"
                                          if plan.for_a_person else ""))
                    if done["outcome"] in ("failed", "refused") and excluded:
                        raise ResumeFailed(done["detail"])
                else:
                    why_not = ("no verified checkpoint before the onset" if not resume_from
                               else "culprit nodes not isolated")
                    outcome["resumed"] = {"outcome": "not resumed", "detail": why_not}
    except ResumeFailed as exc:
        outcome["rolled_back"] = f"resume failed ({exc}); the drained nodes were released"
        outcome["resumed"] = {"outcome": "not resumed", "detail": outcome["rolled_back"]}
        if notifier:
            notifier.stage("rollback", outcome["rolled_back"])
    if notifier and outcome.get("resumed", {}).get("outcome") not in ("done", "nothing-to-do") \
            and (plan.applied or plan.for_a_person):
        notifier.stage("remediation", "Not resumed automatically. Recommended for the next run: "
                       + "; ".join(plan.applied + plan.for_a_person))
    from spikeops.notify import notify_bundle

    summary = (f"resumed: {outcome['resumed'].get('detail')}" if outcome.get("resumed", {}).get("outcome") == "done"
               else outcome.get("resumed", {}).get("detail") or ("kept running, observed" if not stopped else "stopped"))
    if notifier:
        notify_bundle(bundle, notifier=notifier, diagnosis=diagnosis, outcome=summary)
    else:
        from spikeops.notify.report import write_report

        write_report(bundle, diagnosis, incident_doc)
    report_artifact(bundle, key=f"report-{incident.lower()}"[:100])
    outcome["summary"] = summary
    return outcome
