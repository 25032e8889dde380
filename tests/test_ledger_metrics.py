"""The ledger's Prometheus metrics on the receiver's ``/metrics``: the exposition matches the
report, a ledger that does not answer is ``spikeops_ledger_up 0`` (never a 500, never a zero
count), and the real Prometheus (Debian's, as the monitoring tests run it) scrapes a served
receiver and evaluates the shipped recording rules to the report's numbers."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from spikeops.ledger.metrics import LedgerCollector, exposition
from spikeops.ledger.store import Ledger
from spikeops.ledger.summary import summarize, views
from spikeops.sim import monitoring
from tests.conftest import ROOT

RULES = ROOT / "infra" / "monitoring" / "spikeops-ledger-rules.yml"


def _incident(incident: str, cluster: str, lineage: str, job: str, opened: str, *, cause: str = "gpu_xid",
              resumed: bool = True, held: bool = False, recurrence_of: str | None = None) -> dict[str, Any]:
    row = {"incident_id": incident, "cluster": cluster, "job_id": job, "lineage": lineage, "opened": opened,
           "symptom": "instant_nan", "cause": cause, "spike_step": 1345, "gpus": 64, "step_seconds": 2.0,
           "t_spike": opened, "t_alert": opened, "t_stopped": opened, "recurrence_of": recurrence_of,
           "held_for_person": held}
    if not resumed and not held:
        row["t_stopped"] = None  # a single spike, watched: the job kept running
    if resumed:
        minutes = int(opened[14:16]) + 10
        row.update(resumed_as=f"{job}0", resumed_from={"step": 1000, "path": "/c/1000"}, auto_resumed=True,
                   t_resumed_running=opened[:14] + f"{minutes:02d}" + opened[16:])
    return {"incident": row, "jobs": [{"cluster": cluster, "job_id": job, "lineage": lineage}]}


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    """A ledger of five incidents on two clusters, opened in the last hour (the repeat window)."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    now = time.gmtime(time.time() - 3600)
    day = time.strftime("%Y-%m-%dT%H:", now)
    with Ledger(url) as ledger:
        for entry in (_incident("a1", "east", "100", "100", day + "00:00Z"),
                      _incident("a2", "east", "100", "1000", day + "20:00Z", cause="poisoned_checkpoint",
                                recurrence_of="a1"),
                      _incident("a3", "east", "100", "10000", day + "40:00Z", cause="poisoned_checkpoint",
                                resumed=False, held=True, recurrence_of="a2"),
                      _incident("b1", "west", "7", "7", day + "05:00Z", cause="overlong_sample"),
                      _incident("b2", "west", "8", "8", day + "06:00Z", resumed=False)):
            ledger.apply(entry)
    return url


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_exposition_says_what_the_report_says(ledger_url: str) -> None:
    from spikeops.deployments.receiver import ReceiverConfig, create_app

    collector = LedgerCollector(ledger_url, cache_s=0)
    client = TestClient(create_app(lambda alert, key: "run", ReceiverConfig(),
                                   metrics=lambda: exposition(collector)))
    answer = client.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    samples = _samples(answer.text)
    with Ledger(ledger_url) as ledger:
        report = summarize(views(ledger.incidents()))
    east = next(c for c in report["by_cluster"] if c["cluster"] == "east")
    assert samples[("spikeops_ledger_up", ())] == 1.0
    assert samples[("spikeops_incidents_total", (("cause", "poisoned_checkpoint"), ("cluster", "east")))] == 2
    assert samples[("spikeops_incident_recurrences_total", (("cause", "poisoned_checkpoint"), ("cluster", "east")))] == 2
    hours = sum(v for (name, labels), v in samples.items()
                if name == "spikeops_gpu_hours_lost_total" and ("cluster", "east") in labels)
    assert hours == pytest.approx(east["gpu_hours"], abs=0.01)
    assert samples[("spikeops_time_to_resume_seconds_count", (("cluster", "east"),))] == 2
    assert samples[("spikeops_time_to_resume_seconds_sum", (("cluster", "east"),))] / 2 == pytest.approx(east["mttr_s"])
    assert samples[("spikeops_jobs_waiting_for_person", (("cluster", "east"),))] == 1
    assert samples[("spikeops_jobs_waiting_for_person", (("cluster", "west"),))] == 0  # b2 kept running
    assert samples[("spikeops_repeat_lineage_incidents", (("cluster", "east"), ("lineage", "100")))] == 3
    assert not any(name == "spikeops_repeat_lineage_incidents" and ("cluster", "west") in labels
                   for name, labels in samples)


