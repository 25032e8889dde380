"""The incident flow with ``scheduler="slurm"`` against a real Slurm (munged, slurmctld and
one slurmd per node on this machine), real sshd nodes answering from a simulated incident,
real checkpoints with manifests, the Slack-compatible server and a temporary Prefect server.

The Slurm nodes carry the scenario's own node names (plus one spare), so the job Slurm
runs, the nodes the flow collects from over SSH and the node it drains are the same
nodes. Which scenario and seed each test runs is looked up from the simulator's answer
(``build_bundle``'s ``Expected``), not hard-coded, and the flow's results are checked
against that answer. Skipped where Slurm or root is missing (CI installs Slurm)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spikeops.schedulers import ActionLog, SlurmConfig, SlurmScheduler
from spikeops.schedulers.base import LocalRunner
from spikeops.sim import CAUSES, Expected, build_bundle
from spikeops.sim import cluster as simcluster
from spikeops.sim import slurmcluster
from spikeops.sim.slack import SlackServer
from tests.test_incident_flow import _checkpoints

TOKEN = "xoxb-slurm-flow-token-000000"
FIRST_ADDRESS = "127.0.50.11"
NODES = 4  # the job's nodes; the Slurm cluster has one spare beside them
SPARE = "spare-001"
SEEDS = range(40)
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch", "/usr/bin/scontrol")
FINISHED = {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}


def _require_slurm() -> None:
    missing = [path for path in DAEMONS if not os.access(path, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs as root (SlurmUser=root)")


def _find(wanted: Callable[[Expected], bool], causes: tuple[str, ...] = CAUSES) -> tuple[str, int, Expected]:
    """The first (cause, seed) whose simulated incident on NODES nodes is ``wanted``, with
    its answer; built exactly as ``spikeops.sim.cluster.up`` builds it (no distractors)."""
    with tempfile.TemporaryDirectory(prefix="slurmflow-find-") as scratch:
        for cause in causes:
            for seed in SEEDS:
                answer = build_bundle(Path(scratch) / f"{cause}-{seed}", cause, seed=seed, nodes=NODES,
                                      distractors=False)
                if wanted(answer):
                    return cause, seed, answer
    raise AssertionError(f"no simulated incident among {causes} x seeds {SEEDS} is the one this test needs")


@dataclass
class World:
    cluster: simcluster.Cluster
    slurm: slurmcluster.SlurmCluster
    slack: SlackServer
    scheduler: SlurmScheduler
    job: str
    answer: Expected
    tmp: Path

    def run(self, *argv: str) -> str:
        env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        return subprocess.run(list(argv), env={**env, **self.slurm.env}, capture_output=True, text=True,
                              timeout=20, check=True).stdout

    def state(self, job: str) -> str:
        return self.scheduler.show_job(job)[0].state

    def jobs(self) -> list[str]:
        """Every job Slurm knows of, finished ones included (MinJobAge keeps them)."""
        return self.run("squeue", "--states=all", "-h", "-o", "%i").split()

    def runs(self) -> list[str]:
        """One line per start of the batch script: ``NODELIST RESUME_FROM``."""
        path = self.tmp / "runs.txt"
        return path.read_text().splitlines() if path.is_file() else []

    def give_back(self) -> None:
        """The cluster as found: our drains released, every job cancelled."""
        drained = [node.name for node in self.scheduler.drained()]
        if drained:
            self.scheduler.release(drained)
        live = self.run("squeue", "-h", "-o", "%i").split()
        if live:
            self.run("scancel", *live)

    def params(self, incident_id: str, **overrides: Any):
        from tests.test_incident_flow import flow_params

        base = dict(job_id=self.job, inventory=str(self.cluster.inventory), run_dir=str(self.cluster.scenario_bundle),
                    checkpoint_root=str(self.tmp / "ckpt"), incidents_dir=str(self.tmp / "incidents"),
                    incident_id=incident_id, scheduler="slurm", observe_timeout_s=1)
        return flow_params(**{**base, **overrides})


def _wait(what: str, probe: Callable[[], Any], seconds: float = 30) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        answer = probe()
        if answer:
            return answer
        assert time.monotonic() < deadline, f"{what}: not after {seconds:.0f} s (last: {answer!r})"
        time.sleep(0.1)


def _batch_script(tmp: Path, nodes: int) -> Path:
    """A job that records where it runs and from which checkpoint, takes USR1 (the flow's
    save-and-exit request) without exiting, and runs until cancelled. ``--nodes`` is in the
    script so that a resubmission asks for as many nodes as the original."""
    script = tmp / "train.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"#SBATCH --nodes={nodes}\n"
        f"#SBATCH --output={tmp}/slurm-%j.out\n"
        f'echo "$SLURM_JOB_NODELIST ${{SPIKEOPS_RESUME_FROM:-none}}" >> {tmp}/runs.txt\n'
        f"trap 'echo $SLURM_JOB_ID >> {tmp}/usr1.txt' USR1\n"
        "while true; do sleep 0.2; done\n")
    return script


@pytest.fixture
def world(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """``request.param``: which incident (a predicate on the simulator's answer, and the
    causes to look among). The job runs on the scenario's nodes; the spare stays idle."""
    _require_slurm()
    wanted, causes = request.param
    cause, seed, answer = _find(wanted, causes)
    port = simcluster.free_port((FIRST_ADDRESS,))
    with simcluster.running(tmp_path / "cluster", nodes=NODES, port=port, first_address=FIRST_ADDRESS,
                            scenario=cause, seed=seed) as cluster, \
            slurmcluster.running(tmp_path / "slurm", names=[*cluster.nodes, SPARE]) as slurm, \
            SlackServer(token=TOKEN) as slack:
        monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
        monkeypatch.setenv("SPIKEOPS_SLACK_API_URL", slack.api_url)
        monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        scheduler = SlurmScheduler(LocalRunner(slurm.env), SlurmConfig(timeout=20), ActionLog(None))
        world = World(cluster, slurm, slack, scheduler, "", answer, tmp_path)
        world.job = world.run("sbatch", "--parsable", "-w", ",".join(cluster.nodes), f"--chdir={tmp_path}",
                              str(_batch_script(tmp_path, len(cluster.nodes)))).strip().split(";")[0]
        _wait(f"job {world.job} running", lambda: world.state(world.job) == "RUNNING" and world.runs())
        time.sleep(0.5)  # slurmd registers the batch step a moment after the script starts
        _checkpoints(tmp_path / "ckpt", cluster.scenario_bundle)
        try:
            yield world
        finally:
            world.give_back()


