"""Protecting the run: preserve the job's record, then stop it, signalling first so it can save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["stop_job", "stopped", "protect_run", "Protection", "GRACE_S"]

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


class Protection:
    """What the protect stage started: the symptom acted on, what a watch of a single spike
    saw, and a stop that may still be running (the job's grace period after USR1 can be long,
    and the evidence is best taken while the job is still there, so collection and diagnosis
    go on beside it). ``settle`` waits for the stop before anything is decided."""

    def __init__(self, symptom: dict[str, Any], observed: dict[str, Any] | None = None, pending: Any = None,
                 after_collection: Any = None) -> None:
        self.symptom = symptom
        self.observed = observed
        self._pending = pending
        self._settled: tuple[list[dict[str, Any]], bool] | None = None
        #: A hung job: the stop to submit once its stacks and flight recorder are collected.
        self._after_collection = after_collection

    def collected(self, notifier: Any = None) -> None:
        """The evidence is in: a job that was kept alive for it (a stalled job) is stopped now."""
        if self._after_collection is not None and self._pending is None:
            self._pending = self._after_collection()
            self._after_collection = None
            if notifier:
                notifier.stage("protect", "stalled: the stacks and flight recorder are collected, stopping the job")

    def settle(self, notifier: Any = None) -> tuple[list[dict[str, Any]], bool]:
        """The stop's actions and whether the job is stopped (said in the thread once)."""
        from spikeops.response import describe_actions

        if self._settled is None:
            done = self._pending.result() if self._pending is not None else []
            self._settled = (done, stopped(done))
            if notifier and done:
                notifier.stage("protect", describe_actions(done))
        return self._settled


def protect_run(job_id: str, scheduler: SchedulerRef, bundle: str, incident: str, symptom: dict[str, Any], *,
                run_dir: str, observe_steps: int, observe_timeout_s: float, notifier: Any) -> Protection:
    """The matrix's first column: observe a single spike (and classify again when it has
    played out); for a NaN or a spike that does not recover, preserve the job's record and
    signal it at once, and let the stop finish in the background (``Protection.settle``); for
    a stalled job, stop it only once the collection is done (``Protection.collected``)."""
    from spikeops.response import protective_move
    from spikeops.tasks.classify import observe

    observed = None
    if protective_move(symptom["symptom"], observe_steps=observe_steps) == "observe":
        observed = observe(run_dir, bundle, symptom["spike_step"], observe_steps, observe_timeout_s)
        if notifier:
            notifier.stage("observe", f"single spike at step {symptom['spike_step']}: watched until step "
                           f"{observed.get('observed_until')}, now {observed['symptom']}")
        symptom = {**symptom, "symptom": observed["symptom"] or symptom["symptom"]}
    pending = None
    move = protective_move(symptom["symptom"], observe_steps=0)
    if move == "stop_after_collection":
        state = _state(scheduler, bundle, incident, job_id)
        if state in _LIVE:
            # a hung job: its processes hold the stacks and the flight recorder; stopped once collected
            return Protection(symptom, observed, None,
                              after_collection=lambda: stop_job.submit(job_id, scheduler, bundle, incident))
        if state == "COMPLETED":
            # it finished its work: a silent metrics file is no hang, and nothing is resumed
            if notifier:
                notifier.stage("protect", f"job {job_id} completed: no step since, but no hang either")
            return Protection(symptom, observed, None)
    if move == "stop" or not _running(scheduler, bundle, incident, job_id):
        # a job that has already ended (crashed on the NaN, or finished) is recorded as stopped:
        # its nodes are free, and resuming it is what is left to decide
        pending = stop_job.submit(job_id, scheduler, bundle, incident)
    return Protection(symptom, observed, pending)


_LIVE = ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED")


def _state(scheduler: SchedulerRef, bundle: str, incident: str, job_id: str) -> str | None:
    """The job's state word (``RUNNING``, ``COMPLETED``, ``FAILED``...), None when unknown."""
    try:
        info = scheduler.open(bundle, incident).show_job(job_id)
    except Exception:  # the scheduler forgot it
        return None
    state = (info[0] if isinstance(info, tuple) else info).state
    return state.split()[0] if state else None


def _running(scheduler: SchedulerRef, bundle: str, incident: str, job_id: str) -> bool:
    return _state(scheduler, bundle, incident, job_id) in _LIVE
