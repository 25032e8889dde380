"""The alert receiver: monitoring alerts in, one incident flow run per incident out.

Prefect's webhooks are Cloud-only, so spikeops ships its own small FastAPI app:
- ``POST /alerts/alertmanager``: Alertmanager webhook v4;
- ``POST /alerts/grafana``: Grafana alerting webhook (the same alert list, plus its fields);
- ``POST /alerts/generic``: ``{"job": "4412", "cluster": "...", "alertname": "...",
  "status": "firing", "fingerprint": "...", "startsAt": "..."}``.

Authentication is required to listen anywhere but loopback: ``Authorization: Bearer`` with
``SPIKEOPS_RECEIVER_TOKEN``, or an HMAC-SHA256 of the body in ``X-Spikeops-Signature`` with
``SPIKEOPS_RECEIVER_HMAC_KEY``. Alerts are validated, resolved ones ignored, labels mapped to
flow parameters (``spikeops.alerts``: only the job id and cluster name, both checked against
strict patterns), and each firing alert starts the flow through a ``starter`` with the alert's
idempotency key, so a storm of repeats starts one run. The answer comes at once; the flow runs on
its own.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Module level, not inside create_app: FastAPI resolves the handlers' (string) annotations
# in this module's globals, and an unresolved ``Request`` silently becomes a query parameter.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from spikeops.alerts import SOURCES, Alert, AlertError, idempotency_key, parse_alerts
from spikeops.errors import InputError

__all__ = ["ReceiverConfig", "create_app", "check_bind"]


@dataclass(frozen=True)
class ReceiverConfig:
    token: str | None = None
    hmac_key: str | None = None
    default_cluster: str | None = None

    @classmethod
    def from_env(cls) -> ReceiverConfig:
        return cls(os.environ.get("SPIKEOPS_RECEIVER_TOKEN") or None,
                   os.environ.get("SPIKEOPS_RECEIVER_HMAC_KEY") or None,
                   os.environ.get("SPIKEOPS_DEFAULT_CLUSTER") or None)

    @property
    def authenticated(self) -> bool:
        return bool(self.token or self.hmac_key)


def check_bind(host: str, config: ReceiverConfig) -> None:
    """Refuse to listen beyond loopback without authentication."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not config.authenticated:
        raise ValueError(f"refusing to listen on {host} without SPIKEOPS_RECEIVER_TOKEN or SPIKEOPS_RECEIVER_HMAC_KEY")


def _authorised(config: ReceiverConfig, headers: Mapping[str, str], body: bytes) -> bool:
    if not config.authenticated:
        return True
    if config.token:
        given = headers.get("authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip(), config.token):
            return True
    if config.hmac_key:
        signature = headers.get("x-spikeops-signature", "").removeprefix("sha256=")
        expected = hmac.new(config.hmac_key.encode(), body, hashlib.sha256).hexdigest()
        if signature and hmac.compare_digest(signature, expected):
            return True
    return False


def create_app(starter: Callable[[Alert, str], str | None], config: ReceiverConfig | None = None,
               emit: Callable[[Alert], None] | None = None) -> Any:
    """The FastAPI app. ``starter(alert, idempotency_key)`` starts (or finds) the flow run and
    returns its id; ``emit(alert)`` publishes an event (a Prefect event in production)."""
    config = config or ReceiverConfig.from_env()
    app = FastAPI(title="spikeops alert receiver", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/alerts/{source}")
    async def receive(source: str, request: Request) -> JSONResponse:
        body = await request.body()
        if not _authorised(config, request.headers, body):
            return JSONResponse({"error": "unauthorised"}, status_code=401)
        try:
            alerts = parse_alerts(source, body, config.default_cluster)
        except AlertError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400 if source in SOURCES else 404)
        answers = []
        for alert in alerts:
            if emit is not None:
                try:
                    emit(alert)
                except Exception:  # an event is a courtesy; the incident must still start
                    pass
            if alert.status != "firing":
                answers.append({"job": alert.job, "status": alert.status, "flow_run": None, "ignored": "resolved"})
                continue
            key = idempotency_key(alert)
            try:
                # the starter blocks (HTTP to the Prefect API): off the event loop
                run = await run_in_threadpool(starter, alert, key)
            except InputError as exc:  # the labels name no configured cluster, and the like
                return JSONResponse({"error": f"cannot map the alert: {exc}"}, status_code=400)
            except Exception as exc:
                # Alertmanager and Grafana retry a 5xx; Retry-After says when
                return JSONResponse({"error": f"could not start the incident flow: {type(exc).__name__}"},
                                    status_code=503, headers={"Retry-After": "5"})
            answers.append({"job": alert.job, "status": "firing", "flow_run": run, "idempotency_key": key})
        return JSONResponse({"accepted": answers}, status_code=202)

    return app
