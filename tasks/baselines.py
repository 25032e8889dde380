"""Prefect tasks for the baseline refresh and the control run: thin wrappers over
``spikeops.baselines``, plus the tables the Prefect UI shows and the loud word on Slack.

Only the scheduler read retries (a controller restarting is a few seconds); a refresh or a
control run is not retried within a run: the next scheduled run is the retry, and a control
run repeated at once would hide whether the first one failed.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import task

from spikeops.baselines import (
    ControlResult,
    NodeStates,
    RefreshResult,
    copy_baselines,
    node_states,
    refresh_baselines,
    run_control,
)
from spikeops.inventory import fold_nodes
from spikeops.tasks.notify import slack_notifier

__all__ = ["bundle_baselines", "read_node_states", "refresh_cluster_baselines", "control_run", "baseline_table", "control_table",
           "tell_control_failures", "FAILED_VERDICTS"]

#: Control verdicts that are reported loudly (an unreachable node is logged, not alarmed).
FAILED_VERDICTS = ("failed", "timeout")


@task(name="node-states", task_run_name="node states of {cluster}", retries=2, retry_delay_seconds=5)
def read_node_states(cluster: str, scheduler: str, state_dir: str | None) -> NodeStates:
    return node_states(scheduler, state_dir)


@task(name="refresh-baselines", task_run_name="baselines of {cluster}", retries=0)
def refresh_cluster_baselines(cluster: str, inventory: str, baseline_dir: str, skip: list[str]) -> RefreshResult:
    return refresh_baselines(inventory, baseline_dir, skip=skip)


@task(name="control-run", task_run_name="control run on {cluster}", retries=0)
def control_run(cluster: str, inventory: str, nodes: list[str], argv: list[str], timeout: int,
                baseline_dir: str) -> list[ControlResult]:
    return run_control(inventory, nodes, argv, timeout, baseline_dir)


def baseline_table(result: RefreshResult) -> list[dict[str, Any]]:
    """One row per node: what the refresh did and the age of what the store now holds."""
    return [{"node": entry.node, "status": entry.status, "captured": entry.captured or "-",
             "stored": len(entry.stored), "kept": ", ".join(entry.kept) or "-", "detail": entry.detail or "-"}
            for entry in result.nodes]


def control_table(results: list[ControlResult]) -> list[dict[str, Any]]:
    return [{"node": r.node, "verdict": r.verdict, "exit": r.exit, "seconds": round(r.seconds, 1),
             "detail": r.detail or "-", "stderr (tail)": r.stderr_tail[-200:] or "-"} for r in results]


def tell_control_failures(cluster: str, failures: list[ControlResult], baseline_dir: str,
                          channel: str | None = None) -> dict[str, Any]:
    """One Slack message naming the nodes whose control run failed. Each run posts into its
    own state folder (``BASELINE_DIR/_alerts/control-STAMP``, where the outbox lands when no
    token is set), so every failing run is a new message, not a reply to last month's."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    folder = Path(baseline_dir).expanduser() / "_alerts" / f"control-{stamp}"
    lines = [f"control run failed on {fold_nodes([r.node for r in failures])} ({cluster}): these nodes did not "
             "pass the healthy run while idle; look before the scheduler gives them a job"]
    lines += [f"- {r.node}: {r.verdict}, {r.detail or ''}" + (f" ({r.stderr_tail.strip().splitlines()[-1][:160]})"
                                                            if r.stderr_tail.strip() else "")
              for r in failures[:20]]
    if len(failures) > 20:
        lines.append(f"... and {len(failures) - 20} more (see the flow run's control table)")
    delivery = slack_notifier(folder, channel=channel).stage("control-failed", "\n".join(lines))
    return {"posted": delivery.posted, "error": delivery.error, "folder": str(folder)}


@task(name="baselines-into-bundle")
def bundle_baselines(baseline_dir: str, bundle: str, nodes: list[str]) -> list[str]:
    """The incident's nodes' stored baselines, copied into the bundle so the diagnosis reads
    counters as growth (captures from after the window began are left out)."""
    return copy_baselines(baseline_dir, bundle, nodes)
