"""The node lifecycle as scheduled deployments: one per cluster, ``node-lifecycle/CLUSTER``,
every ``lifecycle_every`` (15 min by default), served by ``spikeops serve`` or, in the
scale-out layout, on the cluster's work pool (``spikeops.deployments.pools``).

No deployment ``concurrency_limit``: a run that asks a person pauses, and Prefect gives a
paused run's deployment slot back and then kills the run when the slot's lease cannot be
renewed (docs/flow.md). The flow holds one slot per node instead
(``spikeops.tasks.lifecycle.node_slots``), so two runs never work on one node.
"""

from __future__ import annotations

from typing import Any

from spikeops.config import SpikeopsConfig, parse_duration

__all__ = ["FLOW_NAME", "lifecycle_deployment", "lifecycle_deployments", "deployment_name"]

FLOW_NAME = "node-lifecycle"


def deployment_name(cluster: str) -> str:
    return f"{FLOW_NAME}/{cluster}"


def lifecycle_deployment(config: SpikeopsConfig, cluster: str, *, interval_s: float | None = None,
                         pool: bool = False) -> Any:
    """``node-lifecycle/CLUSTER`` on an interval schedule (the cluster's ``lifecycle_every``, or
    ``interval_s``). ``pool``: on the cluster's work pool, named by module for its workers (the
    worker's ``$SPIKEOPS_CONFIG``); else served from here, with this configuration's path."""
    from prefect.deployments.runner import EntrypointType

    from spikeops.deployments.incident import pool_name
    from spikeops.flows.node_lifecycle import node_lifecycle

    chosen = config.clusters.get(cluster)
    if chosen is None:
        raise ValueError(f"cluster {cluster!r} is not configured")
    interval = interval_s if interval_s is not None else parse_duration(chosen.lifecycle_every)
    if not interval or interval <= 0:
        raise ValueError(f"interval_s must be positive, not {interval!r}")
    parameters: dict[str, Any] = {"cluster": cluster}
    placement: dict[str, Any] = {"entrypoint_type": EntrypointType.MODULE_PATH}
    if pool:
        placement["work_pool_name"] = pool_name(cluster)
    elif config.path is not None:
        parameters["config"] = str(config.path)
    from datetime import UTC, datetime, timedelta

    from prefect.client.schemas.schedules import IntervalSchedule

    # The first run one interval after (re)deploying: a layout that has just started (its
    # incidents still open, its workers warming up) is not surveyed in the same breath.
    every = timedelta(seconds=interval)
    schedule = IntervalSchedule(interval=every, anchor_date=datetime.now(UTC).replace(microsecond=0) + every)
    return node_lifecycle.to_deployment(
        name=cluster, schedule=schedule, parameters=parameters, tags=["spikeops", "lifecycle", f"cluster:{cluster}"],
        description=f"Reboot, validate, release or replace the nodes spikeops drained on {cluster} "
                    "(docs/lifecycle.md); run it from here for one node (nodes)",
        **placement,
    )


def lifecycle_deployments(config: SpikeopsConfig, *, pool: bool = False) -> list[Any]:
    """One lifecycle deployment per configured cluster."""
    return [lifecycle_deployment(config, name, pool=pool) for name in sorted(config.clusters)]
