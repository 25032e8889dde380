"""The node lifecycle on the local scheduler, end to end through ``spikeops nodes``: real sshd
nodes answering from a simulated Xid incident (real nvidia-smi pages and kernel logs, real
dcgmi captures, nccl-tests' format), the real diagnosis convicting the culprit, the ledger,
and the local scheduler's reboot program.

drain -> release refused -> reboot into the drain -> validation fails (dcgmi diag, then the
control run) -> stays drained -> passes -> released; a forced release is audited; nodes
drained by anyone else are never touched; a repeat offender is marked for replacement and
never released without --force."""

from __future__ import annotations

import json
from collections.abc import Iterator


import pytest

from spikeops.schedulers import LocalScheduler
from tests.lifecycle_world import World, lifecycle_world, reboot_program

FIRST = "127.0.126.11"


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[World, LocalScheduler]]:
    with lifecycle_world(FIRST, scheduler_lines='scheduler = "local"\nscheduler_state_dir = "@SCHED@"',
                         extra='reboot = "auto"\nvalidate_after = "1s"') as world:
        sched = world.work / "sched"
        world.config.write_text(world.config.read_text().replace("@SCHED@", str(sched)))
        scheduler = LocalScheduler(sched)
        scheduler.add_nodes(world.cluster.nodes)
        reboot_program(world, sched / LocalScheduler.REBOOT_PROGRAM)
        yield world, scheduler


def _checks(out: str) -> dict[str, str]:
    (outcome,) = json.loads(out)
    return {c["name"]: c["verdict"] for c in outcome["validation"]["checks"]}


def test_a_convicted_node_comes_back_only_after_a_passing_validation(world) -> None:
    world, scheduler = world
    node = world.culprit
    incident = world.convict()
    code, out, err = world.cli("nodes", "drain", node, "--reason", "gpu_xid", "--incident", incident)
    assert code == 0, err
    assert world.kinds(node) == [("drain", "done")]
    code, out, _ = world.cli("nodes", "list", "--json")
    (row,) = json.loads(out)
    assert row["node"] == node and row["lifecycle"] == "drained" and row["next"]["action"] == "reboot"
    assert "Xid" in row["next"]["why"] and row["incident"] == incident
    # no release without a validation: one line, exit 1
    code, out, err = world.cli("nodes", "release", node)
    assert code == 1 and out.count("\n") == 1 and "no validation since its drain" in out, (out, err)
    assert scheduler.nodes()[node].drained_by_spikeops
    # the reboot: into the drain (the local scheduler's reboot program is the sim's reboot)
    code, out, err = world.cli("nodes", "reboot", node)
    assert code == 0, (out, err)
    assert scheduler.nodes()[node].drained_by_spikeops and scheduler.nodes()[node].boot_time
    assert world.kinds(node) == [("drain", "done"), ("reboot", "requested"), ("reboot", "done")]
    # dcgmi diag finds a bad GPU: the validation fails, the node stays drained
    for healthy in world.healthy:
        world.tool(healthy, "all_reduce_perf", "pass")
    world.tool(node, "all_reduce_perf", "pass")
    world.tool(node, "dcgmi", "fail")
    code, out, err = world.cli("nodes", "validate", node, "--json")
    verdicts = _checks(out)
    assert code == 1 and verdicts == {"nvidia-smi": "passed", "evidence": "passed", "dcgmi-diag": "failed",
                                      "control": "passed", "all-reduce": "passed"}, (out, err)
    assert world.history(node)["state"] == "failed-validation"
    code, out, _ = world.cli("nodes", "release", node)
    assert code == 1 and "did not pass" in out and "dcgmi-diag: failed" in out
    # then the healthy-run control fails
    world.tool(node, "dcgmi", "pass")
    world.tool(node, "healthy-run", "fail")
    code, out, _ = world.cli("nodes", "validate", node, "--json")
    assert code == 1 and _checks(out)["control"] == "failed" and "illegal memory access" in out
    # healthy again: passes, and only then is it released
    world.tool(node, "healthy-run", "pass")
    code, out, err = world.cli("nodes", "validate", node)
    assert code == 0 and f"validate {node}: passed" in out, (out, err)
    assert world.history(node)["state"] == "releasable"
    code, out, err = world.cli("nodes", "release", node)
    assert code == 0 and "release " in out and "done" in out, (out, err)
    assert not scheduler.nodes()[node].drained
    record = world.history(node)
    assert record["state"] == "released" and record["convictions"][0]["incident_id"] == incident
    assert [e["kind"] for e in record["events"]] == ["drain", "reboot", "reboot", "validate", "validate", "validate",
                                                    "validate", "validate", "validate", "release"]
    failed = [e for e in record["events"] if e["kind"] == "validate" and e["result"] == "failed"]
    assert "dcgmi-diag: failed" in failed[0]["detail"] and "control: failed" in failed[1]["detail"]


