"""The local-process scheduler (the demo's) and the shared safety policy."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest

from spikeops.cli import main
from spikeops.schedulers import ActionLog, LocalScheduler, SchedulerError
from spikeops.schedulers.local import LocalNode
from spikeops.schedulers.policy import drain_verdict, release_verdict


@pytest.mark.parametrize(
    ("node", "drain", "release"),
    [
        (LocalNode("a"), None, "nothing-to-do"),
        (LocalNode("a", "DRAIN", "spikeops: gpu_xid inc-1"), "nothing-to-do", None),
        (LocalNode("a", "DRAIN", "bad DIMM, RMA", "alice"), "refused", "refused"),
        (LocalNode("a", "DOWN", "Not responding"), "refused", "refused"),
        (LocalNode("a", "FUTURE"), "refused", "nothing-to-do"),
        (LocalNode("a", "IDLE", flags=frozenset({"MAINTENANCE"})), "refused", "nothing-to-do"),
    ],
)
def test_policy(node: LocalNode, drain: str | None, release: str | None) -> None:
    verdict = drain_verdict(node)
    assert (verdict[0] if verdict else None) == drain
    verdict = release_verdict(node)
    assert (verdict[0] if verdict else None) == release
    if drain == "refused" and node.reason:
        assert node.reason in drain_verdict(node)[1]


def _scheduler(tmp_path: Path, **kwargs) -> LocalScheduler:
    scheduler = LocalScheduler(tmp_path / "sched", ActionLog(tmp_path / "bundle" / "actions.jsonl"), **kwargs)
    scheduler.add_nodes([f"gpu-{i:03d}" for i in range(1, 7)])
    return scheduler


def test_drain_release_are_idempotent_and_audited(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, incident="inc-7")
    scheduler.set_node("gpu-004", "DRAIN", "fan failure", "alice")
    first = scheduler.drain(["gpu-002", "gpu-004"], "gpu_xid")
    assert [(r.target, r.outcome) for r in first] == [("gpu-002", "done"), ("gpu-004", "refused")]
    assert "fan failure" in first[1].detail and "alice" in first[1].detail
    assert scheduler.nodes()["gpu-002"].reason == "spikeops: gpu_xid inc-7"
    assert scheduler.nodes()["gpu-004"].reason == "fan failure"  # never overwritten
    assert [r.outcome for r in scheduler.drain(["gpu-002"], "gpu_xid")] == ["nothing-to-do"]
    assert [n.name for n in scheduler.drained()] == ["gpu-002"]
    assert [r.outcome for r in scheduler.release(["gpu-002", "gpu-004"])] == ["done", "refused"]
    assert [r.outcome for r in scheduler.release(["gpu-002"])] == ["nothing-to-do"]
    assert scheduler.nodes()["gpu-004"].base_state == "DRAIN"
    log = ActionLog(tmp_path / "bundle" / "actions.jsonl").read()
    assert [(r["action"], r["target"], r["outcome"]) for r in log] == [
        ("drain", "gpu-002", "done"), ("drain", "gpu-004", "refused"), ("drain", "gpu-002", "nothing-to-do"),
        ("release", "gpu-002", "done"), ("release", "gpu-004", "refused"), ("release", "gpu-002", "nothing-to-do")]
    with pytest.raises(SchedulerError, match="not in the cluster"):
        scheduler.drain(["gpu-099"], "x")


def test_stop_and_resume_real_processes(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, incident="inc-8")
    marker = tmp_path / "saw-usr1"
    script = ("import signal,sys,time,os\n"
              f"signal.signal(signal.SIGUSR1, lambda *a: (open({str(marker)!r},'w').write(os.environ.get("
              "'SPIKEOPS_RESUME_FROM','')), sys.exit(0)))\n"
              "time.sleep(60)\n")
    job = scheduler.submit([sys.executable, "-c", script], ["gpu-001", "gpu-002"])
    time.sleep(0.5)
    assert scheduler.show_job(job).state == "RUNNING"
    stopped = scheduler.stop(job, signal="USR1", grace=10)
    assert stopped.outcome == "done" and "ended by itself" in stopped.detail
    assert marker.is_file()
    assert scheduler.stop(job).outcome == "nothing-to-do"
    resumed = scheduler.resume(job, "/ckpt/step-100", exclude=["gpu-002"])
    assert resumed.outcome == "done"
    new = resumed.extra["new_job"]
    info = scheduler.show_job(new)
    assert "gpu-002" not in info.nodes and len(info.nodes) == 2 and info.env["SPIKEOPS_RESUME_FROM"] == "/ckpt/step-100"
    assert scheduler.resume(job, "/ckpt/step-100", exclude=["gpu-002"]).outcome == "nothing-to-do"
    assert scheduler.stop(new, grace=1).outcome == "done"
    assert scheduler.show_job(new).state == "CANCELLED"


def test_a_job_that_ignores_usr1_is_cancelled_after_its_grace_not_before(tmp_path: Path) -> None:
    """USR1 reaches the job's whole process group: the job decides, not the scheduler's own
    wrapper, so a job busy saving keeps its grace period and is then cancelled."""
    scheduler = _scheduler(tmp_path, incident="inc-9")
    script = "import signal,time\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\ntime.sleep(60)\n"
    job = scheduler.submit([sys.executable, "-c", script], ["gpu-001"])
    time.sleep(1.0)  # the job has set its handler
    started = time.monotonic()
    stopped = scheduler.stop(job, signal="USR1", grace=2)
    assert time.monotonic() - started >= 2
    assert stopped.outcome == "done" and "ended by itself" not in stopped.detail
    assert scheduler.show_job(job).state == "CANCELLED"


def test_cli_local_scheduler_and_dry_run(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path)
    base = ["--scheduler", "local", "--state-dir", str(tmp_path / "sched"), "--bundle", str(tmp_path / "b")]
    out = io.StringIO()
    assert main(["nodes", "drain", "gpu-[001-002]", "--reason", "ib_link", "--dry-run", *base], out=out,
                err=io.StringIO()) == 0
    assert "dry-run" in out.getvalue() and not scheduler.drained()
    assert main(["nodes", "drain", "gpu-[001-002]", "--reason", "ib_link", "--incident", "inc-9", *base],
                out=io.StringIO(), err=io.StringIO()) == 0
    out = io.StringIO()
    assert main(["nodes", "list", "--json", *base], out=out, err=io.StringIO()) == 0
    assert [(n["node"], n["incident"]) for n in json.loads(out.getvalue())] == [("gpu-001", "inc-9"),
                                                                               ("gpu-002", "inc-9")]
    scheduler.set_node("gpu-003", "DRAIN", "RMA", "bob")
    out = io.StringIO()
    assert main(["nodes", "release", "gpu-003", *base], out=out, err=io.StringIO()) == 1
    assert "RMA" in out.getvalue()
    err = io.StringIO()
    assert main(["nodes", "drain", "gpu-1;reboot", "--reason", "x", *base], out=io.StringIO(), err=err) == 2
    err = io.StringIO()
    assert main(["job", "stop", "4412", *base], out=io.StringIO(), err=err) == 2
    assert "not found" in err.getvalue()
    assert main(["job", "stop", "$(reboot)", *base], out=io.StringIO(), err=io.StringIO()) == 2


def _drain_one(args: tuple[str, str]) -> str:
    directory, node = args
    return LocalScheduler(directory).drain([node], "gpu_xid", incident=f"inc-{node}")[0].outcome


def _submit_one(directory: str) -> str:
    return LocalScheduler(directory).submit([sys.executable, "-c", "pass"], ["n-01"])


def test_incidents_acting_at_once_from_several_processes_lose_nothing(tmp_path: Path) -> None:
    """Several flow runs (processes) drain and resubmit on one scheduler at the same moment:
    every drain stays and every job gets its own id (the state is read, changed and written
    under a lock, as slurmctld serialises its own)."""
    import multiprocessing

    scheduler = LocalScheduler(tmp_path / "sched")
    names = [f"n-{i:02d}" for i in range(1, 25)]
    scheduler.add_nodes(names)
    context = multiprocessing.get_context("fork")
    with context.Pool(8) as pool:
        outcomes = pool.map(_drain_one, [(str(tmp_path / "sched"), n) for n in names])
        jobs = pool.map(_submit_one, [str(tmp_path / "sched")] * 16)
    assert outcomes == ["done"] * len(names)
    assert sorted(n.name for n in scheduler.drained()) == names
    assert len(set(jobs)) == 16 and sorted(j.job_id for j in scheduler.jobs()) == sorted(jobs)
