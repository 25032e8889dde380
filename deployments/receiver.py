"""The alert receiver: monitoring alerts in, one incident flow run per incident out.

Prefect's webhooks are Cloud-only, so spikeops ships its own small FastAPI app:
- ``POST /alerts/alertmanager``: Alertmanager webhook v4;
- ``POST /alerts/grafana``: Grafana alerting webhook (the same alert list, plus its fields);
- ``POST /alerts/generic``: ``{"job": "4412", "cluster": "...", "alertname": "...",
  "status": "firing", "fingerprint": "...", "startsAt": "..."}``.

Authentication is required to listen anywhere but loopback: ``Authorization: Bearer`` with
``SPIKEOPS_RECEIVER_TOKEN``, or an HMAC-SHA256 of the body in ``X-Spikeops-Signature`` with
``SPIKEOPS_RECEIVER_HMAC_KEY``. Alerts are validated, resolved ones ignored, labels mapped to
flow parameters (only the job id and cluster name, both checked against strict patterns: a
label carrying shell syntax is refused, never passed on), and each firing alert starts the
flow through a ``starter`` with an idempotency key derived from the alert's fingerprint and
start time, so a storm of repeats starts one run. The answer comes at once; the flow runs on
its own.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Module level, not inside create_app: FastAPI resolves the handlers' (string) annotations
# in this module's globals, and an unresolved ``Request`` silently becomes a query parameter.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from spikeops.errors import InputError

__all__ = ["ReceiverConfig", "Alert", "parse_alerts", "idempotency_key", "create_app", "check_bind"]

_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,127}$")
_CLUSTER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
JOB_LABELS = ("job_id", "slurm_job_id", "job", "jobid")
CLUSTER_LABELS = ("cluster", "cluster_name")
MAX_BODY = 1 << 20


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


@dataclass(frozen=True)
class Alert:
    source: str
    status: str
    name: str
    job: str
    cluster: str | None
    fingerprint: str
    starts_at: str
    labels: dict[str, str]


class AlertError(ValueError):
    """A payload that cannot be turned into alerts; the message is the 400's reason."""


def check_bind(host: str, config: ReceiverConfig) -> None:
    """Refuse to listen beyond loopback without authentication."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not config.authenticated:
        raise ValueError(f"refusing to listen on {host} without SPIKEOPS_RECEIVER_TOKEN or SPIKEOPS_RECEIVER_HMAC_KEY")


def _label(labels: Mapping[str, Any], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = labels.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def _alert(source: str, raw: Any, common: Mapping[str, Any], default_cluster: str | None) -> Alert:
    if not isinstance(raw, dict):
        raise AlertError("an alert is not an object")
    labels = {**{k: v for k, v in (common or {}).items() if isinstance(v, str)},
              **{k: v for k, v in (raw.get("labels") or {}).items() if isinstance(v, str)}}
    job = _label(labels, JOB_LABELS)
    if job is None:
        raise AlertError(f"no job label ({', '.join(JOB_LABELS)})")
    if not _JOB.match(job):
        raise AlertError("job label is not a job id (letters, digits and _.:+- only)")
    cluster = _label(labels, CLUSTER_LABELS) or default_cluster
    if cluster is not None and not _CLUSTER.match(cluster):
        raise AlertError("cluster label is not a cluster name (letters, digits and _.- only)")
    status = str(raw.get("status") or "firing").lower()
    starts = str(raw.get("startsAt") or "")
    fingerprint = str(raw.get("fingerprint") or "") or hashlib.sha256(
        json.dumps(sorted(labels.items())).encode()).hexdigest()[:16]
    return Alert(source, status, labels.get("alertname", "alert"), job, cluster, fingerprint, starts, labels)


def parse_alerts(source: str, body: bytes, default_cluster: str | None = None) -> list[Alert]:
    """Alerts from a webhook body; AlertError with the reason when it is not one."""
    if len(body) > MAX_BODY:
        raise AlertError(f"body over {MAX_BODY} bytes")
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AlertError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(document, dict):
        raise AlertError("not a JSON object")
    if source in ("alertmanager", "grafana"):
        alerts = document.get("alerts")
        if not isinstance(alerts, list) or not alerts:
            raise AlertError("no 'alerts' list")
        common = document.get("commonLabels") or {}
        return [_alert(source, raw, common, default_cluster) for raw in alerts]
    if source == "generic":
        labels = {k: v for k, v in document.items() if isinstance(v, str)}
        return [_alert(source, {"labels": labels, "status": document.get("status", "firing"),
                                "startsAt": document.get("startsAt", ""),
                                "fingerprint": document.get("fingerprint", "")}, {}, default_cluster)]
    raise AlertError(f"unknown source {source!r}")


def idempotency_key(alert: Alert) -> str:
    """One incident per alert occurrence: its fingerprint and start, whatever the repeats."""
    return "alert-" + hashlib.sha256(f"{alert.fingerprint}|{alert.starts_at}|{alert.job}".encode()).hexdigest()[:32]


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
            return JSONResponse({"error": str(exc)}, status_code=400 if source in
                                ("alertmanager", "grafana", "generic") else 404)
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
