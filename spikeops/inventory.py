"""The cluster inventory: which nodes a job can run on and how to reach them over SSH.

A TOML file (docs/inventory.md) rather than flags, because the same answers (user, key,
known_hosts, bastion, timeouts) hold for every incident on a cluster and must not be typed
at 3 a.m. What the inventory leaves unset is taken from the user's ``~/.ssh/config``, so a
team that already reaches its nodes with ``ssh gpu-001`` needs to write almost nothing.

Loading is strict: an unknown key, a wrong type or a node set that does not parse is a
one-line ``InputError`` naming the key, because a typo in ``conect_timeout`` silently
ignored would surface as a hung incident.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.errors import InputError
from spikeops.probes.slurm import expand_nodelist, fold_nodes

__all__ = [
    "Inventory",
    "SshSettings",
    "JobSettings",
    "ProbeSettings",
    "Target",
    "load_inventory",
    "parse_inventory",
    "expand_nodes",
    "fold_nodes",
    "DEFAULT_SESSIONS_PER_NODE",
    "SESSION_MODES",
    "SSH_CLIENTS",
    "resolve_targets",
    "DEFAULT_PORT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_COMMAND_TIMEOUT",
    "DEFAULT_FANOUT",
]

DEFAULT_PORT = 22
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_COMMAND_TIMEOUT = 30.0
DEFAULT_FANOUT = 128
#: OpenSSH's default MaxSessions is 10; stay below it so a stock sshd never refuses a channel.
DEFAULT_SESSIONS_PER_NODE = 8
#: ``[ssh] sessions``: every probe of a node in one SSH session (default), or one session each.
SESSION_MODES = ("single", "per-probe")
#: ``[ssh] client``: paramiko in the collector's process (default), or OpenSSH's ``ssh``.
SSH_CLIENTS = ("paramiko", "openssh")
#: Node names become bundle folder names and SSH host names; never shell words.
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class SshSettings:
    """``[ssh]``; ``None`` means "not set here": ``~/.ssh/config``, then the default, decides."""

    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    jump_host: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT
    fanout: int = DEFAULT_FANOUT
    sessions_per_node: int = DEFAULT_SESSIONS_PER_NODE
    config: str | None = "~/.ssh/config"
    sessions: str = SESSION_MODES[0]
    spool_dir: str | None = None
    client: str = SSH_CLIENTS[0]


@dataclass(frozen=True)
class JobSettings:
    """``[job]``: where the job's logs are on a node. ``{job}`` and ``{node}`` are filled in
    (shell-quoted); the rest is the operator's own shell text, globs included."""

    nccl_log: str | None = None
    train_log: str | None = None
    nccl_version: str | None = None
    #: The job's ``TORCH_FR_DUMP_TEMP_FILE`` on a node (dumps are this prefix + the rank);
    #: unset: read from the job's processes' environment, else torch's default.
    flight_recorder: str | None = None
    #: A command printing the job's process ids on a node, one a line (``scontrol listpids
    #: {job}`` prints a header and more columns: the first column of digit lines is read);
    #: unset: the processes whose environment holds ``SLURM_JOB_ID`` or
    #: ``SPIKEOPS_LOCAL_JOB`` = the job (and, when they name one, this node).
    pids: str | None = None


@dataclass(frozen=True)
class ProbeSettings:
    """``[probes.NAME]``: per-probe overrides."""

    enabled: bool = True
    timeout: float | None = None
    max_bytes: int | None = None
    command: str | None = None


@dataclass(frozen=True)
class Inventory:
    path: Path | None
    name: str
    nodes: list[str]
    ssh: SshSettings = field(default_factory=SshSettings)
    hosts: dict[str, str] = field(default_factory=dict)
    job: JobSettings = field(default_factory=JobSettings)
    probes: dict[str, ProbeSettings] = field(default_factory=dict)
    scheduler: str | None = None
    gpus_per_node: int | None = None

    @property
    def nodeset(self) -> str:
        return fold_nodes(self.nodes)


@dataclass(frozen=True)
class Target:
    """Everything needed to open one SSH connection, after inventory and ssh_config merged."""

    node: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    known_hosts: tuple[str, ...]
    jump: Target | None = None


# ------------------------------------------------------------------------- node sets


def expand_nodes(spec: str | Iterable[str]) -> list[str]:
    """``gpu-[001-004],cpu-1`` to names, in order, without duplicates; InputError if bad."""
    parts = [spec] if isinstance(spec, str) else list(spec)
    names: list[str] = []
    seen: set[str] = set()
    for part in parts:
        expanded, problem = expand_nodelist(str(part))
        if problem:
            raise InputError(f"bad node set: {problem}")
        for name in expanded:
            if not _NODE_NAME.match(name):
                raise InputError(f"bad node name {name!r} (letters, digits and ._- only)")
            if name not in seen:
                seen.add(name)
                names.append(name)
    return names


# ------------------------------------------------------------------------- loading


