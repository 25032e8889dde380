"""The incident flow's memory across incidents, end to end on one machine: real sshd nodes
answering from a simulated incident, the local scheduler running real job processes, real
checkpoints with manifests, the Slack-compatible server, a temporary Prefect server and a
SQLite ledger; the configuration is a real spikeops.toml whose paths are ``{job}`` templates.

- a NaN that comes back at the same step after each resume: the second incident finds the
  first in history.json, is diagnosed ``poisoned_checkpoint``, resumes from the older
  checkpoint (never the same one) and quarantines the suspect; the culprit drained by the
  first is called into question, and stays drained; the third incident stops for a person
  (the restart budget of two automatic resumes is spent), mentioning the on-call;
- a data cause that recurs gets a wider skip;
- an unreachable ledger does not stop an incident: its entry waits in the spool and is
  written by the next incident.

Which scenario and seed each test runs is looked up from the simulator's answer, not
hard-coded."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spikeops.checkpoints.manifest import QUARANTINE_MARKER
from spikeops.schedulers import LocalScheduler
from spikeops.sim import Expected
from spikeops.sim import cluster as simcluster
from spikeops.sim.slack import SlackServer
from spikeops.sim.trainjob import lay_checkpoints
from tests import test_incident_flow_slurm as slurmflow

TOKEN = "xoxb-ledger-flow-token-00000"
FIRST_ADDRESS = "127.0.61.11"
NODES = 4
SPARE = "spare-001"
#: An address of the sim's block with no server: the spare answers nothing (unreachable is evidence).
SPARE_ADDRESS = "127.0.61.250"
ONCALL = "<!subteam^S0ONCALL>"
FILES = ("metrics.jsonl", "ranks.jsonl", "batches.jsonl", "train.log", "incident.json")


def find(wanted: Callable[[Expected], bool], causes: tuple[str, ...]) -> tuple[str, int]:
    """The first (cause, seed) whose simulated incident on NODES nodes is ``wanted``."""
    assert slurmflow.NODES == NODES
    cause, seed, _ = slurmflow._find(wanted, causes)
    return cause, seed


def add_spare(inventory: Path, spare: str, address: str) -> None:
    """The spare in the collector's inventory (a resumed job may land on it)."""
    text = inventory.read_text()
    nodes = re.search(r'^nodes = "(.*)"$', text, re.M)
    assert nodes is not None, text
    text = text.replace(nodes.group(0), f'nodes = "{nodes.group(1)},{spare}"')
    text = text.replace("[hosts]\n", f'[hosts]\n"{spare}" = "{address}"\n')
    inventory.write_text(text)


def config_text(tmp: Path, inventory: Path, scheduler: str, **extra: Any) -> str:
    lines = ["[incidents]", f'dir = "{tmp}/incidents"', "", "[clusters.sim]", f'inventory = "{inventory}"',
             f'scheduler = "{scheduler}"', f'run_dir = "{tmp}/runs/{{job}}"', f'checkpoint_root = "{tmp}/ckpt/{{job}}"',
             'approval = "auto-hardware"', "observe_timeout_s = 1", 'replay = "never"', "max_auto_resumes = 2",
             'recurrence_window = "24h"', f'oncall = "{ONCALL}"', 'slack_channel = "#incidents"']
    lines += [f"{key} = {json.dumps(value)}" for key, value in extra.items()]
    return "\n".join(lines) + "\n"