def test_a_ledger_that_does_not_answer_is_down_not_zero() -> None:
    text = exposition(LedgerCollector("postgresql://x:secret@127.0.0.1:9/none", cache_s=0))[0].decode()
    assert _samples(text) == {("spikeops_ledger_up", ()): 0.0} and "secret" not in text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def receiver(ledger_url: str) -> Iterator[str]:
    """The receiver app with the ledger's metrics, served by uvicorn on a free port."""
    import uvicorn

    from spikeops.deployments.receiver import ReceiverConfig, create_app

    collector = LedgerCollector(ledger_url, cache_s=1)
    app = create_app(lambda alert, key: "run", ReceiverConfig(), metrics=lambda: exposition(collector))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _query(chain: monitoring.Monitoring, promql: str) -> list[dict[str, Any]]:
    url = f"{chain.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())["data"]["result"]


def test_prometheus_scrapes_the_receiver_and_records_the_report(receiver: str, ledger_url: str,
                                                                 tmp_path: Path) -> None:
    if monitoring.missing() is not None:
        pytest.fail(f"{monitoring.missing()}: run `make apt` (infra/apt-ensure.sh prometheus prometheus-alertmanager)")
    checked = subprocess.run([shutil.which("promtool") or "promtool", "check", "rules", str(RULES)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS: 9 rules found" in checked.stdout, checked.stdout + checked.stderr
    with Ledger(ledger_url) as ledger:
        report = summarize(views(ledger.incidents()))
    wanted = {c["cluster"]: c for c in report["by_cluster"]}
    with monitoring.running(tmp_path / "chain", receiver="http://127.0.0.1:9/alerts/alertmanager",
                            targets=[receiver], rules=RULES) as chain:
        deadline = time.monotonic() + 60
        found: dict[str, float] = {}
        while time.monotonic() < deadline and len(found) < 2:
            found = {r["metric"]["cluster"]: float(r["value"][1])
                     for r in _query(chain, "cluster:spikeops_gpu_hours_lost:sum")}
            time.sleep(0.5)
        assert set(found) == {"east", "west"}, found
        with Ledger(ledger_url) as ledger:  # a3 left its job stopped: its cost grows by the second
            later = {c["cluster"]: c for c in summarize(views(ledger.incidents()))["by_cluster"]}
        for cluster, hours in found.items():
            assert wanted[cluster]["gpu_hours"] - 0.01 <= hours <= later[cluster]["gpu_hours"] + 0.01, (cluster, hours)
        assert found["west"] == pytest.approx(wanted["west"]["gpu_hours"], abs=0.01)  # nothing down there
        mttr = {r["metric"]["cluster"]: float(r["value"][1]) for r in _query(chain, "cluster:spikeops_mttr_seconds:all")}
        assert mttr == {"east": pytest.approx(wanted["east"]["mttr_s"]), "west": pytest.approx(wanted["west"]["mttr_s"])}
        counts = {(r["metric"]["cluster"], r["metric"]["cause"]): float(r["value"][1])
                  for r in _query(chain, "cluster_cause:spikeops_incidents:sum")}
        assert counts == {("east", "gpu_xid"): 1, ("east", "poisoned_checkpoint"): 2, ("west", "gpu_xid"): 1,
                          ("west", "overlong_sample"): 1}
        up = _query(chain, 'up{job="training"}')
        assert up and up[0]["value"][1] == "1"
