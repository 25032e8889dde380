"""From the watcher to the incident flow, for real: the alert receiver served by uvicorn on
loopback with the Prefect starter, and the ``watch-job`` flow calling ``run_deployment``,
both against the applied ``incident-response`` deployment on a temporary Prefect server
(nobody serves it, so its runs stay scheduled: what is checked is that exactly one run
exists per incident, with the right parameters)."""

from __future__ import annotations

import argparse
import io
import json
import math
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spikeops.config import load_config
from spikeops.errors import InputError
from spikeops.watch import Detector, post_to_receiver, receiver_target
from spikeops.watch.cli import add_parser, run
from tests.watch_curves import healthy, jsonl

CONFIG = """
[incidents]
dir = "{root}/incidents"
[clusters.sim]
inventory = "{root}/sim.toml"
run_dir = "{root}/runs/{{job}}"
[watch]
cooldown_steps = 100
"""


def _nan_metrics(path: Path, at: int = 250) -> None:
    rows = healthy(61, n=400).records()
    for row in rows[at:at + 30]:
        row["loss"] = math.nan
    path.write_text(jsonl(rows))


def _runs(deployment_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as prefect:
        return prefect.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


@pytest.fixture(scope="module")
def deployment_id(prefect_server: None) -> Any:
    from spikeops.deployments.serve import incident_deployment

    return incident_deployment().apply()


@pytest.fixture
def receiver(tmp_path: Path, deployment_id: Any) -> Iterator[str]:
    import uvicorn

    from spikeops.deployments.receiver import ReceiverConfig, create_app
    from spikeops.tasks.start import prefect_starter

    (tmp_path / "spikeops.toml").write_text(CONFIG.format(root=tmp_path))
    app = create_app(prefect_starter(load_config(tmp_path / "spikeops.toml"), announce=False),
                     ReceiverConfig(token="t0ken"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/alerts/generic"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_receiver_target_storm_makes_one_run(tmp_path: Path, receiver: str, deployment_id: Any) -> None:
    path = tmp_path / "metrics.jsonl"
    _nan_metrics(path, at=250)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    before = {str(run.id) for run in _runs(deployment_id)}
    fire = receiver_target(receiver, "4412", "sim", token="t0ken")
    notes = set()
    for _ in range(8):  # the same incident seen by eight watchers (or one restarted eight times)
        detector = Detector()
        anomaly = next(a for a in map(detector.feed, rows) if a is not None)
        notes.add(fire(anomaly))
    assert len(notes) == 1 and next(iter(notes)).startswith("flow run ")
    new = [run for run in _runs(deployment_id) if str(run.id) not in before]
    assert [f"flow run {run.id}" for run in new] == list(notes)
    params = new[0].parameters
    assert params["job_id"] == "4412" and params["cluster"] == "sim"  # the rest comes from spikeops.toml
    labels = params["overrides"]["alert"]["payload"]["labels"]
    assert labels["kind"] == "nan" and labels["step"] == "250" and labels["source"] == "spikeops-watch"
    with pytest.raises(InputError, match="HTTP 401"):
        post_to_receiver(receiver, {"job": "4412"}, token="wrong")
    with pytest.raises(InputError, match="not configured"):
        fire_elsewhere = receiver_target(receiver, "4412", "prod", token="t0ken")
        fire_elsewhere(anomaly)


def test_watch_flow_starts_the_incident_deployment_once(tmp_path: Path, deployment_id: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from spikeops.flows.watch import watch_job

    # --fire deployment opens the incident's Slack thread as the receiver does: into the
    # bundle's outbox here, never to a real workspace.
    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)
    monkeypatch.delenv("SPIKEOPS_SLACK_API_URL", raising=False)

    config = tmp_path / "spikeops.toml"
    config.write_text(CONFIG.format(root=tmp_path))
    path = tmp_path / "metrics.jsonl"
    _nan_metrics(path, at=300)
    before = {str(run.id) for run in _runs(deployment_id)}
    started = watch_job(job="4412", cluster="sim", metrics=str(path), config=str(config), once=True,
                        announce=False)
    assert [(s["anomaly"]["kind"], s["anomaly"]["step"]) for s in started] == [("nan", 300)]
    new = [run for run in _runs(deployment_id) if str(run.id) not in before]
    assert [str(run.id) for run in new] == [started[0]["flow_run"]]
    params = new[0].parameters
    assert params["job_id"] == "4412" and params["overrides"]["incident_id"].startswith("inc-")
    assert params["overrides"]["alert"]["payload"]["labels"]["step"] == "300"
    # Watching the same file again (a restarted watcher), by the flow or by the CLI, finds
    # the same run through the idempotency key.
    again = watch_job(job="4412", cluster="sim", metrics=str(path), config=str(config), once=True,
                      announce=False)
    assert again[0]["flow_run"] == started[0]["flow_run"]
    parser = argparse.ArgumentParser(prog="spikeops")
    add_parser(parser.add_subparsers(dest="command"))
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args(["watch", "--metrics", str(path), "--once", "--fire", "deployment", "--job", "4412",
                              "--cluster", "sim", "--config", str(config)])
    status = run(args, out, err)
    assert status == 0 and out.getvalue().strip().endswith(f"-> flow run {started[0]['flow_run']}")
    assert [str(run.id) for run in _runs(deployment_id) if str(run.id) not in before] == [started[0]["flow_run"]]
    with pytest.raises(InputError, match="not configured"):
        watch_job(job="4412", cluster="prod", metrics=str(path), config=str(config), once=True)
