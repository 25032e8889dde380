"""The node lifecycle on a real Slurm (munged, slurmctld and one slurmd per node, RebootProgram
set), real sshd nodes answering from a simulated Xid incident, the real diagnosis, the ledger
and a temporary Prefect server, through the node-lifecycle flow.

drain -> the flow reboots the reset-class fault into the drain (Slurm's own reboot: the node's
slurmd is restarted in a new time namespace and registers with a boot time after the request)
-> the flow validates: dcgmi diag fails, the node stays drained -> validates again after the
backoff: it passes -> the flow asks a person -> approved through the flow run's input ->
released. A node someone else drained is never touched. Skipped where Slurm or root is missing
(CI installs Slurm)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spikeops.schedulers import ActionLog, SlurmConfig, SlurmScheduler
from spikeops.schedulers.base import LocalRunner
from spikeops.sim import slurmcluster
from tests.lifecycle_world import World, lifecycle_world

FIRST = "127.0.127.11"
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/scontrol", "/usr/bin/unshare")


def _require_slurm() -> None:
    missing = [path for path in DAEMONS if not os.access(path, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: apt-get install slurmctld slurmd slurm-client munge util-linux")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs as root (SlurmUser=root)")


@pytest.fixture
def slurm_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[World, Any, SlurmScheduler]]:
    _require_slurm()
    with lifecycle_world(FIRST, scheduler_lines='scheduler = "slurm"',
                         extra='reboot = "auto"\nrelease = "ask"\nvalidate_after = "1s"\napproval_timeout_s = 120') \
            as world, slurmcluster.running(tmp_path / "slurm", names=world.cluster.nodes, reboot=True) as slurm:
        hook = slurm.directory / "reboot-hook"  # what the reboot does to the node: its GPU is back
        hook.write_text(f"#!/bin/sh\nexec {sys.executable} -m spikeops.sim.nodelife reboot "
                        f"--dir {world.cluster.directory} \"$1\" --smi-from {world.healthy[0]}\n")
        hook.chmod(0o755)
        monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        scheduler = SlurmScheduler(LocalRunner(slurm.env), SlurmConfig(timeout=20), ActionLog(None))
        for node in world.cluster.nodes:
            world.tool(node, "all_reduce_perf", "pass")
        yield world, slurm, scheduler


def _node(scheduler: SlurmScheduler, name: str) -> Any:
    return scheduler.show_nodes()[0][name]


def _approve_when_paused(run: Any, approver: str) -> dict[str, Any]:
    """Run the flow in a thread; when it pauses for approval, ``approver`` says yes through the
    flow run's input (what the Resume page sends). The flow's result."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.flow_runs import resume_flow_run

    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(run()))
    runner.start()
    paused = None
    deadline = time.monotonic() + 120
    with get_client(sync_client=True) as client:
        while paused is None and time.monotonic() < deadline and runner.is_alive():
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["node-lifecycle"])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["PAUSED"]))))
            paused = runs[0] if runs else None
            time.sleep(0.5)
    assert paused is not None, f"the flow never paused for approval (it returned {result})"
    resume_flow_run(paused.id, run_input={"approve": True, "nodes": "", "approver": approver, "note": "looks fine"})
    runner.join(180)
    assert not runner.is_alive()
    return result


