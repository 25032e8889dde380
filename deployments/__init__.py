"""Prefect deployments, their triggers, and the alert receiver that turns a monitoring alert
into a flow run. Empty until the incident flow issue."""

__all__: list[str] = []
