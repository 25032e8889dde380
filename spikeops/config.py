"""``spikeops.toml``: one file for what the pipeline needs to know about each cluster.

The alert receiver turns an alert's labels (job id, cluster name) into the incident flow's
parameters with it, so no alert can name an inventory, a path or a command: labels only pick
among what the operator configured. Secrets are never read from here (tokens come from the
environment or Prefect blocks); ``SPIKEOPS_CONFIG`` names the file.

```toml
[incidents]
dir = "/var/lib/spikeops/incidents"

[receiver]
addr = "127.0.0.1:8787"

[clusters.sim]
inventory = "/etc/spikeops/sim.toml"
scheduler = "slurm"                 # or "local" (+ scheduler_state_dir)
run_dir = "/shared/runs/{job}"      # where the job's spikeops.train files are
checkpoint_root = "/ckpt/{job}"
slack_channel = "#incidents"
approval = "always"                 # always | auto-hardware | never
observe_steps = 50                  # after a single spike, steps to watch before deciding
observe_timeout_s = 600             # ... and the most seconds to wait for them
baseline_dir = "/var/lib/spikeops/baselines/sim"   # kept fresh by the baseline deployment
control_command = ["/opt/bin/healthy-run", "--short"]  # the seed's control run on idle nodes
control_timeout_s = 600

[watch]                             # spikeops watch thresholds (docs/watch.md)
```
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.errors import InputError

__all__ = ["ClusterConfig", "SpikeopsConfig", "load_config", "DEFAULT_RECEIVER_ADDR", "JOB_ID", "CLUSTER_NAME"]

DEFAULT_RECEIVER_ADDR = "127.0.0.1:8787"
#: What a job id may be: a scheduler's id, never shell syntax (alerts and forms are checked against it).
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,127}$")
#: What a cluster name may be.
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


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
    observe_steps: int | None = None
    observe_timeout_s: int | None = None
    #: Where the scheduled baseline refresh keeps each node's last healthy probes.
    baseline_dir: str | None = None
    #: The seed's periodic "healthy run" control: a command run on idle nodes (argv, no shell).
    control_command: list[str] | None = None
    control_timeout_s: int = 600


@dataclass(frozen=True)
class SpikeopsConfig:
    path: Path | None
    incidents_dir: str = "~/.local/state/spikeops/incidents"
    receiver_addr: str = DEFAULT_RECEIVER_ADDR
    clusters: dict[str, ClusterConfig] = field(default_factory=dict)
    #: The ``[watch]`` table as written; ``spikeops.watch`` validates it.
    watch: dict[str, Any] = field(default_factory=dict)

    def flow_parameters(self, job: str, cluster: str | None) -> dict[str, Any]:
        """The incident flow's parameters for a job on a configured cluster; InputError when
        the cluster is not configured (or is ambiguous) or the job id is not one."""
        if not JOB_ID.match(job or ""):
            raise InputError(f"bad job id {job!r}")
        if cluster is None:
            if len(self.clusters) != 1:
                raise InputError("the alert names no cluster and several are configured")
            cluster = next(iter(self.clusters))
        chosen = self.clusters.get(cluster)
        if chosen is None:
            raise InputError(f"cluster {cluster!r} is not configured")
        fill = lambda text: text.replace("{job}", job) if text else text  # noqa: E731 - job id already checked
        params: dict[str, Any] = {
            "job_id": job, "inventory": chosen.inventory, "run_dir": fill(chosen.run_dir),
            "checkpoint_root": fill(chosen.checkpoint_root), "incidents_dir": self.incidents_dir,
            "scheduler": chosen.scheduler, "scheduler_state_dir": chosen.scheduler_state_dir,
            "slack_channel": chosen.slack_channel, "approval": chosen.approval,
            "observe_steps": chosen.observe_steps, "observe_timeout_s": chosen.observe_timeout_s,
            "baseline_dir": chosen.baseline_dir,
        }
        return {k: v for k, v in params.items() if v is not None}


_CLUSTER_KEYS = set(ClusterConfig.__dataclass_fields__) - {"name"}


def load_config(path: str | Path | None = None) -> SpikeopsConfig:
    """Read ``path`` (default ``$SPIKEOPS_CONFIG``, else ``./spikeops.toml``; absent: defaults)."""
    target = Path(path or os.environ.get("SPIKEOPS_CONFIG") or "spikeops.toml").expanduser()
    if not target.is_file():
        if path is not None:
            raise InputError(f"{target}: no such configuration file")
        return SpikeopsConfig(None)
    try:
        document = tomllib.loads(target.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{target}: not valid TOML ({exc})") from None
    unknown = set(document) - {"incidents", "receiver", "clusters", "watch"}
    for section in ("incidents", "receiver", "clusters", "watch"):
        if section in document and not isinstance(document[section], dict):
            raise InputError(f"{target}: [{section}] must be a table")
    if unknown:
        raise InputError(f"{target}: unknown section {sorted(unknown)[0]!r}")
    clusters = {}
    for name, table in (document.get("clusters") or {}).items():
        if not isinstance(table, dict):
            raise InputError(f"{target}: [clusters.{name}] must be a table")
        extra = set(table) - _CLUSTER_KEYS
        if extra:
            raise InputError(f"{target}: [clusters.{name}] unknown key {sorted(extra)[0]!r}")
        for required in ("inventory", "run_dir"):
            if not isinstance(table.get(required), str):
                raise InputError(f"{target}: [clusters.{name}] needs {required}")
        if table.get("approval", "always") not in ("always", "auto-hardware", "never"):
            raise InputError(f"{target}: [clusters.{name}] approval must be always, auto-hardware or never")
        command = table.get("control_command")
        if command is not None and (not isinstance(command, list) or not command
                                    or not all(isinstance(part, str) and part for part in command)):
            raise InputError(f"{target}: [clusters.{name}] control_command must be a list of strings (argv)")
        clusters[name] = ClusterConfig(name=name, **table)
    return SpikeopsConfig(
        target,
        incidents_dir=str((document.get("incidents") or {}).get("dir", SpikeopsConfig.incidents_dir)),
        receiver_addr=str((document.get("receiver") or {}).get("addr", DEFAULT_RECEIVER_ADDR)),
        clusters=clusters,
        watch=dict(document.get("watch") or {}),
    )
