"""Prefect tasks for evidence collection: a few shard tasks, threads inside each.

A Prefect task run costs about 25 ms of orchestration here; 1,000 nodes x 9 probes as
separate tasks would spend minutes on bookkeeping while the evidence rotates away. So the
unit of Prefect work is a shard of consecutive nodes (48 by default), and the SSH fan-out
inside a shard is the core's thread pool. Per-node results become a table artifact.

Where the shards run is the cluster's choice (``collect_runner`` in spikeops.toml): on the
flow's own task runner (threads in the flow run's process, the default), or on a Dask cluster
(``dask_scheduler``) through prefect-dask's ``DaskTaskRunner``, so that the SSH fan-out of a
10,000-node job is spread over the Dask workers' machines while the flow stays where it is.
The shard task is the same either way, and so is every byte it writes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
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

__all__ = ["collect_shard", "collect_evidence", "collection_table", "shard_runner",
           "PendingCollection", "start_collection", "start_incident_collection", "finish_incident_collection",
           "DEFAULT_SHARD_SIZE", "DASK_CONNECT_TIMEOUT_S"]

DEFAULT_SHARD_SIZE = 48
#: How long to wait for the Dask scheduler before collecting with threads instead.
DASK_CONNECT_TIMEOUT_S = 10


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


Submit = Callable[[Any, dict[str, Any]], Any]


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


@contextmanager
def shard_runner(dask_scheduler: str | None = None) -> Iterator[Submit]:
    """``submit(task, parameters) -> future`` for the shards: the flow's own task runner, or
    a ``DaskTaskRunner`` connected to ``dask_scheduler``. A Dask scheduler that does not
    answer within ``DASK_CONNECT_TIMEOUT_S`` is logged and the flow's runner is used: the
    evidence rotates away while we wait, and an orchestration choice must not cost it.
    Before the first shard every worker's profiler is stopped (``spikeops.tasks.dask_worker``: on
    Python 3.11 it can deadlock a worker that runs shards); workers that cannot be prepared
    so are treated as a scheduler that does not answer."""
    def local(shard_task: Any, parameters: dict[str, Any]) -> Any:
        return shard_task.submit(**parameters)

    if not dask_scheduler:
        yield local
        return
    from prefect_dask import DaskTaskRunner

    from spikeops.tasks.dask_worker import NoProfiler

    runner = DaskTaskRunner(address=dask_scheduler, client_kwargs={"timeout": f"{DASK_CONNECT_TIMEOUT_S}s"})
    runner.__enter__()
    try:
        runner.client  # noqa: B018 - connects now (it would connect at the first submit)
    except (OSError, TimeoutError) as exc:
        runner.__exit__(None, None, None)
        get_run_logger().warning("Dask scheduler %s did not answer (%s): collecting with the flow's threads",
                                 dask_scheduler, _first_line(exc))
        yield local
        return
    try:
        # Before any shard: a worker's profiler can deadlock it for good (tasks/dask_worker.py).
        runner.client.register_plugin(NoProfiler())
    except Exception as exc:  # a worker that cannot load the plugin would hang or fail the shards
        runner.__exit__(None, None, None)
        get_run_logger().warning("Dask workers at %s could not be prepared (%s): collecting with the flow's "
                                 "threads", dask_scheduler, _first_line(exc))
        yield local
        return
    try:
        yield lambda shard_task, parameters: runner.submit(shard_task, parameters)
    finally:
        runner.__exit__(None, None, None)


class PendingCollection:
    """A collection whose shards are running (``start_collection``); ``result`` waits for them,
    then writes the bundle's collection record and the table artifact, once."""

    def __init__(self, inventory: Any, job: str, root: Path, baseline: bool, started: Any, futures: list[Any],
                 runner: ExitStack, artifact_key: str | None) -> None:
        self._inventory, self._job, self._root, self._baseline = inventory, job, root, baseline
        self._started, self._futures, self._runner, self._artifact_key = started, futures, runner, artifact_key
        self._t0 = time.monotonic()
        self._result: CollectResult | None = None

    def result(self) -> CollectResult:
        if self._result is None:
            with self._runner:
                results = [result for future in self._futures for result in future.result()]
            outcome = CollectResult(self._root, self._job, self._baseline, time.monotonic() - self._t0, results)
            record_collection(outcome, self._inventory, self._started)
            create_table_artifact(key=self._artifact_key, table=collection_table(results),
                                  description="\n".join(outcome.summary_lines()))
            self._result = outcome
        return self._result


