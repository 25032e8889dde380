"""End to end with real servers: `prefect server start` (SQLite in its own PREFECT_HOME,
analytics off) and `spikeops serve` as subprocesses; an Alertmanager alert POSTed to the
receiver becomes exactly one completed flow run, which collects from real sshd nodes,
diagnoses, drains the culprit on the local scheduler and resumes the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from spikeops.schedulers import LocalScheduler
from spikeops.sim import cluster as simcluster
from tests.test_incident_flow import _checkpoints

BIN = Path(sys.executable).parent


def _free(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _wait_http(url: str, seconds: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{process.args[:3]} exited {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise AssertionError(f"{url} not up within {seconds} s")


def _post(url: str, body: bytes, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


@contextmanager
def local_incident(work: Path, cluster_dir: Path, *, nodes: int, first_address: str, extra_config: str = "",
                   job_argv: list[str] | None = None,
                   seed: int = 5) -> Iterator[tuple[simcluster.Cluster, LocalScheduler, str, Path]]:
    """A simulated Xid incident ready to be served: sshd nodes, a local scheduler running the
    job on them (plus one spare), checkpoints with manifests, and the spikeops.toml mapping
    cluster "sim" to it all. Yields (cluster, scheduler, job id, config path). The seed picks
    the symptom: 5 a single spike (watched first), 1 a NaN (stopped at once)."""
    port = simcluster.free_port((first_address,))
    with simcluster.running(cluster_dir, nodes=nodes, port=port, first_address=first_address,
                            scenario="gpu_xid", seed=seed) as cluster:
        scheduler = LocalScheduler(work / "sched")
        scheduler.add_nodes(cluster.nodes + ["spare-001"])
        job = scheduler.submit(job_argv or [sys.executable, "-c", "import time; time.sleep(600)"], cluster.nodes)
        _checkpoints(work / "ckpt", cluster.scenario_bundle)
        config = work / "spikeops.toml"
        config.write_text(
            f'[incidents]\ndir = "{work}/incidents"\n'
            f'[clusters.sim]\ninventory = "{cluster.inventory}"\nrun_dir = "{cluster.scenario_bundle}"\n'
            f'checkpoint_root = "{work}/ckpt"\nscheduler = "local"\nscheduler_state_dir = "{work}/sched"\n'
            f'approval = "auto-hardware"\nobserve_timeout_s = 2\n{extra_config}')
        try:
            yield cluster, scheduler, job, config
        finally:
            for other in scheduler.jobs():
                if other.state == "RUNNING":
                    scheduler.stop(other.job_id, grace=0.5)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_alert_to_a_completed_incident_with_real_servers(tmp_path: Path) -> None:
    prefect_port, receiver_port = _free(), _free()
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
               SPIKEOPS_RECEIVER_TOKEN="e2e-token", SLACK_BOT_TOKEN="")
    env.pop("SLACK_BOT_TOKEN")
    logs = open(tmp_path / "servers.log", "wb")  # noqa: SIM115
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                               str(prefect_port)], env=env, stdout=logs, stderr=subprocess.STDOUT,
                              start_new_session=True)
    serving = None
    try:
        with local_incident(tmp_path, tmp_path / "cluster", nodes=5, first_address="127.0.14.11") as (
                cluster, scheduler, job, config):
            _wait_http(f"{api}/health", 180, server)
            serving = subprocess.Popen([str(BIN / "spikeops"), "serve", "--config", str(config),
                                        "--addr", f"127.0.0.1:{receiver_port}"], env=env, stdout=logs,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            receiver = f"http://127.0.0.1:{receiver_port}"
            _wait_http(f"{receiver}/healthz", 60, serving)
            alert = {"version": "4", "status": "firing", "alerts": [{
                "status": "firing", "startsAt": "2026-11-29T18:03:12Z", "fingerprint": "e2e01",
                "labels": {"alertname": "TrainingLossNaN", "job_id": job, "cluster": "sim"}}]}
            body = json.dumps(alert).encode()
            assert _post(f"{receiver}/alerts/alertmanager", body, "wrong")[0] == 401
            status, answer = _post(f"{receiver}/alerts/alertmanager", b"{nope", "e2e-token")
            assert status == 400 and "not JSON" in answer["error"]
            hostile = json.loads(body)
            hostile["alerts"][0]["labels"]["job_id"] = f"{job}; touch {tmp_path}/pwned"
            assert _post(f"{receiver}/alerts/alertmanager", json.dumps(hostile).encode(), "e2e-token")[0] == 400
            runs = set()
            for _ in range(100):
                status, answer = _post(f"{receiver}/alerts/alertmanager", body, "e2e-token")
                assert status == 202
                runs.add(answer["accepted"][0]["flow_run"])
            assert len(runs) == 1
            run_id = runs.pop()
            state = None
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                with urllib.request.urlopen(f"{api}/flow_runs/{run_id}", timeout=10) as answer:
                    state = json.loads(answer.read())["state"]["type"]
                if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                    break
                time.sleep(1)
            assert state == "COMPLETED", (state, (tmp_path / "servers.log").read_text()[-3000:])
            drained = [n.name for n in scheduler.drained()]
            assert len(drained) == 1 and scheduler.show_job(job).state != "RUNNING"
            resumed = [j for j in scheduler.jobs() if j.comment]
            assert len(resumed) == 1 and drained[0] not in resumed[0].nodes
            assert not (tmp_path / "pwned").exists()
            # the run started warm: forked from serve's forkserver with the flow object, not a
            # `python -m prefect.engine` that loads the flow from storage again
            log = (tmp_path / "servers.log").read_text()
            assert "Downloading flow code from storage" not in log
            assert any("multiprocessing.forkserver" in _cmdline(pid) for pid in _children(serving.pid))
    finally:
        if serving is not None:
            _stop(serving)
        _stop(server)
        logs.close()
