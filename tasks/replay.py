"""The replay gate: before a resume, re-run the spike window from the checkpoint before the
onset, once on the job's own nodes and once on others, to tell bad data or unstable numerics
(both replays reproduce the spike) from a GPU that silently computes wrong numbers (only the
replay on the original nodes does, and that node's ranks' gradients differ) from a transient
(neither does). docs/replay.md.

The replays are the job itself, resubmitted through the scheduler with the environment it was
submitted with plus the replay's variables (``SPIKEOPS_REPLAY``...: the job restores the
checkpoint, data order and RNG, runs deterministically through the spike step and writes
``replay.jsonl`` into the bundle); the verdict is the diagnosis's (``spikeops diagnose`` reads
``replay/``). Bounded: a step budget decides whether to replay at all, a time budget stops the
replays, and what did not finish is reported, never judged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task

from spikeops.response import Gate, replay_wanted
from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["replay_gate", "start_replay", "wait_for_job", "tell_replay"]

#: Job states a replay is still in (Slurm's and the local scheduler's).
_ACTIVE = {"RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


@task(name="start-replay", task_run_name="replay {run} on {nodes}")
def start_replay(job_id: str, scheduler: SchedulerRef, bundle: str, incident: str, run: str, checkpoint: str,
                 until: int, ranks: dict[int, str], nodes: list[str]) -> dict[str, Any]:
    """Start one replay of the job (idempotent by its key: a rerun finds it)."""
    from spikeops.replay import replay_env

    out = Path(bundle) / "replay" / run
    out.mkdir(parents=True, exist_ok=True)
    env = replay_env(run, until, str(out), checkpoint, ranks)
    extra: dict[str, Any] = {}
    preserved = Path(bundle) / "scheduler" / f"batch-{job_id}.sh"
    if scheduler.kind == "slurm" and preserved.is_file():
        extra["script"] = preserved
    return scheduler.open(bundle, incident).resume(
        job_id, checkpoint, env=env, key=f"spikeops-replay:{job_id}:{run}:{until}", on=nodes, action="replay",
        **extra).to_json()


@task(name="wait-for-replay", task_run_name="wait for job {job_id}")
def wait_for_job(job_id: str, scheduler: SchedulerRef, bundle: str, incident: str, deadline: float) -> dict[str, Any]:
    """Until the replay job ends or the deadline (``time.time()``) passes; then it is stopped."""
    live = scheduler.open(bundle, incident)
    state = "UNKNOWN"
    while time.time() < deadline:
        info = live.show_job(job_id)
        state = (info[0] if isinstance(info, tuple) else info).state
        if state.split()[0] not in _ACTIVE:
            return {"job": job_id, "state": state, "timed_out": False}
        time.sleep(1.0)
    live.stop(job_id, grace=5)
    return {"job": job_id, "state": state, "timed_out": True}


def replay_gate(job_id: str, scheduler: SchedulerRef, bundle: str, incident: str, diagnosis: dict[str, Any], *,
                policy: str, max_steps: int, timeout_s: int, stopped: bool, ask: Any, notifier: Any, logger: Any,
                links: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Run the two replays when the policy and the diagnosis call for them; ``ask(gate)``
    returns a person's ``(approved, why)`` under ``replay = "ask"``. Returns what was done (for
    the outcome and the thread), or None when no replay was wanted."""
    from spikeops.replay import RUN_OTHER, RUN_SAME, plan_other_nodes, rank_map

    if policy == "never":
        return None
    wanted, why = replay_wanted(diagnosis, stopped=stopped, max_steps=max_steps)
    if not wanted:
        logger.info("no replay: %s", why)
        return None
    document = json.loads((Path(bundle) / "incident.json").read_text())
    ranks = rank_map(document)
    nodes = list(dict.fromkeys(ranks.values()))
    live = scheduler.open(bundle, incident)
    spares = [n for n in (live.idle_nodes() if hasattr(live, "idle_nodes") else []) if n not in nodes]
    placement = plan_other_nodes(nodes, spares, ranks)
    if not placement.possible:
        return _said(notifier, links, {"ran": False, "why": f"no replay: {placement.reason}"})
    checkpoint, until = diagnosis["resume_from"]["path"], int(diagnosis["spike_step"])
    question = (f"replay the spike window ({why}) on {len(nodes)} original node(s) and on other nodes "
                f"({placement.reason}) before deciding")
    if policy == "ask":
        approved, answer = ask(Gate("replay", ask=True, question=question))
        if not approved:
            return _said(notifier, links, {"ran": False, "why": f"no replay: {answer}"})
    if notifier:
        notifier.stage("replay-start", f"Replaying: {why}; on the original nodes and on other nodes "
                       f"({placement.reason}), at most {timeout_s} s", links=links)
    started = time.time()
    deadline = started + timeout_s
    runs = {RUN_SAME: (ranks, nodes), RUN_OTHER: (placement.ranks, placement.nodes)}
    jobs: dict[str, dict[str, Any]] = {}
    together = placement.kind == "spares"  # disjoint nodes: both at once; else one after the other
    for run, (run_ranks, run_nodes) in runs.items():
        began = start_replay(job_id, scheduler, bundle, incident, run, checkpoint, until, run_ranks, run_nodes)
        jobs[run] = {"start": began}
        if began["outcome"] not in ("done", "nothing-to-do"):
            return _said(notifier, links, {"ran": False, "why": f"replay {run} not started: {began['detail']}",
                                           "jobs": jobs})
        if not together:
            jobs[run]["end"] = wait_for_job(began["extra"]["new_job"], scheduler, bundle, incident, deadline)
    for run, record in jobs.items():
        if "end" not in record:
            record["end"] = wait_for_job(record["start"]["extra"]["new_job"], scheduler, bundle, incident, deadline)
    seconds = time.time() - started
    timed_out = [run for run, record in jobs.items() if record["end"]["timed_out"]]
    result = {"ran": True, "why": why, "placement": placement.kind, "seconds": round(seconds, 1), "until": until,
              "steps": until - int(diagnosis["resume_from"]["step"]), "timed_out": timed_out,
              "jobs": {run: record["start"]["extra"].get("new_job") for run, record in jobs.items()}}
    logger.info("replays done in %.1f s: %s", seconds, result)
    return result


def tell_replay(bundle: str, diagnosis: dict[str, Any], replayed: dict[str, Any], notifier: Any, *,
                links: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The replays' verdict in the thread, with their cost; the verdict as data."""
    from spikeops.replay import bundle_verdict

    verdict = bundle_verdict(bundle, replayed.get("until", diagnosis.get("spike_step")))
    found = verdict.to_json() if verdict is not None else {"verdict": "inconclusive", "summary": "no replay file"}
    cost = f"{replayed['steps']} steps replayed twice in {replayed['seconds']:.0f} s"
    if replayed.get("timed_out"):
        cost += f"; stopped at the time budget: {', '.join(replayed['timed_out'])}"
    if notifier:
        lines = [f"Replay verdict: *{found['verdict']}*: {found.get('summary') or found.get('reason') or ''} ({cost})"]
        lines += [f"{e['file']}:{e['line']}: {e['text'][:200]}" for e in (found.get("evidence") or [])[:3]]
        notifier.stage("replay-verdict", "\n".join(lines), links=links)
    return {"verdict": found["verdict"], "summary": found.get("summary"), "culprit_nodes": found.get("culprit_nodes"),
            "cost": cost}


def _said(notifier: Any, links: Mapping[str, str] | None, result: dict[str, Any]) -> dict[str, Any]:
    if notifier:
        notifier.stage("replay", result["why"], links=links)
    return result
