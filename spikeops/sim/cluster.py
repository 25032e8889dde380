"""A local cluster of real OpenSSH servers that answer like the nodes of a GPU job.

``spikeops collect`` SSHes to every node of a job and runs probes; this is what it is
tested and benchmarked against, and what the demo collects from. ``up(D, nodes=N)`` writes
an incident with ``spikeops.sim.build_bundle`` (so the ground truth of what the nodes show
is known), gives each node a loopback address (127.0.0.11 and up), starts one ``sshd`` per
16 addresses, and writes what a client needs: ``D/inventory.toml`` (the collector's),
``D/ssh_config`` (for ``ssh -F``, ``pdsh`` and ``clush``), ``D/known_hosts`` and a key.
Each SSH session runs the client's command with ``/bin/sh`` on a "node" whose fake
``nvidia-smi``, ``dmesg``, ``ethtool`` and ``ibstat`` print that node's files, and whose
sysfs is ``$SPIKEOPS_SYSFS``. ``scenario="real"`` answers with real tool output from
``shared/fixtures/real`` instead. Faults make nodes refuse, stay silent, present a wrong
host key, hang, flood, answer slowly, lack GPUs or InfiniBand, print binary output, leave a
child holding their output open (``linger``), or lose their SSH connection mid-run (``dies``).
``login=REAL_LOGIN`` makes each connection and each session cost what a real node's login
does (``spikeops.sim.nodetools.LoginCost``); the default is this machine's bare sshd.
``tools=REAL_TOOL_TIMES`` makes the fake tools take as long as real ones (``ToolTimes``);
the default answers at once.

Layout of D (all written by ``up``)::

    cluster.json  inventory.toml  ssh_config  known_hosts
    scenario/                 the sim bundle (or, for "real", just its incident.json)
    nodes/<node>/             probe files, bin/ (fault overrides), sys/class/{net,infiniband}
    jobs/<job>/<node>/        nccl.out, train.out, nccl-version.txt
    addr/<address> -> ../nodes/<node>
    bin/                      node-shell (sshd's ForceCommand) and the fake tools
    keys/                     id_ed25519(.pub), authorized_keys
    sshd/                     host_ed25519, sshd-K.conf    run/  *.pid    log/  sshd-K.log

``up`` on a directory whose cluster is running fails (ClusterError: run ``down`` first);
on a stopped cluster's directory it replaces the cluster (its own entries only); on any
other non-empty directory it fails. ``down`` stops every process started for D, by pid,
and leaves the files for inspection. Command line: ``python -m spikeops.sim.cluster
up|down|status`` (``infra/sim/cluster`` wraps it). The core of spikeops never imports this.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import pwd
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ClusterShell.NodeSet import NodeSet

from spikeops.bundle import BundleWriter
from spikeops.sim import localcluster
from spikeops.sim.build import build_bundle
from spikeops.sim.model import CAUSES
from spikeops.sim.nodefiles import NodeSource, bundle_sources, real_sources, write_node
from spikeops.sim.nodetools import (
    CHEAP_LOGIN,
    OVERRIDES,
    REAL_LOGIN,
    REAL_LOGIN_CPU,
    NO_TOOL_TIMES,
    REAL_TOOL_TIMES,
    LoginCost,
    ToolTimes,
    write_override,
    write_tools,
)
from spikeops.sim.sshd import (
    MAX_LISTEN,
    ClusterError,
    check_free,
    ensure_privsep_dir,
    find_processes,
    keygen,
    listening,
    login_user,
    read_pid,
    sshd_config,
    sshd_path,
    start_daemons,
    stop_processes,
    tarpit_command,
    wait_listening,
)

__all__ = [
    "Cluster",
    "ClusterError",
    "FAULTS",
    "LOGINS",
    "TOOL_TIMES",
    "NODE_MODELS",
    "REAL",
    "FORMAT",
    "up",
    "down",
    "load",
    "running",
    "scratch",
    "set_login",
    "status",
    "node_addresses",
    "free_port",
    "default_fixtures",
    "main",
]

#: Fault kinds (``--fault NODE=KIND``).
FAULTS = ("refuse", "silent", "hostkey", "hang", "flood", "slow", "nogpu", "noib", "binary", "linger", "dies")
#: ``--login`` choices: what a login costs on the simulated nodes.
LOGINS = {"cheap": CHEAP_LOGIN, "real": REAL_LOGIN, "real-cpu": REAL_LOGIN_CPU}
#: ``--tool-times`` choices: how long the fake tools take.
TOOL_TIMES = {"none": NO_TOOL_TIMES, "real": REAL_TOOL_TIMES}
#: The node models the collection benchmark measures: (login cost, tool times) by name.
NODE_MODELS: dict[str, tuple[LoginCost, ToolTimes]] = {
    "cheap": (CHEAP_LOGIN, NO_TOOL_TIMES),
    "real": (REAL_LOGIN, NO_TOOL_TIMES),
    "real-cpu": (REAL_LOGIN_CPU, NO_TOOL_TIMES),
    "real-tools": (REAL_LOGIN, REAL_TOOL_TIMES),
}
#: The scenario whose nodes answer with real tool output.
REAL = "real"
#: ``cluster.json``'s format tag.
FORMAT = "spikeops-sim-cluster/1"
REAL_JOB = "1000"
# Cluster's fields that are paths (cluster.json holds them as strings).
_PATHS = ("directory", "inventory", "known_hosts", "ssh_config", "identity_file", "scenario_bundle")

# What up writes in D (and may replace when the cluster there is stopped).
_ENTRIES = ("cluster.json", "inventory.toml", "ssh_config", "known_hosts", "scenario", "nodes", "jobs", "addr",
            "bin", "keys", "sshd", "run", "log")


@dataclass
class Cluster:
    """A started simulated cluster: where everything is, as ``up`` wrote it to cluster.json."""

    directory: Path
    nodes: list[str]
    addresses: dict[str, str]
    port: int
    user: str
    job: str
    inventory: Path
    known_hosts: Path
    ssh_config: Path
    identity_file: Path
    scenario_bundle: Path
    faults: dict[str, str] = field(default_factory=dict)

    def ssh(self, node: str, command: str | None = None) -> list[str]:
        """argv of ``ssh -F D/ssh_config NODE [COMMAND]`` (for subprocess)."""
        argv = ["ssh", "-F", str(self.ssh_config), node]
        return argv if command is None else [*argv, command]


# ---------------------------------------------------------------------------- helpers


def node_addresses(first: str, count: int) -> list[str]:
    """``count`` loopback addresses from ``first`` up, skipping any x.y.z.0 and x.y.z.255."""
    try:
        address = ipaddress.IPv4Address(first)
    except ValueError as exc:
        raise ValueError(f"first address {first!r} is not an IPv4 address") from exc
    out = []
    while len(out) < count:
        if not address.is_loopback:
            raise ValueError(f"{count} node addresses from {first} leave 127.0.0.0/8 at {address}")
        if address.packed[-1] not in (0, 255):
            out.append(str(address))
        address += 1
    return out


def free_port(addresses: Sequence[str] = ("127.0.0.11",), low: int = 20000, high: int = 32000) -> int:
    """A port nothing listens on at any of ``addresses``, below Linux's ephemeral range
    (so an outgoing connection cannot take it between this check and ``up``)."""
    start = low + (os.getpid() * 7919 + int(time.time() * 1000)) % (high - low)
    for offset in range(high - low):
        port = low + (start - low + offset) % (high - low)
        try:
            check_free(addresses, port)
        except ClusterError:
            continue
        return port
    raise ClusterError(f"no free port in {low}-{high} on {addresses[0]}...")


def default_fixtures() -> Path:
    """``<repo root>/../shared/fixtures/real`` (or ``SPIKEOPS_REAL_FIXTURES``)."""
    configured = os.environ.get("SPIKEOPS_REAL_FIXTURES")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "real"


def _toml(value: str) -> str:
    """A TOML basic string (JSON's escapes are a subset of TOML's)."""
    return json.dumps(value, ensure_ascii=False)


def _check_faults(faults: Mapping[str, str] | None, count: int) -> None:
    """ValueError for an unknown kind or an index ``#i`` outside 0..count-1."""
    for key, kind in (faults or {}).items():
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r} for {key}; known: {', '.join(FAULTS)}")
        if key.startswith("#") and not (key[1:].isdigit() and int(key[1:]) < count):
            raise ValueError(f"fault node {key!r}: not an index 0..{count - 1}")