def relog(run_dir: Path, after: int) -> None:
    """The resumed run logs the steps after its checkpoint again, and the same NaN comes at
    the same step: the re-logged lines are appended, as a resumed job appends to its log."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    first = [line for line in lines if line.strip()]
    seen, original = set(), []
    for line in first:  # the first run's lines (a second relog must not double the second run)
        step = json.loads(line)["step"]
        if step in seen:
            break
        seen.add(step)
        original.append(line)
    again = [line for line in original if json.loads(line)["step"] > after]
    path.write_text("\n".join(lines + again) + "\n")


@dataclass
class World:
    cluster: simcluster.Cluster
    slack: SlackServer
    scheduler: LocalScheduler
    job: str
    tmp: Path
    ledger_url: str

    def run(self, job: str, incident: str, **overrides: Any) -> dict[str, Any]:
        from spikeops.flows.incident_response import incident_response
        from tests.test_incident_flow import flow_params

        return incident_response(**flow_params(job, "sim", incident_id=incident, **overrides))

    def texts(self) -> str:
        return " | ".join(m.text for m in self.slack.messages)

    def ledger(self) -> Any:
        from spikeops.ledger.store import Ledger

        return Ledger(self.ledger_url)


@pytest.fixture
def world(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """``request.param``: (predicate on the simulator's answer, causes to look among)."""
    cause, seed = find(*request.param)
    port = simcluster.free_port((FIRST_ADDRESS,))
    with simcluster.scratch() as scratch, \
            simcluster.running(scratch / "cluster", nodes=NODES, port=port, first_address=FIRST_ADDRESS,
                               scenario=cause, seed=seed) as cluster, SlackServer(token=TOKEN) as slack:
        add_spare(cluster.inventory, SPARE, SPARE_ADDRESS)
        ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
        monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
        monkeypatch.setenv("SPIKEOPS_SLACK_API_URL", slack.api_url)
        monkeypatch.setenv("SPIKEOPS_LEDGER_URL", ledger_url)
        config = tmp_path / "spikeops.toml"
        config.write_text(config_text(tmp_path, cluster.inventory, "local", scheduler_state_dir=str(tmp_path / "sched")))
        monkeypatch.setenv("SPIKEOPS_CONFIG", str(config))
        scheduler = LocalScheduler(tmp_path / "sched")
        scheduler.add_nodes(cluster.nodes + [SPARE])
        job = scheduler.submit([sys.executable, "-c", "import time; time.sleep(600)"], cluster.nodes)
        run_dir = tmp_path / "runs" / job
        run_dir.mkdir(parents=True)
        for name in FILES:
            if (cluster.scenario_bundle / name).is_file():
                shutil.copy2(cluster.scenario_bundle / name, run_dir / name)
        if (cluster.scenario_bundle / "reference").is_dir():
            shutil.copytree(cluster.scenario_bundle / "reference", run_dir / "reference")
        lay_checkpoints(tmp_path / "ckpt" / job, cluster.scenario_bundle)
        time.sleep(0.3)
        world = World(cluster, slack, scheduler, job, tmp_path, ledger_url)
        try:
            yield world
        finally:
            for info in scheduler.jobs():
                if info.state == "RUNNING":
                    scheduler.stop(info.job_id, grace=0.5)


def _xid_nan(answer: Expected) -> bool:
    return (answer.symptom == "instant_nan" and answer.cause == "gpu_xid" and len(answer.culprit_nodes) == 1
            and answer.resume_from is not None and answer.resume_from["step"] < answer.onset_step)


def _history(bundle: Path) -> list[dict[str, Any]]:
    return json.loads((bundle / "history.json").read_text())


@pytest.mark.parametrize("world", [(_xid_nan, ("gpu_xid",))], indirect=True)
def test_a_nan_that_recurs_after_each_resume_is_resumed_twice_from_older_checkpoints_then_waits(
        world: World, prefect_server: None) -> None:
    tmp, job1 = world.tmp, world.job
    ckpt, run_dir = tmp / "ckpt" / job1, tmp / "runs" / job1
    # 1: an Xid NaN; the culprit drained, the job resumed from the newest verified checkpoint
    first = world.run(job1, "inc-rec-1")
    diagnosis = first["diagnosis"]
    assert diagnosis["primary"]["cause"] == "gpu_xid" and len(diagnosis["culprit_nodes"]) == 1
    culprit = diagnosis["culprit_nodes"][0]
    c1 = diagnosis["resume_from"]
    assert first["resumed"]["outcome"] == "done", first["resumed"]
    job2 = first["resumed"]["extra"]["new_job"]
    assert Path(c1["path"]).parent == ckpt and _history(Path(first["bundle"])) == []
    assert first["lost"]["gpus"] and first["lost"]["gpu_hours"] > 0
    assert "GPU-hours lost" in first["summary"]

    # 2: the resumed job NaNs again at the same step
    relog(run_dir, c1["step"])
    second = world.run(job2, "inc-rec-2")  # preflight passes: job 2 trains in job 1's directories
    bundle2 = Path(second["bundle"])
    history = _history(bundle2)
    assert [h["incident_id"] for h in history] == ["inc-rec-1"]
    assert history[0]["resumed_as"] == job2 and history[0]["resumed_from"]["path"] == c1["path"]
    assert history[0]["plan"]["excluded"] == [culprit]
    incident2 = json.loads((bundle2 / "incident.json").read_text())
    assert incident2["job"]["resumed_from"]["path"] == c1["path"]  # from the lineage
    assert second["diagnosis"]["primary"]["cause"] == "poisoned_checkpoint"
    c2 = second["diagnosis"]["resume_from"]
    assert c2 is not None and c2["step"] < c1["step"] and c2["path"] != c1["path"]
    assert second["resumed"]["outcome"] == "done", second["resumed"]
    job3 = second["resumed"]["extra"]["new_job"]
    assert world.scheduler.show_job(job3).env["SPIKEOPS_RESUME_FROM"] == c2["path"]
    marker = json.loads((Path(c1["path"]) / QUARANTINE_MARKER).read_text())
    assert marker["reason"].startswith("poisoned") and "inc-rec-2" in marker["reason"]
    # the conviction of the first incident is in doubt: said, recorded, and the node stays drained
    texts = world.texts()
    assert f"The conviction of {culprit} in inc-rec-1 (gpu_xid) is in doubt" in texts, texts
    assert [n.name for n in world.scheduler.drained()] == [culprit]
    report = (bundle2 / "report.md").read_text()
    assert "Conviction in doubt" in report and "## Cost" in report and "inc-rec-1" in report

    # 3: and again: the budget of two automatic resumes is spent, a person decides (nobody answers)
    relog(run_dir, c2["step"])
    third = world.run(job3, "inc-rec-3", approval_timeout_s=3)
    assert third["diagnosis"]["primary"]["cause"] == "poisoned_checkpoint"
    assert third["resumed"]["outcome"] == "not resumed", third["resumed"]
    assert world.scheduler.show_job(job3).state != "RUNNING"
    assert len(world.scheduler.jobs()) == 3  # nothing resubmitted
    texts = world.texts()
    assert f"{ONCALL} Restart budget spent: 2 of 2 automatic resumes" in texts, texts
    assert f"Job {job3} is left STOPPED" in texts
    assert [h["incident_id"] for h in _history(Path(third["bundle"]))] == ["inc-rec-1", "inc-rec-2"]
    import os
    if os.environ.get("SHOW_TEXTS"):
        print("\n".join(m.text for m in world.slack.messages))

    # the ledger: one lineage of three incidents, two automatic resumes, the cost of each
    with world.ledger() as ledger:
        rows = {r["incident_id"]: r for r in ledger.lineage_incidents("sim", job1)}
        assert set(rows) == {"inc-rec-1", "inc-rec-2", "inc-rec-3"}
        assert rows["inc-rec-2"]["recurrence_of"] == "inc-rec-1" and rows["inc-rec-3"]["recurrence_of"] == "inc-rec-2"
        assert rows["inc-rec-3"]["held_for_person"] and not rows["inc-rec-1"]["held_for_person"]
        assert [r["new_job"] for r in ledger.resumes_of("sim", job1) if r["status"] == "done"] == [job2, job3]
        assert ledger.job("sim", job3)["checkpoint_root"] == str(ckpt)
        assert ledger.lineage_count("sim", job1) == 3
    from spikeops.cli import main as cli

    class Out:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> None:
            self.text += text

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    out, err = Out(), Out()
    assert cli(["nodes", "history", culprit, "--json"], out=out, err=err) == 0, err.text
    record = json.loads(out.text)
    assert record["state"] == "drained" and record["convictions"][0]["incident_id"] == "inc-rec-1"
    assert record["convictions"][0]["in_doubt"][0]["incident_id"] == "inc-rec-2"
    out = Out()
    assert cli(["incidents", "report", "--json", "--since", "all"], out=out, err=err) == 0, err.text
    report = json.loads(out.text)
    assert report["repeat_lineages"][0]["incidents"] == 3 and report["repeat_lineages"][0]["held_for_person"]
    assert report["total"]["recurrences"] == 2 and report["total"]["gpu_hours"] > 0


def _data_nan(answer: Expected) -> bool:
    return (answer.symptom == "instant_nan" and answer.layer == "data" and answer.resume_from is not None
            and answer.cause in ("overlong_sample", "corrupted_sample"))


@pytest.mark.parametrize("world", [(_data_nan, ("overlong_sample", "corrupted_sample"))], indirect=True)
def test_a_data_cause_that_recurs_gets_a_wider_skip(world: World, prefect_server: None) -> None:
    tmp, job1 = world.tmp, world.job
    first = world.run(job1, "inc-data-1")
    assert first["diagnosis"]["primary"]["layer"] == "data" and first["resumed"]["outcome"] == "done"
    job2 = first["resumed"]["extra"]["new_job"]
    skipped = set(map(int, world.scheduler.show_job(job2).env["SPIKEOPS_SKIP_STEPS"].split(":")))
    relog(tmp / "runs" / job1, first["diagnosis"]["resume_from"]["step"])
    second = world.run(job2, "inc-data-2")
    assert second["resumed"]["outcome"] == "done", second["resumed"]
    env = world.scheduler.show_job(second["resumed"]["extra"]["new_job"]).env
    wider = set(map(int, env["SPIKEOPS_SKIP_STEPS"].split(":")))
    assert wider > skipped or ("SPIKEOPS_SKIP_RANKS" not in env and wider >= skipped), (skipped, wider, env)
    assert "SPIKEOPS_SKIP_RANKS" not in env  # every rank's batches
    diagnosis = json.loads((Path(second["bundle"]) / "diagnosis.json").read_text())
    assert any("recurred" in f["summary"] and "inc-data-1" in f["summary"] for f in diagnosis["findings"])


@pytest.mark.parametrize("world", [(_xid_nan, ("gpu_xid",))], indirect=True)
def test_an_unreachable_ledger_does_not_stop_an_incident(world: World, prefect_server: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger is a PostgreSQL nobody listens for: the incident goes on (and, the restart
    budget being unknown, waits for a person); its entry is spooled with the password masked,
    then written by the next incident once the ledger answers."""
    from spikeops.ledger.spool import pending

    secret = "hunter2-ledger-password"
    monkeypatch.setenv("SPIKEOPS_LEDGER_URL", f"postgresql://spikeops:{secret}@127.0.0.1:9/spikeops")
    outcome = world.run(world.job, "inc-offline-1", approval_timeout_s=2)
    assert outcome["diagnosis"]["primary"]["cause"] == "gpu_xid"
    assert outcome["resumed"]["outcome"] == "not resumed" and world.scheduler.drained() == []
    texts = world.texts()
    assert "The ledger cannot be reached" in texts and "127.0.0.1:9" in texts
    assert "restart budget cannot be checked" in texts and secret not in texts
    bundle = Path(outcome["bundle"])
    assert secret not in (bundle / "ledger.json").read_text() and secret not in (bundle / "report.md").read_text()
    spooled = pending(world.tmp / "incidents")
    assert [p.stem for p in spooled] == ["inc-offline-1"]
    # the ledger answers again: the next incident writes the spooled entry first
    monkeypatch.setenv("SPIKEOPS_LEDGER_URL", world.ledger_url)
    world.run(world.job, "inc-offline-2", skip=["protect", "collect", "isolate", "resume", "notify"])
    assert pending(world.tmp / "incidents") == []
    with world.ledger() as ledger:
        assert ledger.incident("inc-offline-1")["cause"] == "gpu_xid"


# ---------------------------------------------------------------------------- on the real Slurm


SLURM_ADDRESS = "127.0.62.11"
SLURM_SPARE_ADDRESS = "127.0.62.250"


@pytest.fixture
def slurm_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The real Slurm (munged, slurmctld, one slurmd per node) over the scenario's node names
    plus a spare; the job is a batch script that records where and from which checkpoint it
    runs (tests/test_incident_flow_slurm.py)."""
    from spikeops.schedulers import ActionLog, SlurmConfig, SlurmScheduler
    from spikeops.schedulers.base import LocalRunner
    from spikeops.sim import slurmcluster

    slurmflow._require_slurm()
    cause, seed = find(_xid_nan, ("gpu_xid",))
    port = simcluster.free_port((SLURM_ADDRESS,))
    with simcluster.scratch() as scratch, \
            simcluster.running(scratch / "cluster", nodes=NODES, port=port, first_address=SLURM_ADDRESS,
                               scenario=cause, seed=seed) as cluster, \
            slurmcluster.running(tmp_path / "slurm", names=[*cluster.nodes, SPARE]) as slurm, \
            SlackServer(token=TOKEN) as slack:
        add_spare(cluster.inventory, SPARE, SLURM_SPARE_ADDRESS)
        monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
        monkeypatch.setenv("SPIKEOPS_SLACK_API_URL", slack.api_url)
        monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        config = tmp_path / "spikeops.toml"
        config.write_text(config_text(tmp_path, cluster.inventory, "slurm"))
        monkeypatch.setenv("SPIKEOPS_CONFIG", str(config))
        scheduler = SlurmScheduler(LocalRunner(slurm.env), SlurmConfig(timeout=20), ActionLog(None))
        world = slurmflow.World(cluster, slurm, slack, scheduler, "", None, tmp_path)  # type: ignore[arg-type]
        world.job = world.run("sbatch", "--parsable", "-w", ",".join(cluster.nodes), f"--chdir={tmp_path}",
                                     str(slurmflow._batch_script(tmp_path, len(cluster.nodes)))).strip().split(";")[0]
        slurmflow._wait(f"job {world.job} running", lambda: world.state(world.job) == "RUNNING")
        time.sleep(0.5)
        run_dir = tmp_path / "runs" / world.job
        run_dir.mkdir(parents=True)
        for name in FILES:
            if (cluster.scenario_bundle / name).is_file():
                shutil.copy2(cluster.scenario_bundle / name, run_dir / name)
        lay_checkpoints(tmp_path / "ckpt" / world.job, cluster.scenario_bundle)
        try:
            yield world
        finally:
            world.give_back()


def test_on_slurm_a_recurring_nan_is_resumed_from_older_checkpoints_then_stops_for_a_person(
        slurm_world: Any, prefect_server: None) -> None:
    """The key scenario on the real Slurm: each resubmission trains in its lineage's
    directories (the configuration's ``{job}`` paths name the first job's), the second incident
    finds the first in history.json and resumes from the older checkpoint, the third waits for
    a person."""
    from spikeops.flows.incident_response import incident_response
    from tests.test_incident_flow import flow_params

    world, tmp = slurm_world, slurm_world.tmp
    job1 = world.job

    def run(job: str, incident: str, **overrides: Any) -> dict[str, Any]:
        return incident_response(**flow_params(job, "sim", incident_id=incident, **overrides))

    first = run(job1, "inc-slurm-rec-1")
    assert first["diagnosis"]["primary"]["cause"] == "gpu_xid" and first["resumed"]["outcome"] == "done"
    culprit, c1 = first["diagnosis"]["culprit_nodes"][0], first["diagnosis"]["resume_from"]
    job2 = first["resumed"]["extra"]["new_job"]
    slurmflow._wait(f"job {job2} running", lambda: world.state(job2) == "RUNNING")
    relog(tmp / "runs" / job1, c1["step"])

    second = run(job2, "inc-slurm-rec-2")
    assert [h["incident_id"] for h in _history(Path(second["bundle"]))] == ["inc-slurm-rec-1"]
    assert second["diagnosis"]["primary"]["cause"] == "poisoned_checkpoint"
    c2 = second["diagnosis"]["resume_from"]
    assert c2["step"] < c1["step"] and Path(c2["path"]).parent == tmp / "ckpt" / job1
    assert second["resumed"]["outcome"] == "done", second["resumed"]
    job3 = second["resumed"]["extra"]["new_job"]
    slurmflow._wait(f"job {job3} running", lambda: world.state(job3) == "RUNNING" and len(
        (tmp / "runs.txt").read_text().splitlines()) == 3)
    runs = (tmp / "runs.txt").read_text().splitlines()
    assert [line.split()[1] for line in runs] == ["none", c1["path"], c2["path"]]  # never the same checkpoint
    assert culprit not in world.scheduler.show_job(job3)[0].nodes and [n.name for n in world.scheduler.drained()] \
        == [culprit]
    assert "is in doubt" in " | ".join(m.text for m in world.slack.messages)
    relog(tmp / "runs" / job1, c2["step"])

    third = run(job3, "inc-slurm-rec-3", approval_timeout_s=3)
    assert third["resumed"]["outcome"] == "not resumed" and world.state(job3) == "CANCELLED"
    assert len((tmp / "runs.txt").read_text().splitlines()) == 3  # nothing resubmitted
    texts = " | ".join(m.text for m in world.slack.messages)
    assert f"{ONCALL} Restart budget spent" in texts and f"Job {job3} is left STOPPED" in texts
    assert third["lost"]["gpus"] and third["lost"]["gpu_hours"] > 0
