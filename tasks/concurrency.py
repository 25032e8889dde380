"""One incident per job at a time: a Prefect global concurrency limit per job."""

from __future__ import annotations

from typing import Any

__all__ = ["job_limit_name", "one_incident_per_job"]


def job_limit_name(job_id: str) -> str:
    """The global concurrency limit that serialises one job's incidents."""
    return f"spikeops-job-{job_id}"


def one_incident_per_job(job_id: str, timeout_s: float) -> Any:
    """A slot of the job's own concurrency limit (created at 1 on first use): a second alert
    about the same job, under another idempotency key, waits for the first incident to end
    instead of stopping, draining and resubmitting beside it."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    name = job_limit_name(job_id)
    with get_client(sync_client=True) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass
    return concurrency(name, occupy=1, timeout_seconds=timeout_s, strict=True)
