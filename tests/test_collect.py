"""`spikeops collect` against real OpenSSH servers on loopback (infra/sim/cluster).

One faulty cluster holds every fault the collection must survive: a node that refuses
connections, one that accepts and never speaks SSH, one with a changed host key, one whose
nvidia-smi hangs, one that prints a gigabyte, one without a GPU, one without InfiniBand.
The run must finish within its timeouts, record each fault as data, and bring back the
other nodes' evidence byte for byte, through either SSH client (``[ssh] client``: paramiko
in the collector, or OpenSSH's ``ssh``).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from spikeops.cli import main
from spikeops.collect import collect
from spikeops.errors import InputError
from spikeops.inventory import load_inventory
from spikeops.probes.infiniband import parse_counters
from spikeops.sim import cluster as simcluster

FAULTS = {"#1": "refuse", "#2": "silent", "#3": "hostkey", "#4": "hang", "#5": "flood",
          "#6": "nogpu", "#7": "noib", "#8": "slow"}
#: Small bounds so the faulty nodes cost seconds, not the defaults' minutes.
CONNECT_TIMEOUT = 5
COMMAND_TIMEOUT = 6
CAP = 1 << 20


CLIENTS = ["paramiko", "openssh"]


def _inventory(cluster: simcluster.Cluster, name: str, extra: str = "", client: str = "paramiko",
               **replace: str) -> Path:
    """A copy of the cluster's inventory with tighter bounds, the SSH client (and any edits)."""
    text = cluster.inventory.read_text().replace("fanout = 128\n", f'fanout = 128\nclient = "{client}"\n')
    text = text.replace("connect_timeout = 5", f"connect_timeout = {CONNECT_TIMEOUT}")
    text = text.replace("command_timeout = 10", f"command_timeout = {COMMAND_TIMEOUT}")
    for old, new in replace.items():
        text = text.replace(old, new)
    text += f"\n[probes.nvidia-smi-q]\nmax_bytes = {CAP}\n" + extra
    path = cluster.directory / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def faulty() -> Iterator[simcluster.Cluster]:
    port = simcluster.free_port(("127.0.8.11",))
    with simcluster.scratch() as root, simcluster.running(root / "c", nodes=12, port=port,
                                                          first_address="127.0.8.11", faults=FAULTS) as cluster:
        yield cluster


