"""Scheduler actions against a real Slurm (munge, slurmctld and slurmd on this machine)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spikeops.cli import main
from spikeops.errors import InputError
from spikeops.schedulers import ActionLog, SchedulerError, SlurmConfig, SlurmScheduler
from spikeops.schedulers.base import LocalRunner
from spikeops.sim import slurmcluster


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmcluster.SlurmCluster]:
    with slurmcluster.running(tmp_path_factory.mktemp("slurm") / "s", nodes=4) as cluster:
        yield cluster


def _scheduler(slurm, tmp_path: Path, **kwargs) -> SlurmScheduler:
    config = SlurmConfig(timeout=20, signal_grace=10)
    return SlurmScheduler(LocalRunner(slurm.env), config, ActionLog(tmp_path / "actions.jsonl"), **kwargs)


def _cli(slurm, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    for key, value in slurm.env.items():
        monkeypatch.setenv(key, value)
    out, err = io.StringIO(), io.StringIO()
    return main(argv, out=out, err=err), out.getvalue(), err.getvalue()


def _scontrol(slurm, *args: str) -> str:
    return subprocess.run(["scontrol", *args], env={**os.environ, **slurm.env}, capture_output=True,
                          text=True, timeout=20, check=True).stdout


def _submit(slurm, tmp_path: Path, body: str, *options: str) -> str:
    script = tmp_path / f"job-{time.monotonic_ns()}.sh"
    script.write_text("#!/bin/sh\n" + body)
    done = subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / "slurm-%j.out"), *options, str(script)],
                          env={**os.environ, **slurm.env}, capture_output=True, text=True, timeout=20,
                          check=True, cwd=tmp_path)  # the job's WorkDir, where a resubmission writes
    return done.stdout.strip().split(";")[0]


def _wait_state(slurm, job: str, states: set[str], seconds: float = 20) -> str:
    deadline = time.monotonic() + seconds
    state = ""
    while time.monotonic() < deadline:
        state = next(p.split("=", 1)[1] for p in _scontrol(slurm, "show", "job", "-o", job).split()
                     if p.startswith("JobState="))
        if state in states:
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job} stayed {state}, wanted {states}")


def _wait_file(path: Path, seconds: float = 20) -> None:
    """Until the batch script has set its trap (and a moment for slurmd to register the step)."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    time.sleep(0.3)


def _node_reason(slurm, node: str) -> tuple[str, str]:
    fields = dict(p.split("=", 1) for p in _scontrol(slurm, "show", "node", "-o", node).split() if "=" in p)
    text = _scontrol(slurm, "show", "node", "-o", node)
    reason = text.split("Reason=", 1)[1].strip() if "Reason=" in text else ""
    return fields["State"], reason


def test_drain_release_and_someone_elses_node(slurm, tmp_path: Path) -> None:
    scheduler = _scheduler(slurm, tmp_path, incident="inc-20261129T180312Z-1")
    first = scheduler.drain(["node001"], "gpu_xid")
    assert [r.outcome for r in first] == ["done"]
    state, reason = _node_reason(slurm, "node001")
    assert "DRAIN" in state and reason.startswith("spikeops: gpu_xid inc-20261129T180312Z-1")
    assert [r.outcome for r in scheduler.drain(["node001"], "gpu_xid")] == ["nothing-to-do"]
    # someone else's drain is never overwritten nor resumed
    _scontrol(slurm, "update", "NodeName=node003", "State=DRAIN", "Reason=bad PSU, ticket 42")
    refused = scheduler.drain(["node003"], "gpu_xid")
    assert refused[0].outcome == "refused" and "bad PSU" in refused[0].detail
    assert scheduler.release(["node003"])[0].outcome == "refused"
    assert _node_reason(slurm, "node003")[1].startswith("bad PSU, ticket 42")
    assert [n.name for n in scheduler.drained()] == ["node001"]
    assert [r.outcome for r in scheduler.release(["node001"])] == ["done"]
    assert "DRAIN" not in _node_reason(slurm, "node001")[0]
    assert [r.outcome for r in scheduler.release(["node001"])] == ["nothing-to-do"]
    _scontrol(slurm, "update", "NodeName=node003", "State=RESUME")
    log = ActionLog(tmp_path / "actions.jsonl").read()
    assert [(r["action"], r["outcome"]) for r in log] == [
        ("drain", "done"), ("drain", "nothing-to-do"), ("drain", "refused"), ("release", "refused"),
        ("release", "done"), ("release", "nothing-to-do")]
    update = [c for c in log[0]["commands"] if "update" in c["argv"]][0]
    assert update["exit"] == 0 and update["argv"][:3] == ["scontrol", "update", "NodeName=node001"]
    with pytest.raises(SchedulerError, match="not in the cluster"):
        scheduler.drain(["node999"], "x")