def test_force_release_is_audited_and_other_peoples_drains_are_never_touched(world) -> None:
    world, scheduler = world
    mine, theirs = world.healthy[0], world.healthy[1]
    code, _, err = world.cli("nodes", "drain", mine, "--reason", "suspect fan")
    assert code == 0, err
    code, out, _ = world.cli("nodes", "release", mine)
    assert code == 1 and "no validation" in out
    code, out, err = world.cli("nodes", "release", mine, "--force")
    assert code == 2 and "--reason" in err
    code, out, err = world.cli("nodes", "release", mine, "--force", "--reason", "fan replaced, checked by hand")
    assert code == 0 and "forced: fan replaced" in out, (out, err)
    (event,) = [e for e in world.history(mine)["events"] if e["kind"] == "force-release"]
    assert "fan replaced, checked by hand" in event["detail"] and "no validation" in event["detail"] and event["by"]
    # someone else's drain: not validated, not rebooted, not released, not listed
    scheduler.set_node(theirs, "DRAIN", "bad DIMM, RMA 4412", "alice")
    for action in ("validate", "reboot", "release"):
        code, out, _ = world.cli("nodes", action, theirs)
        assert code == 1 and "bad DIMM, RMA 4412" in out, (action, out)
    code, out, _ = world.cli("nodes", "list", "--json")
    assert theirs not in [row["node"] for row in json.loads(out)]
    assert scheduler.nodes()[theirs].reason == "bad DIMM, RMA 4412" and world.history(theirs)["events"] == []
    scheduler.set_node(theirs, "IDLE", None)


def test_a_second_conviction_in_the_window_marks_a_node_for_replacement(world) -> None:
    from spikeops.lifecycle.service import ClusterLife

    world, scheduler = world
    lemon = world.healthy[2]
    first = world.convict("inc-lemon-1", node=lemon)
    second = world.convict("inc-lemon-2", node=lemon)
    code, _, err = world.cli("nodes", "drain", lemon, "--reason", "gpu_xid", "--incident", second)
    assert code == 0, err
    with ClusterLife.open(str(world.config), "sim", by="test") as life:
        (view,) = life.survey([lemon])
        assert view.step.action == "replace" and first in view.step.why and second in view.step.why
        marked = life.mark_replace(lemon, view.step.why)
        assert marked.outcome == "done"
        (again,) = life.survey([lemon])
        assert again.step.action == "hold" and "replacement" in again.step.why
    assert "REPLACE" in scheduler.nodes()[lemon].reason and scheduler.nodes()[lemon].drained_by_spikeops
    assert world.history(lemon)["state"] == "replace"
    outbox = list((world.work / "incidents" / "_nodes" / "sim" / lemon).glob("replace-*/outbox.jsonl"))
    assert outbox and "MARKED FOR REPLACEMENT" in outbox[0].read_text()
    # even a passing validation does not bring it back without a person's --force
    world.tool(lemon, "dcgmi", "pass")
    code, out, _ = world.cli("nodes", "validate", lemon)
    assert code == 0, out
    code, out, _ = world.cli("nodes", "release", lemon)
    assert code == 1 and "marked for replacement" in out
    assert world.history(lemon)["state"] == "replace"
    code, out, _ = world.cli("nodes", "release", lemon, "--force", "--reason", "GPU board swapped")
    assert code == 0 and world.history(lemon)["state"] == "released"



