"""Prefect tasks for evidence collection: a few shard tasks, threads inside each.

A Prefect task run costs about 25 ms of orchestration here; 1,000 nodes x 9 probes as
separate tasks would spend minutes on bookkeeping while the evidence rotates away. So the
unit of Prefect work is a shard of consecutive nodes (48 by default), and the SSH fan-out
inside a shard is the core's thread pool. Per-node results become a table artifact.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from spikeops.collect.collector import (
    CollectResult,
    NodeResult,
    collect_nodes,
    prepare_bundle,
    record_collection,
    shard_nodes,
)
from spikeops.inventory import expand_nodes, load_inventory

__all__ = ["collect_shard", "collect_evidence", "collect_incident", "collection_table", "DEFAULT_SHARD_SIZE"]

DEFAULT_SHARD_SIZE = 48


@task(name="collect-shard", task_run_name="collect {label}", retries=0)
def collect_shard(inventory_path: str, job: str, bundle: str, nodes: list[str], *, baseline: bool = False,
                  fanout: int | None = None, label: str = "") -> list[NodeResult]:
    """Collect one shard. No retries: a failed node is data already, and a retry would
    replace the evidence of the first attempt."""
    inventory = load_inventory(inventory_path)
    return collect_nodes(inventory, job, bundle, nodes, baseline=baseline, fanout=fanout)


def collection_table(results: list[NodeResult]) -> list[dict[str, Any]]:
    """One row per node for the Prefect UI: outcome, seconds, and what went wrong."""
    return [
        {"node": r.node, "outcome": r.outcome, "seconds": round(r.seconds, 2),
         "probes ok": sum(1 for run in r.probes if run.error is None), "problems": "; ".join(
             ([r.detail] if r.detail and not r.probes else []) + r.problems()) or "-"}
        for r in results
    ]


def collect_evidence(inventory_path: str | Path, job: str, bundle: str | Path, nodes: str | list[str] | None = None,
                     *, baseline: bool = False, replace: bool = False,
                     shard_size: int = DEFAULT_SHARD_SIZE, artifact_key: str | None = None) -> CollectResult:
    """Collect a job's evidence from inside a flow: shard tasks submitted together, each
    with its share of the inventory's fan-out, then the bundle's collection record and a
    table artifact. Call it from a flow (it submits tasks)."""
    inventory = load_inventory(inventory_path)
    wanted = expand_nodes(nodes) if isinstance(nodes, str) else nodes
    root, wanted, started = prepare_bundle(inventory, job, bundle, wanted, baseline=baseline, replace=replace)
    shards = shard_nodes(wanted, shard_size)
    share = max(1, math.ceil(inventory.ssh.fanout / len(shards)))
    t0 = time.monotonic()
    futures = [
        collect_shard.submit(str(inventory.path), job, str(root), shard, baseline=baseline, fanout=share,
                             label=f"{index + 1}/{len(shards)} ({len(shard)} nodes)")
        for index, shard in enumerate(shards)
    ]
    results = [result for future in futures for result in future.result()]
    outcome = CollectResult(root, job, baseline, time.monotonic() - t0, results)
    record_collection(outcome, inventory, started)
    create_table_artifact(
        key=artifact_key, table=collection_table(results),
        description="\n".join(outcome.summary_lines()),
    )
    return outcome


def collect_incident(inventory_path: str, job: str, bundle: str, nodes: list[str], incident: str, *,
                     notifier: Any) -> CollectResult:
    """The incident's evidence from every node of the job over SSH (the bundle's node folders
    are replaced), told in the thread as a count of nodes by outcome."""
    collected = collect_evidence(inventory_path, job, bundle, nodes or None, replace=True,
                                 artifact_key=f"collection-{incident.lower()}"[:100])
    buckets = collected.buckets()
    if notifier:
        notifier.stage("collect", f"collected {len(buckets['ok'])}/{len(collected.nodes)} nodes"
                       + "".join(f"; {k}: {len(v)}" for k, v in buckets.items() if v and k != "ok"))
    return collected
