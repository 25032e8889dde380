"""The incident flow end to end on one machine: real sshd nodes answering from a simulated
Xid incident, the local scheduler running a real job process, real checkpoints with
manifests, the local Slack server, and a temporary Prefect server."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from spikeops.schedulers import LocalScheduler
from spikeops.sim import cluster as simcluster
from spikeops.sim.slack import SlackServer
from spikeops.sim.trainjob import lay_checkpoints

TOKEN = "xoxb-flow-test-token-000000"


def _checkpoints(root: Path, scenario: Path) -> None:
    """Real checkpoint directories (with manifests) at the scenario's checkpoint steps; the
    ones the scenario marks unverified are really damaged."""
    lay_checkpoints(root, scenario)


@pytest.fixture(params=[("gpu_xid", 5)])
def world(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    port = simcluster.free_port(("127.0.12.11",))
    with simcluster.running(tmp_path / "cluster", nodes=6, port=port, first_address="127.0.12.11",
                            scenario=request.param[0], seed=request.param[1]) as cluster, SlackServer(token=TOKEN) as slack:
        monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
        monkeypatch.setenv("SPIKEOPS_SLACK_API_URL", slack.api_url)
        scheduler = LocalScheduler(tmp_path / "sched")
        scheduler.add_nodes(cluster.nodes + ["spare-001"])
        job = scheduler.submit([sys.executable, "-c", "import time; time.sleep(120)"], cluster.nodes)
        time.sleep(0.3)
        _checkpoints(tmp_path / "ckpt", cluster.scenario_bundle)
        yield cluster, slack, scheduler, job, tmp_path


def test_an_xid_incident_is_stopped_diagnosed_isolated_and_resumed(world, prefect_server: None) -> None:
    from spikeops.flows.incident_response import incident_response

    cluster, slack, scheduler, job, tmp_path = world
    params = flow_params(
        job_id=job, inventory=str(cluster.inventory), run_dir=str(cluster.scenario_bundle),
        checkpoint_root=str(tmp_path / "ckpt"), incidents_dir=str(tmp_path / "incidents"),
        incident_id="inc-flow-1", scheduler="local", scheduler_state_dir=str(tmp_path / "sched"),
        approval="auto-hardware", observe_timeout_s=1,
    )
    outcome = incident_response(**params)
    assert outcome["symptom"]["symptom"] == "instant_nan"
    expected = json.loads((cluster.scenario_bundle / "diagnosis.expected.json").read_text()) \
        if (cluster.scenario_bundle / "diagnosis.expected.json").exists() else None
    culprits = outcome["diagnosis"]["culprit_nodes"]
    assert outcome["diagnosis"]["primary"]["cause"] == "gpu_xid" and len(culprits) == 1
    if expected:
        assert culprits == expected["culprit_nodes"]
    # stopped, then the culprit drained and nothing else
    assert scheduler.show_job(job).state != "RUNNING"
    assert [n.name for n in scheduler.drained()] == culprits
    # resumed from the verified checkpoint, without the culprit
    resumed = outcome["resumed"]
    assert resumed["outcome"] == "done", resumed
    new = scheduler.show_job(resumed["extra"]["new_job"])
    assert culprits[0] not in new.nodes and new.env["SPIKEOPS_RESUME_FROM"] == outcome["diagnosis"]["resume_from"]["path"]
    assert f"global_step{outcome['diagnosis']['resume_from']['step']}" in new.env["SPIKEOPS_RESUME_FROM"]
    # one Slack thread with every stage and the summary edited in
    parent = next(m for m in slack.messages if m.thread_ts is None)
    texts = " | ".join(m.text for m in slack.thread(parent.ts))
    for stage in ("stop", "collected", "Diagnosis", "drain", "auto-approved"):
        assert stage in texts, (stage, texts)
    assert parent.updated and "resumed" in parent.text or "gpu_xid" in parent.text
    bundle = Path(outcome["bundle"])
    assert (bundle / "report.md").is_file() and (bundle / "actions.jsonl").is_file()
    # a rerun of the same incident stops, drains and resubmits nothing more
    before = len(scheduler.jobs())
    again = incident_response(**params)
    assert len(scheduler.jobs()) == before
    assert {a["outcome"] for a in again["actions"]} <= {"nothing-to-do"}
    scheduler.stop(resumed["extra"]["new_job"], grace=0.5)


def flow_params(job_id: str, cluster: str | None = None, **overrides) -> dict:
    """The flow's keyword arguments: the job, the cluster, and every other field as an override."""
    from spikeops.flows.incident_response import IncidentOverrides

    return {"job_id": job_id, "cluster": cluster, "overrides": IncidentOverrides(**overrides)}


