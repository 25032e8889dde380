"""The replay gate through the incident flow, on real computation.

examples/train_tiny.py runs as a 3-process gloo job on CPU (one process per simulated node),
started by the local scheduler on nodes that are real sshd servers (their probes show healthy
hardware: no Xid, no ECC, nothing a node-side tool would see). Each incident is a real
divergence; the flow collects, diagnoses, replays the spike window from the checkpoint before
it on the original nodes and on spares, diagnoses again with the replays, then acts:

- ``sdc_persistent``: one node's "GPU" flips a bit in a matmul from step 23 on. The replay on
  the original nodes reproduces the spike, the one on spares does not, and at the first step
  where they differ only that node's rank's gradients differ: that node, and only it, is
  drained; the job resumes without it.
- ``replay_data``: an overlong sample at step 23 and no flip: both replays reproduce the spike
  bit for bit: the data cause is confirmed and nothing is drained.
- ``sdc_transient``: one flip at step 23 only: neither replay meets it again: a transient,
  resumed as planned and said so.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spikeops.schedulers import LocalScheduler
from spikeops.sim import cluster as simcluster

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tiny.py"
SPARES = ["spare-001", "spare-002", "spare-003"]
SPIKE = 23
SCENARIOS = {
    "sdc_persistent": lambda bad: ["--inject-flip", bad, "--flip-from", str(SPIKE)],
    "sdc_transient": lambda bad: ["--inject-flip", bad, "--flip-from", str(SPIKE), "--flip-once"],
    "replay_data": lambda bad: ["--inject-overlong", str(SPIKE), "--inject-rank", "1"],
}


def _wait_done(scheduler: LocalScheduler, job: str, seconds: float = 300) -> str:
    deadline = time.monotonic() + seconds
    state = scheduler.show_job(job).state
    while state == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
        state = scheduler.show_job(job).state
    return state


@pytest.fixture(params=list(SCENARIOS))
def incident(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    from spikeops.schedulers.jobenv import command_env
    import os

    port = simcluster.free_port(("127.0.16.11",))
    with simcluster.running(tmp_path / "cluster", nodes=3, port=port, first_address="127.0.16.11",
                            scenario="false_alarm", seed=3) as cluster:
        scheduler = LocalScheduler(tmp_path / "sched")
        scheduler.add_nodes(cluster.nodes + SPARES)
        bad = cluster.nodes[1]
        run = tmp_path / "run"
        argv = [sys.executable, str(EXAMPLE), "--out", str(run), "--launch", "--steps", str(SPIKE + 1),
                "--ckpt-every", "10", *SCENARIOS[request.param](bad)]
        job = scheduler.submit(argv, cluster.nodes, environment=command_env(os.environ), cwd=str(tmp_path))
        assert _wait_done(scheduler, job) == "COMPLETED", (tmp_path / "sched" / "jobs" / f"{job}.out").read_text()[-2000:]
        yield request.param, cluster, scheduler, job, run, bad, tmp_path
        for other in scheduler.jobs():
            if other.state == "RUNNING":
                scheduler.stop(other.job_id, grace=0.5)


def test_the_replay_gate_tells_a_corrupting_gpu_from_data_and_from_a_transient(incident: Any,
                                                                              prefect_server: None) -> None:
    from spikeops.flows.incident_response import IncidentOverrides, incident_response

    scenario, cluster, scheduler, job, run, bad, tmp_path = incident
    outcome = incident_response(job, overrides=IncidentOverrides(
        inventory=str(cluster.inventory), run_dir=str(run), checkpoint_root=str(run / "ckpt"),
        incidents_dir=str(tmp_path / "incidents"), incident_id=f"inc-{scenario.replace('_', '-')}",
        scheduler="local", scheduler_state_dir=str(tmp_path / "sched"), approval="auto-hardware",
        replay="auto", replay_steps=50, replay_timeout_s=600, observe_timeout_s=1))
    bundle = Path(outcome["bundle"])
    replay = outcome.get("replay") or {}
    assert replay.get("ran"), replay
    for name in ("same-nodes", "other-nodes"):
        assert (bundle / "replay" / name / "replay.jsonl").is_file()
    diagnosis = json.loads((bundle / "diagnosis.json").read_text())
    drained = [n.name for n in scheduler.drained()]
    resumed = outcome.get("resumed") or {}
    thread = [json.loads(line).get("text", "") for line in (bundle / "outbox.jsonl").read_text().splitlines()]
    verdict_lines = [t for t in thread if t.startswith("Replay verdict")]
    assert verdict_lines and "steps replayed twice" in verdict_lines[0]  # the cost is in the thread
    if scenario == "sdc_persistent":
        assert replay["verdict"]["verdict"] == "sdc"
        assert diagnosis["primary"]["cause"] == "silent_data_corruption"
        assert diagnosis["culprit_nodes"] == [bad] and drained == [bad]
        assert resumed.get("outcome") == "done"
        new = scheduler.show_job(resumed["extra"]["new_job"])
        assert bad not in new.nodes and len(new.nodes) == 3
    elif scenario == "replay_data":
        assert replay["verdict"]["verdict"] == "reproduced"
        assert diagnosis["primary"]["cause"] == "overlong_sample" and not diagnosis["culprit_nodes"]
        assert drained == [] and resumed.get("outcome") == "done"
        assert scheduler.show_job(resumed["extra"]["new_job"]).env.get("SPIKEOPS_SKIP_STEPS")
    else:
        assert replay["verdict"]["verdict"] == "transient"
        assert not diagnosis["culprit_nodes"] and drained == []
        assert resumed.get("outcome") == "done"
        assert "transient" in verdict_lines[0]
