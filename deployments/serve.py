"""Serving the incident flow, the scheduled baseline refresh and the alert receiver (``spikeops serve``).

``incident_deployment()`` is the flow as a served deployment: up to ``DEPLOYMENT_CONCURRENCY``
incidents run at once, but never two of one job (the flow holds a per-job concurrency limit).
``prefect_starter`` is what the receiver calls for a firing alert:
- it maps the alert's labels to the flow's parameters through ``spikeops.toml``;
- it calls ``run_deployment`` with the alert's idempotency key (Prefect returns the existing
  run for a key it has seen, so a storm of repeats starts one run);
- it does not wait (``timeout=0``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from spikeops.config import SpikeopsConfig

__all__ = ["DEPLOYMENT_NAME", "incident_deployment", "prefect_starter", "prefect_emitter", "serve"]

FLOW_NAME = "incident-response"
#: Incidents of different jobs at once; one job's incidents are serialised inside the flow
#: (``one_incident_per_job``), so two alerts never act on one job together.
DEPLOYMENT_CONCURRENCY = 4
DEPLOYMENT_NAME = f"{FLOW_NAME}/incident-response"


def incident_deployment() -> Any:
    from flows.incident_response import incident_response

    return incident_response.to_deployment(name="incident-response", concurrency_limit=DEPLOYMENT_CONCURRENCY,
                                           description="One incident end to end (docs/flow.md)")


def prefect_starter(config: SpikeopsConfig, deployment: str = DEPLOYMENT_NAME, *,
                    announce: bool = True) -> Callable[[Any, str], str]:
    from prefect.deployments import run_deployment

    def start(alert: Any, key: str) -> str:
        parameters = config.flow_parameters(alert.job, alert.cluster)
        parameters["incident_id"] = key.replace("alert-", "inc-")
        parameters["alert"] = {"source": alert.source, "received": alert.starts_at, "payload": {
            "alertname": alert.name, "labels": alert.labels, "fingerprint": alert.fingerprint}}
        run = run_deployment(deployment, parameters={"params": parameters}, idempotency_key=key, timeout=0)
        if announce:
            threading.Thread(target=open_thread, args=(parameters, alert, str(run.id)), daemon=True).start()
        return str(run.id)

    return start


def open_thread(parameters: dict[str, Any], alert: Any, run_id: str) -> None:
    """The Slack thread's opening message, posted by the receiver the moment the alert is
    accepted (the flow run needs seconds to be picked up and started). It lands in the
    incident's bundle (``slack.json``), where the flow finds the thread and continues it;
    posted once per incident, however many repeats arrive."""
    from pathlib import Path

    from spikeops.notify import SlackNotifier

    bundle = Path(parameters["incidents_dir"]).expanduser() / parameters["incident_id"]
    bundle.mkdir(parents=True, exist_ok=True)
    incident = {"incident_id": parameters["incident_id"], "job": {"id": alert.job},
                "alert": {"source": alert.source, "received": alert.starts_at}}
    SlackNotifier(bundle, channel=parameters.get("slack_channel")).open(
        incident, symptom=None, links={"flow_run": f"{_ui_url()}/runs/flow-run/{run_id}"} if _ui_url() else None)


def _ui_url() -> str | None:
    import os

    return os.environ.get("PREFECT_UI_URL") or None


def prefect_emitter() -> Callable[[Any], None]:
    """Each alert as a Prefect event (``spikeops.alert.<status>``), for users' automations."""
    from prefect.events import emit_event

    def emit(alert: Any) -> None:
        emit_event(event=f"spikeops.alert.{alert.status}",
                   resource={"prefect.resource.id": f"spikeops.job.{alert.job}", "spikeops.cluster": alert.cluster or ""},
                   payload={"alertname": alert.name, "fingerprint": alert.fingerprint})

    return emit


def serve(config: SpikeopsConfig, addr: str | None = None) -> None:
    """The receiver (uvicorn, in a thread) and the flow's deployment (``prefect.serve``)."""
    import os

    # Pick up a new incident run within a second or two, not prefect's default 10 s.
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "1")
    import uvicorn
    from prefect import serve as prefect_serve

    from deployments.receiver import ReceiverConfig, check_bind, create_app

    host, _, port = (addr or config.receiver_addr).rpartition(":")
    receiver = ReceiverConfig.from_env()
    check_bind(host, receiver)
    from deployments.baselines import baseline_deployment, wants_baselines

    deployments = [incident_deployment()]
    if wants_baselines(config):  # a cluster with a baseline_dir: the scheduled refresh too
        deployments.append(baseline_deployment(config))
    # Register the deployments before the receiver listens: an alert that arrives in between
    # would otherwise find no deployment to run and be answered 503.
    for deployment in deployments:
        deployment.apply()
    app = create_app(prefect_starter(config), receiver, emit=prefect_emitter())
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=int(port), log_level="warning"))
    threading.Thread(target=server.run, name="spikeops-receiver", daemon=True).start()
    prefect_serve(*deployments)
