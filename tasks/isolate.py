"""Isolating the convicted nodes: drained with a ``spikeops:`` reason.

A drain is not undone when the resume that depends on it fails: the evidence that convicted
the node holds whatever happened to the job, and no node spikeops drained returns to service
without a passing validation (docs/lifecycle.md: ``spikeops nodes validate``, the
``node-lifecycle`` deployment, or a person's audited ``nodes release --force --reason``)."""

from __future__ import annotations

from typing import Any

from prefect import task

from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["isolate"]


@task(name="isolate")
def isolate(scheduler: SchedulerRef, bundle: str, incident: str, nodes: list[str], cause: str) -> list[dict[str, Any]]:
    return [r.to_json() for r in scheduler.open(bundle, incident).drain(nodes, cause, incident)]
