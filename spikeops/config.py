"""``spikeops.toml``: one file for what the pipeline needs to know about each cluster.

The alert receiver turns an alert's labels (job id, cluster name) into the incident flow's
parameters with it, so no alert can name an inventory, a path or a command: labels only pick
among what the operator configured. Secrets are never read from here (tokens come from the
environment or Prefect blocks); ``SPIKEOPS_CONFIG`` names the file.

```toml
[incidents]
dir = "/var/lib/spikeops/incidents"
max_concurrent = 4                  # incidents acting at once (one per job, always)

[receiver]
addr = "127.0.0.1:8787"

[clusters.sim]
inventory = "/etc/spikeops/sim.toml"
scheduler = "slurm"                 # or "local" (+ scheduler_state_dir)
run_dir = "/shared/runs/{job}"      # where the job's spikeops.train files are ({lineage}: the
checkpoint_root = "/ckpt/{job}"     # lineage's first job; a job spikeops resumed keeps its parent's paths)
slack_channel = "#incidents"
approval = "always"                 # always | auto-hardware | never
approval_timeout_s = 3600           # how long a person has to answer; silence is a no
replay = "ask"                      # replay the spike window before resuming: auto | ask | never
replay_steps = 500                  # ... at most this many steps
replay_timeout_s = 1800             # ... and seconds for both replays
observe_steps = 50                  # after a single spike, steps to watch before deciding
observe_timeout_s = 600             # ... and the most seconds to wait for them
baseline_dir = "/var/lib/spikeops/baselines/sim"   # kept fresh by the baseline deployment
control_command = ["/opt/bin/healthy-run", "--short"]  # the seed's control run on idle nodes
control_timeout_s = 600
collect_runner = "threads"          # or "dask": the collection shards run on a Dask cluster...
dask_scheduler = "tcp://10.1.0.5:8786"   # ... this one, near the nodes (docs/scaleout.md)
max_auto_resumes = 2                # resumes of one job lineage without a person...
recurrence_window = "24h"           # ... within this window (s, m, h or d); past it a person decides
oncall = "<!subteam^S0123ABC>"      # who Slack mentions when an incident waits for a person
reboot = "ask"                      # reset-class faults: reboot into the drain? ask | auto | never
release = "ask"                     # a node that passed validation: ask | auto (docs/lifecycle.md)
validate_after = "30m"              # wait after the drain (or reboot) before validating; doubles per failure
validation = ["nvidia-smi", "dcgmi-diag", "control", "all-reduce", "evidence"]
validation_timeouts = { "dcgmi-diag" = 1800 }   # seconds per check (defaults in lifecycle/checks.py)
allreduce_command = ["mpirun", "--host", "{node},{peer}", "-np", "2", "all_reduce_perf", "-b", "8M", "-e", "1G", "-f", "2", "-g", "{gpus}"]
allreduce_min_busbw = 150.0         # GB/s the AllReduce with a healthy peer must reach (default: not checked)
lemon_threshold = 2                 # convictions of one node within lemon_window -> marked for replacement
lemon_window = "30d"
lifecycle_every = "15m"             # how often the node-lifecycle deployment runs for this cluster

[ledger]                            # the index across incidents (docs/ledger.md)
url = "postgresql://spikeops@db.example/spikeops"   # default: SQLite under $XDG_STATE_HOME/spikeops

[watch]                             # spikeops watch thresholds (docs/watch.md)

[prefect]                           # the local server `spikeops serve` starts without PREFECT_API_URL
port = 4200
home = "~/.local/state/spikeops/prefect"   # its database and settings
```
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from spikeops.errors import InputError

__all__ = ["ClusterConfig", "SpikeopsConfig", "IncidentSettings", "load_config", "check_config", "resolve_incident",
           "DEFAULT_RECEIVER_ADDR", "DEFAULT_INCIDENTS_DIR", "DEFAULT_MAX_CONCURRENT", "JOB_ID", "CLUSTER_NAME",
           "SCHEDULERS", "APPROVALS", "SKIPPABLE", "REPLAYS", "COLLECT_RUNNERS",
           "DASK_ADDRESS", "DEFAULT_PREFECT_PORT", "DEFAULT_PREFECT_HOME", "DEFAULT_MAX_AUTO_RESUMES",
           "DEFAULT_RECURRENCE_WINDOW", "parse_duration", "lifecycle_policy"]

DEFAULT_RECEIVER_ADDR = "127.0.0.1:8787"
DEFAULT_INCIDENTS_DIR = "~/.local/state/spikeops/incidents"
DEFAULT_MAX_CONCURRENT = 4
#: The local Prefect server of ``spikeops serve`` without ``PREFECT_API_URL``: Prefect's own port,
#: and a home of its own beside the incidents, never the user's ``~/.prefect`` profile.
DEFAULT_PREFECT_PORT = 4200
DEFAULT_PREFECT_HOME = "~/.local/state/spikeops/prefect"
SCHEDULERS = ("slurm", "local")
APPROVALS = ("always", "auto-hardware", "never")
SKIPPABLE = ("protect", "collect", "isolate", "resume", "notify")
REPLAYS = ("auto", "ask", "never")
#: Where the collection shards run: the flow's own threads (one process), or a Dask cluster.
COLLECT_RUNNERS = ("threads", "dask")
#: A Dask scheduler's address (what ``dask scheduler`` prints): tcp:// or tls://, host, port.
DASK_ADDRESS = re.compile(r"^(tcp|tls)://[A-Za-z0-9_.:\[\]-]+:\d{1,5}$")
#: What a job id may be: a scheduler's id, never shell syntax (alerts and forms are checked against it).
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,127}$")
#: What a cluster name may be.
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: The restart budget (docs/ledger.md): resumes of one job lineage spikeops makes without a
#: person, within the recurrence window; past it nothing is resumed without a person.
DEFAULT_MAX_AUTO_RESUMES = 2
DEFAULT_RECURRENCE_WINDOW = "24h"
_DURATION = re.compile(r"^(\d{1,7})\s*(s|m|h|d)$")


def parse_duration(value: Any) -> int:
    """Seconds of ``"24h"``, ``"90m"``, ``"2d"``, ``"600s"`` (or a whole number of seconds);
    ValueError otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _DURATION.match(value.strip()) if isinstance(value, str) else None
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"a duration such as 24h, 90m, 2d or 600s, not {value!r}")
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    inventory: str
    run_dir: str
    scheduler: str = "slurm"
    scheduler_state_dir: str | None = None
    checkpoint_root: str | None = None
    slack_channel: str | None = None
    approval: str = "always"
    approval_timeout_s: int | None = None
    observe_steps: int | None = None
    observe_timeout_s: int | None = None
    #: Where the scheduled baseline refresh keeps each node's last healthy probes.
    baseline_dir: str | None = None
    #: The seed's periodic "healthy run" control: a command run on idle nodes (argv, no shell).
    control_command: list[str] | None = None
    control_timeout_s: int = 600
    #: The replay gate (docs/replay.md): re-run the spike window before resuming, on the
    #: original nodes and on others, when the diagnosis is not conclusive hardware.
    replay: str = "ask"
    replay_steps: int = 500
    replay_timeout_s: int = 1800
    #: Where the collection shards run: "threads" (in the flow's process) or "dask".
    collect_runner: str = "threads"
    #: The Dask scheduler the shards go to with ``collect_runner = "dask"``.
    dask_scheduler: str | None = None
    #: The restart budget: resumes of one lineage without a person within ``recurrence_window``.
    max_auto_resumes: int = DEFAULT_MAX_AUTO_RESUMES
    recurrence_window: str = DEFAULT_RECURRENCE_WINDOW
    #: Mentioned in Slack when an incident waits for a person (``<@U…>``, ``<!subteam^S…>``, ``@name``).
    oncall: str | None = None
    #: The node lifecycle (docs/lifecycle.md): reboot reset-class faults into the drain
    #: (ask | auto | never), release nodes that passed validation (ask | auto), when to
    #: validate, which checks, the AllReduce, and the lemon rule.
    reboot: str = "ask"
    release: str = "ask"
    validate_after: str = "30m"
    validation: list[str] | None = None
    validation_timeouts: dict[str, int] | None = None
    allreduce_command: list[str] | None = None
    allreduce_min_busbw: float | None = None
    lemon_threshold: int = 2
    lemon_window: str = "30d"
    lifecycle_every: str = "15m"


