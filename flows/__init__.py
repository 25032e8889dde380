"""Prefect flows, each composed from the stages in ``tasks``: ``incident_response`` (the
incident pipeline), ``watch`` (follow a job's metrics, start incidents), ``baselines`` (keep
the nodes' healthy captures fresh), ``node_lifecycle`` (a drained node's way back: reboot,
validate, release, replace). Flows import ``tasks`` and the core, never ``deployments``."""

__all__: list[str] = []
