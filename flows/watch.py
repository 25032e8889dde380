"""The ``watch-job`` flow: follow one job's metrics and start the incident flow on an anomaly.

It runs ``spikeops.watch`` (the detector, debounced: one incident, one start) on a
``metrics.jsonl``, a training log or Prometheus queries, and starts the served
``incident-response`` deployment for each incident through the receiver's own path: the
anomaly becomes the generic alert (``spikeops.watch.fire.alert_payload``), the receiver's
parser and idempotency key turn it into an ``Alert`` and a key, and
``spikeops.deployments.serve.prefect_starter`` maps it to the flow's parameters with
``spikeops.toml`` and calls ``run_deployment(..., idempotency_key=key, timeout=0)``. So an
incident found by the watcher and the same incident posted to the receiver start one run,
and a watcher restarted over the same file starts nothing new.

The starting is a task (it retries: the Prefect API may blink); the watching is the flow's
own loop, which ends after ``max_incidents`` or ``timeout_s`` (or, with ``once``, at the end
of what is there).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import flow, get_run_logger

from spikeops.config import load_config
from spikeops.watch import Anomaly, Detector, WatchConfig, describe, open_source, watch
from spikeops.watch.sources import SourceStats
from spikeops.tasks.start import DEPLOYMENT_NAME, start_incident

__all__ = ["watch_job"]


@flow(name="watch-job", description="Follow a job's metrics; start incident-response on an anomaly (docs/watch.md)")
def watch_job(job: str, cluster: str | None = None, metrics: str | None = None, log: str | None = None,
              prometheus: str | None = None, queries: dict[str, str] | None = None, config: str | None = None,
              from_start: bool = False, once: bool = False, max_incidents: int | None = None,
              timeout_s: float | None = None, deployment: str = DEPLOYMENT_NAME,
              announce: bool = True) -> list[dict[str, Any]]:
    """Watch one job; the incidents started, each with its flow run."""
    logger = get_run_logger()
    spikeops_config = load_config(config)
    settings = WatchConfig.from_table(spikeops_config.watch)
    spikeops_config.flow_parameters(job, cluster)  # an unknown cluster fails now, not hours later
    stats = SourceStats()
    records = open_source(settings, metrics=metrics, log=log, prometheus=prometheus, queries=queries,
                          from_start=from_start, once=once, timeout=timeout_s, stats=stats, idle=not once)
    started: list[dict[str, Any]] = []

    def fire(anomaly: Anomaly) -> str | None:
        note = start_incident(asdict(anomaly), job, cluster, config, deployment, announce)
        logger.info("%s -> %s", describe(anomaly), note)
        started.append({"anomaly": asdict(anomaly), "flow_run": (note or "").removeprefix("flow run ") or None})
        return note

    detector = Detector(settings)
    watch(records, detector, fire, max_incidents=max_incidents)
    logger.info("watched %d record(s), %d incident(s), %d unreadable line(s)",
                detector.counts["records"], len(detector.incidents), stats.bad_lines)
    return started
