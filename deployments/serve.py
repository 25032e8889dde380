"""Serving the incident flow, the scheduled baseline refresh and the alert receiver (``spikeops serve``).

``incident_deployment()`` is the flow as a served deployment: up to ``DEPLOYMENT_CONCURRENCY``
incidents run at once, but never two of one job (the flow holds a per-job concurrency limit).
The receiver starts runs with ``tasks.start.prefect_starter`` (shared with the watcher).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from spikeops.config import SpikeopsConfig
from tasks.start import DEPLOYMENT_NAME, prefect_starter

__all__ = ["DEPLOYMENT_NAME", "incident_deployment", "prefect_emitter", "serve"]

#: Incidents of different jobs at once; one job's incidents are serialised inside the flow
#: (``one_incident_per_job``), so two alerts never act on one job together.
DEPLOYMENT_CONCURRENCY = 4


def incident_deployment() -> Any:
    from flows.incident_response import incident_response

    return incident_response.to_deployment(name="incident-response", concurrency_limit=DEPLOYMENT_CONCURRENCY,
                                           description="One incident end to end (docs/flow.md)")


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