def lifecycle_policy(cluster: ClusterConfig) -> Any:
    """The cluster's ``spikeops.lifecycle.plan.LifecyclePolicy``."""
    from spikeops.lifecycle.plan import LifecyclePolicy

    return LifecyclePolicy(reboot=cluster.reboot, release=cluster.release,
                           validate_after_s=parse_duration(cluster.validate_after),
                           lemon_threshold=cluster.lemon_threshold, lemon_window_s=parse_duration(cluster.lemon_window))


@dataclass(frozen=True)
class SpikeopsConfig:
    path: Path | None
    incidents_dir: str = DEFAULT_INCIDENTS_DIR
    receiver_addr: str = DEFAULT_RECEIVER_ADDR
    #: Incidents acting at once (a Prefect global concurrency limit; one per job always).
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    clusters: dict[str, ClusterConfig] = field(default_factory=dict)
    #: The ``[watch]`` table as written; ``spikeops.watch`` validates it.
    watch: dict[str, Any] = field(default_factory=dict)
    #: The local Prefect server ``spikeops serve`` starts when ``PREFECT_API_URL`` is not set.
    prefect_port: int = DEFAULT_PREFECT_PORT
    prefect_home: str = DEFAULT_PREFECT_HOME
    #: ``[ledger] url``: the ledger's SQLAlchemy URL (None: ``$SPIKEOPS_LEDGER_URL`` or the
    #: default SQLite file; ``spikeops.ledger.ledger_url``). May hold a password: never print it.
    ledger_url: str | None = None

    def flow_parameters(self, job: str, cluster: str | None, lineage: str | None = None) -> dict[str, Any]:
        """The incident flow's parameters for a job on a configured cluster; InputError when
        the cluster is not configured (or is ambiguous) or the job id is not one. ``{job}`` in
        a path is the job id, ``{lineage}`` its lineage's first job (``lineage``, default the
        job itself: the flow knows it from the ledger)."""
        if not JOB_ID.match(job or ""):
            raise InputError(f"bad job id {job!r}")
        if cluster is None:
            if len(self.clusters) != 1:
                raise InputError("the alert names no cluster and several are configured")
            cluster = next(iter(self.clusters))
        chosen = self.clusters.get(cluster)
        if chosen is None:
            raise InputError(f"cluster {cluster!r} is not configured")
        if lineage is not None and not JOB_ID.match(lineage):
            raise InputError(f"bad lineage {lineage!r}")
        root = lineage or job  # ids already checked: nothing but [A-Za-z0-9_.:+-]
        fill = lambda text: text.replace("{job}", job).replace("{lineage}", root) if text else text  # noqa: E731
        params: dict[str, Any] = {
            "job_id": job, "inventory": chosen.inventory, "run_dir": fill(chosen.run_dir),
            "checkpoint_root": fill(chosen.checkpoint_root), "incidents_dir": self.incidents_dir,
            "scheduler": chosen.scheduler, "scheduler_state_dir": chosen.scheduler_state_dir,
            "slack_channel": chosen.slack_channel, "approval": chosen.approval,
            "approval_timeout_s": chosen.approval_timeout_s, "replay": chosen.replay,
            "replay_steps": chosen.replay_steps, "replay_timeout_s": chosen.replay_timeout_s, "observe_steps": chosen.observe_steps, "observe_timeout_s": chosen.observe_timeout_s,
            "baseline_dir": chosen.baseline_dir,
            "dask_scheduler": chosen.dask_scheduler if chosen.collect_runner == "dask" else None,
            "max_auto_resumes": chosen.max_auto_resumes,
            "recurrence_window_s": parse_duration(chosen.recurrence_window), "oncall": chosen.oncall,
        }
        return {k: v for k, v in params.items() if v is not None}


