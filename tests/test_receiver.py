"""The alert receiver: payloads, auth, idempotency, and labels that must not reach anything."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from fastapi.testclient import TestClient

from spikeops.deployments.receiver import ReceiverConfig, check_bind, create_app
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
    # one run, and one event: the copies are answered from the receiver's memory (issue 19)
    assert len(runs) == 1 and len(events) == 1
    accepted = answer.json()["accepted"][0]
    assert accepted["job"] == "4412" and accepted["flow_run"] == "run-1" and accepted["start"] == "remembered"
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


# ---------------------------------------------------------------------------- a storm, for real


class _Gate:
    """A starter that blocks until released, counting its calls: a slow Prefect API."""

    def __init__(self, fail_first: int = 0) -> None:
        import threading

        self.calls = 0
        self.fail_first = fail_first
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, alert, key):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(30)
        if self.calls <= self.fail_first:
            raise ConnectionError("prefect api down")
        return f"run-{key[-6:]}"


def _post_all(app, bodies: list[dict], gate: _Gate) -> list:
    """POST the first body, wait until its start is held in ``gate``, POST the rest
    concurrently (one event loop, as uvicorn serves them), and only once all of them have been
    answered release the start and collect the first answer. The copies are thus answered
    while the start is still in flight, never after it."""
    import asyncio

    import httpx

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as client:
            headers = {"Authorization": "Bearer s3cret"}
            first = asyncio.create_task(client.post("/alerts/alertmanager", json=bodies[0], headers=headers))
            assert await asyncio.to_thread(gate.entered.wait, 10)
            rest = await asyncio.gather(*(client.post("/alerts/alertmanager", json=b, headers=headers)
                                          for b in bodies[1:]))
            assert not first.done()
            gate.release.set()
            return [await first, *rest]

    return asyncio.run(main())


def test_concurrent_duplicates_cost_one_start_and_are_answered_at_once() -> None:
    gate = _Gate()
    events = []
    app = create_app(gate, ReceiverConfig(token="s3cret"), emit=events.append)
    copies = 300

    answers = _post_all(app, [ALERTMANAGER] * copies, gate)
    assert [a.status_code for a in answers] == [202] * copies
    first = answers[0].json()["accepted"][0]
    assert first["start"] == "started" and first["flow_run"].startswith("run-")
    others = [a.json()["accepted"][0] for a in answers[1:]]
    assert {o["start"] for o in others} == {"in-flight"} and {o["flow_run"] for o in others} == {None}
    assert gate.calls == 1 and len(events) == 1
    stats = app.state.flight.stats
    assert (stats.started, stats.in_flight, stats.remembered) == (1, copies - 1, 0)
    later = TestClient(app).post("/alerts/alertmanager", json=ALERTMANAGER, headers={"Authorization": "Bearer s3cret"})
    assert later.json()["accepted"][0] == {**first, "start": "remembered"}
    assert gate.calls == 1


def test_a_failed_start_is_not_remembered() -> None:
    gate = _Gate(fail_first=1)
    app = create_app(gate, ReceiverConfig(token="s3cret"))

    answers = _post_all(app, [ALERTMANAGER] * 20, gate)
    assert answers[0].status_code == 503 and answers[0].headers["retry-after"] == "5"
    assert {a.json()["accepted"][0]["start"] for a in answers[1:]} == {"in-flight"}
    assert app.state.flight.remembered() == 0 and app.state.flight.stats.failed == 1
    client = TestClient(app)
    retry = client.post("/alerts/alertmanager", json=ALERTMANAGER, headers={"Authorization": "Bearer s3cret"})
    assert retry.status_code == 202 and retry.json()["accepted"][0]["start"] == "started"
    assert gate.calls == 2  # the next copy asked again, and this time it worked
    again = client.post("/alerts/alertmanager", json=ALERTMANAGER, headers={"Authorization": "Bearer s3cret"})
    assert again.json()["accepted"][0]["start"] == "remembered" and gate.calls == 2


def test_the_memory_is_bounded_and_forgets_in_time() -> None:
    from spikeops.deployments.receiver import SingleFlight

    now = [0.0]
    calls = []

    def starter(alert, key):
        calls.append(key)
        return f"run-{len(calls)}"

    flight = SingleFlight(starter, remember_s=60, remember_max=3, clock=lambda: now[0])
    alert = parse_alerts("alertmanager", json.dumps(ALERTMANAGER).encode())[0]

    def start(key):
        how, value = flight.begin(alert, key)
        return value.result(5) if how == "started" else (how, value)

    for key in "abcde":
        start(key)
    assert flight.remembered() == 3 and calls == list("abcde")
    assert start("e") == ("remembered", "run-5")
    start("a")  # dropped as the oldest: asked again (Prefect's own key would find its run)
    assert calls[-1] == "a" and flight.remembered() == 3
    now[0] = 61.0  # past remember_s: asked again
    start("e")
    assert calls[-1] == "e" and len(calls) == 7
    with pytest.raises(ValueError):
        SingleFlight(starter, remember_max=-1)
    flight.close()


def test_a_flood_of_distinct_keys_is_bounded_too() -> None:
    """Distinct keys being started at once are capped: a flood of new alerts gets 503s
    (Alertmanager retries) instead of an unbounded queue in memory."""
    from spikeops.deployments.receiver import SingleFlight

    gate = _Gate()
    flight = SingleFlight(gate, max_flying=2)
    alert = parse_alerts("alertmanager", json.dumps(ALERTMANAGER).encode())[0]
    held = [flight.begin(alert, key) for key in ("a", "b")]
    assert [how for how, _ in held] == ["started", "started"]
    assert [flight.begin(alert, key)[0] for key in ("c", "d", "a")] == ["busy", "busy", "in-flight"]
    gate.release.set()
    assert sorted(future.result(10) for _, future in held) == ["run-a", "run-b"]
    assert flight.begin(alert, "c")[0] == "started" and flight.stats.busy == 2
    flight.close()


def test_resolved_alerts_start_nothing_and_distinct_jobs_start_their_own() -> None:
    client, runs, events = _client()
    headers = {"Authorization": "Bearer s3cret"}
    other = {**ALERTMANAGER["alerts"][0], "labels": {**ALERTMANAGER["alerts"][0]["labels"], "job_id": "4413"},
             "fingerprint": "77aa"}
    both = {**ALERTMANAGER, "alerts": [ALERTMANAGER["alerts"][0], other]}
    answer = client.post("/alerts/alertmanager", json=both, headers=headers).json()["accepted"]
    assert [a["job"] for a in answer] == ["4412", "4413"] and len(runs) == 2
    assert answer[0]["flow_run"] != answer[1]["flow_run"]
    resolved = {**ALERTMANAGER, "status": "resolved",
                "alerts": [{**a, "status": "resolved", "endsAt": "2026-11-29T19:00:00Z"} for a in both["alerts"]]}
    for _ in range(3):
        answer = client.post("/alerts/alertmanager", json=resolved, headers=headers).json()["accepted"]
        assert [a["ignored"] for a in answer] == ["resolved", "resolved"]
    assert len(runs) == 2
    assert [e.status for e in events] == ["firing", "firing"] + ["resolved"] * 6


def test_the_same_job_on_two_clusters_is_two_incidents() -> None:
    """A job id is unique only within its cluster: the same alert from another cluster is not a
    copy, and is not answered with the first cluster's run (nor by the fast path)."""
    client, runs, _ = _client()
    headers = {"Authorization": "Bearer s3cret"}
    sim = client.post("/alerts/alertmanager", json=ALERTMANAGER, headers=headers).json()["accepted"][0]
    prod = client.post("/alerts/alertmanager", json={**ALERTMANAGER, "commonLabels": {"cluster": "prod"}},
                       headers=headers).json()["accepted"][0]
    assert sim["start"] == prod["start"] == "started" and sim["flow_run"] != prod["flow_run"] and len(runs) == 2
    again = client.post("/alerts/alertmanager", json={**ALERTMANAGER, "commonLabels": {"cluster": "prod"}},
                        headers=headers).json()["accepted"][0]
    assert again == {**prod, "start": "remembered"}


