"""The local SSH cluster (spikeops.sim.cluster), against real sshd and the OpenSSH client.

Each cluster gets its own loopback range and a free port; every ssh call has a subprocess
timeout, so a broken server fails a test instead of hanging the suite.
"""

from __future__ import annotations

import os
import sys
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from spikeops.sim import cluster as sim_cluster
from spikeops.sim.cluster import Cluster, ClusterError, free_port, load, node_addresses, running, up
from tests.conftest import REAL, ROOT

SSHD = os.environ.get("SPIKEOPS_SSHD", "/usr/sbin/sshd")
SSH_TIMEOUT = 15


def _require_openssh() -> None:
    if not os.access(SSHD, os.X_OK) or shutil.which("ssh") is None:
        pytest.fail(f"{SSHD} or ssh missing: the cluster tests need openssh-server and openssh-client "
                    f"(apt-get install openssh-server openssh-client)")


def ssh(cluster: Cluster, node: str, command: str | None = None, *options: str,
        timeout: float = SSH_TIMEOUT) -> subprocess.CompletedProcess[bytes]:
    argv = cluster.ssh(node, command)
    argv[3:3] = list(options)
    return subprocess.run(argv, capture_output=True, timeout=timeout, check=False)


def _start(directory: Path, first: str, nodes: int, **kwargs) -> Cluster:
    _require_openssh()
    port = free_port(node_addresses(first, nodes))
    return up(directory, nodes=nodes, port=port, first_address=first, **kwargs)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _require_openssh()
    first = "127.0.0.11"
    port = free_port(node_addresses(first, 8))
    with running(tmp_path_factory.mktemp("cluster"), nodes=8, port=port, first_address=first,
                 faults={"#5": "refuse", "#6": "hostkey", "#7": "hang"}) as started:
        yield started


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    _require_openssh()
    directory = tmp_path_factory.mktemp("real")
    try:
        yield _start(directory, "127.0.0.31", 6, scenario="real", fixtures=REAL,
                     faults={"#1": "nogpu", "#2": "silent", "#3": "noib", "#4": "flood", "#5": "slow"})
    finally:
        sim_cluster.down(directory)


def _healthy(cluster: Cluster) -> list[str]:
    return [node for node in cluster.nodes if node not in cluster.faults]


# ---------------------------------------------------------------------------- files


def test_addresses_skip_network_and_broadcast():
    assert node_addresses("127.0.0.253", 4) == ["127.0.0.253", "127.0.0.254", "127.0.1.1", "127.0.1.2"]
    with pytest.raises(ValueError, match="127.0.0.0/8"):
        node_addresses("127.255.255.250", 10)


def test_bad_faults_fail_before_anything_is_built(tmp_path):
    with pytest.raises(ValueError, match="unknown fault"):
        up(tmp_path / "c", nodes=2, faults={"#0": "melt"})
    with pytest.raises(ValueError, match="not an index"):
        up(tmp_path / "c", nodes=2, faults={"#2": "hang"})
    assert not (tmp_path / "c").exists()


def test_written_files(cluster):
    root = cluster.directory
    assert load(root) == cluster
    inventory = tomllib.loads(cluster.inventory.read_text())
    assert inventory["cluster"]["name"] == "sim" and inventory["cluster"]["gpus_per_node"] == 8
    ssh_section = inventory["ssh"]
    assert ssh_section["user"] == cluster.user and ssh_section["port"] == cluster.port
    assert ssh_section["identity_file"] == f"{root}/keys/id_ed25519"
    assert ssh_section["known_hosts"] == f"{root}/known_hosts"
    assert (ssh_section["connect_timeout"], ssh_section["command_timeout"], ssh_section["fanout"]) == (5, 10, 128)
    assert inventory["hosts"] == cluster.addresses
    assert list(cluster.addresses.values()) == [f"127.0.0.{11 + i}" for i in range(8)]
    assert inventory["job"]["nccl_version"] == f"cat {root}/jobs/{{job}}/{{node}}/nccl-version.txt"
    assert len(cluster.known_hosts.read_text().splitlines()) == 8
    assert oct(cluster.identity_file.stat().st_mode & 0o777) == "0o600"
    node = _healthy(cluster)[0]
    job_dir = root / "jobs" / cluster.job / node
    scenario = cluster.scenario_bundle / "nodes" / node
    assert (job_dir / "nccl.out").read_bytes() == (scenario / "nccl.log").read_bytes()
    assert (job_dir / "nccl-version.txt").read_bytes() == (scenario / "nccl-version.txt").read_bytes()


