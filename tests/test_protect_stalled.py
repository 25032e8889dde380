"""The matrix's protect step for a stalled job, in a real flow run on a real local scheduler:
a running job is left alone until the collection is done, then stopped; a job that completed
is no hang, and is neither stopped nor resumed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from spikeops.schedulers import LocalScheduler

STALLED = {"symptom": "stalled", "spike_step": 40}


def _protect(job: str, state: Path, bundle: Path) -> tuple[str, str, bool, list[str]]:
    from prefect import flow

    from spikeops.tasks.protect import protect_run
    from spikeops.tasks.scheduler import SchedulerRef

    @flow
    def protect_then_collect() -> tuple[str, str, bool, list[str]]:
        protection = protect_run(job, SchedulerRef("local", str(state)), str(bundle), "inc-stall", STALLED,
                                 run_dir=str(bundle), observe_steps=50, observe_timeout_s=1, notifier=None)
        while_collecting = LocalScheduler(state).show_job(job).state
        protection.collected(None)  # what the flow calls once the nodes' evidence is in
        done, stopped = protection.settle()
        return while_collecting, LocalScheduler(state).show_job(job).state, stopped, [a["action"] for a in done]

    return protect_then_collect()


def test_a_running_stalled_job_is_stopped_only_after_the_collection(tmp_path: Path, prefect_server: None) -> None:
    scheduler = LocalScheduler(tmp_path / "sched")
    scheduler.add_nodes(["n1"])
    job = scheduler.submit([sys.executable, "-c", "import time; time.sleep(120)"], ["n1"])
    try:
        while_collecting, after, stopped, actions = _protect(job, tmp_path / "sched", tmp_path / "bundle")
        assert while_collecting == "RUNNING"
        assert stopped and after != "RUNNING" and "stop" in actions
    finally:
        scheduler.stop(job, grace=0.5)


def test_a_completed_job_is_not_a_hang(tmp_path: Path, prefect_server: None) -> None:
    scheduler = LocalScheduler(tmp_path / "sched")
    scheduler.add_nodes(["n1"])
    job = scheduler.submit([sys.executable, "-c", "pass"], ["n1"])
    deadline = time.monotonic() + 60
    while scheduler.show_job(job).state == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scheduler.show_job(job).state == "COMPLETED"
    while_collecting, after, stopped, actions = _protect(job, tmp_path / "sched", tmp_path / "bundle")
    assert (while_collecting, after, stopped, actions) == ("COMPLETED", "COMPLETED", False, [])