def test_copies_take_the_fast_path_and_it_still_checks_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of a body already parsed is answered without parsing it again, but never
    without checking its credentials; anything else takes the full path."""
    import spikeops.deployments.receiver as receiver

    client, runs, _ = _client()
    good = {"Authorization": "Bearer s3cret"}
    first = client.post("/alerts/alertmanager", json=ALERTMANAGER, headers=good)
    assert first.json()["accepted"][0]["start"] == "started"

    def no_parsing(*args, **kwargs):
        raise AssertionError("a copy was parsed again")

    monkeypatch.setattr(receiver, "parse_alerts", no_parsing)
    for _ in range(5):
        copy = client.post("/alerts/alertmanager", json=ALERTMANAGER, headers=good)
        assert copy.status_code == 202 and copy.json() == {"accepted": [{**first.json()["accepted"][0],
                                                                         "start": "remembered"}]}
    assert client.post("/alerts/alertmanager", json=ALERTMANAGER).status_code == 401
    assert client.post("/alerts/alertmanager", json=ALERTMANAGER,
                       headers={"Authorization": "Bearer wrong"}).status_code == 401
    monkeypatch.undo()
    other = {**ALERTMANAGER, "alerts": [{**ALERTMANAGER["alerts"][0], "fingerprint": "other"}]}
    assert client.post("/alerts/alertmanager", json=other, headers=good).json()["accepted"][0]["start"] == "started"
    assert len(runs) == 2


def test_a_large_body_is_a_copy_too_and_a_changed_one_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies over 16 KiB are known by their digest, not kept whole: still recognised, and a body
    that differs by one byte is not taken for its copy."""
    import spikeops.deployments.receiver as receiver

    client, runs, _ = _client()
    good = {"Authorization": "Bearer s3cret"}
    large = {**ALERTMANAGER, "alerts": [{**ALERTMANAGER["alerts"][0], "annotations": {"pad": "x" * 20_000}}]}
    body = json.dumps(large).encode()
    assert client.post("/alerts/alertmanager", content=body, headers=good).json()["accepted"][0]["start"] == "started"
    parsed = []
    monkeypatch.setattr(receiver, "parse_alerts", lambda *args: parsed.append(args) or parse_alerts(*args))
    copy = client.post("/alerts/alertmanager", content=body, headers=good).json()["accepted"][0]
    assert copy["start"] == "remembered" and parsed == []
    changed = body.replace(b'"pad": "x', b'"pad": "y', 1)
    assert client.post("/alerts/alertmanager", content=changed, headers=good).json()["accepted"][0]["start"] \
        == "remembered" and len(parsed) == 1  # the same alert (same key), but parsed: not a known body
    assert len(runs) == 1
