"""Protecting the run: preserve the job's record, then stop it, signalling first so it can save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from tasks.scheduler import SchedulerRef

__all__ = ["stop_job", "stopped", "GRACE_S"]

#: Seconds between the job's USR1 (save and exit) and the cancel.
GRACE_S = 10


@task(name="stop-job")
def stop_job(job_id: str, scheduler: SchedulerRef, bundle: str, incident: str) -> list[dict[str, Any]]:
    """Preserve the job's record (where the scheduler can), then stop it."""
    live = scheduler.open(bundle, incident)
    done = []
    # A rerun keeps the record taken while the job ran (a second one would show it cancelled).
    if hasattr(live, "preserve") and not (Path(bundle) / "scheduler" / f"job-{job_id}.txt").is_file():
        done.append(live.preserve(job_id, bundle).to_json())
    done.append(live.stop(job_id, signal="USR1", grace=GRACE_S).to_json())
    return done


def stopped(actions: list[dict[str, Any]]) -> bool:
    """Whether these actions left the job stopped (now or by an earlier run)."""
    return any(a["action"] == "stop" and a["outcome"] in ("done", "nothing-to-do") for a in actions)


def protect_run(job_id: str, scheduler: SchedulerRef, bundle: str, incident: str, symptom: dict[str, Any], *,
                run_dir: str, observe_steps: int, observe_timeout_s: float, notifier: Any) -> dict[str, Any]:
    """The matrix's first column: observe a single spike (and classify again when it has
    played out), stop at once for a NaN or a spike that does not recover.

    Returns ``{"symptom": the symptom acted on, "observed": what the watch saw or None,
    "actions": what was done, "stopped": whether the job is stopped}``."""
    from spikeops.response import describe_actions, protective_move
    from tasks.classify import observe

    result: dict[str, Any] = {"symptom": symptom, "observed": None, "actions": [], "stopped": False}
    if protective_move(symptom["symptom"], observe_steps=observe_steps) == "observe":
        watched = observe(run_dir, bundle, symptom["spike_step"], observe_steps, observe_timeout_s)
        result["observed"] = watched
        if notifier:
            notifier.stage("observe", f"single spike at step {symptom['spike_step']}: watched until step "
                           f"{watched.get('observed_until')}, now {watched['symptom']}")
        result["symptom"] = {**symptom, "symptom": watched["symptom"] or symptom["symptom"]}
    if protective_move(result["symptom"]["symptom"], observe_steps=0) == "stop":
        done = stop_job(job_id, scheduler, bundle, incident)
        result["actions"] = done
        result["stopped"] = stopped(done)
        if notifier and done:
            notifier.stage("protect", describe_actions(done))
    return result