_CLUSTER_KEYS = set(ClusterConfig.__dataclass_fields__) - {"name"}
#: Integer keys of a cluster and their bounds (inclusive).
_INT_BOUNDS = {"approval_timeout_s": (1, 7 * 86400), "observe_steps": (0, 10_000),
               "observe_timeout_s": (0, 86_400), "control_timeout_s": (1, 86_400),
               "replay_steps": (1, 1_000_000), "replay_timeout_s": (10, 7 * 86400), "max_auto_resumes": (0, 100),
               "lemon_threshold": (1, 100)}
_LIFECYCLE_CHOICES = {"reboot": ("ask", "auto", "never"), "release": ("ask", "auto")}
_STR_KEYS = ("inventory", "run_dir", "scheduler_state_dir", "checkpoint_root", "slack_channel", "baseline_dir",
             "dask_scheduler", "oncall")


def _cluster(target: Path, name: str, table: Any) -> ClusterConfig:
    """One ``[clusters.NAME]`` table, every key checked; InputError names the key."""
    where = f"{target}: [clusters.{name}]"
    if not CLUSTER_NAME.match(name):
        raise InputError(f"{where}: a cluster name is letters, digits and _.- only")
    if not isinstance(table, dict):
        raise InputError(f"{where} must be a table")
    extra = set(table) - _CLUSTER_KEYS
    if extra:
        raise InputError(f"{where} unknown key {sorted(extra)[0]!r}")
    for required in ("inventory", "run_dir"):
        if required not in table:
            raise InputError(f"{where} needs {required}")
    for key in _STR_KEYS:
        if key in table and (not isinstance(table[key], str) or not table[key].strip()):
            raise InputError(f"{where} {key} must be a non-empty string")
    if table.get("scheduler", "slurm") not in SCHEDULERS:
        raise InputError(f"{where} scheduler must be {' or '.join(SCHEDULERS)}, not {table['scheduler']!r}")
    if table.get("approval", "always") not in APPROVALS:
        raise InputError(f"{where} approval must be always, auto-hardware or never")
    if table.get("replay", "ask") not in REPLAYS:
        raise InputError(f"{where} replay must be auto, ask or never, not {table['replay']!r}")
    for key, (low, high) in _INT_BOUNDS.items():
        value = table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise InputError(f"{where} {key} must be a whole number from {low} to {high}, not {value!r}")
    command = table.get("control_command")
    if command is not None and (not isinstance(command, list) or not command
                                or not all(isinstance(part, str) and part for part in command)):
        raise InputError(f"{where} control_command must be a list of strings (argv)")
    runner = table.get("collect_runner", "threads")
    if runner not in COLLECT_RUNNERS:
        raise InputError(f"{where} collect_runner must be {' or '.join(COLLECT_RUNNERS)}, not {runner!r}")
    address = table.get("dask_scheduler")
    if address is not None and not DASK_ADDRESS.match(address):
        raise InputError(f"{where} dask_scheduler must be a Dask scheduler address (tcp://HOST:PORT), not {address!r}")
    if runner == "dask" and address is None:
        raise InputError(f"{where} collect_runner = \"dask\" needs dask_scheduler (tcp://HOST:PORT)")
    for key in ("recurrence_window", "validate_after", "lemon_window", "lifecycle_every"):
        if key in table:
            try:
                parse_duration(table[key])
            except ValueError as exc:
                raise InputError(f"{where} {key} must be {exc}") from None
    _check_lifecycle(where, table)
    oncall = table.get("oncall")
    if oncall is not None and (len(oncall) > 200 or any(c in oncall for c in "\r\n")):
        raise InputError(f"{where} oncall must be one line of at most 200 characters (a Slack mention)")
    return ClusterConfig(name=name, **table)


