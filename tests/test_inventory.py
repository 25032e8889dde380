"""The inventory: strict loading, node sets, and the merge with ~/.ssh/config."""

from __future__ import annotations

from pathlib import Path

import pytest

from spikeops.errors import InputError
from spikeops.inventory import load_inventory, parse_inventory, resolve_targets

FULL = """
[cluster]
name = "sim"
nodes = "gpu-[001-016]"
gpus_per_node = 8

[ssh]
user = "root"
port = 22
identity_file = "keys/id_ed25519"
known_hosts = "/etc/spikeops/known_hosts"
jump_host = "ops@bastion:2200"
connect_timeout = 10
command_timeout = 30
fanout = 128

[hosts]
"gpu-001" = "127.0.0.11"

[job]
nccl_log = "/shared/logs/{job}/*.out"

[probes.nvidia-smi-q]
timeout = 60
max_bytes = 1048576

[probes.nvml]
enabled = false
"""


def test_full_inventory_reads_every_section(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(FULL)
    inventory = load_inventory(path)
    assert inventory.name == "sim"
    assert len(inventory.nodes) == 16 and inventory.nodes[0] == "gpu-001" and inventory.nodes[-1] == "gpu-016"
    assert inventory.nodeset == "gpu-[001-016]"
    assert inventory.ssh.fanout == 128 and inventory.ssh.command_timeout == 30.0
    assert inventory.hosts == {"gpu-001": "127.0.0.11"}
    assert inventory.job.nccl_log == "/shared/logs/{job}/*.out"
    assert inventory.probes["nvidia-smi-q"].timeout == 60.0
    assert inventory.probes["nvml"].enabled is False
    target = resolve_targets(inventory, ["gpu-001", "gpu-002"])
    assert target["gpu-001"].hostname == "127.0.0.11"
    assert target["gpu-002"].hostname == "gpu-002"
    # relative paths in the file are relative to the file, not to the working directory
    assert target["gpu-001"].identity_files == (str(tmp_path / "keys" / "id_ed25519"),)
    assert target["gpu-001"].jump is not None
    assert (target["gpu-001"].jump.user, target["gpu-001"].jump.hostname, target["gpu-001"].jump.port) == (
        "ops", "bastion", 2200)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cluster]\nnodes = 'gpu-[001-004'\n", "bad node set"),
        ("[cluster]\nname = 'x'\n", "nodes is required"),
        ("[cluster]\nnodes = 'a'\n[ssh]\nconect_timeout = 3\n", "unknown key 'conect_timeout'"),
        ("[cluster]\nnodes = 'a'\n[ssh]\nport = 'twenty-two'\n", "port must be int"),
        ("[cluster]\nnodes = 'a'\n[ssh]\nfanout = 0\n", "fanout must be positive"),
        ("[cluster]\nnodes = 'a'\n[ssh]\nport = 70000\n", "out of range"),
        ("[cluster]\nnodes = 'a'\n[probes.smi]\ntimeout = 3\n", "unknown probe"),
        ("[cluster]\nnodes = 'a'\n[job]\nnccl_log = 3\n", "nccl_log must be str"),
        ("[cluster]\nnodes = 'a;rm -rf /'\n", "bad node name"),
        ("[cluster\nnodes = 'a'\n", "not valid TOML"),
        ("[cluster]\nnodes = 'a'\n[surprise]\n", "unknown key 'surprise'"),
    ],
)
def test_bad_inventories_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_inventory(text, "inv.toml")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such inventory"):
        load_inventory(tmp_path / "absent.toml")
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 10)
    with pytest.raises(InputError, match="not a text file"):
        load_inventory(binary)


def test_strangers_are_refused() -> None:
    inventory = parse_inventory("[cluster]\nnodes = 'gpu-[1-4]'\n")
    with pytest.raises(InputError, match="not in the inventory: gpu-9"):
        resolve_targets(inventory, ["gpu-1", "gpu-9"])


def test_ssh_config_fills_what_the_inventory_leaves_unset(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(
        "Host gpu-*\n  HostName 10.0.0.%h\n  User trainer\n  Port 2022\n  IdentityFile ~/.ssh/cluster_key\n"
        "  UserKnownHostsFile /etc/ssh/cluster_known_hosts\n  ProxyJump jump@gate:2201\n"
        "Host gate\n  HostName 192.0.2.1\n"
    )
    text = f"[cluster]\nnodes = 'gpu-[1-2]'\n[ssh]\nconfig = '{config}'\n"
    target = resolve_targets(parse_inventory(text))["gpu-1"]
    assert target.user == "trainer" and target.port == 2022
    assert target.hostname == "10.0.0.gpu-1"  # %h expanded by paramiko as OpenSSH does
    assert target.identity_files == (str(Path("~/.ssh/cluster_key").expanduser()),)
    assert target.known_hosts == ("/etc/ssh/cluster_known_hosts",)
    assert target.jump is not None and target.jump.hostname == "192.0.2.1" and target.jump.user == "jump"
    # the inventory wins where it speaks
    explicit = text + "user = 'root'\nport = 22\n[hosts]\n'gpu-1' = '127.0.0.11'\n"
    target = resolve_targets(parse_inventory(explicit))["gpu-1"]
    assert (target.user, target.port, target.hostname) == ("root", 22, "127.0.0.11")
    # and config = '' ignores ~/.ssh/config entirely
    bare = resolve_targets(parse_inventory("[cluster]\nnodes = 'gpu-1'\n[ssh]\nconfig = ''\n"))["gpu-1"]
    assert bare.port == 22 and bare.hostname == "gpu-1" and bare.jump is None
