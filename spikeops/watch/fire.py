"""What ``spikeops watch`` does when an incident starts, and the loop that ties it together.

A firing target is a callable ``fire(anomaly) -> note``; the note (a flow run id, say) is
shown next to the anomaly's line. Three targets exist:

- ``print_target(stream)``: one line per incident, nothing else (a dry run; the default);
- ``receiver_target(url, job, cluster)``: POST the alert to spikeops' alert receiver
  (``/alerts/generic``), which maps it to the incident flow's parameters and starts one run;
- the ``deployment`` target in ``flows/watch.py``: ``run_deployment`` directly, through the
  receiver's own mapping (it lives outside the core because it needs Prefect).

The alert is the generic receiver JSON (``deployments/receiver.py``). Its ``fingerprint`` is
derived from the job, the kind and the step, and ``startsAt`` is the step's own time, so the
same incident seen twice (a watcher restarted with ``--from-start``, a repeat after a lost
answer) has the same idempotency key and starts one flow run.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

from spikeops.errors import InputError, SpikeopsError
from spikeops.watch.detect import Anomaly, Detector

__all__ = ["Fire", "ALERT_NAMES", "alert_payload", "fingerprint", "describe", "post_to_receiver",
           "print_target", "receiver_target", "watch"]

Fire = Callable[[Anomaly], "str | None"]

#: Alert names, the same as the example Prometheus rules (infra/monitoring/prometheus-rules.yml).
ALERT_NAMES = {
    "nan": "TrainingLossNaN",
    "loss_spike": "TrainingLossSpike",
    "grad_spike": "TrainingGradNormSpike",
    "loss_scale_collapse": "TrainingLossScaleCollapse",
    "throughput_drop": "TrainingThroughputDrop",
    "stalled": "TrainingStalled",
}


def fingerprint(anomaly: Anomaly, job: str) -> str:
    """Stable for one incident of one job: the receiver's idempotency key rests on it."""
    return hashlib.sha256(f"{job}|{anomaly.kind}|{anomaly.step}".encode()).hexdigest()[:16]


def _number_text(value: float | None) -> str | None:
    return None if value is None else f"{value:.6g}"


def alert_payload(anomaly: Anomaly, job: str, cluster: str | None) -> dict[str, str]:
    """The ``POST /alerts/generic`` body for an incident (every field a string: the receiver
    keeps string fields as the alert's labels, which land in the incident's bundle)."""
    payload = {
        "job": job, "alertname": ALERT_NAMES.get(anomaly.kind, "TrainingAnomaly"), "status": "firing",
        "fingerprint": fingerprint(anomaly, job), "startsAt": anomaly.time or "",
        "source": "spikeops-watch", "kind": anomaly.kind, "step": str(anomaly.step), "summary": anomaly.detail,
    }
    for name, value in (("value", anomaly.value), ("score", anomaly.score)):
        text = _number_text(value)
        if text is not None:
            payload[name] = text
    for name, value in (anomaly.rule or {}).items():
        if name not in payload:
            payload[str(name)] = str(value)
    if cluster:
        payload["cluster"] = cluster
    return payload


def describe(anomaly: Anomaly) -> str:
    """One line for a terminal or a log."""
    when = f" at {anomaly.time}" if anomaly.time else ""
    return f"step {anomaly.step}{when}: {anomaly.kind}: {anomaly.detail}"


def _retry_after(exc: urllib.error.HTTPError) -> float:
    try:
        return min(30.0, max(0.0, float(exc.headers.get("Retry-After", "2"))))
    except (TypeError, ValueError):
        return 2.0


def post_to_receiver(url: str, payload: Mapping[str, Any], token: str | None = None, *, timeout: float = 10.0,
                     attempts: int = 3, sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """POST ``payload`` as JSON; the receiver's answer. A refusal (4xx: bad token, a job or
    cluster it does not know) is an InputError at once; a 5xx or no connection is retried
    (``Retry-After`` honoured, at most 30 s) and after ``attempts`` is a SpikeopsError.
    ``token`` goes in ``Authorization: Bearer``; it is never printed."""
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    problem = ""
    for attempt in range(max(1, attempts)):
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the operator's URL
                answer = json.loads(response.read(1 << 20) or b"{}")
                return answer if isinstance(answer, dict) else {"answer": answer}
        except urllib.error.HTTPError as exc:
            try:
                reason = json.loads(exc.read(1 << 16)).get("error") or exc.reason
            except (ValueError, AttributeError):
                reason = exc.reason
            if exc.code < 500:
                raise InputError(f"the receiver at {url} refused the alert: HTTP {exc.code}: {str(reason)[:200]}") \
                    from None
            problem, wait = f"HTTP {exc.code}: {str(reason)[:200]}", _retry_after(exc)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            problem, wait = str(getattr(exc, "reason", exc))[:200], 2.0
        if attempt + 1 < attempts:
            sleep(wait)
    raise SpikeopsError(f"the receiver at {url} did not take the alert after {attempts} attempts ({problem})")


def print_target(stream: TextIO) -> Fire:
    """Write one line per incident to ``stream``; start nothing."""

    def fire(anomaly: Anomaly) -> str | None:
        stream.write(describe(anomaly) + "\n")
        stream.flush()
        return None

    return fire


def receiver_target(url: str, job: str, cluster: str | None, token: str | None = None, *,
                    timeout: float = 10.0) -> Fire:
    """Post each incident to the alert receiver; the note is the flow run it started."""

    def fire(anomaly: Anomaly) -> str | None:
        answer = post_to_receiver(url, alert_payload(anomaly, job, cluster), token, timeout=timeout)
        accepted = answer.get("accepted") or [{}]
        run = accepted[0].get("flow_run") if isinstance(accepted[0], dict) else None
        return f"flow run {run}" if run else "posted"

    return fire


def watch(records: Iterable[Mapping[str, Any] | None], detector: Detector, fire: Fire, *,
          max_incidents: int | None = None) -> list[Anomaly]:
    """Feed ``records`` to ``detector`` and ``fire`` each incident it starts; stop after
    ``max_incidents`` (the source is closed then) or when the records end. A ``None`` from
    the source is a poll that found nothing new: the detector is asked whether the job has
    stalled."""
    fired: list[Anomaly] = []
    try:
        for record in records:
            anomaly = detector.tick() if record is None else detector.feed(record)
            if anomaly is None and record is not None and detector.idle:
                anomaly = detector.tick()
            if anomaly is None:
                continue
            fire(anomaly)
            fired.append(anomaly)
            if max_incidents is not None and len(fired) >= max_incidents:
                break
    finally:
        close = getattr(records, "close", None)
        if callable(close):
            close()
    return fired
