"""Benchmark: from a NaN in a training job to the flow run and the first Slack message, through
the real Prometheus and Alertmanager, at realistic and at the fastest sensible intervals.

The chain, all real and on this machine:
- a training job (``tests/monitored_job.py``: spikeops.train's logger and Prometheus exporter,
  a step every 0.1 s) whose loss goes NaN when the benchmark says so;
- Debian's Prometheus scraping it and evaluating the shipped rules, Debian's Alertmanager routing
  with ``alertmanager-local.yml`` (group_wait 0 s, as in the production example);
- ``spikeops serve`` (the receiver, which posts the Slack thread's opening message on accepting
  the alert, and the served incident deployment, polled every second) on a real
  ``prefect server start`` (SQLite);
- the local Slack-compatible server, in this process.

Clocks (all this machine's wall clock): the NaN (the file that turns the job's loss NaN is
written; its next step, within 0.1 s, logs NaN), the alert firing (Prometheus's own ``activeAt``,
the evaluation that found it), the flow run created and started (Prefect's own timestamps), the
first Slack message (seen by the Slack server). The flow itself fails at once afterwards (its
inventory does not exist): only the start is measured here; bench_incident.py measures the rest.
Run by hand: ``python bench/bench_monitoring.py [--trials 3] [--settings 15s 1s]``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spikeops.sim import monitoring  # noqa: E402
from spikeops.sim.slack import SlackServer  # noqa: E402
from tests.receiver_process import http_json as _json  # noqa: E402
from tests.receiver_process import prefect_env, wait_for  # noqa: E402
from tests.test_e2e_serve import BIN, _free, _stop, _wait_http  # noqa: E402


def _wait(check: Any, seconds: float, what: str) -> Any:
    return wait_for(what, check, seconds, poll=0.05)

TOKEN = "xoxb-bench-token-000000000"


def _stamp(text: str | None) -> float | None:
    """An RFC 3339 time (Prometheus writes nanoseconds: cut to microseconds) as Unix seconds."""
    if not text:
        return None
    text = re.sub(r"(\.\d{6})\d+", r"\1", text.replace("Z", "+00:00"))
    return datetime.fromisoformat(text).timestamp()


def trial(chain: monitoring.Monitoring, api: str, slack: SlackServer, work: Path, job: str,
          env: dict[str, str], logs: Any) -> dict[str, float | None]:
    folder = work / "runs" / job
    process = subprocess.Popen([sys.executable, "-m", "tests.monitored_job", "--job", job, "--dir", str(folder)],
                               env=env, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        target = _wait(lambda: (folder / "exporter").is_file() and (folder / "exporter").read_text(), 30, "exporter")
        monitoring.add_target(chain.directory, target)
        query = urllib.parse.urlencode({"query": f'training_step{{job_id="{job}"}}'})
        _wait(lambda: _json(f"{chain.prometheus_url}/api/v1/query?{query}")["data"]["result"], 120, "first scrape")
        messages_before = len(slack.messages)
        nan = time.time()
        (folder / "nan").touch()

        def fired() -> float | None:
            for alert in monitoring.alerts(chain):
                if alert["labels"].get("job_id") == job and alert["state"] == "firing":
                    return _stamp(alert["activeAt"])
            return None

        firing = _wait(fired, 120, "the alert firing")

        def run() -> dict | None:
            for flow_run in _json(f"{api}/flow_runs/filter", {"limit": 50}):
                if ((flow_run.get("parameters") or {}).get("params") or {}).get("job_id") == job:
                    return flow_run
            return None

        first_slack = _wait(lambda: len(slack.messages) > messages_before and time.time(), 120, "Slack")
        flow_run = _wait(run, 60, "the flow run")
        try:
            started = _wait(lambda: _stamp(_json(f"{api}/flow_runs/{flow_run['id']}").get("start_time")), 60,
                            "the flow run starting")
        except AssertionError:  # reported as not started, not as a number
            started = None
        return {"nan": nan, "firing": firing, "created": _stamp(flow_run["created"]), "running": started,
                "slack": first_slack}
    finally:
        _stop(process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=["15s", "1s"],
                        help="scrape and evaluation intervals to measure (default 15s 1s)")
    args = parser.parse_args()
    why = monitoring.missing()
    if why:
        print(why, file=sys.stderr)
        return 2
    print("| scrape / evaluation | trial | NaN -> firing (s) | firing -> flow run created (s) | "
          "firing -> first Slack message (s) | created -> running (s) | NaN -> first Slack message (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows: dict[str, list[dict[str, float]]] = {}
    work = Path(tempfile.mkdtemp(prefix="spikeops-bench-monitoring-"))  # kept: processes.log says what happened
    print(f"(files in {work})", file=sys.stderr)
    with SlackServer(token=TOKEN) as slack:
        prefect_port, receiver_port = _free(), _free()
        api = f"http://127.0.0.1:{prefect_port}/api"
        config = work / "spikeops.toml"
        config.write_text(f'[incidents]\ndir = "{work}/incidents"\n[clusters.sim]\ninventory = "{work}/none.toml"\n'
                          f'run_dir = "{work}/runs/{{job}}"\nscheduler = "local"\nslack_channel = "#incidents"\n'
                          'approval = "never"\n')  # nothing to wait for: the runs end at once
        env = prefect_env(work, api, SLACK_BOT_TOKEN=TOKEN, SPIKEOPS_SLACK_API_URL=slack.api_url)
        logs = open(work / "processes.log", "wb")  # noqa: SIM115
        server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                   str(prefect_port)], env=env, stdout=logs, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        serving = None
        try:
            _wait_http(f"{api}/health", 120, server)
            serving = subprocess.Popen([str(BIN / "spikeops"), "serve", "--config", str(config), "--addr",
                                        f"127.0.0.1:{receiver_port}"], env=env, stdout=logs,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            _wait_http(f"http://127.0.0.1:{receiver_port}/healthz", 120, serving)
            time.sleep(2)  # let `prefect serve` register and start polling
            job = 7000
            for setting in args.settings:
                chain_dir = work / f"monitoring-{setting}"
                chain = monitoring.up(chain_dir, receiver=f"http://127.0.0.1:{receiver_port}/alerts/alertmanager",
                                      scrape_interval=setting, evaluation_interval=setting, group_wait="0s")
                try:
                    for number in range(args.trials):
                        job += 1
                        t = trial(chain, api, slack, work, str(job), env, logs)
                        row = {"to_firing": t["firing"] - t["nan"], "to_created": t["created"] - t["firing"],
                               "to_slack": t["slack"] - t["firing"], "total": t["slack"] - t["nan"],
                               "to_running": t["running"] - t["created"] if t["running"] else float("nan")}
                        rows.setdefault(setting, []).append(row)
                        print(f"| {setting} / {setting} | {number + 1} | {row['to_firing']:.2f} | "
                              f"{row['to_created']:.2f} | {row['to_slack']:.2f} | {_s(row['to_running'])} | "
                              f"{row['total']:.2f} |", flush=True)
                finally:
                    monitoring.down(chain_dir)
        finally:
            if serving is not None:
                _stop(serving)
            _stop(server)
            logs.close()
    for setting, measured in rows.items():
        medians = {k: statistics.median(r[k] for r in measured if r[k] == r[k]) if any(r[k] == r[k] for r in measured)
                   else float("nan") for k in measured[0]}
        print(f"| {setting} / {setting} | median | {medians['to_firing']:.2f} | {medians['to_created']:.2f} | "
              f"{medians['to_slack']:.2f} | {_s(medians['to_running'])} | {medians['total']:.2f} |")
    return 0


def _s(seconds: float) -> str:
    return "not within 60 s" if seconds != seconds else f"{seconds:.2f}"


if __name__ == "__main__":
    sys.exit(main())