def _resolve_faults(faults: Mapping[str, str] | None, nodes: Sequence[str]) -> dict[str, str]:
    """{node name: kind}; keys are node names or ``#i`` (index into ``nodes``)."""
    _check_faults(faults, len(nodes))
    out: dict[str, str] = {}
    for key, kind in (faults or {}).items():
        if key.startswith("#"):
            node = nodes[int(key[1:])]
        elif key in nodes:
            node = key
        else:
            raise ValueError(f"fault node {key!r} is not a node of the cluster ({NodeSet.fromlist(nodes)})")
        out[node] = kind
    return out


def _check_directory(root: Path) -> None:
    # Paths are written into sshd_config, shell scripts and TOML unquoted or single-quoted.
    localcluster.prepare(root, _ENTRIES, lambda r: bool(find_processes(r, _pid_files(r))), what="a cluster",
                         written_into="sshd and shell configs", down_command="infra/sim/cluster down")


def _make_reachable(root: Path) -> list[str]:
    """Give D 0755 and every ancestor the search bit, so the login user reaches D.

    pytest's and mkdtemp's directories are 0700; only o+x (never read) is added."""
    os.chmod(root, 0o755)
    changed = []
    for folder in root.parents:
        mode = folder.stat().st_mode
        if not mode & 0o001:
            os.chmod(folder, (mode & 0o7777) | 0o001)
            changed.append(str(folder))
    return changed


