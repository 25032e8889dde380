"""The real monitoring chain end to end: training jobs export their step metrics
(``spikeops.train.PrometheusExporter``), Debian's Prometheus scrapes them and evaluates the
shipped rules, Debian's Alertmanager groups, repeats and resolves what fires and posts it to
the real receiver, which starts the incident flow on a real Prefect server.

Asserted: a job whose loss goes NaN gets exactly one incident run, however often Alertmanager
repeats the alert (short group and repeat intervals make it repeat within the test), and one
Prefect call; a second job alerting at the same time gets its own run; the resolved alert that
follows the recovery is received and starts nothing. Intervals are short (1 s scrapes and
evaluations); waits have generous deadlines and nothing is timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from spikeops.sim import monitoring
from tests.conftest import ROOT
from tests.receiver_process import http_json as _json
from tests.receiver_process import prefect_env
from tests.receiver_process import wait_for as _until
from tests.test_e2e_serve import BIN, _free, _stop, _wait_http

JOBS = ("5001", "5002")


def _runs_by_job(api: str) -> dict[str, list[str]]:
    """The incident flow runs on the server, by the job id in their parameters."""
    out: dict[str, list[str]] = {}
    for run in _json(f"{api}/flow_runs/filter", {"limit": 200}):
        params = run.get("parameters") or {}
        job = (params.get("params") or {}).get("job_id") or params.get("job_id")
        out.setdefault(str(job), []).append(run["id"])
    return out


def _query(chain: monitoring.Monitoring, promql: str) -> list[dict]:
    url = f"{chain.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    return _json(url)["data"]["result"]


@pytest.fixture
def installed() -> None:
    if monitoring.missing() is not None:  # what infra/monitoring/up does; `make test` has done it
        subprocess.run([str(ROOT / "infra" / "apt-ensure.sh"), *monitoring.PACKAGES], check=False, timeout=600)
    why = monitoring.missing()
    if why is not None:
        pytest.fail(why)


def test_nan_through_prometheus_and_alertmanager_starts_one_run_per_job(tmp_path: Path, installed: None) -> None:
    prefect_port, receiver_port = _free(), _free()
    api = f"http://127.0.0.1:{prefect_port}/api"
    config = tmp_path / "spikeops.toml"
    config.write_text(f'[incidents]\ndir = "{tmp_path}/incidents"\n'
                      f'[clusters.sim]\ninventory = "{tmp_path}/inventory.toml"\nrun_dir = "{tmp_path}/runs/{{job}}"\n'
                      'scheduler = "local"\n')
    env = prefect_env(tmp_path, api)
    logs = open(tmp_path / "processes.log", "wb")  # noqa: SIM115
    started: list[subprocess.Popen] = []

    def spawn(argv: list[str]) -> subprocess.Popen:
        process = subprocess.Popen(argv, env=env, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=ROOT)
        started.append(process)
        return process

    def log_tail() -> str:
        return (tmp_path / "processes.log").read_text(errors="replace")[-3000:]

    chain_dir = tmp_path / "monitoring"
    try:
        server = spawn([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)])
        jobs = {job: tmp_path / "runs" / job for job in JOBS}
        for job, folder in jobs.items():
            spawn([sys.executable, "-m", "tests.monitored_job", "--job", job, "--dir", str(folder)])
        targets = [_until(f"job {job}'s exporter", lambda f=folder: (f / "exporter").is_file()
                          and (f / "exporter").read_text(), 30, log_tail) for job, folder in jobs.items()]
        _wait_http(f"{api}/health", 120, server)
        receiver = spawn([sys.executable, "-m", "tests.receiver_process", str(receiver_port), str(config)])
        _wait_http(f"http://127.0.0.1:{receiver_port}/healthz", 120, receiver)

        def record() -> dict:
            return _json(f"http://127.0.0.1:{receiver_port}/test/record")

        chain = monitoring.up(chain_dir, receiver=f"http://127.0.0.1:{receiver_port}/alerts/alertmanager",
                              targets=targets, scrape_interval="1s", evaluation_interval="1s",
                              group_wait="0s", group_interval="2s", repeat_interval="3s")
        # both jobs scraped, healthy, past the rules' warmup: nothing has fired
        _until("both jobs scraped past step 100",
               lambda: len(_query(chain, "training_step > 100")) == 2, 90, lambda: str(_query(chain, "training_step")))
        assert _runs_by_job(api) == {} and record()["alerts"] == []

        for folder in jobs.values():
            (folder / "nan").touch()
        _until("an incident run for each job", lambda: set(_runs_by_job(api)) == set(JOBS), 90,
               lambda: f"{record()} {monitoring.alerts(chain)} {log_tail()}")

        def firing(job: str) -> int:
            return sum(1 for a in record()["alerts"] if a["job"] == job and a["status"] == "firing")

        # Alertmanager repeats (repeat_interval 3 s); each repeat is answered from memory
        _until("Alertmanager repeating job 5001's alert", lambda: firing(JOBS[0]) >= 3, 60, lambda: str(record()))
        (jobs[JOBS[0]] / "nan").unlink()  # job 5001 recovers: its alert resolves (a minute later:
        # the rule's counter window keeps it firing that long after the last NaN step)
        _until("the resolved alert of job 5001 at the receiver", lambda: any(
            a["job"] == JOBS[0] and a["status"] == "resolved" for a in record()["alerts"]), 150,
            lambda: f"{monitoring.alerts(chain)}")
        time.sleep(3)  # one more repeat interval: job 5002's alert keeps coming, 5001's does not

        runs = _runs_by_job(api)
        assert {job: len(ids) for job, ids in runs.items()} == {JOBS[0]: 1, JOBS[1]: 1}
        seen = record()
        assert seen["starter_calls"] == 2  # one Prefect call per incident, whatever the repeats
        by_job = {job: [a for a in seen["alerts"] if a["job"] == job and a["status"] == "firing"] for job in JOBS}
        for job in JOBS:
            assert [a["start"] for a in by_job[job]][0] == "started"
            assert {a["start"] for a in by_job[job][1:]} <= {"remembered", "in-flight"}
            assert {a["flow_run"] for a in by_job[job] if a["flow_run"]} == set(runs[job])
        assert all(a["flow_run"] is None for a in seen["alerts"] if a["status"] == "resolved")
        states = {a["labels"]["job_id"]: a["state"] for a in monitoring.alerts(chain)}
        assert states.get(JOBS[1]) == "firing" and JOBS[0] not in states
    finally:
        monitoring.down(chain_dir)
        for process in reversed(started):
            _stop(process)
        logs.close()


def test_up_down_status_and_their_errors(tmp_path: Path, installed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """infra/monitoring/up and down as a user runs them: both servers up and ready, the local
    Alertmanager config pointed at the receiver, a second up refused while it runs, down
    idempotent and leaving the files, a missing binary a one-line reason."""
    chain_dir = tmp_path / "mon"
    receiver = "http://127.0.0.1:9/alerts/alertmanager"
    done = subprocess.run([str(ROOT / "infra" / "monitoring" / "up"), "--dir", str(chain_dir), "--receiver", receiver,
                           "--scrape-interval", "15s", "--evaluation-interval", "15s", "--repeat-interval", "1m"],
                          capture_output=True, text=True, timeout=120)
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("up: Prometheus at http://127.0.0.1:")
        state = monitoring.status(chain_dir)
        assert state["running"] and all(state["ready"].values())
        config = json.loads((chain_dir / "alertmanager.yml").read_text())
        hooks = [h["url"] for r in config["receivers"] for h in r.get("webhook_configs", [])]
        route = next(r for r in config["route"]["routes"] if r["receiver"] == "spikeops")
        assert hooks == [receiver] and route["repeat_interval"] == "1m"
        checked = subprocess.run(["amtool", "check-config", str(chain_dir / "alertmanager.yml")],
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout
        monitoring.add_target(chain_dir, "127.0.0.1:9")
        chain = monitoring.load(chain_dir)
        _until("the new target discovered", lambda: _json(f"{chain.prometheus_url}/api/v1/targets")["data"][
            "activeTargets"], 30)
        again = subprocess.run([str(ROOT / "infra" / "monitoring" / "up"), "--dir", str(chain_dir)],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and "already running" in again.stderr
        assert len(again.stderr.strip().splitlines()) == 1
    finally:
        for _ in range(2):  # idempotent
            stopped = subprocess.run([str(ROOT / "infra" / "monitoring" / "down"), "--dir", str(chain_dir)],
                                     capture_output=True, text=True, timeout=60)
            assert stopped.returncode == 0, stopped.stderr
    assert not monitoring.status(chain_dir)["running"] and (chain_dir / "prometheus.yml").is_file()
    monkeypatch.setenv("SPIKEOPS_ALERTMANAGER", str(tmp_path / "none"))
    with pytest.raises(monitoring.ClusterError, match="apt-get install prometheus prometheus-alertmanager"):
        monitoring.up(tmp_path / "other", receiver=receiver)
    assert not (tmp_path / "other").exists()
