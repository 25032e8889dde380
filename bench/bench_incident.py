"""Benchmark: from the alert's POST to the first Slack message, and to the diagnosis in Slack.

Real servers, as in tests/test_e2e_serve.py: `prefect server start` (SQLite) and
`spikeops serve` as processes, the local sshd cluster answering from a simulated Xid
incident at 16 and 64 nodes, the local-process scheduler, and the local Slack-compatible
server (in this process), which timestamps every message it receives. One alert is POSTed;
the clock stops at the thread's first message, at its diagnosis reply and at the message that
the job is stopped. The training job ignores USR1, as a real one busy saving its state does,
so the stop takes the whole grace period (10 s) before the cancel.
Targets: first message under 5 s (issue 9); diagnosis under 10 s at 64 nodes whatever the
job's grace period (issue 18: collection and diagnosis run beside the stop).
Run by hand: `python bench/bench_incident.py [--nodes 16 64]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spikeops.sim.slack import SlackServer  # noqa: E402
from tests.test_e2e_serve import BIN, _free, _post, _stop, _wait_http, local_incident  # noqa: E402

TOKEN = "xoxb-bench-token-000000000"


#: The simulated incident's seed per symptom (spikeops.sim's gpu_xid scenario).
SYMPTOMS = {"nan": 1, "spike": 5}


def one(nodes: int, work: Path, trace: bool = False, symptom: str = "nan", start: str = "warm",
        layout: str = "served") -> dict[str, float]:
    """One alert. ``layout``: ``served`` (``spikeops serve`` runs the flow) or ``pool`` (the
    scale-out layout: the cluster's work pool and deployment, a worker, ``serve --receiver-only``);
    ``start``: warm (``spikeops serve`` / ``spikeops worker``) or cold (Prefect's own engine
    command per run: ``--cold-start`` / ``prefect worker start --type process``)."""
    import subprocess

    prefect_port, receiver_port = _free(), _free()
    api = f"http://127.0.0.1:{prefect_port}/api"
    with SlackServer(token=TOKEN) as slack:
        env = dict(os.environ, PREFECT_HOME=str(work / "prefect-home"), PREFECT_API_URL=api,
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
                   SPIKEOPS_RECEIVER_TOKEN="bench", SLACK_BOT_TOKEN=TOKEN, SPIKEOPS_SLACK_API_URL=slack.api_url,
                   SPIKEOPS_LEDGER_URL=f"sqlite:///{work / 'ledger.db'}")  # never the user's ledger
        logs = open(work / "servers.log", "wb")  # noqa: SIM115
        server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                   str(prefect_port)], env=env, stdout=logs, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        serving = worker = None
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
        cluster_dir = Path(tempfile.mkdtemp(prefix="spikeops-bench-inc-", dir=shm))
        try:
            stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
                        "time.sleep(600)"]
            with local_incident(work, cluster_dir / "c", nodes=nodes, first_address="127.0.18.11",
                                extra_config='slack_channel = "#incidents"\n', job_argv=stubborn,
                                seed=SYMPTOMS[symptom]) as (
                    cluster, scheduler, job, config):
                _wait_http(f"{api}/health", 180, server)
                if layout == "pool":
                    subprocess.run([sys.executable, "-m", "spikeops.deployments.topology", "deploy", "--config",
                                    str(config)], env=env, check=True, capture_output=True, timeout=120)
                    argv = ([str(BIN / "spikeops"), "worker", "--pool", "spikeops-sim"] if start == "warm" else
                            [str(BIN / "prefect"), "worker", "start", "--pool", "spikeops-sim", "--type", "process"])
                    worker = subprocess.Popen(argv, env=dict(env, SPIKEOPS_CONFIG=str(config),
                                                             PREFECT_WORKER_QUERY_SECONDS="0.5",
                                                             PREFECT_WORKER_PREFETCH_SECONDS="5"),
                                              stdout=logs, stderr=subprocess.STDOUT, start_new_session=True)
                serving = subprocess.Popen([str(BIN / "spikeops"), "serve", "--config", str(config),
                                            "--addr", f"127.0.0.1:{receiver_port}"]
                                           + (["--receiver-only"] if layout == "pool" else
                                              ["--cold-start"] if start == "cold" else []), env=env, stdout=logs,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                _wait_http(f"http://127.0.0.1:{receiver_port}/healthz", 60, serving)
                time.sleep(2 if layout == "served" else 8)  # the runner / the worker registered and polling
                alert = {"alerts": [{"status": "firing", "startsAt": "2026-11-29T18:03:12Z", "fingerprint": "b1",
                                     "labels": {"alertname": "TrainingLossNaN", "job_id": job, "cluster": "sim"}}]}
                t0, t0_wall = time.monotonic(), time.time()
                status, _ = _post(f"http://127.0.0.1:{receiver_port}/alerts/alertmanager", json.dumps(alert).encode(),
                                  "bench")
                accepted = time.monotonic() - t0
                first = diagnosis = stopped = None
                deadline = t0 + 120
                while time.monotonic() < deadline and (diagnosis is None or (symptom == "nan" and stopped is None)):
                    if first is None and slack.messages:
                        first = time.monotonic() - t0
                    if diagnosis is None and any(m.text.startswith("Diagnosis") for m in slack.messages):
                        diagnosis = time.monotonic() - t0
                    if stopped is None and any(m.text.startswith("preserve") or m.text.startswith("stop ")
                                               for m in slack.messages):
                        stopped = time.monotonic() - t0
                    time.sleep(0.05)
                parents = len({m.ts for m in slack.messages if m.thread_ts is None})
                running = _run_started(api, t0_wall)
                if trace:  # the run's own clock, then every message of the thread, seconds after the POST
                    _trace_runs(api, t0_wall)
                    for m in slack.messages:
                        print(f"#  {float(m.ts) - t0_wall:7.2f} s  {m.text[:100]!r}", file=sys.stderr)
                return {"layout": layout, "nodes": nodes, "symptom": symptom, "accepted": accepted, "first_message": first, "diagnosis": diagnosis,
                        "stopped": stopped, "status": status, "threads": parents, "running": running}
        finally:
            for process in (worker, serving):
                if process is not None:
                    _stop(process)
            _stop(server)
            logs.close()
            if trace:
                print(f"# servers' log: {work / 'servers.log'} (kept in --trace mode)", file=sys.stderr)
            import shutil

            shutil.rmtree(cluster_dir, ignore_errors=True)


def _run_started(api: str, t0_wall: float) -> float | None:
    """Seconds from the POST to the run's Running state (Prefect's ``start_time``)."""
    import urllib.request
    from datetime import datetime

    request = urllib.request.Request(f"{api}/flow_runs/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        starts = [run["start_time"] for run in json.loads(answer.read()) if run.get("start_time")]
    return min(datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp() - t0_wall for t in starts) if starts else None


def _trace_runs(api: str, t0_wall: float) -> None:
    """When the run was created, when it was due and when it started (Prefect's timestamps)."""
    import urllib.request
    from datetime import datetime

    request = urllib.request.Request(f"{api}/flow_runs/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        runs = json.loads(answer.read())
    for run in runs:
        for key in ("created", "expected_start_time", "start_time", "end_time"):
            if run.get(key):
                at = datetime.fromisoformat(run[key].replace("Z", "+00:00")).timestamp() - t0_wall
                print(f"#  {at:7.2f} s  run {run['name']}: {key}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--symptom", nargs="+", choices=sorted(SYMPTOMS), default=["nan", "spike"],
                        help="nan: stopped at once (the grace runs beside collection); spike: a single "
                             "spike, watched first for at most observe_timeout_s = 2 s (default both)")
    parser.add_argument("--trace", action="store_true", help="print every Slack message with its time (stderr)")
    parser.add_argument("--start", nargs="+", choices=["warm", "cold"], default=["warm"],
                        help="warm: spikeops serve forks each run from its forkserver (the default); cold: "
                             "--cold-start, the baseline: Prefect's python -m prefect.engine per run")
    parser.add_argument("--layout", nargs="+", choices=["served", "pool"], default=["served"],
                        help="served: spikeops serve runs the flow (default); pool: a work pool, its worker "
                             "(spikeops worker when warm, prefect worker start when cold) and serve --receiver-only")
    args = parser.parse_args()
    print("| layout | nodes | symptom | run start | alert accepted (s) | first Slack message (s) | run running (s) "
          "| diagnosis in Slack (s) | job stopped (s) | threads |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layout, nodes, symptom, start in [(lay, n, s, w) for lay in args.layout for n in args.nodes
                                          for s in args.symptom for w in args.start]:
        if args.trace:  # the work directory is kept, for its servers' log
            row = one(nodes, Path(tempfile.mkdtemp(prefix="spikeops-bench-incident-")), True, symptom, start, layout)
        else:
            with tempfile.TemporaryDirectory(prefix="spikeops-bench-incident-") as tmp:
                row = one(nodes, Path(tmp), symptom=symptom, start=start, layout=layout)
        fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "—"  # noqa: E731
        print(f"| {layout} | {nodes} | {symptom} | {start} | {fmt(row['accepted'])} | {fmt(row['first_message'])} | "
              f"{fmt(row['running'])} | {fmt(row['diagnosis'])} | {fmt(row['stopped'])} | {row['threads']} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