# ---------------------------------------------------------------------------- answers


def test_nvidia_smi_is_the_scenario_file_byte_for_byte(cluster):
    for node in _healthy(cluster)[:2]:
        proc = ssh(cluster, node, "nvidia-smi -q")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == (cluster.scenario_bundle / "nodes" / node / "nvidia-smi-q.txt").read_bytes()


def test_node_environment_and_empty_command(cluster):
    node = _healthy(cluster)[1]
    assert ssh(cluster, node).stdout.decode().strip() == node
    out = ssh(cluster, node, 'echo "$SPIKEOPS_SIM_NAME $SPIKEOPS_SYSFS"; dmesg | head -1').stdout.decode()
    name, sysfs = out.splitlines()[0].split()
    assert name == node and sysfs == f"{cluster.directory}/nodes/{node}/sys"
    kernel = (cluster.scenario_bundle / "nodes" / node / "kernel.log").read_text()
    assert out.splitlines()[1] == kernel.splitlines()[0]


def test_ib_counters_grep_gives_the_scenario_values(cluster):
    node = _healthy(cluster)[2]
    proc = ssh(cluster, node, 'grep -H . "$SPIKEOPS_SYSFS"/class/infiniband/*/ports/*/counters/*')
    assert proc.returncode == 0, proc.stderr
    sysfs = f"{cluster.directory}/nodes/{node}/sys/"
    got = sorted(line.replace(sysfs, "/sys/", 1) for line in proc.stdout.decode().splitlines())
    scenario = (cluster.scenario_bundle / "nodes" / node / "ib-counters.txt").read_text().splitlines()
    want = sorted(line for line in scenario if "/ports/" in line and "/counters/" in line)
    assert got == want and want


def test_ethtool_answers_each_interface_of_sysfs(cluster):
    node = _healthy(cluster)[0]
    ifaces = ssh(cluster, node, 'ls "$SPIKEOPS_SYSFS"/class/net').stdout.decode().split()
    assert "lo" in ifaces and len(ifaces) >= 2
    for iface in ifaces:
        if iface == "lo":
            continue
        proc = ssh(cluster, node, f"ethtool -S {iface}")
        assert proc.returncode == 0
        assert proc.stdout == (cluster.scenario_bundle / "nodes" / node / f"ethtool-{iface}.txt").read_bytes()
    proc = ssh(cluster, node, "ethtool -S nosuch0")
    assert proc.returncode == 1 and b"no device matches name" in proc.stderr


def test_refused_node(cluster):
    proc = ssh(cluster, cluster.nodes[5], "true")
    assert proc.returncode == 255 and b"Connection refused" in proc.stderr


def test_wrong_host_key(cluster):
    proc = ssh(cluster, cluster.nodes[6], "true")
    assert proc.returncode == 255
    assert b"Host key verification failed" in proc.stderr or b"IDENTIFICATION HAS CHANGED" in proc.stderr


def test_hanging_nvidia_smi(cluster):
    with pytest.raises(subprocess.TimeoutExpired):
        ssh(cluster, cluster.nodes[7], "nvidia-smi -q", timeout=2)


def test_jump_host(cluster):
    jump, target = _healthy(cluster)[:2]
    proc = ssh(cluster, target, "echo $SPIKEOPS_SIM_NAME", "-J", jump)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().strip() == target


def test_fan_out_tools(cluster):
    nodes = _healthy(cluster)[:3]
    env = {**os.environ, "PDSH_SSH_ARGS": f"-F {cluster.ssh_config} %h", "PDSH_RCMD_TYPE": "ssh"}
    if shutil.which("pdsh"):
        proc = subprocess.run(["pdsh", "-w", ",".join(nodes), "echo $SPIKEOPS_SIM_NAME"], env=env,
                              capture_output=True, timeout=SSH_TIMEOUT, check=False)
        assert sorted(proc.stdout.decode().splitlines()) == sorted(f"{n}: {n}" for n in nodes)
    clush = Path(sys.executable).with_name("clush")
    proc = subprocess.run([str(clush), "-o", f"-F {cluster.ssh_config}", "-w", ",".join(nodes), "-N",
                           "echo $SPIKEOPS_SIM_NAME"], capture_output=True, timeout=SSH_TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.decode().split()) == sorted(nodes)


