"""The baseline flow as a scheduled deployment (``spikeops serve`` serves it beside the
incident flow; ``prefect.yaml`` has the same for a work pool).

One run at a time, and a run that comes due while the previous one is still going is
cancelled rather than queued: a queue of refreshes would only capture the same nodes
twice, and a control run stacked behind another would find no idle node to measure.
"""

from __future__ import annotations

from typing import Any

from spikeops.config import SpikeopsConfig

__all__ = ["DEPLOYMENT_NAME", "DEFAULT_INTERVAL_S", "baseline_deployment", "wants_baselines"]

FLOW_NAME = "refresh-baselines"
DEPLOYMENT_NAME = f"{FLOW_NAME}/refresh-baselines"
#: Every six hours: counters drift slowly, and each control run occupies idle GPUs.
DEFAULT_INTERVAL_S = 6 * 3600


def wants_baselines(config: SpikeopsConfig) -> bool:
    """Whether any configured cluster keeps baselines (serve the deployment only then)."""
    return any(cluster.baseline_dir for cluster in config.clusters.values())


def baseline_deployment(config: SpikeopsConfig | None = None, interval_s: float = DEFAULT_INTERVAL_S, *,
                        cluster: str | None = None) -> Any:
    """A ``RunnerDeployment`` of ``refresh-baselines`` on an interval schedule, concurrency 1.
    With ``cluster``: ``refresh-baselines/CLUSTER`` for that cluster alone, on its work pool
    (``spikeops.deployments.pools``), named by module for the pool's workers."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType

    from spikeops.flows.baselines import refresh_baselines_flow

    if not interval_s or interval_s <= 0:
        raise ValueError(f"interval_s must be positive, not {interval_s!r}")
    parameters: dict[str, Any] = {"config": str(config.path)} if config is not None and config.path is not None else {}
    placement: dict[str, Any] = {"entrypoint_type": EntrypointType.MODULE_PATH}  # never a cwd-relative path
    if cluster is not None:
        from spikeops.deployments.incident import pool_name

        parameters = {"clusters": cluster}  # the worker's $SPIKEOPS_CONFIG, not this machine's path
        placement["work_pool_name"] = pool_name(cluster)
    return refresh_baselines_flow.to_deployment(
        name=cluster or "refresh-baselines", interval=interval_s, parameters=parameters,
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        description="Refresh per-node baselines and run the healthy-run control on idle nodes (docs/baselines.md)",
        **placement,
    )
