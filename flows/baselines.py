"""The scheduled baseline flow: keep each node's counters fresh, and run the control.

For each cluster of ``spikeops.toml`` with a ``baseline_dir`` (or the ones named):
1. ask the scheduler which nodes are out of service (drained, down) and which are idle;
2. refresh the baselines of every other node of the inventory (``spikeops.baselines``);
3. when the cluster has a ``control_command``, run it on the idle nodes: the seed's
   periodic short healthy run. A failed or timed-out control is logged as a warning and
   posted to Slack; the per-node results are a table artifact either way.

A cluster whose scheduler cannot be read is not refreshed (a drained node might otherwise
be baselined in its sick state); the other clusters go on and the run ends failed, naming it.
"""

# No `from __future__ import annotations` here: a served run receives the flow object pickled
# (deployments/warm_start.py), and string annotations would be resolved against the pickled
# function's globals, which hold only the names its code uses (not `Annotated`, not the types).

import re
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from spikeops.config import ClusterConfig, SpikeopsConfig, load_config
from spikeops.errors import InputError, SpikeopsError
from spikeops.inventory import fold_nodes, load_inventory
from spikeops.tasks.baselines import (
    FAILED_VERDICTS,
    baseline_table,
    control_run,
    control_table,
    read_node_states,
    refresh_cluster_baselines,
    tell_control_failures,
)

__all__ = ["refresh_baselines_flow", "FLOW_NAME", "chosen_clusters"]

FLOW_NAME = "refresh-baselines"


def chosen_clusters(config: SpikeopsConfig, names: str | list[str] | None) -> list[ClusterConfig]:
    """The named clusters (each must have a baseline_dir), or every cluster that has one."""
    if names is None:
        return [cluster for cluster in config.clusters.values() if cluster.baseline_dir]
    chosen = []
    for name in [names] if isinstance(names, str) else names:
        cluster = config.clusters.get(name)
        if cluster is None:
            raise InputError(f"cluster {name!r} is not configured")
        if not cluster.baseline_dir:
            raise InputError(f"cluster {name!r} has no baseline_dir")
        chosen.append(cluster)
    return chosen


def _key(kind: str, cluster: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return f"{kind}-{re.sub(r'[^a-z0-9-]+', '-', cluster.lower())}"[:100]


def _control(cluster: ClusterConfig, idle: list[str], logger: Any) -> dict[str, Any]:
    inventory_nodes = set(load_inventory(cluster.inventory).nodes)
    nodes = [node for node in idle if node in inventory_nodes]
    if not nodes:
        logger.info("%s: no idle node for the control run", cluster.name)
        return {"nodes": 0}
    results = control_run(cluster.name, cluster.inventory, nodes, list(cluster.control_command or []),
                          cluster.control_timeout_s, str(cluster.baseline_dir))
    create_table_artifact(key=_key("control", cluster.name), table=control_table(results),
                          description=f"control run `{' '.join(cluster.control_command or [])}` on {fold_nodes(nodes)}")
    verdicts: dict[str, list[str]] = {}
    for result in results:
        verdicts.setdefault(result.verdict, []).append(result.node)
    outcome: dict[str, Any] = {"nodes": len(results), **{k: fold_nodes(v) for k, v in verdicts.items()}}
    failures = [r for r in results if r.verdict in FAILED_VERDICTS]
    if failures:
        logger.warning("%s: CONTROL RUN FAILED on %s: %s", cluster.name, fold_nodes([r.node for r in failures]),
                       "; ".join(f"{r.node} {r.verdict} ({r.detail})" for r in failures[:10]))
        outcome["slack"] = tell_control_failures(cluster.name, failures, str(cluster.baseline_dir),
                                                 cluster.slack_channel)
    if verdicts.get("unreachable"):
        logger.warning("%s: control run could not reach %s", cluster.name, fold_nodes(verdicts["unreachable"]))
    return outcome


@flow(name=FLOW_NAME, log_prints=True)
def refresh_baselines_flow(clusters: str | list[str] | None = None, config: str | None = None,
                           control: bool = True) -> dict[str, Any]:
    """Refresh baselines (and run the control) for ``clusters`` (default: every cluster of
    ``config`` with a baseline_dir; ``config`` defaults to $SPIKEOPS_CONFIG)."""
    from spikeops.schedulers import SchedulerError

    logger = get_run_logger()
    settings = load_config(config)
    report: dict[str, Any] = {}
    errors = []
    chosen = chosen_clusters(settings, clusters)
    if not chosen:
        logger.info("no cluster of %s has a baseline_dir: nothing to refresh", settings.path)
    for cluster in chosen:
        try:
            states = read_node_states(cluster.name, cluster.scheduler, cluster.scheduler_state_dir)
        except (SchedulerError, InputError) as exc:
            logger.error("%s: scheduler not readable, baselines left as they are: %s", cluster.name, exc)
            errors.append(f"{cluster.name}: {exc}")
            report[cluster.name] = {"error": str(exc)}
            continue
        refreshed = refresh_cluster_baselines(cluster.name, cluster.inventory, str(cluster.baseline_dir),
                                              states.unavailable)
        create_table_artifact(key=_key("baselines", cluster.name), table=baseline_table(refreshed),
                              description="\n".join(refreshed.summary_lines()))
        for line in refreshed.summary_lines():
            logger.info("%s: %s", cluster.name, line)
        report[cluster.name] = {"baselines": refreshed.to_json()["summary"]}
        if control and cluster.control_command:
            report[cluster.name]["control"] = _control(cluster, states.idle, logger)
    if errors:
        raise SpikeopsError("baselines not refreshed for " + "; ".join(errors))
    return report