def test_up_on_a_running_cluster_fails(cluster):
    with pytest.raises(ClusterError, match="already running"):
        up(cluster.directory, nodes=8, port=cluster.port)


def test_status_command(cluster):
    proc = subprocess.run([str(ROOT / "infra" / "sim" / "cluster"), "status", "--dir", str(cluster.directory)],
                          capture_output=True, text=True, timeout=SSH_TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("running:") and "7/7 addresses listening" in proc.stdout


# ---------------------------------------------------------------------------- real output


def test_real_nodes_answer_with_real_fixtures(real_cluster):
    node = real_cluster.nodes[0]
    assert real_cluster.job == "1000" and real_cluster.nodes == [f"gpu-00{i}" for i in range(1, 7)]
    proc = ssh(real_cluster, node, "nvidia-smi -q")
    assert proc.returncode == 0, proc.stderr
    fixtures = {path.read_bytes() for path in (REAL / "nvidia-smi").glob("*.txt")}
    assert proc.stdout in fixtures
    proc = ssh(real_cluster, node, 'ls "$SPIKEOPS_SYSFS"/class/infiniband')
    assert proc.returncode == 0 and proc.stdout.split()


def test_node_without_gpus(real_cluster):
    proc = ssh(real_cluster, real_cluster.nodes[1], "nvidia-smi -q")
    assert proc.returncode == 127 and proc.stderr.strip() == b"sh: 1: nvidia-smi: not found"


def test_node_without_infiniband(real_cluster):
    proc = ssh(real_cluster, real_cluster.nodes[3], 'ibstat; echo "$?"; ls "$SPIKEOPS_SYSFS"/class')
    assert proc.stdout.decode().split() == ["127", "net"]
    assert b"ibstat: not found" in proc.stderr


def test_other_nvidia_smi_forms(real_cluster):
    proc = ssh(real_cluster, real_cluster.nodes[0], "nvidia-smi -q -x; echo $?; nvidia-smi -L; echo $?")
    assert proc.stdout.decode().splitlines()[-3:] == ["2", "NVIDIA-SMI (spikeops simulated node gpu-001)", "0"]


def test_flooding_and_slow_nvidia_smi(real_cluster):
    proc = ssh(real_cluster, real_cluster.nodes[4], "nvidia-smi -q | head -c 1000000 | wc -c")
    assert proc.stdout.strip() == b"1000000"
    proc = ssh(real_cluster, real_cluster.nodes[5], "timeout 1 nvidia-smi -q; echo $?")
    assert proc.stdout.strip() == b"124"


def test_silent_node(real_cluster):
    proc = ssh(real_cluster, real_cluster.nodes[2], "true", "-o", "ConnectTimeout=1")
    assert proc.returncode == 255 and b"timed out" in proc.stderr


# ---------------------------------------------------------------------------- down


def _processes_referring_to(root: Path) -> list[str]:
    marker = os.fsencode(str(root))
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        for name in ("cmdline", "environ"):
            try:
                data = Path("/proc", entry, name).read_bytes()
            except OSError:
                continue
            if marker in data:
                found.append(f"{entry}: {Path('/proc', entry, 'cmdline').read_bytes()!r}")
                break
    return found


def test_down_stops_everything_and_is_idempotent(tmp_path):
    root = tmp_path / "c"
    started = _start(root, "127.0.0.41", 2, faults={"#0": "hang", "#1": "silent"})
    with pytest.raises(subprocess.TimeoutExpired):
        ssh(started, started.nodes[0], "nvidia-smi -q", timeout=1.5)
    assert _processes_referring_to(started.directory)
    sim_cluster.down(root)
    assert _processes_referring_to(started.directory) == []
    sim_cluster.down(root)
    assert _processes_referring_to(started.directory) == []
    assert sim_cluster.status(root)["running"] is False