def test_a_reset_class_node_is_rebooted_validated_and_released_with_approval(slurm_world, prefect_server: None
                                                                            ) -> None:
    from spikeops.flows.node_lifecycle import node_lifecycle

    world, slurm, scheduler = slurm_world
    node, theirs = world.culprit, world.healthy[2]
    incident = world.convict()
    code, out, err = world.cli("nodes", "drain", node, "--reason", "gpu_xid", "--incident", incident)
    assert code == 0, err
    subprocess.run(["scontrol", "update", f"NodeName={theirs}", "State=DRAIN", "Reason=bad DIMM, RMA 4412"],
                   env={**os.environ, **slurm.env}, check=True, timeout=20)
    boot_before = _node(scheduler, node).fields.get("BootTime")
    world.tool(node, "dcgmi", "fail")

    def run() -> dict[str, Any]:
        return node_lifecycle(cluster="sim", config=str(world.config))

    # 1. the reset-class conviction: rebooted into the drain, through Slurm's RebootProgram
    first = run()
    assert first["nodes"][node]["step"]["action"] == "reboot" and first["nodes"][node]["outcome"]["outcome"] == "done"
    assert theirs not in first["nodes"]  # someone else's drain is not spikeops' to handle
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _node(scheduler, node)
        if not ({"REBOOT_REQUESTED", "REBOOT_ISSUED"} & set(now.flags)) and now.fields.get("BootTime") != boot_before:
            break
        time.sleep(0.5)
    now = _node(scheduler, node)
    assert now.fields.get("BootTime") != boot_before and now.drained_by_spikeops, now.text
    assert [n for n, _ in slurmcluster.reboots(slurm.directory)] == [node]
    # 2. the reboot's end is recorded; once its wait is over, the validation finds dcgmi's
    #    failed GPU: the node stays drained
    second = run()
    if second["nodes"][node]["step"]["action"] == "wait":  # validate_after (1 s) from the reboot's end
        assert "reboot" in second["nodes"][node]["step"]["why"]
        time.sleep(1.2)
        second = run()
    outcome = second["nodes"][node]["outcome"]
    assert second["nodes"][node]["step"]["action"] == "validate" and outcome["outcome"] == "failed", second
    assert "dcgmi-diag: failed" in outcome["detail"] and _node(scheduler, node).drained_by_spikeops
    failed_msgs = list((world.work / "incidents" / "_nodes" / "sim" / node).glob("validation-failed-*/outbox.jsonl"))
    assert failed_msgs and "GPU Memory" in failed_msgs[0].read_text()
    # 3. fixed: after the backoff the validation passes, a person approves, it is released
    world.tool(node, "dcgmi", "pass")
    time.sleep(2.5)  # validate_after 1 s, doubled after one failure
    third = _approve_when_paused(run, "alice")
    assert third["asked"] == {node: "release"} and third["nodes"][node]["outcome"]["outcome"] == "done", third
    after = _node(scheduler, node)
    assert not after.drained and not after.down, after.text
    record = world.history(node)
    assert record["state"] == "released"
    assert [(e["kind"], e["result"]) for e in record["events"]] == [
        ("drain", "done"), ("reboot", "requested"), ("reboot", "done"), ("validate", "started"),
        ("validate", "failed"), ("validate", "started"), ("validate", "passed"), ("release", "done")]
    assert record["events"][-1]["by"] == "spikeops node-lifecycle (approved by alice)"
    # never touched: someone else's drain, its reason, its record
    assert _node(scheduler, theirs).reason.startswith("bad DIMM, RMA 4412") and world.history(theirs)["events"] == []


def test_slurm_reboots_only_spikeops_drains_into_the_drain(slurm_world) -> None:
    """The scheduler's reboot on the real slurmd: only a node spikeops drained, back drained with
    a new BootTime and spikeops' reason; a repeat while it reboots is nothing to do, a release
    then is refused; someone else's drain and an undrained node are refused."""
    world, slurm, scheduler = slurm_world
    mine, theirs, idle = world.cluster.nodes[:3]
    env = {**os.environ, **slurm.env}
    subprocess.run(["scontrol", "update", f"NodeName={theirs}", "State=DRAIN", "Reason=fan failure"], env=env,
                   check=True, timeout=20)
    assert scheduler.drain([mine], "gpu_xid", "inc-sr-1")[0].outcome == "done"
    before = _node(scheduler, mine).fields.get("BootTime")
    (asked,) = scheduler.reboot([mine], "gpu_xid reboot", "inc-sr-1")
    assert asked.outcome == "done" and asked.extra["boot_before"] == before, asked.line()
    assert asked.commands[1].argv[:3] == ["scontrol", "reboot", "reason=spikeops: gpu_xid reboot inc-sr-1"]
    assert not any(word in " ".join(asked.commands[1].argv) for word in ("ASAP", "nextstate"))
    assert scheduler.reboot_status(mine, before)[0] in ("rebooting", "done")
    if scheduler.reboot_status(mine, before)[0] == "rebooting":
        assert scheduler.reboot([mine], "again")[0].outcome == "nothing-to-do"
        refused = scheduler.release([mine])[0]
        assert refused.outcome == "refused" and "reboot is in progress" in refused.detail
    for other, words in ((theirs, "fan failure"), (idle, "drain it first")):
        result = scheduler.reboot([other], "x")[0]
        assert result.outcome == "refused" and words in result.detail, result.line()
    deadline = time.monotonic() + 60
    while scheduler.reboot_status(mine, before)[0] == "rebooting" and time.monotonic() < deadline:
        time.sleep(0.5)
    status, detail = scheduler.reboot_status(mine, before)
    after = _node(scheduler, mine)
    assert status == "done" and after.drained_by_spikeops and after.reason.startswith("spikeops: gpu_xid reboot"), \
        (status, detail, after.text)
    assert slurmcluster.reboots(slurm.directory)[-1][0] == mine
    assert _node(scheduler, theirs).reason.startswith("fan failure") and not _node(scheduler, idle).drained
