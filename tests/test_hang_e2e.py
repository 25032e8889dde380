"""A hung job, end to end: ``spikeops watch`` sees the step counter stop, the alert receiver
starts the incident flow, the flow keeps the job alive while it collects its flight recorder
dumps over SSH, then stops it, names the rank that never joined the collective and its node,
convicts no node, and resumes the job from the newest verified checkpoint.

Everything is real: a 3-node ``examples/train_tiny.py`` gloo job under the local scheduler
(one rank's data loader hangs), sshd nodes, the watcher CLI, the receiver on uvicorn, the flow
on a temporary Prefect server. Only the stall rule is shortened ([watch] stall_factor 3,
stall_min_s 8: the tiny job's steps take a fraction of a second), as the rule itself allows.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from spikeops.schedulers import LocalScheduler
from spikeops.sim import cluster as simcluster
from tests.conftest import ROOT

FIRST = "127.0.28.11"
TRAIN = ROOT / "examples" / "train_tiny.py"
CONFIG = """
[incidents]
dir = "{root}/incidents"
[clusters.sim]
inventory = "{inventory}"
run_dir = "{root}/run"
checkpoint_root = "{root}/run/ckpt"
scheduler = "local"
scheduler_state_dir = "{root}/sched"
approval = "auto-hardware"
replay = "never"
[watch]
stall_factor = 3
stall_min_s = 8
"""


def _receiver(starter: Any) -> tuple[Any, threading.Thread, socket.socket, str]:
    import uvicorn

    from spikeops.deployments.receiver import ReceiverConfig, create_app

    app = create_app(starter, ReceiverConfig(token="t0ken"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return server, thread, sock, f"http://127.0.0.1:{sock.getsockname()[1]}/alerts/generic"


def test_spikeops_watch_to_a_resumed_job(tmp_path: Path, prefect_server: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from spikeops import cli
    from spikeops.flows.incident_response import IncidentOverrides, incident_response

    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)
    monkeypatch.delenv("SPIKEOPS_SLACK_API_URL", raising=False)
    port = simcluster.free_port((FIRST,))
    with simcluster.scratch() as root, simcluster.running(root / "c", nodes=3, port=port, first_address=FIRST,
                                                           scenario="false_alarm", seed=4) as cluster:
        prefix = root / "fr" / "nccl_trace_rank_"
        prefix.parent.mkdir(mode=0o755)
        with cluster.inventory.open("a") as inventory:  # the login user cannot read root's environments
            inventory.write(f'flight_recorder = "{prefix}"\n'
                            "pids = \"pgrep -f -- 'train_tiny.py.*--distributed'\"\n")
        config = tmp_path / "spikeops.toml"
        config.write_text(CONFIG.format(root=tmp_path, inventory=cluster.inventory))
        monkeypatch.setenv("SPIKEOPS_CONFIG", str(config))
        monkeypatch.setenv("SPIKEOPS_RECEIVER_TOKEN", "t0ken")
        scheduler = LocalScheduler(tmp_path / "sched")
        scheduler.add_nodes(cluster.nodes + ["spare-001"])
        run = tmp_path / "run"
        argv = [sys.executable, str(TRAIN), "--out", str(run), "--launch", "--spawn", "--steps", "60",
                "--ckpt-every", "5", "--fr-dump-after", "2", "--collective-timeout", "900",
                "--inject-hang", cluster.nodes[2], "--hang-at", "24"]
        job = scheduler.submit(argv, cluster.nodes, env={"TORCH_FR_BUFFER_SIZE": "2000",
                                                          "TORCH_FR_DUMP_TEMP_FILE": str(prefix)})
        outcome: dict[str, Any] = {}
        flows: list[threading.Thread] = []

        def starter(alert: Any, key: str) -> str:
            """As the Prefect starter does, from the alert: the flow run, here in a thread of
            this process (nobody serves the deployment in a test)."""
            overrides = IncidentOverrides(incident_id=key.replace("alert-", "inc-"), alert={
                "source": alert.source, "received": alert.starts_at,
                "payload": {"alertname": alert.name, "labels": alert.labels, "fingerprint": alert.fingerprint}})
            runner = threading.Thread(target=lambda: outcome.update(
                incident_response(job_id=alert.job, cluster=alert.cluster, overrides=overrides)))
            runner.start()
            flows.append(runner)
            return key

        server, thread, sock, url = _receiver(starter)
        resumed_job = None
        try:
            deadline = time.monotonic() + 240
            while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline:
                time.sleep(0.2)
            out, err = io.StringIO(), io.StringIO()
            code = cli.main(["watch", "--metrics", str(run / "metrics.jsonl"), "--from-start", "--job", job,
                             "--cluster", "sim", "--config", str(config), "--fire", "receiver", "--receiver", url,
                             "--max-incidents", "1", "--timeout", "240"], out=out, err=err)
            assert code == 0, err.getvalue()
            said = out.getvalue()
            assert ": stalled: no step after 20 for" in said and "-> flow run" in said, said + err.getvalue()
            for runner in flows:
                runner.join(420)
            assert outcome, "the flow did not finish"
            assert outcome["symptom"]["symptom"] == "stalled"
            diagnosis = outcome["diagnosis"]
            assert diagnosis["primary"]["cause"] == "collective_hang" and diagnosis["culprit_nodes"] == []
            bundle = Path(outcome["bundle"])
            document = json.loads((bundle / "diagnosis.json").read_text())
            faulty = [int(r) for r, node in json.loads((run / "incident.json").read_text())["job"]["ranks"].items()
                      if node == cluster.nodes[2]]
            finding = document["findings"][0]
            assert finding["ranks"] == faulty and finding["nodes"] == [cluster.nodes[2]]
            assert document["resume_from"]["step"] == 15  # the newest verified one before step 20
            # the job's evidence was collected from each node while it still ran, then it was stopped
            for node in cluster.nodes:
                assert len(list((bundle / "nodes" / node / "flight-recorder").iterdir())) == 3
            collection = json.loads((bundle / "collection.json").read_text())
            actions = [json.loads(line) for line in (bundle / "actions.jsonl").read_text().splitlines()]
            stop = next(a for a in actions if a["action"] == "stop")
            collected = datetime.fromisoformat(collection["started"]) + timedelta(seconds=collection["seconds"])
            assert stop["outcome"] == "done" and datetime.fromisoformat(stop["time"]) >= collected
            assert scheduler.show_job(job).state != "RUNNING"
            # resumed from the verified checkpoint, on the same nodes (none convicted)
            resumed = outcome["resumed"]
            assert resumed["outcome"] == "done", resumed
            resumed_job = resumed["extra"]["new_job"]
            new = scheduler.show_job(resumed_job)
            assert new.env["SPIKEOPS_RESUME_FROM"].endswith("step-15") and sorted(new.nodes) == sorted(cluster.nodes)
        finally:
            server.should_exit = True
            thread.join(10)
            sock.close()
            for name in (job, resumed_job):
                if name is not None:
                    scheduler.stop(name, grace=0.5)
