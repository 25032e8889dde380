"""Baselines and the healthy-run control, against real sshd nodes (a simulated ECC incident),
the local scheduler, a real Slurm, the local Slack server and a temporary Prefect server."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spikeops.baselines import (
    BASELINE_FILE,
    CONTROL_FILE,
    add_baselines_parser,
    control_command,
    copy_baselines,
    node_states,
    read_baseline,
    read_control,
    refresh_baselines,
    run_control,
)
from spikeops.errors import InputError
from spikeops.schedulers import LocalScheduler
from spikeops.sim import cluster as simcluster
from spikeops.timeparse import parse_iso
from tests.conftest import ROOT

FIRST = "127.0.40.11"
#: Nothing listens here: a node pointed at it does not answer.
NOWHERE = "127.0.40.250"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    port = simcluster.free_port((FIRST,))
    with simcluster.running(tmp_path_factory.mktemp("baselines") / "c", nodes=4, port=port, first_address=FIRST,
                            scenario="gpu_ecc", seed=3) as started:
        yield started


def _served(cluster, node: str, name: str) -> Path:
    """The file a simulated node prints for a probe."""
    return cluster.directory / "nodes" / node / name


def _inventory_without(cluster, node: str, tmp_path: Path) -> Path:
    """The cluster's inventory with ``node`` moved to an address where nothing listens."""
    text = cluster.inventory.read_text()
    moved = re.sub(rf'^"{node}" = "[^"]+"$', f'"{node}" = "{NOWHERE}"', text, flags=re.MULTILINE)
    assert moved != text
    path = tmp_path / "inventory.toml"
    path.write_text(moved)
    return path


def _swap_served(cluster, replacements: dict[str, Path]) -> dict[str, bytes]:
    """Make nodes print other nvidia-smi pages; returns what they printed before."""
    before = {}
    for node, source in replacements.items():
        target = _served(cluster, node, "nvidia-smi-q.txt")
        before[node] = target.read_bytes()
        target.unlink()
        shutil.copyfile(source, target)
    return before


def _restore_served(cluster, before: dict[str, bytes]) -> None:
    for node, data in before.items():
        target = _served(cluster, node, "nvidia-smi-q.txt")
        target.unlink()
        target.write_bytes(data)


# ------------------------------------------------------------------------------ refresh


