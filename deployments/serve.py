"""Serving the incident flow, the scheduled baseline refresh, the node lifecycle of each cluster
and the alert receiver (``spikeops serve``).

``incident_deployment()`` is the flow as a served deployment: up to ``[incidents]
max_concurrent`` incidents act at once, never two of one job (limits the flow holds itself,
``spikeops.tasks.concurrency``).
The receiver starts runs with ``spikeops.tasks.start.prefect_starter`` (shared with the watcher).
``serve_receiver`` is the receiver alone, for the layout where each cluster's workers run the
flows (``spikeops.deployments.pools``, ``infra/prefect/up``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from spikeops.config import SpikeopsConfig
from spikeops.tasks.start import CLUSTER_DEPLOYMENT, DEPLOYMENT_NAME, prefect_starter

from spikeops.deployments.incident import (describe_parameters, ensure_incident_limit, incident_deployment,
                                           restrict_clusters)

__all__ = ["DEPLOYMENT_NAME", "incident_deployment", "describe_parameters", "restrict_clusters", "prefect_emitter",
           "serve", "serve_receiver", "ledger_metrics"]


def check_api() -> str:
    """The Prefect API's URL when it answers; ValueError with one line when it does not."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or "(no PREFECT_API_URL: a temporary local server)"
    try:
        with get_client(sync_client=True) as client:
            error = client.api_healthcheck()
    except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same answer
        error = exc
    if error is not None:
        raise ValueError(f"cannot reach the Prefect API at {url}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0][:200] if str(error) else ''}")
    return url


def prefect_emitter() -> Callable[[Any], None]:
    """Each alert as a Prefect event (``spikeops.alert.<status>``), for users' automations."""
    from prefect.events import emit_event

    def emit(alert: Any) -> None:
        emit_event(event=f"spikeops.alert.{alert.status}",
                   resource={"prefect.resource.id": f"spikeops.job.{alert.job}", "spikeops.cluster": alert.cluster or ""},
                   payload={"alertname": alert.name, "fingerprint": alert.fingerprint})

    return emit


def ledger_metrics(config: SpikeopsConfig) -> Callable[[], tuple[bytes, str]]:
    """``GET /metrics``: the ledger's incidents, costs and lineages (``spikeops.ledger.metrics``)."""
    from spikeops.ledger.metrics import LedgerCollector, exposition

    collector = LedgerCollector(config.ledger_url)
    return lambda: exposition(collector)


def serve_receiver(config: SpikeopsConfig, addr: str | None = None) -> None:
    """The receiver alone (``spikeops serve --receiver-only``): each alert starts its
    cluster's deployment, ``incident-response/CLUSTER``, which that cluster's workers run
    (``spikeops.deployments.pools``; ``infra/prefect/up`` deploys them). Refuses to start, with one
    line, while a cluster has no deployment: each of its alerts would fail."""
    import uvicorn

    from spikeops.deployments.pools import missing_deployments
    from spikeops.deployments.receiver import ReceiverConfig, check_bind, create_app

    host, _, port = (addr or config.receiver_addr).rpartition(":")
    receiver = ReceiverConfig.from_env()
    check_bind(host, receiver)
    check_api()
    missing = missing_deployments(config)
    if missing:
        raise ValueError(f"no deployment {', '.join(missing)} on the Prefect server: deploy the clusters' "
                         "work pools first (infra/prefect/up, or python -m spikeops.deployments.topology deploy)")
    ensure_incident_limit(config)
    app = create_app(prefect_starter(config, CLUSTER_DEPLOYMENT), receiver, emit=prefect_emitter(),
                     metrics=ledger_metrics(config))
    uvicorn.Server(uvicorn.Config(app, host=host, port=int(port), log_level="warning")).run()


