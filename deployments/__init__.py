"""Prefect deployments, their triggers, and the alert receiver that turns a monitoring alert
into a flow run (``serve``, ``receiver``, ``baselines``, ``lifecycle``)."""

__all__: list[str] = []