def test_refresh_stores_every_node_and_a_silent_node_keeps_its_old_baseline(cluster, tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = refresh_baselines(cluster.inventory, store)
    assert {e.node: e.status for e in first.nodes} == {n: "refreshed" for n in cluster.nodes}
    for node in cluster.nodes:
        assert (store / node / "nvidia-smi-q.txt").read_bytes() == _served(cluster, node, "nvidia-smi-q.txt").read_bytes()
        record = read_baseline(store, node)
        assert record["probes"]["nvidia-smi-q.txt"]["captured"] and record["captured"]
        assert "kernel.log" not in record["probes"] and not (store / node / "kernel.log").exists()  # logs are no baseline
    assert not [p for p in store.iterdir() if p.name.startswith(".incoming")]

    silent, changed = cluster.nodes[0], cluster.nodes[1]
    old = {p.name: p.read_bytes() for p in (store / silent).iterdir() if p.name != BASELINE_FILE}
    old_record = read_baseline(store, silent)
    other = _served(cluster, cluster.nodes[2], "nvidia-smi-q.txt")
    before = _swap_served(cluster, {changed: other, silent: other})
    try:
        second = refresh_baselines(_inventory_without(cluster, silent, tmp_path), store)
    finally:
        _restore_served(cluster, before)
    statuses = {e.node: e for e in second.nodes}
    assert statuses[silent].status == "kept" and statuses[silent].outcome == "unreachable"
    assert {p.name: p.read_bytes() for p in (store / silent).iterdir() if p.name != BASELINE_FILE} == old
    record = read_baseline(store, silent)
    assert record["probes"] == old_record["probes"] and record["last_refresh"]["outcome"] == "unreachable"
    assert (store / changed / "nvidia-smi-q.txt").read_bytes() == other.read_bytes()  # an answer replaces
    assert statuses[changed].status == "refreshed"


def test_a_failed_probe_keeps_its_file_and_drained_nodes_are_skipped(cluster, tmp_path: Path) -> None:
    store = tmp_path / "store"
    refresh_baselines(cluster.inventory, store)
    flaky, drained = cluster.nodes[1], cluster.nodes[3]
    kept = (store / flaky / "nvidia-smi-q.txt").read_bytes()
    served = _served(cluster, flaky, "nvidia-smi-q.txt")
    saved = served.read_bytes()
    served.unlink()  # the node's nvidia-smi now fails (not installed)
    try:
        scheduler = LocalScheduler(tmp_path / "sched")
        scheduler.add_nodes(cluster.nodes)
        scheduler.set_node(drained, "DRAIN", "RMA 77", "bob")
        states = node_states("local", tmp_path / "sched")
        assert states.unavailable == [drained] and drained not in states.idle
        (store / drained).rename(tmp_path / "old-drained")
        result = refresh_baselines(cluster.inventory, store, skip=states.unavailable)
    finally:
        served.write_bytes(saved)
    entries = {e.node: e for e in result.nodes}
    assert entries[flaky].status == "partial" and entries[flaky].kept == ["nvidia-smi-q.txt"]
    assert (store / flaky / "nvidia-smi-q.txt").read_bytes() == kept
    then = parse_iso(read_baseline(store, flaky)["probes"]["nvidia-smi-q.txt"]["captured"])
    assert then is not None and then < parse_iso(entries[flaky].captured)  # the earlier capture, kept
    assert entries[drained].status == "skipped" and not (store / drained).exists()


# ------------------------------------------------------------------------------ into a bundle


def _diagnosis(bundle: Path) -> dict:
    from spikeops.diagnosis import diagnose

    return diagnose(bundle).to_json()


def test_copied_baselines_let_the_diagnosis_read_growth(cluster, tmp_path: Path) -> None:
    """Baselines captured while the nodes were healthy turn ECC counts that are history
    without a baseline into growth; baselines equal to now make them history again."""
    shipped = _diagnosis(cluster.scenario_bundle)  # the scenario's own baselines: the answer
    bundle = tmp_path / "bundle"
    shutil.copytree(cluster.scenario_bundle, bundle, ignore=shutil.ignore_patterns("baseline"))
    without = _diagnosis(bundle)
    culprits = shipped["culprit_nodes"]
    assert culprits and not set(culprits) & set(without["culprit_nodes"])

    healthy = {n: cluster.scenario_bundle / "nodes" / n / "baseline" / "nvidia-smi-q.txt" for n in cluster.nodes}
    before = _swap_served(cluster, healthy)
    try:
        refresh_baselines(cluster.inventory, tmp_path / "healthy")
    finally:
        _restore_served(cluster, before)
    refresh_baselines(cluster.inventory, tmp_path / "now")
    later = datetime.now(UTC) + timedelta(seconds=1)

    grown = tmp_path / "grown"
    shutil.copytree(bundle, grown)
    lines = copy_baselines(tmp_path / "healthy", grown, cluster.nodes, before=later)
    assert all("copied" in line for line in lines), lines
    assert (grown / "nodes" / culprits[0] / "baseline" / BASELINE_FILE).is_file()  # provenance beside the files
    verdict = _diagnosis(grown)
    assert verdict["primary"]["cause"] == shipped["primary"]["cause"] and verdict["culprit_nodes"] == culprits
    assert any("since baseline" in f["summary"] for f in verdict["findings"] if f["nodes"] == culprits)

    same = tmp_path / "same"
    shutil.copytree(bundle, same)
    copy_baselines(tmp_path / "now", same, cluster.nodes, before=later)
    assert not set(culprits) & set(_diagnosis(same)["culprit_nodes"])
    assert any("unchanged since baseline" in f["summary"] for f in _diagnosis(same)["findings"])

    # a bundle's own baseline is never overwritten
    again = copy_baselines(tmp_path / "now", grown, cluster.nodes, before=later)
    assert all("already has a baseline" in line for line in again)
    assert _diagnosis(grown)["culprit_nodes"] == culprits


def test_a_baseline_captured_after_the_window_began_is_not_copied(cluster, tmp_path: Path) -> None:
    store = tmp_path / "store"
    refresh_baselines(cluster.inventory, store, cluster.nodes[:2])
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    start = datetime.now(UTC) - timedelta(minutes=5)
    (bundle / "incident.json").write_text(json.dumps({"incident_id": "inc-x", "job": {"id": "1", "nodes": []},
                                                      "window": {"start": start.isoformat(), "end": None}}))
    lines = copy_baselines(store, bundle, cluster.nodes[:3])
    assert [line.split(":")[0] for line in lines] == cluster.nodes[:3]
    assert "captured after the window began" in lines[0] and "no stored baseline" in lines[2]
    assert not (bundle / "nodes" / cluster.nodes[0] / "baseline").exists()


# ------------------------------------------------------------------------------ control runs


def test_control_runs_on_idle_nodes_and_keeps_what_happened(cluster, tmp_path: Path) -> None:
    store = tmp_path / "store"
    scheduler = LocalScheduler(tmp_path / "sched")
    scheduler.add_nodes(cluster.nodes)
    busy = cluster.nodes[:2]
    job = scheduler.submit([sys.executable, "-c", "import time; time.sleep(60)"], busy)
    try:
        idle = node_states("local", tmp_path / "sched").idle
        assert idle == sorted(set(cluster.nodes) - set(busy))
        marker = tmp_path / "pwned"
        hostile = ["echo", f"a; touch {marker}", f"$(touch {marker})", f"`touch {marker}`", "|", "&&", "'\""]
        results = run_control(cluster.inventory, idle, hostile, 20, store)
    finally:
        scheduler.stop(job, grace=0.5)
    assert [r.node for r in results] == idle and {r.verdict for r in results} == {"ok"}
    assert results[0].stdout_tail == " ".join(hostile[1:]) + "\n" and not marker.exists()  # words, not shell
    for node in cluster.nodes:
        assert (store / node / CONTROL_FILE).is_file() == (node in idle)
    kept = read_control(store, idle[0])
    assert kept["exit"] == 0 and kept["argv"] == hostile and kept["seconds"] >= 0 and kept["verdict"] == "ok"

    failing = run_control(cluster.inventory, idle[:1], ["sh", "-c", "echo checked >&2; exit 3"], 20, store)
    assert failing[0].verdict == "failed" and failing[0].exit == 3 and "checked" in failing[0].stderr_tail
    slow = run_control(cluster.inventory, idle[:1], ["sleep", "30"], 1, store)
    assert slow[0].verdict == "timeout" and slow[0].seconds < 25
    kept = read_control(store, idle[0])
    assert kept["verdict"] == "timeout" and [p["verdict"] for p in kept["previous"]] == ["failed", "ok"]

    silent = run_control(_inventory_without(cluster, idle[0], tmp_path), idle[:1], ["true"], 5)
    assert silent[0].verdict == "unreachable" and silent[0].exit is None


def test_a_control_command_must_be_an_argv() -> None:
    with pytest.raises(InputError):
        control_command("reboot now", 10)  # type: ignore[arg-type]
    with pytest.raises(InputError):
        control_command(["ok", ""], 10)
    with pytest.raises(InputError):
        control_command(["true"], 0)
    assert control_command(["a b", "$x"], 9.6) == "exec timeout -k 5 10 'a b' '$x'"


def _config(cluster, tmp_path: Path, name: str, command: list[str], extra: str = "") -> Path:
    """spikeops.toml with one cluster on the local scheduler (state in tmp_path/sched)."""
    config = tmp_path / "spikeops.toml"
    config.write_text(f"""
[clusters.{name}]
inventory = "{cluster.inventory}"
run_dir = "{tmp_path}"
scheduler = "local"
scheduler_state_dir = "{tmp_path / 'sched'}"
baseline_dir = "{tmp_path / 'store'}"
control_command = {json.dumps(command)}
control_timeout_s = 30
""" + extra)
    return config


def test_the_command_line(cluster, tmp_path: Path) -> None:
    state = tmp_path / "sched"
    LocalScheduler(state).add_nodes(cluster.nodes)
    config = _config(cluster, tmp_path, "sim", ["sh", "-c", "exit 0"])
    parser = argparse.ArgumentParser()
    add_baselines_parser(parser.add_subparsers(dest="command"))

    def run(*argv: str) -> tuple[int, str]:
        out = io.StringIO()
        args = parser.parse_args(["baselines", *argv, "--config", str(config)])
        return args.handler(args, out, io.StringIO()), out.getvalue()

    code, text = run("refresh", "--json")
    assert code == 0 and json.loads(text)["summary"]["refreshed"]
    assert run("control")[0] == 0
    code, text = run("show", "--json")
    assert code == 0 and {row["control"] for row in json.loads(text)} == {"ok"}
    with pytest.raises(InputError):
        run("refresh", "--cluster", "nope")


# ------------------------------------------------------------------------------ the flow


def test_the_flow_refreshes_skips_drained_nodes_and_reports_a_failed_control(cluster, tmp_path: Path,
                                                                            prefect_server: None,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client

    from spikeops.flows.baselines import refresh_baselines_flow
    from spikeops.sim.slack import SlackServer

    token = "xoxb-baselines-test-token-0000"
    state = tmp_path / "sched"
    scheduler = LocalScheduler(state)
    scheduler.add_nodes(cluster.nodes)
    drained = cluster.nodes[0]
    scheduler.set_node(drained, "DRAIN", "spikeops: gpu_xid inc-1", "spikeops")
    store = tmp_path / "store"
    config = _config(cluster, tmp_path, "sim-a", ["sh", "-c", "echo 'ECC check failed' >&2; exit 4"],
                     extra=f'slack_channel = "#gpu-health"\n\n[clusters.no-baselines]\n'
                           f'inventory = "{cluster.inventory}"\nrun_dir = "{tmp_path}"\n')
    with SlackServer(token=token, channels={"C0GPUHEALTH": "gpu-health"}) as slack:
        monkeypatch.setenv("SLACK_BOT_TOKEN", token)
        monkeypatch.setenv("SPIKEOPS_SLACK_API_URL", slack.api_url)
        report = refresh_baselines_flow(config=str(config))
        messages = list(slack.messages)
    assert set(report) == {"sim-a"}
    outcome = report["sim-a"]
    assert outcome["baselines"]["skipped"] == drained and not (store / drained).exists()
    assert all(read_baseline(store, n)["captured"] for n in cluster.nodes[1:])
    assert outcome["control"]["nodes"] == len(cluster.nodes) - 1 and outcome["control"]["slack"]["posted"]
    assert not (store / drained / CONTROL_FILE).exists()
    alert = [m for m in messages if "control run failed" in m.text]
    assert len(alert) == 1 and alert[0].channel == "C0GPUHEALTH" and "ECC check failed" in alert[0].text
    with get_client(sync_client=True) as client:
        artifacts = {a.key: a for a in client.read_artifacts() if a.key in ("baselines-sim-a", "control-sim-a")}
    rows = artifacts["control-sim-a"].data
    rows = json.loads(rows) if isinstance(rows, str) else rows
    assert {row["verdict"] for row in rows} == {"failed"} and len(rows) == len(cluster.nodes) - 1


# ------------------------------------------------------------------------------ deployments


def test_the_deployments_load_with_prefects_own_loader() -> None:
    import importlib

    from prefect.cli.deploy._config import _load_deploy_configs_and_actions
    from prefect.cli.deploy._models import DeploymentConfig, RawScheduleConfig
    from prefect.cli.deploy._schedules import _schedule_config_to_deployment_schedule
    from rich.console import Console

    import yaml

    path = ROOT / "prefect.yaml"
    raw = yaml.safe_load(path.read_text())
    console = Console(file=io.StringIO())
    deployments, actions = _load_deploy_configs_and_actions(path, console=console)
    assert not console.file.getvalue(), console.file.getvalue()  # no validation complaint
    assert [d["name"] for d in deployments] == ["incident-response", "refresh-baselines", "node-lifecycle"]
    for entry in raw["deployments"]:
        assert set(entry) <= set(DeploymentConfig.model_fields), entry
        assert entry["work_pool"]["name"] == "spikeops"
        module, _, name = entry["entrypoint"].partition(":")
        assert module.startswith("spikeops.") and "/" not in module  # by module: no checkout needed
        flow = getattr(importlib.import_module(module), name)
        assert flow.name == entry["name"]
        for schedule in entry.get("schedules") or []:
            RawScheduleConfig.model_validate(schedule)
    assert "concurrency_limit" not in deployments[0]  # the flow holds its own limits (a pause keeps them)
    assert deployments[1]["concurrency_limit"]["limit"] == 1
    schedule = _schedule_config_to_deployment_schedule(deployments[1]["schedules"][0])["schedule"]
    assert schedule.interval > timedelta(0)  # what `prefect deploy` builds from it
    assert actions["pull"] == []  # explicitly none: workers import the installed package


def test_the_served_baseline_deployment() -> None:
    from spikeops.deployments.baselines import baseline_deployment, wants_baselines
    from spikeops.config import ClusterConfig, SpikeopsConfig

    config = SpikeopsConfig(Path("/etc/spikeops.toml"), clusters={
        "a": ClusterConfig("a", "inv.toml", "/runs", baseline_dir="/var/lib/b")})
    deployment = baseline_deployment(config, interval_s=600)
    assert deployment.name == "refresh-baselines" and deployment.parameters == {"config": "/etc/spikeops.toml"}
    assert deployment.schedules[0].schedule.interval == timedelta(seconds=600)
    assert deployment.concurrency_limit == 1 and deployment.concurrency_options.collision_strategy.value == "CANCEL_NEW"
    assert wants_baselines(config) and not wants_baselines(SpikeopsConfig(None))
    with pytest.raises(ValueError):
        baseline_deployment(config, interval_s=0)


# ------------------------------------------------------------------------------ Slurm


@pytest.mark.skipif(not all(os.access(p, os.X_OK) for p in ("/usr/sbin/munged", "/usr/sbin/slurmctld",
                                                           "/usr/sbin/slurmd", "/usr/bin/sbatch")),
                    reason="Slurm's daemons are not installed")
def test_slurm_idle_nodes_leave_out_drained_and_busy_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spikeops.schedulers import SlurmConfig, SlurmScheduler
    from spikeops.schedulers.base import LocalRunner
    from spikeops.sim import slurmcluster

    with slurmcluster.running(tmp_path / "slurm", nodes=3) as slurm:
        env = {**os.environ, **slurm.env}
        scheduler = SlurmScheduler(LocalRunner(slurm.env), SlurmConfig(timeout=20))
        assert sorted(scheduler.idle_nodes()) == sorted(slurm.nodes)
        drained, busy, idle = slurm.nodes
        subprocess.run(["scontrol", "update", f"NodeName={drained}", "State=DRAIN", "Reason=someone else"],
                       env=env, check=True, timeout=20)
        script = tmp_path / "job.sh"
        script.write_text("#!/bin/sh\nsleep 60\n")
        job = subprocess.run(["sbatch", "--parsable", "-w", busy, "-o", str(tmp_path / "out"), str(script)],
                             env=env, capture_output=True, text=True, check=True, timeout=20, cwd=tmp_path).stdout.strip()
        try:
            deadline = time.monotonic() + 20
            while scheduler.idle_nodes() != [idle] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert scheduler.idle_nodes() == [idle]
            for key, value in slurm.env.items():
                monkeypatch.setenv(key, value)
            states = node_states("slurm")  # what the flow reads: scontrol on this machine, SLURM_CONF honoured
            assert states.unavailable == [drained] and states.idle == [idle]
        finally:
            subprocess.run(["scancel", job], env=env, timeout=20, check=False)