def _pid_files(root: Path) -> list[Path]:
    run = root / "run"
    return sorted(run.glob("*.pid")) if run.is_dir() else []


# ---------------------------------------------------------------------------- scenario


def _real_incident(bundle: Path, nodes: list[str]) -> dict[str, Any]:
    now = datetime.now(UTC).replace(microsecond=0)
    iso = "%Y-%m-%dT%H:%M:%SZ"
    incident = {
        "incident_id": f"inc-{now:%Y%m%dT%H%M%SZ}-{REAL_JOB}",
        "created": now.strftime(iso),
        "alert": {"source": "spikeops-sim", "received": now.strftime(iso), "payload": {"scenario": REAL}},
        "job": {"id": REAL_JOB, "scheduler": "slurm", "name": "real-fixtures", "nodes": nodes, "gpus_per_node": 8,
                "started": (now - timedelta(hours=6)).strftime(iso), "resumed_from": None},
        "window": {"start": (now - timedelta(minutes=10)).strftime(iso), "end": now.strftime(iso)},
    }
    BundleWriter(bundle).write_incident(incident)
    return incident


def _scenario(root: Path, scenario: str, nodes: int, seed: int, distractors: bool,
              fixtures: Path | None) -> tuple[dict[str, Any], dict[str, NodeSource]]:
    bundle = root / "scenario"
    if scenario == REAL:
        width = max(3, len(str(nodes)))
        names = [f"gpu-{i:0{width}d}" for i in range(1, nodes + 1)]
        source_dir = fixtures if fixtures is not None else default_fixtures()
        try:
            sources = real_sources(source_dir, names, seed)
        except FileNotFoundError as exc:
            raise ClusterError(f"scenario real: {exc}") from exc
        bundle.mkdir(parents=True)
        return _real_incident(bundle, names), sources
    if scenario not in CAUSES:
        raise ValueError(f"unknown scenario {scenario!r}; known: {REAL}, {', '.join(CAUSES)}")
    build_bundle(bundle, scenario, seed=seed, nodes=nodes, distractors=distractors)
    incident = json.loads((bundle / "incident.json").read_text(encoding="utf-8"))
    return incident, bundle_sources(bundle, incident["job"]["nodes"])


# ---------------------------------------------------------------------------- writing


