"""Isolating the convicted nodes: drained with a ``spikeops:`` reason, released again if the
resume that depends on the drain fails (a failed incident never leaves the cluster smaller)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import task
from prefect.transactions import get_transaction

from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["isolate"]


@task(name="isolate")
def isolate(scheduler: SchedulerRef, bundle: str, incident: str, nodes: list[str], cause: str) -> list[dict[str, Any]]:
    done = [r.to_json() for r in scheduler.open(bundle, incident).drain(nodes, cause, incident)]
    current = get_transaction()
    if current is not None:  # what the rollback must undo: only what this run drained
        current.set("isolated", {"scheduler": asdict(scheduler), "bundle": bundle, "incident": incident,
                                 "nodes": [d["target"] for d in done if d["outcome"] == "done"]})
    return done


@isolate.on_rollback
def _release_isolated(transaction: Any) -> None:
    """A later step failed (the job could not be resumed elsewhere): give the nodes back."""
    record = transaction.get("isolated", None)
    if not record or not record["nodes"]:
        return
    SchedulerRef(**record["scheduler"]).open(record["bundle"], record["incident"]).release(record["nodes"])