def _params(world, **overrides):
    cluster, _, _, job, tmp_path = world
    base = dict(job_id=job, inventory=str(cluster.inventory), run_dir=str(cluster.scenario_bundle),
                checkpoint_root=str(tmp_path / "ckpt"), incidents_dir=str(tmp_path / "incidents"),
                incident_id="inc-flow-2", scheduler="local", scheduler_state_dir=str(tmp_path / "sched"),
                observe_timeout_s=1)
    return flow_params(**{**base, **overrides})


def _decline_when_paused(world, **overrides) -> tuple[dict, list[str]]:
    """Run the flow in a thread; when it pauses for approval, a person declines through
    resume_flow_run. The flow's outcome and the Slack texts."""
    import threading

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.flow_runs import resume_flow_run

    from spikeops.flows.incident_response import incident_response

    slack = world[1]
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(incident_response(
        **_params(world, approval_timeout_s=120, **overrides))))
    runner.start()
    paused = None
    deadline = time.monotonic() + 90
    with get_client(sync_client=True) as client:
        while paused is None and time.monotonic() < deadline and runner.is_alive():
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=["PAUSED"]))))
            paused = runs[0] if runs else None
            time.sleep(0.5)
    assert paused is not None, f"the flow never paused for approval (it returned {result})"
    resume_flow_run(paused.id, run_input={"approve": False, "approver": "alice", "note": "false positive?"})
    runner.join(120)
    return result, [m.text for m in slack.messages]


def test_isolation_waits_for_a_person_and_a_decline_changes_nothing(world, prefect_server: None) -> None:
    """approval=always: the flow pauses with a typed input; a person declines through
    resume_flow_run; no node is drained and the job is not resubmitted."""
    scheduler = world[2]
    result, texts = _decline_when_paused(world)
    assert any("Waiting for approval to drain" in text for text in texts)
    assert result["approval"] == "declined by alice"
    assert scheduler.drained() == []
    assert result["resumed"]["outcome"] == "not resumed"
    assert len(scheduler.jobs()) == 1


@pytest.mark.parametrize("world", [("overlong_sample", 3)], indirect=True)
def test_always_means_a_resume_without_culprits_waits_for_a_person_too(world, prefect_server: None) -> None:
    """approval=always gates every action: a data NaN (no node to drain) is stopped, but its
    resume waits for a person, and a decline leaves the job stopped and nothing resubmitted."""
    scheduler, job = world[2], world[3]
    result, texts = _decline_when_paused(world, incident_id="inc-flow-gate")
    assert any("Waiting for approval to resume from" in text and "skip the batches" in text for text in texts)
    assert result["resumed"] == {"outcome": "not resumed", "detail": "resume not approved: declined by alice"}
    assert scheduler.show_job(job).state != "RUNNING" and len(scheduler.jobs()) == 1
    assert any("Not resumed automatically" in text for text in texts)


@pytest.mark.parametrize("world", [("false_alarm", 5)], indirect=True)
def test_a_false_alarm_changes_nothing(world, prefect_server: None) -> None:
    from spikeops.flows.incident_response import incident_response

    _, _, scheduler, job, _ = world
    outcome = incident_response(**_params(world, incident_id="inc-flow-3"))
    assert outcome["diagnosis"]["primary"]["cause"] == "false_alarm" and outcome["actions"] == []
    assert scheduler.show_job(job).state == "RUNNING" and scheduler.drained() == []
    scheduler.stop(job, grace=0.5)


@pytest.mark.parametrize("world", [("overlong_sample", 0)], indirect=True)  # seed 0: a single spike
def test_a_single_spike_from_data_keeps_the_job_running(world, prefect_server: None) -> None:
    from spikeops.flows.incident_response import incident_response

    _, _, scheduler, job, _ = world
    outcome = incident_response(**_params(world, incident_id="inc-flow-4"))
    assert outcome["diagnosis"]["primary"]["cause"] == "overlong_sample"
    assert outcome["symptom"]["symptom"] == "single_spike"
    assert scheduler.show_job(job).state == "RUNNING"  # the matrix: record and observe, do not stop
    assert outcome["observed"]["symptom"] == "single_spike"  # watched (bounded), still a single spike
    assert scheduler.drained() == [] and outcome["diagnosis"]["culprit_nodes"] == []
    scheduler.stop(job, grace=0.5)