def _write_inventory(cluster: Cluster, gpus_per_node: int, flight_recorder: bool = False) -> None:
    root = cluster.directory
    job_files = f"{root}/jobs/{{job}}/{{node}}"
    lines = [
        "[cluster]",
        'name = "sim"',
        f"nodes = {_toml(str(NodeSet.fromlist(cluster.nodes)))}",
        f"gpus_per_node = {gpus_per_node}",
        "",
        "[ssh]",
        f"user = {_toml(cluster.user)}",
        f"port = {cluster.port}",
        f"identity_file = {_toml(str(cluster.identity_file))}",
        f"known_hosts = {_toml(str(cluster.known_hosts))}",
        "connect_timeout = 5",
        "command_timeout = 10",
        "fanout = 128",
        "",
        "[hosts]",
        *(f"{_toml(node)} = {_toml(cluster.addresses[node])}" for node in cluster.nodes),
        "",
        "[job]",
        f"nccl_log = {_toml(job_files + '/*.out')}",
        f"train_log = {_toml(job_files + '/train.out')}",
        f"nccl_version = {_toml('cat ' + job_files + '/nccl-version.txt')}",
        *([f"flight_recorder = {_toml(job_files + '/flight-recorder/nccl_trace_rank_')}"] if flight_recorder else []),
    ]
    cluster.inventory.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_ssh_config(cluster: Cluster) -> None:
    lines = [f"# spikeops simulated cluster: ssh -F {cluster.ssh_config} NODE COMMAND", ""]
    for node in cluster.nodes:
        lines += [f"Host {node}", f"    HostName {cluster.addresses[node]}", f"    Port {cluster.port}", ""]
    lines += [
        "Host *",
        f"    User {cluster.user}",
        f"    IdentityFile {cluster.identity_file}",
        "    IdentitiesOnly yes",
        f"    UserKnownHostsFile {cluster.known_hosts}",
        "    GlobalKnownHostsFile /dev/null",
        "    StrictHostKeyChecking yes",
        "    UpdateHostKeys no",
        "    BatchMode yes",
        # Offer curve25519 first: the default sntrup761 hybrid costs the OpenSSH client ~90 ms
        # of CPU per connection here, which a 1024-node fan-out on 2 cores cannot afford.
        "    KexAlgorithms ^curve25519-sha256",
        "    ConnectTimeout 5",
        "    LogLevel ERROR",
    ]
    cluster.ssh_config.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_keys(cluster: Cluster) -> None:
    root = cluster.directory
    (root / "keys").mkdir()
    (root / "sshd").mkdir()
    client = keygen(cluster.identity_file, "spikeops-sim client")
    (root / "keys" / "authorized_keys").write_text(client + "\n", encoding="ascii")
    host = keygen(root / "sshd" / "host_ed25519", "spikeops-sim host")
    lines = []
    for node in cluster.nodes:
        key = host
        if cluster.faults.get(node) == "hostkey":  # a key the node does not hold
            key = keygen(root / "sshd" / f"wrong-{node}", f"spikeops-sim wrong key {node}")
        kind, blob = key.split()[:2]
        lines.append(f"[{cluster.addresses[node]}]:{cluster.port} {kind} {blob}")
    cluster.known_hosts.write_text("\n".join(lines) + "\n", encoding="ascii")


def _write_nodes(cluster: Cluster, sources: Mapping[str, NodeSource]) -> None:
    root = cluster.directory
    (root / "addr").mkdir()
    for node in cluster.nodes:
        fault = cluster.faults.get(node)
        node_dir = root / "nodes" / node
        write_node(node_dir, root / "jobs" / cluster.job / node, sources[node], gpu=fault != "nogpu",
                   ib=fault != "noib")
        if fault in OVERRIDES:
            write_override(root, node_dir, fault)
        os.symlink(f"../nodes/{node}", root / "addr" / cluster.addresses[node])


def _save(cluster: Cluster, extra: Mapping[str, Any]) -> None:
    localcluster.save(cluster.directory, FORMAT, cluster, extra)