def _paused_run(incident_id: str, runner: threading.Thread) -> Any:
    """The paused flow run of this incident (the Prefect server is shared by the session)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    paused_filter = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["PAUSED"])))
    deadline = time.monotonic() + 90
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline and runner.is_alive():
            for run in client.read_flow_runs(flow_run_filter=paused_filter):
                if ((run.parameters or {}).get("overrides") or {}).get("incident_id") == incident_id:
                    return run
            time.sleep(0.3)
    return None


def _run_approved(params: Any) -> dict[str, Any]:
    """Run the flow in a thread and answer its approval as a person would: yes."""
    from prefect.flow_runs import resume_flow_run

    from spikeops.flows.incident_response import incident_response

    result: dict[str, Any] = {}
    failed: list[BaseException] = []

    def body() -> None:
        try:
            result.update(incident_response(**params))
        except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
            failed.append(exc)

    runner = threading.Thread(target=body)
    runner.start()
    paused = _paused_run(params["overrides"].incident_id, runner)
    if paused is not None:
        resume_flow_run(paused.id, run_input={"approve": True, "approver": "test"})
    runner.join(180)
    assert not failed, failed
    assert paused is not None, f"the flow never paused for approval (it returned {result})"
    return result


def _hardware_nan(answer: Expected) -> bool:
    return (answer.symptom == "instant_nan" and answer.cause == "gpu_xid" and len(answer.culprit_nodes) == 1
            and answer.resume_from is not None)


@pytest.mark.parametrize("world", [(_hardware_nan, ("gpu_xid",))], indirect=True)
def test_an_xid_nan_is_approved_then_drained_and_resumed_without_the_node(world: World, prefect_server: None) -> None:
    answer, incident_id = world.answer, "inc-slurm-xid"
    outcome = _run_approved(world.params(incident_id, approval="always", approval_timeout_s=120))
    assert outcome["symptom"]["symptom"] == "instant_nan"
    diagnosis = outcome["diagnosis"]
    culprit = diagnosis["culprit_nodes"]
    assert diagnosis["primary"]["cause"] == "gpu_xid" and culprit == answer.culprit_nodes
    assert outcome["approval"] == "approved by test"
    # exactly the culprit drained, with a spikeops reason naming the cause and the incident
    drained = world.scheduler.drained()
    assert [node.name for node in drained] == culprit
    assert drained[0].reason.startswith("spikeops:") and "gpu_xid" in drained[0].reason \
        and incident_id in drained[0].reason
    assert "DRAIN" in world.scheduler.show_nodes()[0][culprit[0]].state
    # the original job: asked to save (USR1 reached the script), then cancelled; its script kept
    assert world.state(world.job) == "CANCELLED"
    assert (world.tmp / "usr1.txt").read_text().split() == [world.job]
    bundle = Path(outcome["bundle"])
    assert (bundle / "scheduler" / f"batch-{world.job}.sh").read_text() == (world.tmp / "train.sh").read_text()
    # resubmitted from the newest verified checkpoint before the onset, on as many nodes, not the culprit
    resumed = outcome["resumed"]
    assert resumed["outcome"] == "done", resumed
    resume_from = diagnosis["resume_from"]
    assert resume_from["step"] == answer.resume_from["step"] and resume_from["step"] <= answer.onset_step
    assert Path(resume_from["path"]).parent == world.tmp / "ckpt"
    new = resumed["extra"]["new_job"]
    _wait(f"resumed job {new} running", lambda: world.state(new) == "RUNNING" and len(world.runs()) == 2)
    first, second = world.runs()
    assert first.split() == [world.scheduler.show_job(world.job)[0].fields["NodeList"], "none"]
    nodelist, checkpoint = second.split()
    nodes = world.scheduler.show_job(new)[0].nodes
    assert checkpoint == resume_from["path"]
    assert nodelist == world.scheduler.show_job(new)[0].fields["NodeList"]
    assert culprit[0] not in nodes and len(nodes) == NODES and SPARE in nodes
    # one Slack thread with every stage
    parent = next(m for m in world.slack.messages if m.thread_ts is None)
    texts = " | ".join(m.text for m in world.slack.thread(parent.ts))
    for stage in ("stop", "collected", "Diagnosis", "Waiting for approval", "drain", f"resubmitted as job {new}"):
        assert stage in texts, (stage, texts)
    # a rerun of the same incident (approved again) drains and submits nothing more
    jobs = world.jobs()
    again = _run_approved(world.params(incident_id, approval="always", approval_timeout_s=120))
    assert world.jobs() == jobs and [node.name for node in world.scheduler.drained()] == culprit
    changing = [a for a in again["actions"] if a["action"] != "preserve"]  # preserve only reads and records
    assert {a["action"] for a in changing} == {"stop", "drain", "resume"}
    assert {a["outcome"] for a in changing} == {"nothing-to-do"}, changing
    assert again["resumed"]["extra"]["new_job"] == new


def _data_single_spike(answer: Expected) -> bool:
    return answer.symptom == "single_spike" and answer.layer == "data"


@pytest.mark.parametrize("world", [(_data_single_spike, CAUSES)], indirect=True)
def test_a_single_spike_from_data_keeps_the_slurm_job_running(world: World, prefect_server: None) -> None:
    from spikeops.flows.incident_response import incident_response

    outcome = incident_response(**world.params("inc-slurm-spike"))
    assert outcome["symptom"]["symptom"] == "single_spike" and outcome["observed"]["symptom"] == "single_spike"
    assert outcome["diagnosis"]["primary"]["cause"] == world.answer.cause
    assert outcome["diagnosis"]["culprit_nodes"] == [] and outcome["actions"] == []
    assert world.state(world.job) == "RUNNING" and world.jobs() == [world.job]
    assert world.scheduler.drained() == [] and not (world.tmp / "usr1.txt").exists()


@pytest.mark.parametrize("world", [(lambda answer: answer.cause == "false_alarm", ("false_alarm",))], indirect=True)
def test_a_false_alarm_changes_nothing_on_slurm(world: World, prefect_server: None) -> None:
    from spikeops.flows.incident_response import incident_response

    outcome = incident_response(**world.params("inc-slurm-false"))
    assert outcome["diagnosis"]["primary"]["cause"] == "false_alarm" and outcome["actions"] == []
    assert world.state(world.job) == "RUNNING" and world.jobs() == [world.job]
    assert world.scheduler.drained() == [] and not (world.tmp / "usr1.txt").exists()
    assert world.runs() == [f"{world.scheduler.show_job(world.job)[0].fields['NodeList']} none"]
