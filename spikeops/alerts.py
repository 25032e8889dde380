"""Monitoring alerts as spikeops reads them: Alertmanager v4, Grafana and generic payloads.

Shared by whatever turns an alert into an incident (the HTTP receiver in ``deployments/``,
the watcher's flow when it fires through the same path): a payload is validated, labels are
mapped strictly (only a job id and a cluster name, each checked against a pattern, so a
label carrying shell syntax is refused and never passed on), and each alert occurrence gets
one idempotency key, so a storm of repeats is one incident.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spikeops.config import CLUSTER_NAME, JOB_ID

__all__ = ["Alert", "AlertError", "parse_alerts", "idempotency_key", "JOB_LABELS", "CLUSTER_LABELS",
           "MAX_BODY", "SOURCES"]

JOB_LABELS = ("job_id", "slurm_job_id", "job", "jobid")
CLUSTER_LABELS = ("cluster", "cluster_name")
MAX_BODY = 1 << 20
SOURCES = ("alertmanager", "grafana", "generic")


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
    if not JOB_ID.match(job):
        raise AlertError("job label is not a job id (letters, digits and _.:+- only)")
    cluster = _label(labels, CLUSTER_LABELS) or default_cluster
    if cluster is not None and not CLUSTER_NAME.match(cluster):
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
    """One incident per alert occurrence: its fingerprint and start, whatever the repeats. A
    job id is unique only within its cluster, and a fingerprint need not name the cluster (the
    watcher's does not), so the cluster is part of the key: job 4412 on two clusters is two
    incidents, never one answered with the other's run."""
    occurrence = f"{alert.fingerprint}|{alert.starts_at}|{alert.job}"
    if alert.cluster:  # without one, the key is what it always was
        occurrence += f"|{alert.cluster}"
    return "alert-" + hashlib.sha256(occurrence.encode()).hexdigest()[:32]