def _check_lifecycle(where: str, table: dict[str, Any]) -> None:
    """The lifecycle keys of a cluster (docs/lifecycle.md), each checked for its type and range."""
    from spikeops.lifecycle.checks import CHECKS

    for key, choices in _LIFECYCLE_CHOICES.items():
        if key in table and table[key] not in choices:
            raise InputError(f"{where} {key} must be {' | '.join(choices)}, not {table[key]!r}")
    checks = table.get("validation")
    if checks is not None and (not isinstance(checks, list) or not checks or any(c not in CHECKS for c in checks)):
        raise InputError(f"{where} validation must be a non-empty list of checks among {', '.join(CHECKS)}")
    timeouts = table.get("validation_timeouts")
    if timeouts is not None and (not isinstance(timeouts, dict) or any(
            k not in CHECKS or isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 86400
            for k, v in timeouts.items())):
        raise InputError(f"{where} validation_timeouts must map checks ({', '.join(CHECKS)}) to 1..86400 seconds")
    command = table.get("allreduce_command")
    if command is not None and (not isinstance(command, list) or not command
                                or not all(isinstance(part, str) and part for part in command)):
        raise InputError(f"{where} allreduce_command must be a list of strings (argv; {{node}}, {{peer}}, {{gpus}})")
    floor = table.get("allreduce_min_busbw")
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int | float) or floor <= 0):
        raise InputError(f"{where} allreduce_min_busbw must be a positive number of GB/s")


