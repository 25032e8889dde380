"""The scale-out layout: one process work pool per cluster, the flows deployed to each.

A worker is the only thing that must reach a cluster's nodes and scheduler (its SSH keys, its
Slurm login), so each cluster of ``spikeops.toml`` gets its own pool, ``spikeops-CLUSTER``,
served by workers that run near it, and its own deployment of the incident flow,
``incident-response/CLUSTER``, whose ``cluster`` parameter is fixed to that cluster. The alert
receiver (``spikeops serve --receiver-only``) starts the deployment of the alert's cluster
(``spikeops.tasks.start.CLUSTER_DEPLOYMENT``), so an alert about the east cluster can only run on
east's workers. A cluster with a ``baseline_dir`` gets ``refresh-baselines/CLUSTER`` on its
pool too, and every cluster ``node-lifecycle/CLUSTER`` (docs/lifecycle.md).

The deployments name the flows by module (``spikeops.flows.incident_response.incident_response``), not
by file: the workers run the spikeops installed beside them, whatever their working directory,
and need no pull step. ``infra/prefect/up`` (``spikeops.deployments.topology``) calls ``deploy``;
``prefect.yaml`` is the same for teams that deploy with the Prefect CLI.
"""

from __future__ import annotations

from typing import Any

from spikeops.config import SpikeopsConfig
from spikeops.deployments.incident import (POOL_PREFIX, describe_parameters, ensure_incident_limit, pool_name,
                                           restrict_clusters)
from spikeops.tasks.start import CLUSTER_DEPLOYMENT, cluster_deployment_name

__all__ = ["POOL_PREFIX", "pool_name", "cluster_deployment", "ensure_pool", "deploy", "missing_deployments",
           "CLUSTER_DEPLOYMENT"]

def cluster_deployment(config: SpikeopsConfig, cluster: str) -> Any:
    """``incident-response/CLUSTER`` on the cluster's pool: the run form asks only for the job
    id (the cluster is fixed), and the run's worker finds the rest in its spikeops.toml."""
    from prefect.deployments.runner import EntrypointType

    from spikeops.flows.incident_response import incident_response

    if cluster not in config.clusters:
        raise ValueError(f"cluster {cluster!r} is not configured")
    deployment = incident_response.to_deployment(
        name=cluster, parameters={"cluster": cluster}, work_pool_name=pool_name(cluster),
        entrypoint_type=EntrypointType.MODULE_PATH, tags=["spikeops", "incident", f"cluster:{cluster}"],
        description=f"One incident end to end on cluster {cluster}, run by its workers (docs/flow.md)")
    describe_parameters(deployment._parameter_openapi_schema)
    restrict_clusters(deployment._parameter_openapi_schema, [cluster])
    return deployment


def ensure_pool(name: str) -> bool:
    """A process work pool called ``name`` (with Prefect's default job template); True when
    it was created now."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            pass
        try:
            client.create_work_pool(WorkPoolCreate(
                name=name, type="process", base_job_template=ProcessWorker.get_default_base_job_template(),
                description="spikeops: the incident flows of one cluster (deployments/pools.py)"))
        except ObjectAlreadyExists:
            return False
    return True


def deploy(config: SpikeopsConfig) -> dict[str, list[str]]:
    """Every cluster's pool and deployments, and the shared incident limit; returns each
    pool's deployments (full names). Idempotent: a second call updates them in place."""
    from spikeops.deployments.baselines import baseline_deployment
    from spikeops.deployments.lifecycle import deployment_name, lifecycle_deployment

    if not config.clusters:
        raise ValueError("no [clusters.NAME] configured: nothing to deploy")
    ensure_incident_limit(config)
    deployed: dict[str, list[str]] = {}
    for name, cluster in sorted(config.clusters.items()):
        pool = pool_name(name)
        ensure_pool(pool)
        cluster_deployment(config, name).apply()
        deployed[pool] = [cluster_deployment_name(CLUSTER_DEPLOYMENT, name)]
        if cluster.baseline_dir:
            baseline_deployment(config, cluster=name).apply()
            deployed[pool].append(f"refresh-baselines/{name}")
        lifecycle_deployment(config, name, pool=True).apply()
        deployed[pool].append(deployment_name(name))
    return deployed


def missing_deployments(config: SpikeopsConfig) -> list[str]:
    """The clusters' incident deployments the Prefect API does not know (the receiver-only
    layout refuses to start without them: every alert for that cluster would fail)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    missing = []
    with get_client(sync_client=True) as client:
        for name in sorted(config.clusters):
            full = cluster_deployment_name(CLUSTER_DEPLOYMENT, name)
            try:
                client.read_deployment_by_name(full)
            except ObjectNotFound:
                missing.append(full)
    return missing