@pytest.fixture(scope="module", params=CLIENTS)
def client(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def collected(faulty: simcluster.Cluster, client: str, tmp_path_factory: pytest.TempPathFactory):
    inventory = load_inventory(_inventory(faulty, f"tight-{client}.toml", client=client))
    out = tmp_path_factory.mktemp("bundle") / "b"
    return collect(inventory, faulty.job, out), out


def _node(cluster: simcluster.Cluster, fault: str) -> str:
    return next(node for node, kind in cluster.faults.items() if kind == fault)


def _probes(out: Path, node: str) -> dict:
    return json.loads((out / "nodes" / node / "probes.json").read_text())


def test_healthy_nodes_evidence_is_verbatim(faulty, collected) -> None:
    result, out = collected
    healthy = [n for n in faulty.nodes if n not in faulty.faults]
    assert healthy and {r.node for r in result.nodes if r.outcome == "ok"} >= set(healthy)
    for node in healthy:
        source = faulty.scenario_bundle / "nodes" / node
        for name in ("nvidia-smi-q.txt", "kernel.log", "ibstat.txt", "nccl.log"):
            assert (out / "nodes" / node / name).read_bytes() == (source / name).read_bytes(), (node, name)
        for ethtool in source.glob("ethtool-*.txt"):
            assert (out / "nodes" / node / ethtool.name).read_bytes() == ethtool.read_bytes()
        got = parse_counters((out / "nodes" / node / "ib-counters.txt").read_text())
        want = parse_counters((source / "ib-counters.txt").read_text())
        assert [(p.device, p.port, p.counters) for p in got.ports] == [(p.device, p.port, p.counters) for p in want.ports]
        statuses = _probes(out, node)
        assert statuses["nvidia-smi-q"] == {**statuses["nvidia-smi-q"], "command": "nvidia-smi -q", "exit": 0, "error": None}
        assert statuses["nvml"]["exit"] == 127  # spikeops is not installed on the simulated nodes


def test_unreachable_refused_and_silent_nodes_are_recorded_not_fatal(faulty, collected) -> None:
    result, out = collected
    outcome = {r.node: r for r in result.nodes}
    for fault, bucket, error in (("refuse", "unreachable", "unreachable"), ("silent", "timeout", "unreachable"),
                                 ("hostkey", "refused", "host-key")):
        node = _node(faulty, fault)
        assert outcome[node].outcome == bucket, (fault, outcome[node])
        statuses = _probes(out, node)
        assert statuses and {entry["error"] for entry in statuses.values()} == {error}
        assert sorted(p.name for p in (out / "nodes" / node).iterdir()) == ["probes.json"]
    assert "refused" in outcome[_node(faulty, "refuse")].detail
    assert "did not speak SSH" in outcome[_node(faulty, "silent")].detail
    assert "does not match known_hosts" in outcome[_node(faulty, "hostkey")].detail


def test_hung_flooding_and_toolless_nodes_keep_their_other_evidence(faulty, collected) -> None:
    result, out = collected
    hang, flood = _node(faulty, "hang"), _node(faulty, "flood")
    assert _probes(out, hang)["nvidia-smi-q"]["error"] == "timeout"
    assert _probes(out, hang)["kernel"]["error"] is None and (out / "nodes" / hang / "kernel.log").stat().st_size > 0
    assert {r.node: r.outcome for r in result.nodes}[hang] == "timeout"
    assert _probes(out, flood)["nvidia-smi-q"]["error"] == "output-truncated"
    assert (out / "nodes" / flood / "nvidia-smi-q.txt").stat().st_size == CAP
    assert _probes(out, flood)["kernel"]["error"] is None
    nogpu = _node(faulty, "nogpu")
    assert _probes(out, nogpu)["nvidia-smi-q"] == {**_probes(out, nogpu)["nvidia-smi-q"], "exit": 127,
                                                   "error": "command-failed"}
    assert not (out / "nodes" / nogpu / "nvidia-smi-q.txt").exists()
    assert "not found" in (out / "nodes" / nogpu / "nvidia-smi-q.err").read_text()
    noib = _node(faulty, "noib")
    assert _probes(out, noib)["ibstat"]["exit"] == 127
    assert (out / "nodes" / noib / "nvidia-smi-q.txt").is_file()
    slow = _node(faulty, "slow")
    assert _probes(out, slow)["nvidia-smi-q"]["error"] is None and _probes(out, slow)["nvidia-smi-q"]["seconds"] >= 2.5
    # bounded: nothing waited past the timeouts (a hang guard, not a speed claim)
    assert result.seconds < 3 * CONNECT_TIMEOUT + 2 * (COMMAND_TIMEOUT + 4) + 10


def test_summary_folds_nodes_per_outcome(faulty, collected) -> None:
    result, out = collected
    lines = result.summary_lines()
    assert lines[0].startswith(f"collected 12 node(s) of job {faulty.job}")
    labels = {line.split()[0] for line in lines[1:5]}
    assert labels == {"ok", "timed", "unreachable", "refused"}
    record = json.loads((out / "collection.json").read_text())
    assert record["summary"]["refused"] == _node(faulty, "hostkey")
    assert json.loads((out / "incident.json").read_text())["job"]["id"] == faulty.job


def test_existing_evidence_is_not_replaced_without_asking(faulty, client, collected, tmp_path: Path) -> None:
    _, out = collected
    inventory = load_inventory(_inventory(faulty, f"tight-{client}.toml", client=client))
    healthy = [n for n in faulty.nodes if n not in faulty.faults][:2]
    with pytest.raises(InputError, match="already holds evidence"):
        collect(inventory, faulty.job, out, nodes=healthy)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = (copy / "nodes" / healthy[0] / "nvidia-smi-q.txt").read_bytes()
    again = collect(inventory, faulty.job, copy, nodes=healthy, replace=True)
    assert [r.outcome for r in again.nodes] == ["ok", "ok"]
    assert (copy / "nodes" / healthy[0] / "nvidia-smi-q.txt").read_bytes() == before


@pytest.mark.parametrize("client", CLIENTS)
def test_unknown_host_key_and_wrong_identity_are_refused(faulty, client: str, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    healthy = [n for n in faulty.nodes if n not in faulty.faults][:2]
    inventory = load_inventory(_inventory(faulty, f"nokeys-{client}.toml", client=client,
                                          **{str(faulty.known_hosts): str(empty)}))
    result = collect(inventory, faulty.job, tmp_path / "b1", nodes=healthy)
    assert [r.outcome for r in result.nodes] == ["refused", "refused"]
    assert "not in known_hosts" in result.nodes[0].detail
    assert {e["error"] for e in _probes(tmp_path / "b1", healthy[0]).values()} == {"host-key"}
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    inventory = load_inventory(_inventory(faulty, f"wrongkey-{client}.toml", client=client,
                                          **{str(faulty.identity_file): str(stranger)}))
    result = collect(inventory, faulty.job, tmp_path / "b2", nodes=healthy)
    assert [r.outcome for r in result.nodes] == ["refused", "refused"]
    assert {e["error"] for e in _probes(tmp_path / "b2", healthy[0]).values()} == {"auth"}


@pytest.mark.parametrize("client", CLIENTS)
def test_collection_through_a_jump_host(faulty, client: str, tmp_path: Path) -> None:
    healthy = [n for n in faulty.nodes if n not in faulty.faults]
    jump, targets = healthy[0], healthy[1:3]
    spec = f'jump_host = "{faulty.user}@{faulty.addresses[jump]}:{faulty.port}"\n'
    path = _inventory(faulty, f"jump-{client}.toml", client=client,
                      **{"[hosts]": "[hosts]", "fanout = 128\n": "fanout = 128\n" + spec})
    result = collect(load_inventory(path), faulty.job, tmp_path / "b", nodes=targets)
    assert [r.outcome for r in result.nodes] == ["ok", "ok"]
    assert (tmp_path / "b" / "nodes" / targets[0] / "nvidia-smi-q.txt").is_file()
    refused = _node(faulty, "refuse")
    bad = _inventory(faulty, f"badjump-{client}.toml", client=client, **{"fanout = 128\n": "fanout = 128\n" + spec.replace(
        faulty.addresses[jump], faulty.addresses[refused])})
    result = collect(load_inventory(bad), faulty.job, tmp_path / "c", nodes=targets)
    assert [r.outcome for r in result.nodes] == ["unreachable", "unreachable"]
    assert all(r.detail.startswith("jump host") for r in result.nodes)


def test_cli_collect_and_its_errors(faulty, tmp_path: Path) -> None:
    path = _inventory(faulty, "cli.toml")
    healthy = [n for n in faulty.nodes if n not in faulty.faults][:2]
    out, err = io.StringIO(), io.StringIO()
    code = main(["collect", "-i", str(path), "--job", faulty.job, "--nodes", ",".join(healthy),
                 "--out", str(tmp_path / "b"), "--json"], out=out, err=err)
    assert code == 0, err.getvalue()
    document = json.loads(out.getvalue())
    assert [n["outcome"] for n in document["nodes"]] == ["ok", "ok"]
    for argv, message in (
        (["--job", "1; reboot"], "bad job id"),
        (["--job", "1", "--nodes", "gpu-[001-002]"], "not in the inventory"),
        (["--job", "1", "--nodes", "$(reboot)"], "bad node"),
    ):
        err = io.StringIO()
        code = main(["collect", "-i", str(path), "--out", str(tmp_path / "x"), *argv], out=io.StringIO(), err=err)
        assert code == 2 and message in err.getvalue() and err.getvalue().count("\n") == 1, err.getvalue()
    err = io.StringIO()
    assert main(["collect", "-i", str(tmp_path / "none.toml"), "--job", "1", "--out", str(tmp_path / "y")],
                out=io.StringIO(), err=err) == 2
    assert "no such inventory" in err.getvalue()
    unreachable = [_node(faulty, "refuse")]
    code = main(["collect", "-i", str(path), "--job", faulty.job, "--nodes", unreachable[0],
                 "--out", str(tmp_path / "z")], out=io.StringIO(), err=io.StringIO())
    assert code == 1  # nothing reached: the bundle records why, the exit status says so


def test_baseline_goes_beside_the_evidence(faulty, tmp_path: Path) -> None:
    inventory = load_inventory(_inventory(faulty, "base.toml"))
    healthy = [n for n in faulty.nodes if n not in faulty.faults][:2]
    collect(inventory, faulty.job, tmp_path / "b", nodes=healthy, baseline=True)
    folder = tmp_path / "b" / "nodes" / healthy[0]
    assert (folder / "baseline" / "nvidia-smi-q.txt").is_file() and (folder / "baseline" / "probes.json").is_file()
    assert not (folder / "nvidia-smi-q.txt").exists()
    collect(inventory, faulty.job, tmp_path / "b", nodes=healthy)  # the incident capture is still allowed
    assert (folder / "nvidia-smi-q.txt").is_file() and (tmp_path / "b" / "baseline-collection.json").is_file()


def test_collected_bundle_diagnoses_like_the_scenario(tmp_path: Path) -> None:
    """End to end: the evidence that travelled over SSH gives the same diagnosis as the
    scenario's own files."""
    from spikeops.diagnosis import diagnose

    port = simcluster.free_port(("127.0.9.11",))
    with simcluster.scratch() as root, simcluster.running(root / "c", nodes=6, port=port, first_address="127.0.9.11",
                                                          scenario="gpu_xid", seed=3) as cluster:
        bundle = tmp_path / "bundle"
        bundle.mkdir()
        for name in ("incident.json", "metrics.jsonl", "ranks.jsonl", "batches.jsonl", "checkpoints.json"):
            if (cluster.scenario_bundle / name).exists():
                shutil.copy(cluster.scenario_bundle / name, bundle / name)
        result = collect(load_inventory(cluster.inventory), cluster.job, bundle)
        assert {r.outcome for r in result.nodes} == {"ok"}
        expected = diagnose(cluster.scenario_bundle).to_json()
    got = diagnose(bundle).to_json()
    assert got["primary"]["cause"] == expected["primary"]["cause"] == "gpu_xid"
    assert got["culprit_nodes"] == expected["culprit_nodes"] and got["culprit_nodes"]