def test_a_resume_that_cannot_happen_leaves_the_culprit_drained_for_validation(world, prefect_server: None) -> None:
    """The spare node is down (someone else's RMA): the job cannot run without the culprit. The
    culprit's conviction still holds, so it stays drained until it passes validation (issue 26:
    no node spikeops drained returns without one), and the thread says so."""
    from spikeops.flows.incident_response import incident_response

    _, slack, scheduler, job, _ = world
    scheduler.set_node("spare-001", "DOWN", "RMA 1234", "bob")
    outcome = incident_response(**_params(world, incident_id="inc-flow-5", approval="auto-hardware"))
    assert [a["outcome"] for a in outcome["actions"] if a["action"] == "drain"] == ["done"]
    assert outcome["resumed"]["outcome"] == "not resumed" and "stay drained" in outcome["rolled_back"]
    assert [n.name for n in scheduler.drained()] == outcome["diagnosis"]["culprit_nodes"]  # not released
    assert scheduler.nodes()["spare-001"].reason == "RMA 1234"  # someone else's node untouched
    assert any("until they pass validation" in m.text for m in slack.messages)


def test_a_broken_flow_says_so_in_the_thread(world, prefect_server: None, tmp_path: Path) -> None:
    from spikeops.flows.incident_response import incident_response

    _, slack, scheduler, job, _ = world
    with pytest.raises(Exception, match="no such inventory"):
        incident_response(**_params(world, incident_id="inc-flow-6", inventory=str(tmp_path / "missing.toml")))
    parent = next(m for m in slack.messages if m.thread_ts is None)
    failure = [m for m in slack.thread(parent.ts) if "incident flow failed" in m.text]
    assert failure and "no such inventory" in failure[0].text
    scheduler.stop(job, grace=0.5)


@pytest.mark.parametrize("world", [("overlong_sample", 3)], indirect=True)
def test_a_data_nan_resumes_with_its_batches_skipped(world, prefect_server: None) -> None:
    from spikeops.flows.incident_response import incident_response

    cluster, slack, scheduler, job, _ = world
    outcome = incident_response(**_params(world, incident_id="inc-flow-data", approval="auto-hardware"))
    assert outcome["symptom"]["symptom"] == "instant_nan"
    assert outcome["diagnosis"]["primary"]["cause"] == "overlong_sample" and not scheduler.drained()
    resumed = outcome["resumed"]
    assert resumed["outcome"] == "done", resumed
    new = scheduler.show_job(resumed["extra"]["new_job"])
    diagnosis = json.loads((Path(outcome["bundle"]) / "diagnosis.json").read_text())
    skip = next(a for a in diagnosis["actions"] if a["kind"] == "skip_batches")
    assert new.env["SPIKEOPS_SKIP_STEPS"] == ":".join(str(s) for s in skip["steps"])
    assert "NCCL_DEBUG" not in new.env and sorted(new.nodes) == sorted(cluster.nodes)
    texts = " | ".join(m.text for m in slack.messages)
    assert "remediation: skip the batches of step" in texts, texts
    scheduler.stop(new.job_id, grace=0.5)


def test_incidents_of_one_job_wait_for_each_other(prefect_server: None) -> None:
    """The per-job limit: a second incident of the same job waits; another job's does not."""
    import threading

    from spikeops.tasks.concurrency import one_incident_per_job

    held, release = threading.Event(), threading.Event()

    def first() -> None:
        with one_incident_per_job("77001", timeout_s=30):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=first)
    holder.start()
    try:
        assert held.wait(30)
        with pytest.raises(TimeoutError):
            with one_incident_per_job("77001", timeout_s=2):
                pass
        with one_incident_per_job("77002", timeout_s=5):  # another job: at once
            pass
    finally:
        release.set()
        holder.join(30)
    with one_incident_per_job("77001", timeout_s=10):  # free again once the first ended
        pass


def test_preflight_refuses_a_bad_path_before_the_job_is_touched(world, prefect_server: None, tmp_path: Path) -> None:
    from spikeops.flows.incident_response import incident_response

    _, slack, scheduler, job, _ = world
    with pytest.raises(Exception, match="preflight refused") as error:
        incident_response(**_params(world, incident_id="inc-flow-typo", run_dir=str(tmp_path / "runz"),
                                    checkpoint_root=str(tmp_path / "ckptz")))
    assert "run_dir" in str(error.value) and "checkpoint_root" in str(error.value)
    assert scheduler.show_job(job).state == "RUNNING"  # nothing was stopped
    assert not scheduler.drained()
    failure = [m.text for m in slack.messages if "incident flow failed" in m.text]
    assert failure and "not touched" in failure[0] and "runz: no such directory" in failure[0]
    scheduler.stop(job, grace=0.5)