def _table(document: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = document.get(key, {})
    if not isinstance(value, dict):
        raise InputError(f"{where}: [{key}] must be a table")
    return value


def _check_keys(table: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    known = set(known)
    unknown = sorted(set(table) - known)
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _typed(table: Mapping[str, Any], key: str, kinds: tuple[type, ...], where: str) -> Any:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds:
        raise InputError(f"{where}: {key} must be {kinds[0].__name__}, not a boolean")
    if not isinstance(value, kinds):
        raise InputError(f"{where}: {key} must be {kinds[0].__name__}, got {type(value).__name__}")
    return value


def _positive(value: Any, key: str, where: str) -> Any:
    if value is not None and value <= 0:
        raise InputError(f"{where}: {key} must be positive, got {value}")
    return value


def _text_or_none(value: str | None) -> str | None:
    return value if value not in (None, "") else None


def _ssh_settings(table: Mapping[str, Any], where: str) -> SshSettings:
    _check_keys(table, SshSettings.__dataclass_fields__, f"{where} [ssh]")
    text = {key: _text_or_none(_typed(table, key, (str,), f"{where} [ssh]"))
            for key in ("user", "identity_file", "known_hosts", "jump_host")}
    port = _positive(_typed(table, "port", (int,), f"{where} [ssh]"), "port", where)
    if port is not None and port > 65535:
        raise InputError(f"{where}: [ssh] port {port} out of range")
    numbers: dict[str, Any] = {}
    for key, kinds in (("connect_timeout", (int, float)), ("command_timeout", (int, float)),
                       ("fanout", (int,)), ("sessions_per_node", (int,))):
        value = _positive(_typed(table, key, kinds, f"{where} [ssh]"), key, f"{where} [ssh]")
        if value is not None:
            numbers[key] = float(value) if key.endswith("timeout") else value
    config = table.get("config", "~/.ssh/config")
    if config is not None and not isinstance(config, str):
        raise InputError(f"{where}: [ssh] config must be a path string ('' to ignore ~/.ssh/config)")
    sessions = _typed(table, "sessions", (str,), f"{where} [ssh]") or SESSION_MODES[0]
    if sessions not in SESSION_MODES:
        raise InputError(f"{where}: [ssh] sessions must be one of {', '.join(map(repr, SESSION_MODES))}, "
                         f"not {sessions!r}")
    client = _typed(table, "client", (str,), f"{where} [ssh]") or SSH_CLIENTS[0]
    if client not in SSH_CLIENTS:
        raise InputError(f"{where}: [ssh] client must be one of {', '.join(map(repr, SSH_CLIENTS))}, not {client!r}")
    if client == "openssh" and sessions != "single":
        raise InputError(f"{where}: [ssh] client = \"openssh\" runs one session per node; "
                         f"sessions = {sessions!r} needs client = \"paramiko\"")
    spool = _text_or_none(_typed(table, "spool_dir", (str,), f"{where} [ssh]"))
    if spool is not None and (not spool.startswith("/") or "\n" in spool or "\0" in spool):
        raise InputError(f"{where}: [ssh] spool_dir must be an absolute path on the nodes, not {spool!r}")
    return SshSettings(port=port, config=_text_or_none(config), sessions=sessions, spool_dir=spool, client=client,
                       **text, **numbers)


def _probe_settings(table: Mapping[str, Any], where: str) -> dict[str, ProbeSettings]:
    from spikeops.probes import registry
    from spikeops.probes.base import remote_probes

    registry()
    known = {probe.name for probe in remote_probes()}
    result: dict[str, ProbeSettings] = {}
    for name, entry in table.items():
        spot = f"{where} [probes.{name}]"
        if name not in known:
            raise InputError(f"{spot}: unknown probe (known: {', '.join(sorted(known))})")
        if not isinstance(entry, dict):
            raise InputError(f"{spot}: must be a table")
        _check_keys(entry, ProbeSettings.__dataclass_fields__, spot)
        enabled = _typed(entry, "enabled", (bool,), spot)
        timeout = _positive(_typed(entry, "timeout", (int, float), spot), "timeout", spot)
        max_bytes = _positive(_typed(entry, "max_bytes", (int,), spot), "max_bytes", spot)
        command = _text_or_none(_typed(entry, "command", (str,), spot))
        result[name] = ProbeSettings(
            enabled=True if enabled is None else enabled,
            timeout=None if timeout is None else float(timeout),
            max_bytes=max_bytes, command=command,
        )
    return result


def parse_inventory(text: str, source: str = "inventory", path: Path | None = None) -> Inventory:
    """Parse inventory TOML text; InputError (one line) on anything wrong."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{source}: not valid TOML ({exc})") from None
    _check_keys(document, ("cluster", "ssh", "hosts", "job", "probes"), source)
    cluster = _table(document, "cluster", source)
    _check_keys(cluster, ("name", "nodes", "scheduler", "gpus_per_node"), f"{source} [cluster]")
    nodes_spec = cluster.get("nodes")
    if not nodes_spec:
        raise InputError(f"{source}: [cluster] nodes is required (a node set such as \"gpu-[001-016]\")")
    if not isinstance(nodes_spec, str | list):
        raise InputError(f"{source}: [cluster] nodes must be a node-set string or a list of them")
    nodes = expand_nodes(nodes_spec)
    name = _typed(cluster, "name", (str,), f"{source} [cluster]") or (path.stem if path else "cluster")
    gpus = _positive(_typed(cluster, "gpus_per_node", (int,), f"{source} [cluster]"), "gpus_per_node", source)

    hosts_table = _table(document, "hosts", source)
    hosts: dict[str, str] = {}
    for node, address in hosts_table.items():
        if not isinstance(address, str) or not address.strip():
            raise InputError(f"{source}: [hosts] {node!r} must be an address string")
        for name_ in expand_nodes(node):
            hosts[name_] = address.strip()

    job_table = _table(document, "job", source)
    _check_keys(job_table, JobSettings.__dataclass_fields__, f"{source} [job]")
    job = JobSettings(**{key: _text_or_none(_typed(job_table, key, (str,), f"{source} [job]"))
                         for key in JobSettings.__dataclass_fields__})
    return Inventory(
        path=path, name=name, nodes=nodes,
        ssh=_ssh_settings(_table(document, "ssh", source), source),
        hosts=hosts, job=job,
        probes=_probe_settings(_table(document, "probes", source), source),
        scheduler=_typed(cluster, "scheduler", (str,), f"{source} [cluster]"),
        gpus_per_node=gpus,
    )


def load_inventory(path: str | Path) -> Inventory:
    """Read an inventory file; relative paths inside it are relative to the file."""
    target = Path(path).expanduser()
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{target}: no such inventory file") from None
    except OSError as exc:
        raise InputError(f"{target}: unreadable ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{target}: not a text file (inventory is TOML)") from None
    return parse_inventory(text, str(target), target.resolve())


# ------------------------------------------------------------------------- targets


def _expand_path(value: str, base: Path | None) -> str:
    expanded = Path(os.path.expandvars(os.path.expanduser(value)))
    if not expanded.is_absolute() and base is not None:
        expanded = base / expanded
    return str(expanded)


def _ssh_config(path: str | None) -> Any:
    """paramiko's reading of an OpenSSH client config, or None when there is none."""
    if not path:
        return None
    import paramiko

    target = Path(path).expanduser()
    if not target.is_file():
        return None
    try:
        return paramiko.SSHConfig.from_path(str(target))
    except Exception as exc:  # a broken ~/.ssh/config is the user's, report it plainly
        raise InputError(f"{target}: cannot read ssh config ({exc})") from None


def _split_jump(spec: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (OpenSSH ProxyJump form; only the first hop is used)."""
    first = spec.split(",")[0].strip()
    user, _, hostport = first.rpartition("@")
    host, port = hostport, None
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    elif hostport.count(":") == 1:
        host, _, number = hostport.partition(":")
        port = int(number) if number.isdigit() else None
    return (user or None), host, port


def _target(inventory: Inventory, node: str, address: str | None, config: Any,
            *, explicit_user: str | None = None, explicit_port: int | None = None,
            allow_jump: bool = True) -> Target:
    base = inventory.path.parent if inventory.path else None
    looked = config.lookup(node) if config is not None else {}
    ssh = inventory.ssh
    hostname = address or looked.get("hostname") or node
    user = explicit_user or ssh.user or looked.get("user") or os.environ.get("USER") or "root"
    port = explicit_port or ssh.port or int(looked.get("port", DEFAULT_PORT))
    if ssh.identity_file:
        identities: tuple[str, ...] = (_expand_path(ssh.identity_file, base),)
    else:
        identities = tuple(os.path.expanduser(p) for p in looked.get("identityfile", []))
    if ssh.known_hosts:
        known: tuple[str, ...] = (_expand_path(ssh.known_hosts, base),)
    else:
        files = looked.get("userknownhostsfile")
        known = tuple(os.path.expanduser(p) for p in files.split()) if files else (
            os.path.expanduser("~/.ssh/known_hosts"),)
    jump = None
    jump_spec = ssh.jump_host or (looked.get("proxyjump") if looked.get("proxyjump", "none") != "none" else None)
    if allow_jump and jump_spec:
        jump_user, jump_host, jump_port = _split_jump(jump_spec)
        jump = _target(inventory, jump_host, inventory.hosts.get(jump_host), config,
                       explicit_user=jump_user, explicit_port=jump_port, allow_jump=False)
    return Target(node, hostname, int(port), user, identities, known, jump)


def resolve_targets(inventory: Inventory, nodes: Iterable[str] | None = None) -> dict[str, Target]:
    """Where and how to reach each node: ``[hosts]`` and ``[ssh]`` first, then ssh_config,
    then OpenSSH's defaults. A node outside the inventory is an InputError: spikeops only
    connects to hosts the operator listed, whatever an alert says."""
    wanted = inventory.nodes if nodes is None else list(nodes)
    known = set(inventory.nodes)
    strangers = [node for node in wanted if node not in known]
    if strangers:
        raise InputError(f"not in the inventory: {fold_nodes(strangers)} (inventory has {inventory.nodeset})")
    config = _ssh_config(inventory.ssh.config)
    return {node: _target(inventory, node, inventory.hosts.get(node), config) for node in wanted}