def start_collection(inventory_path: str | Path, job: str, bundle: str | Path, nodes: str | list[str] | None = None,
                     *, baseline: bool = False, replace: bool = False,
                     shard_size: int = DEFAULT_SHARD_SIZE, artifact_key: str | None = None,
                     dask_scheduler: str | None = None) -> PendingCollection:
    """Submit a job's collection shards and return at once: the incident flow classifies and
    protects while the nodes answer (``collect_evidence`` for the whole of it). Each shard
    gets its share of the inventory's fan-out, on the Dask cluster at ``dask_scheduler``
    when given. Call it from a flow (it submits tasks)."""
    inventory = load_inventory(inventory_path)
    wanted = expand_nodes(nodes) if isinstance(nodes, str) else nodes
    root, wanted, started = prepare_bundle(inventory, job, bundle, wanted, baseline=baseline, replace=replace)
    shards = shard_nodes(wanted, shard_size)
    share = max(1, math.ceil(inventory.ssh.fanout / len(shards)))
    runner = ExitStack()
    submit = runner.enter_context(shard_runner(dask_scheduler))
    try:
        futures = [
            submit(collect_shard, {"inventory_path": str(inventory.path), "job": job, "bundle": str(root),
                                   "nodes": shard, "baseline": baseline, "fanout": share,
                                   "label": f"{index + 1}/{len(shards)} ({len(shard)} nodes)"})
            for index, shard in enumerate(shards)
        ]
    except BaseException:
        runner.close()
        raise
    return PendingCollection(inventory, job, root, baseline, started, futures, runner, artifact_key)


def collect_evidence(inventory_path: str | Path, job: str, bundle: str | Path, nodes: str | list[str] | None = None,
                     *, baseline: bool = False, replace: bool = False,
                     shard_size: int = DEFAULT_SHARD_SIZE, artifact_key: str | None = None,
                     dask_scheduler: str | None = None) -> CollectResult:
    """Collect a job's evidence from inside a flow: the shards (``start_collection``), then the
    bundle's collection record and a table artifact."""
    return start_collection(inventory_path, job, bundle, nodes, baseline=baseline, replace=replace,
                            shard_size=shard_size, artifact_key=artifact_key,
                            dask_scheduler=dask_scheduler).result()


def start_incident_collection(inventory_path: str, job: str, bundle: str, nodes: list[str], incident: str, *,
                              dask_scheduler: str | None = None) -> PendingCollection:
    """The incident's evidence from every node of the job over SSH (the bundle's node folders
    are replaced), started as soon as the incident is open: the snapshot is taken before the
    job is signalled or watched, and nothing after waits for it until the diagnosis."""
    return start_collection(inventory_path, job, bundle, nodes or None, replace=True,
                            artifact_key=f"collection-{incident.lower()}"[:100], dask_scheduler=dask_scheduler)


def finish_incident_collection(pending: PendingCollection, *, notifier: Any) -> CollectResult:
    """Wait for the incident's collection and tell it in the thread as a count of nodes by outcome."""
    collected = pending.result()
    buckets = collected.buckets()
    if notifier:
        notifier.stage("collect", f"collected {len(buckets['ok'])}/{len(collected.nodes)} nodes"
                       + "".join(f"; {k}: {len(v)}" for k, v in buckets.items() if v and k != "ok"))
    return collected
