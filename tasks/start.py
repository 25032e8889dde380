"""Starting the incident flow for an alert: what the alert receiver and the watcher share.

Both turn an ``Alert`` (``spikeops.alerts``) into one run of the served ``incident-response``
deployment:
- the alert's labels become the flow's parameters through ``spikeops.toml`` (labels only pick
  among what the operator configured);
- ``run_deployment`` gets the alert's idempotency key, so Prefect returns the existing run for
  a key it has seen and a storm of repeats starts one run;
- it does not wait for the run (``timeout=0``);
- the Slack thread's opening message is posted at once, beside the run.

The receiver (``deployments/``) calls ``prefect_starter``; the watcher's flow calls the
``start_incident`` task. Neither layer imports the other.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task

from spikeops.alerts import Alert, AlertError, idempotency_key, parse_alerts
from spikeops.config import SpikeopsConfig, load_config
from spikeops.errors import InputError
from spikeops.watch import Anomaly, alert_payload

__all__ = ["FLOW_NAME", "DEPLOYMENT_NAME", "CLUSTER_DEPLOYMENT", "cluster_deployment_name", "prefect_starter",
           "open_thread", "deployment_target", "start_incident"]

FLOW_NAME = "incident-response"
#: The one deployment ``spikeops serve`` serves in its own process.
DEPLOYMENT_NAME = f"{FLOW_NAME}/incident-response"
#: One deployment per cluster, each on the cluster's work pool (``infra/prefect/up``).
CLUSTER_DEPLOYMENT = f"{FLOW_NAME}/{{cluster}}"


def cluster_deployment_name(deployment: str, cluster: str) -> str:
    """The deployment that runs an incident on ``cluster``: ``deployment`` with ``{cluster}``
    filled in (a name without it is the same for every cluster). The cluster name was
    checked against spikeops.toml, so it is a configured one and a plain name."""
    return deployment.replace("{cluster}", cluster)


def prefect_starter(config: SpikeopsConfig, deployment: str = DEPLOYMENT_NAME, *,
                    announce: bool = True) -> Callable[[Alert, str], str]:
    """``start(alert, key) -> flow run id``: the run for that key, started or found, of
    ``deployment`` (``CLUSTER_DEPLOYMENT``: the alert's cluster's own deployment)."""
    from prefect.deployments import run_deployment

    def start(alert: Alert, key: str) -> str:
        resolved = config.flow_parameters(alert.job, alert.cluster)  # an unknown cluster is refused here
        cluster = alert.cluster or next(iter(config.clusters))
        overrides = {"incident_id": key.replace("alert-", "inc-"), "alert": {
            "source": alert.source, "received": alert.starts_at, "payload": {
                "alertname": alert.name, "labels": alert.labels, "fingerprint": alert.fingerprint}}}
        run = run_deployment(cluster_deployment_name(deployment, cluster),
                             parameters={"job_id": alert.job, "cluster": cluster, "overrides": overrides},
                             idempotency_key=key, timeout=0, flow_run_name=f"job-{alert.job}-{alert.name}"[:100],
                             tags=[f"job:{alert.job}", f"cluster:{cluster}"])
        if announce:
            threading.Thread(target=open_thread, args=({**resolved, **overrides}, alert, str(run.id)),
                             daemon=True).start()
        return str(run.id)

    return start


def open_thread(parameters: dict[str, Any], alert: Alert, run_id: str) -> None:
    """The Slack thread's opening message, posted the moment the alert is accepted (the flow
    run needs seconds to be picked up and started). It lands in the incident's bundle
    (``slack.json``), where the flow finds the thread and continues it; posted once per
    incident, however many repeats arrive."""
    from spikeops.notify import SlackNotifier

    bundle = Path(parameters["incidents_dir"]).expanduser() / parameters["incident_id"]
    bundle.mkdir(parents=True, exist_ok=True)
    incident = {"incident_id": parameters["incident_id"], "job": {"id": alert.job},
                "alert": {"source": alert.source, "received": alert.starts_at}}
    from prefect.utilities.urls import url_for

    url = url_for("flow-run", obj_id=run_id)
    SlackNotifier(bundle, channel=parameters.get("slack_channel")).open(
        incident, symptom=None, links={"flow_run": url} if url else None)


def deployment_target(config: SpikeopsConfig, job: str, cluster: str | None, *,
                      deployment: str = DEPLOYMENT_NAME, announce: bool = True) -> Callable[[Anomaly], str | None]:
    """A watcher's firing target that starts ``deployment`` for each incident exactly as the
    receiver would for the same alert (the anomaly becomes the generic alert, so the same
    incident gets the same key); the note is the flow run's id. The job and cluster are
    checked against ``spikeops.toml`` now, not at the first incident."""
    config.flow_parameters(job, cluster)
    start = prefect_starter(config, deployment, announce=announce)

    def fire(anomaly: Anomaly) -> str | None:
        payload = alert_payload(anomaly, job, cluster)
        try:
            alert = parse_alerts("generic", json.dumps(payload).encode())[0]
        except AlertError as exc:
            raise InputError(f"cannot make an alert of the incident: {exc}") from None
        return f"flow run {start(alert, idempotency_key(alert))}"

    return fire


@task(name="start-incident", retries=2, retry_delay_seconds=5)
def start_incident(anomaly: dict[str, Any], job: str, cluster: str | None, config_path: str | None,
                   deployment: str = DEPLOYMENT_NAME, announce: bool = True) -> str | None:
    """Start (or find, by its idempotency key) the incident flow run for one anomaly. Retries:
    the Prefect API may blink, and the key makes a retry start nothing twice."""
    fire = deployment_target(load_config(config_path), job, cluster, deployment=deployment, announce=announce)
    return fire(Anomaly(**anomaly))