def test_dry_run_changes_nothing(slurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = _cli(slurm, ["nodes", "drain", "node[002-003]", "--reason", "ib_link", "--dry-run",
                                "--bundle", str(tmp_path)], monkeypatch)
    assert code == 0 and out.count("dry-run") == 2
    assert "would run: scontrol update NodeName=node002 State=DRAIN 'Reason=spikeops: ib_link'" in out
    assert "DRAIN" not in _node_reason(slurm, "node002")[0]
    assert json.loads((tmp_path / "actions.jsonl").read_text().splitlines()[0])["outcome"] == "dry-run"


def test_stop_signals_the_batch_script_then_cancels(slurm, tmp_path: Path) -> None:
    scheduler = _scheduler(slurm, tmp_path)
    saved = tmp_path / "saved"
    polite = _submit(slurm, tmp_path, f"trap 'echo saved > {saved}; exit 0' USR1\ntouch {tmp_path}/ready1\n"
                                      "while true; do sleep 0.2; done\n")
    _wait_state(slurm, polite, {"RUNNING"})
    _wait_file(tmp_path / "ready1")
    result = scheduler.stop(polite, signal="USR1")
    assert result.outcome == "done" and "ended by itself" in result.detail
    assert saved.read_text().strip() == "saved"
    stubborn_mark = tmp_path / "stubborn"
    stubborn = _submit(slurm, tmp_path, f"trap 'echo got > {stubborn_mark}' USR1\ntouch {tmp_path}/ready2\n"
                                        "while true; do sleep 0.2; done\n")
    _wait_state(slurm, stubborn, {"RUNNING"})
    _wait_file(tmp_path / "ready2")
    result = scheduler.stop(stubborn, signal="USR1", grace=1.5)
    assert result.outcome == "done" and result.extra["state_after"] == "CANCELLED"
    assert stubborn_mark.is_file()
    assert [c.argv[:2] for c in result.commands if c.argv[0] == "scancel"] == [["scancel", "--signal=USR1"],
                                                                                 ["scancel", stubborn]]
    assert scheduler.stop(stubborn).outcome == "nothing-to-do"
    with pytest.raises(SchedulerError, match="not found"):
        scheduler.stop("987654")


def test_preserve_then_resume_excluding_a_node(slurm, tmp_path: Path) -> None:
    scheduler = _scheduler(slurm, tmp_path, incident="inc-2")
    where = tmp_path / "where"
    body = (f'echo "$SLURM_JOB_NODELIST ${{SPIKEOPS_RESUME_FROM:-none}} ${{SPIKEOPS_LR_SCALE:-1}} '
            f'${{NCCL_DEBUG:-WARN}}" >> {where}\nsleep 60\n')
    job = _submit(slurm, tmp_path, body, "-N", "2", "-w", "node[001-002]")
    _wait_state(slurm, job, {"RUNNING"})
    bundle = tmp_path / "bundle"
    kept = scheduler.preserve(job, bundle)
    assert kept.outcome == "done"
    assert (bundle / "scheduler" / f"batch-{job}.sh").read_text().endswith("sleep 60\n")
    assert (bundle / "scheduler" / f"nodes-{job}.txt").read_text().split() == ["node001", "node002"]
    assert f"JobId={job}" in (bundle / "scheduler" / f"job-{job}.txt").read_text()
    assert scheduler.stop(job).outcome == "done"
    resumed = scheduler.resume(job, "/ckpt/step-12000", exclude=["node001"],
                               script=bundle / "scheduler" / f"batch-{job}.sh",
                               env={"SPIKEOPS_LR_SCALE": "0.3", "NCCL_DEBUG": "INFO"})
    assert resumed.outcome == "done", resumed.detail
    new = resumed.extra["new_job"]
    _wait_state(slurm, new, {"RUNNING"})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(where.read_text().splitlines()) < 2:
        time.sleep(0.1)
    first, second = where.read_text().splitlines()[:2]
    assert first == "node[001-002] none 1 WARN"  # the original run
    nodelist, checkpoint, scale, debug = second.split()
    assert "node001" not in nodelist and checkpoint == "/ckpt/step-12000"
    from spikeops.probes.slurm import expand_nodelist

    assert len(expand_nodelist(nodelist)[0]) == 2  # the size given to sbatch -N survives the resubmission
    assert (scale, debug) == ("0.3", "INFO")  # the remediation reached the resubmitted job
    again = scheduler.resume(job, "/ckpt/step-12000", exclude=["node001"],
                             script=bundle / "scheduler" / f"batch-{job}.sh")
    assert again.outcome == "nothing-to-do" and again.extra["new_job"] == new
    scheduler.stop(new)


def test_requeue_with_excluded_nodes(slurm, tmp_path: Path) -> None:
    scheduler = _scheduler(slurm, tmp_path)
    job = _submit(slurm, tmp_path, "sleep 60\n", "--requeue")
    _wait_state(slurm, job, {"RUNNING"})
    stopped = scheduler.stop(job, mode="hold")
    assert stopped.outcome == "done"
    assert scheduler.stop(job, mode="hold").outcome == "nothing-to-do"
    resumed = scheduler.resume(job, "", exclude=["node004"], requeue=True)
    assert resumed.outcome == "done", resumed.detail
    assert "ExcNodeList=node004" in _scontrol(slurm, "show", "job", "-o", job)
    _wait_state(slurm, job, {"RUNNING", "PENDING"})
    scheduler.stop(job)


def test_bad_input_and_a_missing_controller(slurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = _cli(slurm, ["job", "stop", "12;reboot"], monkeypatch)
    assert code == 2 and "bad job id" in err
    code, _, err = _cli(slurm, ["nodes", "drain", "node[001", "--reason", "x"], monkeypatch)
    assert code == 2
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))
    out, err = io.StringIO(), io.StringIO()
    assert main(["nodes", "list", "--timeout", "3"], out=out, err=err) == 2
    assert err.getvalue().count("\n") == 1 and "cannot read node states" in err.getvalue()


def test_resume_refuses_an_unsafe_environment(slurm, tmp_path: Path) -> None:
    scheduler = _scheduler(slurm, tmp_path, incident="inc-env")
    for env in ({"LD_PRELOAD": "/tmp/x.so"}, {"SPIKEOPS_SKIP_STEPS": "1,2"}, {"NCCL_DEBUG": "INFO\nrm"}):
        with pytest.raises(InputError, match="refusing"):
            scheduler.resume("123", "/ckpt/step-1", env=env)