def serve(config: SpikeopsConfig, addr: str | None = None, *, warm_start: bool = True) -> None:
    """The receiver (uvicorn, in a thread) and the flow's deployment (``prefect.serve``); with
    ``warm_start`` each run is forked from a process that has already imported the flow
    (``spikeops.deployments.warm_start``) instead of a new interpreter importing Prefect."""
    import os

    import uvicorn

    from spikeops.deployments.receiver import ReceiverConfig, check_bind, create_app
    from spikeops.deployments.receiver_http import freeze_heap, server_config

    host, _, port = (addr or config.receiver_addr).rpartition(":")
    receiver = ReceiverConfig.from_env()
    check_bind(host, receiver)
    from spikeops.deployments.baselines import baseline_deployment, wants_baselines

    if config.path is not None:  # the served runs (subprocesses) read the same file
        os.environ["SPIKEOPS_CONFIG"] = str(config.path)
    check_api()
    ensure_incident_limit(config)
    deployments = [incident_deployment(config)]
    if wants_baselines(config):  # a cluster with a baseline_dir: the scheduled refresh too
        deployments.append(baseline_deployment(config))
    from spikeops.deployments.lifecycle import lifecycle_deployments

    deployments += lifecycle_deployments(config)  # node-lifecycle/CLUSTER, each on its own schedule
    # Register the deployments before the receiver listens: an alert that arrives in between
    # would otherwise find no deployment to run and be answered 503.
    for deployment in deployments:
        deployment.apply()
    if warm_start:  # before the receiver and the runner start their threads
        from spikeops.deployments import warm_start as warm

        warm_start = warm.enable()
        if not warm_start:
            print("spikeops serve: this Prefect or platform has no forkserver hook; runs start cold", flush=True)
    app = create_app(prefect_starter(config), receiver, emit=prefect_emitter(), metrics=ledger_metrics(config))
    server = uvicorn.Server(server_config(app, host, int(port)))
    freeze_heap()  # the heap of everything imported so far, out of a storm's collections
    threading.Thread(target=server.run, name="spikeops-receiver", daemon=True).start()
    with runner_settings():
        run_served(deployments, warm=warm_start)


def run_served(deployments: list[Any], *, warm: bool) -> None:
    """``prefect.serve`` for our deployments, except that with ``warm`` the runner is also
    given each deployment's flow object, as ``Runner.add_flow`` gives it: Prefect then starts
    the runs with its direct starter (the flow passed to a child process, which
    ``spikeops.deployments.warm_start`` forks from its server) instead of ``python -m prefect.engine``,
    a new interpreter that imports Prefect and loads the flow from its entrypoint again."""
    import asyncio

    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner

    runner = Runner(pause_on_shutdown=True, query_seconds=runner_poll_s())
    registry = getattr(runner, "_deployment_registry", None)
    cold = []
    for deployment in deployments:
        deployment_id = runner.add_deployment(deployment)
        flow = _flow_of(deployment)
        if warm and flow is not None and hasattr(registry, "register_flow"):
            registry.register_flow(deployment_id, flow)
        else:
            cold.append(deployment.name)
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    print(f"Your deployments are being served and polling for scheduled runs: {names}"
          + (f" (runs of {', '.join(cold)} start cold: python -m prefect.engine)" if cold else ""), flush=True)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal):
        print("spikeops serve: shutting down", flush=True)


def _flow_of(deployment: Any) -> Any:
    """The flow object a deployment of ours was made from, found by its entrypoint: a module
    path (``spikeops.flows.incident_response.incident_response``, what our deployments use) or
    ``module:attribute``. None, with one line on stderr, when it cannot be loaded: the runner
    then starts that deployment's runs cold, which still work."""
    import importlib
    import sys

    entrypoint = (getattr(deployment, "entrypoint", "") or "").strip()
    module_name, colon, attribute = entrypoint.rpartition(":")
    if not colon:
        module_name, _, attribute = entrypoint.rpartition(".")
    if not module_name or not attribute or module_name.endswith(".py") or "/" in module_name:
        print(f"spikeops serve: {entrypoint or '(no entrypoint)'} is not a module path; its runs start cold",
              file=sys.stderr, flush=True)
        return None
    try:
        return getattr(importlib.import_module(module_name), attribute, None)
    except Exception as exc:  # noqa: BLE001 - a flow that cannot load is a cold start, never a crash
        print(f"spikeops serve: cannot load {entrypoint}: {type(exc).__name__}: {exc}; its runs start cold",
              file=sys.stderr, flush=True)
        return None


def runner_poll_s() -> float:
    """Seconds between the runner's looks for new runs: half a second (a quarter on average
    added to every alert's start), or an operator's ``PREFECT_RUNNER_POLL_FREQUENCY``. Prefect's
    setting takes whole seconds; its runner takes any ``query_seconds``."""
    import os

    try:
        return max(0.1, float(os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY") or 0.5))
    except ValueError:
        return 0.5


def runner_settings() -> Any:
    """Pick up a new incident run within a second, not Prefect's default 10 s (an operator's
    own ``PREFECT_RUNNER_POLL_FREQUENCY`` wins). A setting, not an environment variable: by the
    time ``serve`` runs Prefect has read its environment, and a variable set then is ignored
    (the runner polled every 10 s, 5 s on average of every alert's start)."""
    import os

    from prefect.settings import PREFECT_RUNNER_POLL_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_RUNNER_POLL_FREQUENCY: int(os.environ.get(
        "PREFECT_RUNNER_POLL_FREQUENCY") or 1)})