def test_a_node_that_cannot_be_reached_has_not_passed_and_a_flows_drain_is_taken_into_the_record(world) -> None:
    """The incident flow's drain is written to the ledger only at the incident's end: the
    lifecycle finds the node drained by spikeops and records it ("seen"). A node whose address
    answers nothing fails its validation, every check unreachable, and is not released."""
    import re

    from spikeops.lifecycle.service import ClusterLife

    world, scheduler = world
    node = world.healthy[2]
    scheduler.drain([node], "gpu_ecc", "inc-open-9")  # as the flow does, without the CLI
    with ClusterLife.open(str(world.config), "sim", by="test") as life:
        lines = life.observe(life.survey([node]))
    assert lines and "drained by spikeops" in lines[0]
    assert world.kinds(node)[-1] == ("drain", "seen") and world.history(node)["events"][-1]["incident"] == "inc-open-9"
    code, out, _ = world.cli("nodes", "list")
    assert code == 0 and node in out and "drained" in out and re.search(r"next: (wait|validate)", out), out
    # its address answers nothing (a node off the network): not passed, stays drained
    inventory = world.work / "unreachable.toml"
    text = world.cluster.inventory.read_text()
    inventory.write_text(re.sub(rf'^"{node}" = "[^"]+"$', f'"{node}" = "127.0.126.250"', text, flags=re.M))
    config = world.work / "unreachable-spikeops.toml"
    config.write_text(world.config.read_text().replace(str(world.cluster.inventory), str(inventory)))
    from spikeops.cli import main
    import io

    out = io.StringIO()
    code = main(["nodes", "validate", node, "--json", "--config", str(config)], out=out, err=io.StringIO())
    (outcome,) = json.loads(out.getvalue())
    assert code == 1 and outcome["outcome"] == "failed"
    assert {c["verdict"] for c in outcome["validation"]["checks"]} == {"unreachable"}
    assert world.history(node)["state"] == "failed-validation" and scheduler.nodes()[node].drained_by_spikeops
    code, out, _ = world.cli("nodes", "release", node)
    assert code == 1 and "did not pass" in out
    assert world.cli("nodes", "release", node, "--force", "--reason", "test cleanup")[0] == 0


SERVE = """
import sys
from spikeops.config import load_config
from spikeops.deployments.lifecycle import lifecycle_deployment
from spikeops.deployments.serve import run_served
deployment = lifecycle_deployment(load_config(sys.argv[1]), "sim", interval_s=float(sys.argv[2]))
run_served([deployment], warm=False)
"""


def test_the_scheduled_deployment_validates_and_releases_on_its_own(world, prefect_server: None) -> None:
    """node-lifecycle/sim served as ``spikeops serve`` serves it, on a 3 s interval: the Prefect
    server schedules its runs from the deployment's schedule (the scheduler service's own code,
    through POST /deployments/ID/schedule: the test server runs no background services), the
    served runner starts them at their times, and with release = "auto" a drained node that
    passes validation is back in service with no one at the keyboard."""
    import os
    import subprocess
    import sys
    import time

    from tests.test_e2e_serve import _stop

    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter
    from prefect.settings import PREFECT_API_URL

    world, scheduler = world
    node = world.healthy[1]
    config = world.work / "auto.toml"
    config.write_text(world.config.read_text() + 'release = "auto"\n')
    code, _, err = world.cli("nodes", "drain", node, "--reason", "suspect")
    assert code == 0, err
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    served = subprocess.Popen([sys.executable, "-c", SERVE, str(config), "3"], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 120
            deployment = None
            while deployment is None and time.monotonic() < deadline:
                try:
                    deployment = client.read_deployment_by_name("node-lifecycle/sim")
                except Exception:  # noqa: BLE001 - not applied yet
                    time.sleep(0.5)
            assert deployment is not None, "the served deployment never appeared"
            assert deployment.schedules[0].schedule.interval.total_seconds() == 3 and deployment.parameters == {
                "cluster": "sim", "config": str(config)}
            response = client.request("POST", f"/deployments/{deployment.id}/schedule",
                                      json={"min_runs": 3, "max_runs": 3})
            assert response.status_code < 300, response.text
            while time.monotonic() < deadline and scheduler.nodes()[node].drained:
                time.sleep(1)
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
                name=DeploymentFilterName(any_=["sim"])), flow_run_filter=FlowRunFilter())
        assert not scheduler.nodes()[node].drained, (served.poll(), [(r.name, r.state_type) for r in runs])
        assert any(r.auto_scheduled for r in runs)
        record = world.history(node)
        assert record["state"] == "released" and record["events"][-1]["by"] == "spikeops node-lifecycle"
        assert [(e["kind"], e["result"]) for e in record["events"][-3:]] == [
            ("validate", "started"), ("validate", "passed"), ("release", "done")]
    finally:
        _stop(served)
