"""The incident flow as a deployment, and what every deployment of it shares: the run form's
parameters, the shared incident limit and the work pools' names. Its own module so that
``serve``, ``pools`` and ``baselines`` each import it and none of them imports another back.
"""

from __future__ import annotations

from typing import Any

from spikeops.config import SpikeopsConfig

__all__ = ["POOL_PREFIX", "pool_name", "incident_deployment", "describe_parameters", "restrict_clusters",
           "ensure_incident_limit"]

POOL_PREFIX = "spikeops-"


def pool_name(cluster: str) -> str:
    """The work pool of one cluster."""
    return f"{POOL_PREFIX}{cluster}"


def incident_deployment(config: SpikeopsConfig | None = None) -> Any:
    """The incident flow as a deployment. No deployment ``concurrency_limit``: Prefect gives
    a deployment slot back when its run pauses and then kills the run when the slot's lease
    cannot be renewed, so an incident waiting for a person would crash; the flow holds its own
    limits instead (``spikeops.tasks.concurrency``: at most ``max_concurrent`` working, one per job). With
    a configuration, the run form offers its clusters as a choice."""
    from prefect.deployments.runner import EntrypointType

    from spikeops.flows.incident_response import incident_response

    # By module, never by file: a file path is relative to the directory serve started in, and
    # an installed spikeops has no file a run could find from another one.
    deployment = incident_response.to_deployment(name="incident-response", tags=["spikeops", "incident"],
                                                 entrypoint_type=EntrypointType.MODULE_PATH,
                                                 description="One incident end to end (docs/flow.md)")
    schema = deployment._parameter_openapi_schema
    describe_parameters(schema)
    if config is not None and config.clusters:
        restrict_clusters(schema, sorted(config.clusters))
    return deployment


def describe_parameters(schema: Any) -> None:
    """The run form's titles and help for the incident flow's three parameters."""
    for name, title, description in (
            ("job_id", "Job id", "the scheduler's job id, e.g. 4412"),
            ("cluster", "Cluster", "which cluster of spikeops.toml the job runs on"),
            ("overrides", "Overrides (optional)", "leave empty: spikeops.toml has everything")):
        schema.properties[name].update({"title": title, "description": description})


def restrict_clusters(schema: Any, clusters: list[str]) -> None:
    """The ``cluster`` parameter becomes a required choice among ``clusters`` (the run form
    shows a list; with one cluster it is already chosen)."""
    field = schema.properties["cluster"]
    field.pop("anyOf", None)
    field.pop("default", None)
    field.update({"type": "string", "enum": clusters})
    if len(clusters) == 1:
        field["default"] = clusters[0]
    schema.required = sorted(set(schema.required or []) | {"cluster"})


def ensure_incident_limit(config: SpikeopsConfig) -> None:
    """The shared limit (``spikeops-incidents``) at the configured size, before any run."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    from spikeops.tasks.concurrency import INCIDENTS_LIMIT, ensure_limit

    ensure_limit(INCIDENTS_LIMIT, config.max_concurrent)
    with get_client(sync_client=True) as client:
        current = client.read_global_concurrency_limit_by_name(INCIDENTS_LIMIT)
        if current.limit != config.max_concurrent:
            client.update_global_concurrency_limit(INCIDENTS_LIMIT, GlobalConcurrencyLimitUpdate(
                limit=config.max_concurrent))
