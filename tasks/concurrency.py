"""How many incidents act at once: at most ``max_concurrent`` in all, and one per job, held by
the flow itself through Prefect global concurrency limits.

Why not the deployment's ``concurrency_limit``: Prefect releases a deployment slot when its
run pauses, the engine's renewal of that slot's lease then fails (410), and the engine kills
the run; so an incident waiting for a person crashed after about 225 s, stopped and never
resumed. The flow's own limits are not tied to the run's state. Their leases are renewed by
a thread while the process waits, and a renewal error is logged, never fatal: a paused
incident must not kill itself over a lease.

- ``spikeops-incidents`` (limit ``max_concurrent``) counts incidents that are working. A
  paused incident gives its slot back while it waits for a person (``IncidentSlots.paused``)
  and takes one again before it acts on the answer.
- ``spikeops-job-CLUSTER-JOB`` (limit 1; ``spikeops-job-JOB`` without a cluster) is held from start to end, the pause included, so a second
  alert about the same job (another idempotency key) waits instead of stopping, draining or
  resubmitting beside the first. It is removed when its last incident ends; a waiter that
  finds it gone creates it again and goes on waiting its turn.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

__all__ = ["INCIDENTS_LIMIT", "job_limit_name", "ensure_limit", "remove_idle_limit", "IncidentSlots",
           "one_incident_per_job"]

INCIDENTS_LIMIT = "spikeops-incidents"


def job_limit_name(job_id: str, cluster: str | None = None) -> str:
    """The global concurrency limit that serialises one job's incidents. Job ids are a
    scheduler's own (two Slurm clusters both have a job 4412), so the cluster is part of it
    when known: job 4412 of east never waits for job 4412 of west."""
    return f"spikeops-job-{cluster}-{job_id}" if cluster else f"spikeops-job-{job_id}"


def _lease_s() -> float:
    """Seconds a slot's lease lasts between renewals (renewed at 75 %; the server's minimum
    is 60); tests shorten it so that a pause outlasts several renewals."""
    return max(60.0, float(os.environ.get("SPIKEOPS_LEASE_S") or 300))


def ensure_limit(name: str, limit: int) -> None:
    """The limit exists (created at ``limit`` when missing). Read first: creating one that
    exists makes the server log an integrity error."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
        except ObjectAlreadyExists:  # another incident created it in between
            pass


def remove_idle_limit(name: str) -> bool:
    """Delete ``name`` when nothing holds it (a job's limit after its last incident), so the
    server does not keep one limit per job forever. True when deleted."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            current = client.read_global_concurrency_limit_by_name(name)
            if current.active_slots:
                return False
            client.delete_global_concurrency_limit_by_name(name)
            return True
        except ObjectNotFound:
            return False


@contextmanager
def _slot(name: str, limit: int, timeout_s: float) -> Iterator[None]:
    """One slot of ``name``; a limit deleted under a waiter is created again and waited on."""
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
    from prefect.concurrency.sync import concurrency

    for attempt in range(3):
        ensure_limit(name, limit)
        manager = concurrency(name, occupy=1, timeout_seconds=timeout_s, lease_duration=_lease_s(), strict=True,
                              raise_on_lease_renewal_failure=False)
        try:
            manager.__enter__()
        except ConcurrencySlotAcquisitionError as exc:  # the limit was removed while we waited
            if attempt == 2 or "must be created" not in str(exc):
                raise
            continue
        try:
            yield
        finally:
            manager.__exit__(None, None, None)
        return


class IncidentSlots:
    """The slots one incident holds; use as a context manager around the whole flow."""

    def __init__(self, job_id: str, max_concurrent: int, timeout_s: float, cluster: str | None = None) -> None:
        self.job = job_limit_name(job_id, cluster)
        self.max_concurrent = max_concurrent
        self.timeout_s = timeout_s
        self._stack = ExitStack()
        self._working: ExitStack | None = None

    def __enter__(self) -> IncidentSlots:
        self._stack.enter_context(_slot(self.job, 1, self.timeout_s))
        self._take()
        return self

    def _take(self) -> None:
        working = ExitStack()
        working.enter_context(_slot(INCIDENTS_LIMIT, self.max_concurrent, self.timeout_s))
        self._working = working

    def _give_back(self) -> None:
        if self._working is not None:
            self._working.close()
            self._working = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Around a wait for a person: the shared slot is free for other incidents meanwhile;
        the job's own slot is kept. Taken again (waiting its turn) before anything acts."""
        self._give_back()
        try:
            yield
        finally:
            self._take()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._give_back()
        finally:
            self._stack.close()
            try:
                remove_idle_limit(self.job)
            except Exception:  # tidying; the incident's outcome stands
                pass


def one_incident_per_job(job_id: str, timeout_s: float, max_concurrent: int = 4) -> IncidentSlots:
    """The incident's slots (kept under this name for callers of the per-job lock)."""
    return IncidentSlots(job_id, max_concurrent, timeout_s)