def _start_servers(cluster: Cluster, sshd: str, timeout: float) -> tuple[dict[str, int], list[list[str]]]:
    root = cluster.directory
    for name in ("run", "log"):
        (root / name).mkdir(exist_ok=True)
    served = [node for node in cluster.nodes if cluster.faults.get(node) not in ("refuse", "silent")]
    groups = [served[i:i + MAX_LISTEN] for i in range(0, len(served), MAX_LISTEN)]
    commands: dict[str, list[str]] = {}
    logs: dict[str, Path] = {}
    for k, group in enumerate(groups):
        conf = root / "sshd" / f"sshd-{k}.conf"
        conf.write_text(sshd_config(listen=[cluster.addresses[node] for node in group], port=cluster.port,
                                    host_key=root / "sshd" / "host_ed25519",
                                    authorized_keys=root / "keys" / "authorized_keys",
                                    pid_file=root / "run" / f"sshd-{k}.pid",
                                    force_command=root / "bin" / "node-shell"), encoding="utf-8")
        logs[f"sshd-{k}"] = root / "log" / f"sshd-{k}.log"
        commands[f"sshd-{k}"] = [sshd, "-f", str(conf), "-E", str(logs[f"sshd-{k}"])]
    for node in cluster.nodes:
        if cluster.faults.get(node) == "silent":
            commands[f"tarpit-{node}"] = tarpit_command(cluster.addresses[node], cluster.port,
                                                        root / "run" / f"tarpit-{node}.pid")
    start_daemons(commands, logs)
    listeners = [cluster.addresses[n] for n in cluster.nodes if cluster.faults.get(n) != "refuse"]
    wait_listening(listeners, cluster.port, timeout)
    pids: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    for name in commands:
        path = root / "run" / f"{name}.pid"
        while (pid := read_pid(path)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if pid is None:
            raise ClusterError(f"{name} wrote no pid file {path}")
        pids[name] = pid
    return pids, groups


# ---------------------------------------------------------------------------- API


def up(directory: str | Path, *, nodes: int = 8, scenario: str = "gpu_xid", seed: int = 0, port: int = 2222,
       first_address: str = "127.0.0.11", faults: Mapping[str, str] | None = None, distractors: bool = False,
       fixtures: str | Path | None = None, ready_timeout: float = 30.0, login: LoginCost = CHEAP_LOGIN,
       tools: ToolTimes = NO_TOOL_TIMES) -> Cluster:
    """Build the scenario, lay out the nodes, start the servers; return the running Cluster.

    ``faults`` maps a node name or ``#i`` (index into the scenario's node order) to a kind
    of ``FAULTS``; nodes the scenario made unreachable get ``refuse``. ``fixtures`` is the
    real-output directory for ``scenario="real"``; ``login`` what a login costs (default:
    nothing beyond this machine's sshd); ``tools`` how long the node tools take (default: no
    time). Waits at most ``ready_timeout`` seconds
    for every address to listen. On any failure, what was started is stopped again.
    Sets the process umask to 022 while it writes (files must be readable by the login user).
    """
    if nodes < 1:
        raise ValueError("a cluster has at least 1 node")
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is not a TCP port")
    if scenario != REAL and scenario not in CAUSES:
        raise ValueError(f"unknown scenario {scenario!r}; known: {REAL}, {', '.join(CAUSES)}")
    addresses = node_addresses(first_address, nodes)
    _check_faults(faults, nodes)  # before minutes of building, not after
    root = Path(directory).resolve()
    sshd = sshd_path()
    _check_directory(root)
    check_free(addresses, port)
    umask = os.umask(0o022)
    try:
        root.mkdir(parents=True, exist_ok=True)
        # A stub first: a failed up leaves a directory the next up may replace.
        localcluster.save(root, FORMAT, {"state": "starting"})
        user = login_user()
        searchable = _make_reachable(root) if user != _invoking_user() else []
        incident, sources = _scenario(root, scenario, nodes, seed, distractors,
                                      Path(fixtures) if fixtures is not None else None)
        names = list(incident["job"]["nodes"])
        resolved = _resolve_faults(faults, names)
        for node in names:
            if not sources[node].reachable:
                resolved.setdefault(node, "refuse")
        cluster = Cluster(
            directory=root, nodes=names, addresses=dict(zip(names, addresses, strict=True)), port=port, user=user,
            job=str(incident["job"]["id"]), inventory=root / "inventory.toml", known_hosts=root / "known_hosts",
            ssh_config=root / "ssh_config", identity_file=root / "keys" / "id_ed25519",
            scenario_bundle=root / "scenario", faults={node: resolved[node] for node in names if node in resolved},
        )
        extra: dict[str, Any] = {"scenario": scenario, "seed": seed, "first_address": first_address,
                                 "made_searchable": searchable, "pids": {},
                                 "login": _login_record(login), "tools": _tools_record(tools)}
        _save(cluster, extra)  # before any process starts: down finds a half-started cluster
        _write_nodes(cluster, sources)
        write_tools(root, login, tools)
        _write_keys(cluster)
        _write_ssh_config(cluster)
        _write_inventory(cluster, int(incident["job"].get("gpus_per_node") or 8),
                         flight_recorder=any(name.startswith("flight-recorder/") for source in sources.values()
                                             for name in source.job))
        ensure_privsep_dir()
        try:
            pids, groups = _start_servers(cluster, sshd, ready_timeout)
        except BaseException:
            stop_processes(root, _pid_files(root))
            raise
        extra.update(pids=pids, groups=groups, started=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        _save(cluster, extra)
        return cluster
    finally:
        os.umask(umask)


@contextmanager
def scratch(prefix: str = "spikeops-cluster-") -> Iterator[Path]:
    """A new directory under the system temp directory to put a cluster in, removed after.

    Not pytest's ``tmp_path``: that lives under ``/tmp/pytest-of-USER``, which every pytest
    session that starts on the machine makes 0700 again, so the login user (``spikeops-sim``
    when running as root) would lose its way to the keys mid-test whenever someone else
    starts a test run."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def set_login(directory: str | Path, login: LoginCost, tools: ToolTimes = NO_TOOL_TIMES) -> None:
    """Change what a login costs and how long the tools take on a cluster (running or not):
    the next sessions pay it. The benchmark measures every node model on one cluster instead
    of building one per model."""
    root = Path(directory).resolve()
    load(root)  # a clear ClusterError when D holds no cluster
    umask = os.umask(0o022)
    try:
        write_tools(root, login, tools)
    finally:
        os.umask(umask)
    document = json.loads((root / "cluster.json").read_text(encoding="utf-8"))
    document["login"] = _login_record(login)
    document["tools"] = _tools_record(tools)
    document.pop("format", None)
    localcluster.save(root, FORMAT, document)


def _login_record(login: LoginCost) -> dict[str, Any]:
    return {"connection_ms": login.connection_ms, "session_ms": login.session_ms, "session_cpu": login.session_cpu}


def _tools_record(tools: ToolTimes) -> dict[str, Any]:
    return {"nvidia_smi_ms": tools.nvidia_smi_ms, "ethtool_ms": tools.ethtool_ms, "ibstat_ms": tools.ibstat_ms,
            "kernel_ms": tools.kernel_ms}


def _invoking_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def load(directory: str | Path) -> Cluster:
    """The Cluster that ``up`` wrote to ``D/cluster.json`` (running or not)."""
    return localcluster.load(directory, FORMAT, Cluster, _PATHS, what="simulated cluster")


def down(directory: str | Path) -> None:
    """Stop every process started for D (listeners, tarpits, sessions), by pid; idempotent.

    Files stay for inspection; a later ``up`` on D replaces them.
    """
    root = Path(directory).resolve()
    stop_processes(root, _pid_files(root))


def running(directory: str | Path, **kwargs: Any) -> AbstractContextManager[Cluster]:
    """``with running(D, ...) as cluster:`` ``up`` ... ``down``, with ``down`` even when the body raises."""
    return localcluster.session(up, down, directory, kwargs)


def status(directory: str | Path) -> dict[str, Any]:
    """What is running for D: each recorded process (alive or not) and how many node
    addresses accept connections; ``running`` is True when all of them do."""
    from spikeops.sim.sshd import listening

    cluster = load(directory)
    processes = localcluster.recorded_processes(cluster.directory)
    expected = [cluster.addresses[n] for n in cluster.nodes if cluster.faults.get(n) != "refuse"]
    up_now = listening(cluster.port) if Path("/proc/net/tcp").is_file() else set()
    listening_count = sum(1 for address in expected if address in up_now)
    return {
        "directory": str(cluster.directory),
        "nodes": str(NodeSet.fromlist(cluster.nodes)),
        "node_count": len(cluster.nodes),
        "port": cluster.port,
        "faults": cluster.faults,
        "processes": processes,
        "listening": listening_count,
        "expected": len(expected),
        "running": bool(processes) and all(p["alive"] for p in processes.values()) and listening_count == len(expected),
        "sessions": len(find_processes(cluster.directory)) - sum(1 for p in processes.values() if p["alive"]),
    }


# ---------------------------------------------------------------------------- command line


def _fault(text: str) -> tuple[str, str]:
    node, sep, kind = text.partition("=")
    if not sep or not node or kind not in FAULTS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NODE=KIND, KIND one of {', '.join(FAULTS)}")
    return node, kind


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infra/sim/cluster",
        description="A local cluster of real OpenSSH servers (one loopback address per node) that answer "
                    "nvidia-smi, dmesg, ethtool, ibstat and sysfs reads from a spikeops.sim incident.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="build a scenario and start its nodes",
                           description="Build the scenario into DIR and start one sshd per 16 nodes.")
    start.add_argument("--dir", required=True, type=Path, help="cluster directory (new, empty, or a stopped cluster)")
    start.add_argument("--nodes", type=int, default=8, help="number of nodes (default 8)")
    start.add_argument("--scenario", default="gpu_xid",
                       help=f"a spikeops.sim cause or '{REAL}' (real tool output); default gpu_xid. "
                            f"Causes: {', '.join(CAUSES)}")
    start.add_argument("--seed", type=int, default=0, help="scenario seed (default 0)")
    start.add_argument("--port", type=int, default=2222, help="TCP port of every node (default 2222)")
    start.add_argument("--first-address", default="127.0.0.11", help="first node address (default 127.0.0.11)")
    start.add_argument("--fault", action="append", type=_fault, default=[], metavar="NODE=KIND",
                       help=f"NODE is a node name or #i (0-based index); KIND one of {', '.join(FAULTS)}. Repeatable")
    start.add_argument("--distractors", action="store_true", help="plant the scenario's seeded distractors")
    start.add_argument("--fixtures", type=Path, default=None, help="real fixtures directory for --scenario real")
    start.add_argument("--login", choices=tuple(LOGINS), default="cheap",
                       help="what each SSH connection and session costs: 'cheap' (this machine's bare sshd, the "
                            f"default), 'real' ({REAL_LOGIN.connection_ms} ms of waiting per connection for the PAM "
                            f"session stack, {REAL_LOGIN.session_ms} ms per session for the login shell's profile) "
                            "or 'real-cpu' (the same, the session's part as CPU)")
    start.add_argument("--tool-times", choices=tuple(TOOL_TIMES), default="none",
                       help="how long the fake tools take: 'none' (they answer at once, the default) or 'real' "
                            f"(nvidia-smi -q {REAL_TOOL_TIMES.nvidia_smi_ms} ms, ethtool -S "
                            f"{REAL_TOOL_TIMES.ethtool_ms} ms an interface, ibstat {REAL_TOOL_TIMES.ibstat_ms} ms, "
                            "spent waiting as real tools do)")
    stop = sub.add_parser("down", help="stop every process of the cluster (idempotent)")
    stop.add_argument("--dir", required=True, type=Path)
    show = sub.add_parser("status", help="what is running; exit 0 when every node listens, 1 otherwise")
    show.add_argument("--dir", required=True, type=Path)
    show.add_argument("--json", action="store_true", help="print the status as JSON")
    return parser


def _cut(nodeset: str, limit: int = 120) -> str:
    """A folded node set, cut for a terminal (a 1024-node sim set folds to kilobytes)."""
    return nodeset if len(nodeset) <= limit else nodeset[:limit] + "..."


def _print_up(cluster: Cluster, seconds: float) -> None:
    addresses = [cluster.addresses[n] for n in cluster.nodes]
    print(f"up: {len(cluster.nodes)} nodes {_cut(str(NodeSet.fromlist(cluster.nodes)))} on {addresses[0]}-{addresses[-1]} "
          f"port {cluster.port}, job {cluster.job}, user {cluster.user} ({seconds:.1f} s)")
    if cluster.faults:
        shown = [f"{node}={kind}" for node, kind in cluster.faults.items()]
        print("faults: " + ", ".join(shown[:20]) + (f" ... ({len(shown)} in all)" if len(shown) > 20 else ""))
    first = next((n for n in cluster.nodes if n not in cluster.faults), cluster.nodes[0])
    print(f"try: ssh -F {cluster.ssh_config} {first} nvidia-smi -q")
    print(f"inventory: {cluster.inventory}")
    print(f"stop: infra/sim/cluster down --dir {cluster.directory}")


def _print_status(state: Mapping[str, Any]) -> None:
    alive = sum(1 for p in state["processes"].values() if p["alive"])
    print(f"{'running' if state['running'] else 'NOT running'}: {state['directory']} "
          f"{state['node_count']} nodes {_cut(state['nodes'])} port {state['port']}; "
          f"{state['listening']}/{state['expected']} addresses listening; "
          f"{alive}/{len(state['processes'])} servers alive; {state['sessions']} session process(es)")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 on success; 1 for ``status`` of a cluster not fully up; 2 with a one-line reason."""
    args = _parser().parse_args(argv)
    return localcluster.command_line(
        "spikeops.sim.cluster", args,
        start=lambda: up(args.dir, nodes=args.nodes, scenario=args.scenario, seed=args.seed, port=args.port,
                         first_address=args.first_address, faults=dict(args.fault), distractors=args.distractors,
                         fixtures=args.fixtures, login=LOGINS[args.login], tools=TOOL_TIMES[args.tool_times]),
        down=down, status=status, show_up=_print_up, show_status=_print_status)


if __name__ == "__main__":
    sys.exit(main())
