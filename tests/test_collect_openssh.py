"""The OpenSSH client transport (``[ssh] client = "openssh"``) without a cluster: the command
line it runs, what the ssh process may see, and how ssh's complaints become the collector's
failures. Collection through it against real servers is in test_collect.py (every fault,
both clients) and test_collect_single.py (the same bundle as over paramiko)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from spikeops.collect import collect
from spikeops.collect.openssh import classify, run_node, ssh_argv
from spikeops.collect.ssh import ConnectFailure
from spikeops.errors import InputError
from spikeops.inventory import Target, load_inventory, parse_inventory

NODE = Target("gpu-007", "10.1.0.7", 2222, "ops", ("/keys/id ed25519",), ("/etc/kh one", "/etc/kh2"))
JUMP = Target("bastion", "10.0.0.1", 22, "jumper", ("/keys/jump%id",), ("/etc/kh2",))


def _options(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, word in enumerate(argv) if word == "-o")


def test_command_line_is_strict_and_names_the_node() -> None:
    argv = ssh_argv(NODE, 5, config=None)
    options = _options(argv)
    assert argv[-3:] == ["--", "gpu-007", "exec sh -s"] and argv[1:3] == ["-F", "/dev/null"]
    assert options["StrictHostKeyChecking"] == "yes" and options["BatchMode"] == "yes"
    assert options["UserKnownHostsFile"] == "'/etc/kh one' /etc/kh2"
    assert options["GlobalKnownHostsFile"] == "/dev/null" and options["UpdateHostKeys"] == "no"
    assert options["ForwardAgent"] == "no" and options["ClearAllForwardings"] == "yes" and "-a" in argv
    assert options["ControlMaster"] == "no" and options["ControlPath"] == "none"
    assert options["SendEnv"] == "-*" and options["HostName"] == "10.1.0.7" and options["ConnectTimeout"] == "5"
    assert options["IdentitiesOnly"] == "yes" and argv[argv.index("-i") + 1] == "/keys/id ed25519"
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "ops"
    assert "ProxyCommand" not in options


def test_a_jump_host_is_a_proxy_command_with_the_same_rules(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n    KexAlgorithms ^curve25519-sha256\n")
    argv = ssh_argv(Target(**{**NODE.__dict__, "jump": JUMP}), 7, config=str(config))
    assert argv[1:3] == ["-F", str(config)]
    proxy = _options(argv)["ProxyCommand"]
    assert proxy.endswith("-W %h:%p -- bastion")
    assert "StrictHostKeyChecking=yes" in proxy and "-l jumper" in proxy and "10.0.0.1" in proxy
    assert "/keys/jump%%id" in proxy  # a path's own % is not one of ssh's tokens


@pytest.mark.parametrize(("stderr", "outcome", "error", "detail"), [
    ("ssh: connect to host 10.1.0.7 port 2222: Connection refused", "unreachable", "unreachable",
     "connection refused (port 2222)"),
    ("Connection timed out during banner exchange\nConnection to 10.1.0.7 port 2222 timed out", "timeout",
     "unreachable", "accepted the connection but did not speak SSH within 5 s"),
    ("ssh: connect to host 10.1.0.7 port 2222: Connection timed out", "timeout", "unreachable",
     "no TCP connection within 5 s"),
    ("No ED25519 host key is known for [10.1.0.7]:2222 and you have requested strict checking.\n"
     "Host key verification failed.", "refused", "host-key", "host key not in known_hosts (ED25519); not trusted"),
    ("@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n"
     "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n"
     "IT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!\nHost key verification failed.", "refused", "host-key",
     "host key does not match known_hosts (changed or impostor)"),
    ("ops@10.1.0.7: Permission denied (publickey).", "refused", "auth", "authentication as ops failed"),
    ("ssh: Could not resolve hostname gpu-007: Name or service not known", "unreachable", "unreachable",
     "cannot resolve 10.1.0.7 (Name or service not known)"),
    ("ssh: connect to host 10.1.0.7 port 2222: No route to host", "unreachable", "unreachable",
     "cannot connect (No route to host)"),
    ("kex_exchange_identification: read: Connection reset by peer", "unreachable", "unreachable",
     "closed the connection during the handshake"),
    ("something ssh never said before", "unreachable", "unreachable", "SSH failed (something ssh never said before)"),
])
def test_ssh_complaints_become_the_collectors_failures(stderr: str, outcome: str, error: str, detail: str) -> None:
    failure = classify(255, stderr, NODE, 5)
    assert failure is not None
    assert (failure.outcome, failure.error, failure.detail) == (outcome, error, detail)


def test_only_sshs_own_status_is_a_connection_failure() -> None:
    assert classify(0, "", NODE, 5) is None
    assert classify(127, "sh: not found", NODE, 5) is None  # the remote command's status
    assert classify(None, "", NODE, 5) is None              # still running, or killed by us


def test_failures_through_a_jump_host_say_so() -> None:
    node = Target(**{**NODE.__dict__, "jump": JUMP})
    refused = classify(255, "ssh: connect to host 10.0.0.1 port 22: Connection refused\n"
                            "Connection closed by UNKNOWN port 65535", node, 5)
    assert refused is not None and refused.detail == "jump host bastion: connection refused (port 2222)"
    tunnel = classify(255, "channel 0: open failed: connect failed: Connection refused\n"
                           "stdio forwarding failed\nConnection closed by UNKNOWN port 65535", node, 5)
    assert tunnel is not None and tunnel.detail.startswith("jump host bastion: ")
    own = classify(255, "ops@10.1.0.7: Permission denied (publickey).", node, 5)
    assert own is not None and own.detail == "authentication as ops failed"  # the node's, not the jump's


def _fake_ssh(tmp_path: Path, body: str) -> Path:
    """An ``ssh`` that records its environment and arguments, then does ``body``."""
    script = tmp_path / "fake-ssh"
    script.write_text(f'#!/bin/sh\nenv > "{tmp_path}/env"\nprintf "%s\\n" "$@" > "{tmp_path}/argv"\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_the_ssh_process_gets_no_secrets_and_its_failure_is_classified(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPIKEOPS_SSH", str(_fake_ssh(
        tmp_path, "echo 'ssh: connect to host 10.1.0.7 port 2222: Connection refused' >&2\nexit 255")))
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-secret")
    monkeypatch.setenv("SSH_AUTH_SOCK", "/run/agent.sock")
    with pytest.raises(ConnectFailure) as raised:
        run_node(NODE, [], lambda probe: None, sessions=8, expand_interfaces=None, connect_timeout=5,
                 node_deadline=None, spool=None, config=None)
    assert raised.value.detail == "connection refused (port 2222)"
    env = (tmp_path / "env").read_text()
    assert "xoxb-secret" not in env and "SLACK_BOT_TOKEN" not in env
    assert "SSH_AUTH_SOCK=/run/agent.sock" in env  # the agent is how a passphrase-protected key is used
    assert (tmp_path / "argv").read_text().splitlines()[-1] == "exec sh -s"


def test_a_session_that_cannot_run_the_runner_is_not_a_connection_failure(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPIKEOPS_SSH", str(_fake_ssh(tmp_path, "cat >/dev/null &\necho 'S2 fail no tar on the node'")))
    result = run_node(NODE, [], lambda probe: None, sessions=8, expand_interfaces=None, connect_timeout=5,
                      node_deadline=None, spool=None, config=None)
    assert result.fallback == "the node cannot run the runner: no tar on the node" and not result.runs


def test_inventory_client_setting() -> None:
    base = '[cluster]\nnodes = "gpu-[1-2]"\n[ssh]\n'
    assert parse_inventory(base).ssh.client == "paramiko"
    assert parse_inventory(base + 'client = "openssh"\n').ssh.client == "openssh"
    with pytest.raises(InputError, match="client must be one of"):
        parse_inventory(base + 'client = "libssh"\n')
    with pytest.raises(InputError, match="needs client = \"paramiko\""):
        parse_inventory(base + 'client = "openssh"\nsessions = "per-probe"\n')


def test_a_node_without_a_spool_falls_back_to_paramiko(tmp_path: Path) -> None:
    """Through ssh the node answers but cannot run the runner: its probes are run a session
    each over paramiko, and collection.json says both."""
    from spikeops.sim import cluster as simcluster

    port = simcluster.free_port(("127.0.24.11",))
    with simcluster.scratch() as root, simcluster.running(root / "c", nodes=1, port=port,
                                                          first_address="127.0.24.11") as cluster:
        text = cluster.inventory.read_text().replace(
            "fanout = 128\n", 'fanout = 128\nclient = "openssh"\nspool_dir = "/nonexistent/spool"\n')
        path = cluster.directory / "nospool.toml"
        path.write_text(text)
        result = collect(load_inventory(path), cluster.job, tmp_path / "b")
        source = (cluster.scenario_bundle / "nodes" / cluster.nodes[0] / "nvidia-smi-q.txt").read_bytes()
    (node,) = result.nodes
    assert node.outcome == "ok" and node.client == "openssh"
    assert node.sessions.startswith("per-probe (fallback: the node cannot run the runner: no writable spool")
    assert (tmp_path / "b" / "nodes" / node.node / "nvidia-smi-q.txt").read_bytes() == source
    record = json.loads((tmp_path / "b" / "collection.json").read_text())
    assert record["nodes"][0]["client"] == "openssh"
    assert os.listdir(tmp_path / "b" / "nodes" / node.node)
