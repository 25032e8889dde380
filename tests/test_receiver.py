"""The alert receiver: payloads, auth, idempotency, and labels that must not reach anything."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from fastapi.testclient import TestClient

from deployments.receiver import ReceiverConfig, check_bind, create_app
from spikeops.alerts import parse_alerts

ALERTMANAGER = {
    "version": "4", "status": "firing", "receiver": "spikeops", "groupKey": "{}:{alertname=\"LossSpike\"}",
    "commonLabels": {"cluster": "sim"},
    "alerts": [{"status": "firing", "labels": {"alertname": "TrainingLossNaN", "job_id": "4412", "severity": "page"},
                "annotations": {"summary": "loss is NaN"}, "startsAt": "2026-11-29T18:03:12Z",
                "fingerprint": "9f2c11aa"}],
}


def _client(config: ReceiverConfig | None = None):
    runs: dict[str, str] = {}
    events = []

    def starter(alert, key):  # what Prefect's idempotency key does: one run per key
        return runs.setdefault(key, f"run-{len(runs) + 1}")

    app = create_app(starter, config or ReceiverConfig(token="s3cret"), emit=events.append)
    return TestClient(app), runs, events


def test_an_alert_storm_starts_one_run() -> None:
    client, runs, events = _client()
    for _ in range(100):
        answer = client.post("/alerts/alertmanager", json=ALERTMANAGER, headers={"Authorization": "Bearer s3cret"})
        assert answer.status_code == 202
    assert len(runs) == 1 and len(events) == 100
    accepted = answer.json()["accepted"][0]
    assert accepted["job"] == "4412" and accepted["flow_run"] == "run-1"
    later = {**ALERTMANAGER, "alerts": [{**ALERTMANAGER["alerts"][0], "startsAt": "2026-11-30T01:00:00Z"}]}
    client.post("/alerts/alertmanager", json=later, headers={"Authorization": "Bearer s3cret"})
    assert len(runs) == 2  # a new occurrence is a new incident


def test_auth_bad_input_resolved_and_hostile_labels() -> None:
    client, runs, _ = _client()
    assert client.post("/alerts/alertmanager", json=ALERTMANAGER).status_code == 401
    assert client.post("/alerts/alertmanager", json=ALERTMANAGER,
                       headers={"Authorization": "Bearer wrong"}).status_code == 401
    bad = client.post("/alerts/alertmanager", content=b"{not json", headers={"Authorization": "Bearer s3cret"})
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]
    resolved = {**ALERTMANAGER, "alerts": [{**ALERTMANAGER["alerts"][0], "status": "resolved"}]}
    answer = client.post("/alerts/alertmanager", json=resolved, headers={"Authorization": "Bearer s3cret"})
    assert answer.status_code == 202 and answer.json()["accepted"][0]["ignored"] == "resolved"
    for hostile in ("4412; rm -rf /", "$(reboot)", "`id`", "4412\nx"):
        payload = {**ALERTMANAGER, "alerts": [{**ALERTMANAGER["alerts"][0],
                                               "labels": {"alertname": "x", "job_id": hostile}}]}
        answer = client.post("/alerts/alertmanager", json=payload, headers={"Authorization": "Bearer s3cret"})
        assert answer.status_code == 400 and "job label" in answer.json()["error"]
    assert runs == {}


def test_hmac_grafana_and_generic() -> None:
    client, runs, _ = _client(ReceiverConfig(hmac_key="k3y"))
    body = json.dumps({"job": "77", "cluster": "prod", "alertname": "LossSpike", "fingerprint": "ab"}).encode()
    signature = hmac.new(b"k3y", body, hashlib.sha256).hexdigest()
    assert client.post("/alerts/generic", content=body, headers={"X-Spikeops-Signature": "sha256=" + signature}
                       ).status_code == 202
    assert client.post("/alerts/generic", content=body, headers={"X-Spikeops-Signature": "sha256=00"}
                       ).status_code == 401
    grafana = {"receiver": "spikeops", "status": "firing", "alerts": [
        {"status": "firing", "labels": {"alertname": "Loss", "job": "78", "cluster": "prod"},
         "startsAt": "2026-11-29T18:00:00Z", "fingerprint": "cd"}]}
    body = json.dumps(grafana).encode()
    signature = hmac.new(b"k3y", body, hashlib.sha256).hexdigest()
    assert client.post("/alerts/grafana", content=body, headers={"X-Spikeops-Signature": signature}).status_code == 202
    assert len(runs) == 2
    assert [a.cluster for a in parse_alerts("alertmanager", json.dumps(ALERTMANAGER).encode())] == ["sim"]


def test_no_auth_means_loopback_only() -> None:
    check_bind("127.0.0.1", ReceiverConfig())
    with pytest.raises(ValueError, match="refusing to listen"):
        check_bind("0.0.0.0", ReceiverConfig())
    check_bind("0.0.0.0", ReceiverConfig(token="t"))


def test_prefect_unavailable_is_a_retryable_503() -> None:
    def starter(alert, key):
        raise ConnectionError("api down")

    client = TestClient(create_app(starter, ReceiverConfig(token="s3cret")))
    answer = client.post("/alerts/alertmanager", json=ALERTMANAGER, headers={"Authorization": "Bearer s3cret"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert "ConnectionError" in answer.json()["error"] and "api down" not in answer.text