def load_config(path: str | Path | None = None) -> SpikeopsConfig:
    """Read ``path`` (default ``$SPIKEOPS_CONFIG``, else ``./spikeops.toml``; absent: defaults).
    Every key is checked for its type and range here, so a typo is one line naming the key
    when the file is read, not a failure at the first alert."""
    target = Path(path or os.environ.get("SPIKEOPS_CONFIG") or "spikeops.toml").expanduser()
    if not target.is_file():
        if path is not None or os.environ.get("SPIKEOPS_CONFIG"):
            raise InputError(f"{target}: no such configuration file")
        return SpikeopsConfig(None)
    try:
        document = tomllib.loads(target.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{target}: not valid TOML ({exc})") from None
    unknown = set(document) - {"incidents", "receiver", "clusters", "watch", "prefect", "ledger"}
    for section in ("incidents", "receiver", "clusters", "watch", "prefect", "ledger"):
        if section in document and not isinstance(document[section], dict):
            raise InputError(f"{target}: [{section}] must be a table")
    if unknown:
        raise InputError(f"{target}: unknown section {sorted(unknown)[0]!r}")
    incidents = document.get("incidents") or {}
    extra = set(incidents) - {"dir", "max_concurrent"}
    if extra:
        raise InputError(f"{target}: [incidents] unknown key {sorted(extra)[0]!r}")
    if "dir" in incidents and (not isinstance(incidents["dir"], str) or not incidents["dir"].strip()):
        raise InputError(f"{target}: [incidents] dir must be a non-empty string")
    limit = incidents.get("max_concurrent", DEFAULT_MAX_CONCURRENT)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise InputError(f"{target}: [incidents] max_concurrent must be a whole number from 1 to 1000, not {limit!r}")
    receiver = document.get("receiver") or {}
    extra = set(receiver) - {"addr"}
    if extra:
        raise InputError(f"{target}: [receiver] unknown key {sorted(extra)[0]!r}")
    addr = receiver.get("addr", DEFAULT_RECEIVER_ADDR)
    if not isinstance(addr, str) or not re.match(r"^[^\s:]+:\d{1,5}$", addr) or not 0 < int(addr.rpartition(":")[2]) < 65536:
        raise InputError(f"{target}: [receiver] addr must be HOST:PORT, not {addr!r}")
    prefect = document.get("prefect") or {}
    extra = set(prefect) - {"port", "home"}
    if extra:
        raise InputError(f"{target}: [prefect] unknown key {sorted(extra)[0]!r}")
    prefect_port = prefect.get("port", DEFAULT_PREFECT_PORT)
    if isinstance(prefect_port, bool) or not isinstance(prefect_port, int) or not 0 < prefect_port < 65536:
        raise InputError(f"{target}: [prefect] port must be a port number, not {prefect_port!r}")
    prefect_home = prefect.get("home", DEFAULT_PREFECT_HOME)
    if not isinstance(prefect_home, str) or not prefect_home.strip():
        raise InputError(f"{target}: [prefect] home must be a non-empty string")
    ledger = document.get("ledger") or {}
    extra = set(ledger) - {"url"}
    if extra:
        raise InputError(f"{target}: [ledger] unknown key {sorted(extra)[0]!r}")
    ledger_url = ledger.get("url")
    if ledger_url is not None and (not isinstance(ledger_url, str) or "://" not in ledger_url):
        raise InputError(f"{target}: [ledger] url must be an SQLAlchemy URL (sqlite:///PATH, postgresql://...)")
    clusters = {name: _cluster(target, name, table) for name, table in (document.get("clusters") or {}).items()}
    return SpikeopsConfig(
        target,
        incidents_dir=str(incidents.get("dir", DEFAULT_INCIDENTS_DIR)),
        receiver_addr=addr,
        max_concurrent=limit,
        clusters=clusters,
        watch=dict(document.get("watch") or {}),
        prefect_port=prefect_port,
        prefect_home=prefect_home,
        ledger_url=ledger_url,
    )


def check_config(config: SpikeopsConfig) -> list[str]:
    """What ``load_config`` cannot see from the file alone: each cluster's inventory must exist
    and read (a missing or broken one would fail every alert for that cluster), and a local
    scheduler needs its state directory. One line per problem, naming the key."""
    from spikeops.inventory import load_inventory

    problems = []
    for cluster in config.clusters.values():
        where = f"[clusters.{cluster.name}]"
        inventory = Path(cluster.inventory).expanduser()
        if not inventory.is_file():
            problems.append(f"{where} inventory: {inventory}: no such file")
        else:
            try:
                load_inventory(inventory)
            except InputError as exc:
                problems.append(f"{where} inventory: {exc}")
        if cluster.scheduler == "local" and not cluster.scheduler_state_dir:
            problems.append(f"{where} scheduler_state_dir: needed with scheduler = \"local\"")
        if cluster.control_command and not cluster.baseline_dir:
            problems.append(f"{where} control_command: needs baseline_dir (where control verdicts are kept)")
        if cluster.collect_runner == "dask" and not all(find_spec(name) for name in ("prefect_dask", "distributed")):
            problems.append(f"{where} collect_runner: \"dask\" needs prefect-dask and distributed "
                            "(pip install 'spikeops[dask]')")
    return problems


@dataclass(frozen=True)
class IncidentSettings:
    """Everything one incident needs, resolved: what the run asked for, over what
    ``spikeops.toml`` says for its cluster, over the defaults."""

    job_id: str
    inventory: str
    run_dir: str
    cluster: str | None = None
    checkpoint_root: str | None = None
    incidents_dir: str = DEFAULT_INCIDENTS_DIR
    incident_id: str | None = None
    scheduler: str = "slurm"
    scheduler_state_dir: str | None = None
    dry_run: bool = False
    skip: tuple[str, ...] = ()
    approval: str = "always"
    approval_timeout_s: int = 3600
    slack_channel: str | None = None
    observe_steps: int = 50
    observe_timeout_s: int = 600
    baseline_dir: str | None = None
    alert: dict[str, Any] = field(default_factory=dict)
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    replay: str = "never"
    replay_steps: int = 500
    replay_timeout_s: int = 1800
    #: The Dask scheduler the collection shards go to; None: the flow's own threads.
    dask_scheduler: str | None = None
    #: The restart budget (resumes of the job's lineage without a person, in the window).
    max_auto_resumes: int = DEFAULT_MAX_AUTO_RESUMES
    recurrence_window_s: int = 86400
    #: Mentioned in Slack when the incident waits for a person.
    oncall: str | None = None


_SETTINGS = set(IncidentSettings.__dataclass_fields__)


def resolve_incident(config: SpikeopsConfig, job_id: str, cluster: str | None,
                     overrides: Mapping[str, Any], lineage: str | None = None) -> IncidentSettings:
    """The settings of one incident. A named cluster must be configured; with no cluster, the
    only configured one is taken when the run does not give the inventory and run directory
    itself. ``lineage``: the job's lineage (``{lineage}`` in a path). InputError (one line)
    when something needed is missing or invalid."""
    given = {k: v for k, v in overrides.items() if v is not None and k in _SETTINGS}
    base: dict[str, Any] = {"incidents_dir": config.incidents_dir, "max_concurrent": config.max_concurrent}
    self_contained = cluster is None and given.get("inventory") and given.get("run_dir")
    if cluster is not None or (not self_contained and config.clusters):
        base.update(config.flow_parameters(job_id, cluster, lineage))
        base["cluster"] = cluster or next(iter(config.clusters))
    merged = {**base, **given, "job_id": job_id}
    for required in ("inventory", "run_dir"):
        if not merged.get(required):
            raise InputError(f"no {required}: name a configured cluster or give {required}")
    if merged.get("scheduler", "slurm") not in SCHEDULERS:
        raise InputError(f"scheduler must be {' or '.join(SCHEDULERS)}")
    if merged.get("approval", "always") not in APPROVALS:
        raise InputError("approval must be always, auto-hardware or never")
    if merged.get("replay", "never") not in REPLAYS:
        raise InputError("replay must be auto, ask or never")
    if not JOB_ID.match(job_id or ""):
        raise InputError(f"bad job id {job_id!r}")
    merged["skip"] = tuple(merged.get("skip") or ())
    return IncidentSettings(**merged)
