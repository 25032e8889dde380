"""Resuming the job from the verified checkpoint, without the drained nodes, with the
remediation's environment."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task

from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["resume", "ResumeFailed"]


class ResumeFailed(RuntimeError):
    """The job could not be resumed without the drained nodes (they stay drained)."""


@task(name="resume")
def resume(job_id: str, scheduler: SchedulerRef, bundle: str, incident: str, checkpoint: str, exclude: list[str],
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """Resubmit from ``checkpoint`` without ``exclude``."""
    extra: dict[str, Any] = {}
    preserved = Path(bundle) / "scheduler" / f"batch-{job_id}.sh"
    if scheduler.kind == "slurm" and preserved.is_file():
        # the script as preserved while the job ran: Slurm forgets a finished job's script
        # once the job record is purged (MinJobAge), and a resume may come later than that
        extra["script"] = preserved
    return scheduler.open(bundle, incident).resume(job_id, checkpoint, exclude=exclude, env=env or {},
                                                   **extra).to_json()


def isolate_and_resume(job_id: str, scheduler: SchedulerRef, bundle: str, incident: str,
                       diagnosis: dict[str, Any], gate: Any, approved: bool, why: str, *, stopped: bool,
                       can_resume: bool, env: dict[str, str], remediation: str,
                       for_a_person: list[str], notifier: Any,
                       links: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Drain the approved culprits and resume without them. When the job cannot be resumed
    without the drained nodes, they stay drained (their conviction holds): they come back
    only through a passing validation (``spikeops.tasks.isolate``).

    Returns ``{"actions": [...], "resumed": {...} or None, "rolled_back": str or None,
    "stopped": bool}``."""
    from spikeops.response import SUCCESS, describe_actions, must_stop_before_resume, resume_decision
    from spikeops.tasks.isolate import isolate
    from spikeops.tasks.protect import stop_job, stopped as is_stopped

    culprits = list(diagnosis.get("culprit_nodes") or [])
    resume_from = diagnosis.get("resume_from")
    result: dict[str, Any] = {"actions": [], "resumed": None, "rolled_back": None, "stopped": stopped}
    try:
        excluded: list[str] = []
        if approved and gate.action == "isolate":
            drained = isolate(scheduler, bundle, incident, culprits,
                              (diagnosis.get("primary") or {}).get("cause", "?"))
            result["actions"] += drained
            excluded = [a["target"] for a in drained if a["outcome"] in SUCCESS]
            if notifier:
                notifier.stage("isolate", f"{why}; " + describe_actions(drained, "drain"), links=links)
        if must_stop_before_resume(excluded, stopped=result["stopped"], can_resume=can_resume,
                                   resume_from=resume_from):
            done = stop_job(job_id, scheduler, bundle, incident)
            result["actions"] += done
            result["stopped"] = is_stopped(done)
        decision = resume_decision(gate, approved, why, stopped=result["stopped"], can_resume=can_resume,
                                   resume_from=resume_from, culprits=culprits, excluded=excluded)
        if decision is not None and not decision[0]:
            result["resumed"] = {"outcome": "not resumed", "detail": decision[1]}
        elif decision is not None:
            done = resume(job_id, scheduler, bundle, incident, resume_from["path"], excluded, env)
            result["actions"].append(done)
            result["resumed"] = done
            if notifier and done["outcome"] in SUCCESS:
                notifier.stage("resume", f"{done['detail']}; remediation: {remediation}"
                               + (f". Left to a person: {'; '.join(for_a_person)}" if for_a_person else ""),
                               links=links)
            if done["outcome"] in ("failed", "refused") and excluded:
                raise ResumeFailed(done["detail"])
    except ResumeFailed as exc:
        result["rolled_back"] = (f"resume failed ({exc}); the drained nodes stay drained until they pass "
                                 "validation (spikeops nodes validate, or the node-lifecycle deployment)")
        result["resumed"] = {"outcome": "not resumed", "detail": result["rolled_back"]}
        if notifier:
            notifier.stage("rollback", result["rolled_back"], links=links)
    return result
