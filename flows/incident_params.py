"""The incident flow's parameters as the run form shows them: the job id and the cluster, and
optional overrides of what ``spikeops.toml`` says for the cluster, for one run."""

# No `from __future__ import annotations`: the flow that takes these is pickled for warm starts
# (deployments/warm_start.py), and its parameter types must resolve as real objects.

from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = ["IncidentOverrides", "DESCRIPTION"]

DESCRIPTION = """\
Respond to a loss spike or NaN in one training job: protect the run, collect the evidence from
every node, diagnose it layer by layer, drain the nodes the evidence convicts and resume from
the newest verified checkpoint, telling Slack at every step. Give the cluster and the job id;
everything else comes from spikeops.toml. Nothing is drained or resumed without approval unless
the cluster's policy says so."""


class IncidentOverrides(BaseModel):
    """Optional: each field replaces what spikeops.toml says for the cluster, for this run only."""

    inventory: str | None = Field(None, description="cluster inventory file (docs/inventory.md)")
    run_dir: str | None = Field(
        None, description="the job's spikeops.train files (metrics.jsonl...)"
    )
    checkpoint_root: str | None = Field(None, description="directory holding the job's checkpoints")
    incidents_dir: str | None = Field(None, description="where incident bundles are written")
    incident_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        description="continue an existing incident (an idempotent rerun)",
    )
    scheduler: Literal["slurm", "local"] | None = None
    scheduler_state_dir: str | None = Field(
        None, description="the local scheduler's state directory"
    )
    dry_run: bool = Field(False, description="read-only: say what would be done, do nothing")
    skip: list[Literal["protect", "collect", "isolate", "resume", "notify"]] = Field(
        default_factory=list
    )
    approval: Literal["always", "auto-hardware", "never"] | None = Field(
        None,
        description="always: a person approves every drain and resume; auto-hardware: confident "
        "hardware convictions are drained without asking; never: never drain",
    )
    approval_timeout_s: int | None = Field(
        None, ge=1, le=7 * 86400, description="how long a person has to answer"
    )
    slack_channel: str | None = None
    observe_steps: int | None = Field(
        None, ge=0, le=10_000, description="after a single spike: steps to watch"
    )
    observe_timeout_s: int | None = Field(
        None, ge=0, le=86_400, description="... and the most seconds to wait"
    )
    baseline_dir: str | None = Field(
        None, description="per-node baselines kept by the baseline deployment"
    )
    replay: Literal["auto", "ask", "never"] | None = Field(
        None,
        description="re-run the spike window on the original and on other nodes before resuming",
    )
    replay_steps: int | None = Field(
        None, ge=1, le=1_000_000, description="the most steps a replay may run"
    )
    replay_timeout_s: int | None = Field(
        None, ge=10, le=7 * 86400, description="... and seconds for both"
    )
    alert: dict[str, Any] = Field(
        default_factory=dict, description="the alert that started it (set by the receiver)"
    )
