"""Benchmark: concurrent incidents on the scale-out layout versus the single process, and the
collection of 1,024 nodes with thread shards versus Dask.

Part 1, incidents per minute. N incidents (4, 8, 16) of N different jobs fire at once: each job
is its own simulated Xid incident (3 nodes, real sshd on loopback; ``tests/scaleout.py``), all
on one cluster with the local scheduler, ``max_concurrent = 16`` so that the layouts' own
limits show. Layouts:
- ``sqlite-serve``: today's default, ``prefect server start`` on SQLite and ``spikeops serve``
  (receiver and the flow runner in one process; Prefect's runner runs at most 5 flow runs at once);
- ``pg-Wx``: ``infra/prefect/up --workers W --limit 5`` (PostgreSQL, a Prefect server on it, W
  workers of the cluster's pool, each running at most 5 flow runs at once, as the served runner)
  and ``spikeops serve --receiver-only``.
The clock starts at the first POST and stops when the last run is final; "longest queued" is
the most seconds a run waited between its creation and its start (a runner's slot). Errors: a
POST not answered 202, a run not COMPLETED (or not final within 15 min), a job not resumed or a
culprit not drained. Everything is started once per layout; a fresh world per size.

Part 2, collection of 1,024 simulated nodes (64 sshd on loopback) from inside a flow: the shard
tasks (48 nodes each, 22 shards) on the flow's thread runner, then on a real ``distributed``
scheduler with 1 and with 2 worker processes (22 threads in all, so every shard runs at
once in every layout), ``--dask-runs`` collections one after the other on the same workers
(the first one cold: it loads prefect and spikeops into the workers). A collection with no
result within ``--collection-limit`` seconds is reported as hung and ends that layout.

Run by hand: ``python bench/bench_scaleout.py [--sizes 4 8 16] [--layouts ...] [--nodes 1024]``.
Nothing is asserted; the figures go in the README.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.scaleout import dask_cluster, world  # noqa: E402
from tests.test_e2e_serve import _free, _post, _stop, _wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
LAYOUTS = ("sqlite-serve", "pg-1x", "pg-2x", "pg-4x")


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


class Layout:
    """One layout, started once, given a new spikeops.toml (same path) for each size."""

    def __init__(self, name: str, work: Path, config: Path, env: dict[str, str]) -> None:
        self.name, self.work, self.config, self.env = name, work, config, dict(env)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.receiver = f"http://127.0.0.1:{_free()}"
        self.api = ""

    def start(self) -> None:
        logs = open(self.work / f"{self.name}.log", "ab")  # noqa: SIM115
        if self.name == "sqlite-serve":
            port = _free()
            self.api = f"http://127.0.0.1:{port}/api"
            self.env.update(PREFECT_HOME=str(self.work / "prefect-home"), PREFECT_API_URL=self.api,
                            PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
                            SPIKEOPS_LEDGER_URL=f"sqlite:///{self.work / 'ledger.db'}")
            server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                       str(port)], env=self.env, stdout=logs, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            self.processes.append(server)
            _wait_http(f"{self.api}/health", 180, server)
            command = ["serve"]
        else:
            workers = int(self.name.removeprefix("pg-").removesuffix("x"))
            started = subprocess.run([str(ROOT / "infra/prefect/up"), str(self.work / "topology"), "--config",
                                      str(self.config), "--workers", str(workers), "--limit", "5", "--no-ui"],
                                     env=self.env, capture_output=True, text=True, timeout=600, check=False)
            if started.returncode != 0:
                raise RuntimeError(f"infra/prefect/up: {started.stderr.strip().splitlines()[-1:]}")
            self.api = started.stdout.strip().partition("=")[2]
            self.env["PREFECT_API_URL"] = self.api
            command = ["serve", "--receiver-only"]
        serving = subprocess.Popen([str(BIN / "spikeops"), *command, "--config", str(self.config), "--addr",
                                    self.receiver.removeprefix("http://")], env=self.env, stdout=logs,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(serving)
        _wait_http(f"{self.receiver}/healthz", 120, serving)
        time.sleep(3)  # the runner's or workers' first poll

    def stop(self) -> None:
        for process in reversed(self.processes):
            _stop(process)
        if self.name != "sqlite-serve":
            subprocess.run([str(ROOT / "infra/prefect/down"), str(self.work / "topology")], capture_output=True,
                           timeout=180, check=False)


def _fire(layout: Layout, jobs: list, tag: str) -> tuple[dict[str, str], int]:
    runs: dict[str, str] = {}
    errors = 0
    lock = threading.Lock()

    def one(job) -> None:
        nonlocal errors
        body = json.dumps({"alerts": [{"status": "firing", "startsAt": "2026-11-29T18:03:12Z",
                                       "fingerprint": f"{tag}-{job.job}", "labels": {
                                           "alertname": "TrainingLossNaN", "job_id": job.job, "cluster": "sim"}}]})
        status, answer = _post(f"{layout.receiver}/alerts/alertmanager", body.encode(), "bench")
        with lock:
            if status == 202:
                runs[job.job] = answer["accepted"][0]["flow_run"]
            else:
                errors += 1

    threads = [threading.Thread(target=one, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return runs, errors


def incidents(layout: Layout, size: int, work: Path, first_octet: int) -> dict[str, object]:
    with world(work / f"world-{size}", {"sim": size}, first_octets=(1, first_octet),
               max_concurrent=16) as sims:
        shutil.copy(sims.config, layout.config)
        if not layout.processes:
            layout.start()
        t0 = time.monotonic()
        runs, errors = _fire(layout, sims.jobs, f"{layout.name}-{size}")
        final: dict[str, str] = {}
        waits: list[float] = []
        last = t0
        deadline = t0 + 900
        while len(final) < len(runs) and time.monotonic() < deadline:
            for job, run in runs.items():
                if job in final:
                    continue
                try:
                    document = _get(f"{layout.api}/flow_runs/{run}")
                except OSError:
                    continue
                if document["state"]["type"] in FINAL:
                    final[job] = document["state"]["type"]
                    last = time.monotonic()
                    if document.get("start_time"):  # how long it queued before a runner took it
                        waits.append((_when(document["start_time"]) - _when(document["created"])).total_seconds())
            time.sleep(1)
        completed = sum(state == "COMPLETED" for state in final.values())
        errors += len(runs) - completed
        scheduler = sims.schedulers["sim"]
        drained = {n.name for n in scheduler.drained()}
        wrong = 0
        for job in sims.jobs:
            resumed = [j for j in scheduler.jobs() if (j.comment or "").startswith(f"spikeops-resume:{job.job}:")]
            if final.get(job.job) == "COMPLETED" and (len(resumed) != 1 or not set(job.culprits) <= drained):
                wrong += 1
        seconds = last - t0
        return {"layout": layout.name, "size": size, "completed": completed, "errors": errors + wrong,
                "seconds": seconds, "per_minute": completed / seconds * 60 if seconds > 0 else 0.0,
                "max_wait": max(waits, default=0.0),
                "states": sorted(set(final.values())) or ["none"]}


def part_incidents(sizes: list[int], layouts: list[str]) -> None:
    print("| layout | simultaneous incidents | completed | errors | wall (s) | incidents / min | longest queued (s) |",
          flush=True)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for index, name in enumerate(layouts):
        with tempfile.TemporaryDirectory(prefix=f"spikeops-bench-scale-{name}-") as tmp:
            work = Path(tmp)
            env = dict(os.environ, SPIKEOPS_RECEIVER_TOKEN="bench")
            for key in ("PREFECT_API_URL", "SPIKEOPS_CONFIG", "PREFECT_HOME", "SLACK_BOT_TOKEN"):
                env.pop(key, None)
            layout = Layout(name, work, work / "spikeops.toml", env)
            try:
                for size in sizes:
                    row = incidents(layout, size, work, 16 * index + 100 + size)
                    print(f"| {row['layout']} | {size} | {row['completed']}/{size} | {row['errors']} | "
                          f"{row['seconds']:.1f} | {row['per_minute']:.1f} | {row['max_wait']:.1f} |", flush=True)
            finally:
                layout.stop()


def part_collection(nodes: int, runs: int, limit: float) -> None:
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from spikeops.sim import cluster as simcluster
    from spikeops.tasks.collect import collect_evidence

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="spikeops-bench-dask-", dir=shm) as tmp, \
            prefect_test_harness(server_startup_timeout=120):
        work = Path(tmp)
        port = simcluster.free_port(("127.2.0.11",))
        t0 = time.monotonic()
        with simcluster.running(work / "c", nodes=nodes, port=port, first_address="127.2.0.11") as cluster:
            print(f"\n{nodes} simulated nodes up in {time.monotonic() - t0:.0f} s", flush=True)

            @flow
            def collect(bundle: str, dask_scheduler: str | None) -> tuple[float, dict[str, int]]:
                start = time.monotonic()
                result = collect_evidence(cluster.inventory, cluster.job, bundle, dask_scheduler=dask_scheduler)
                return time.monotonic() - start, {k: len(v) for k, v in result.buckets().items() if v}

            def row(label: str, bundle: str, dask_scheduler: str | None) -> bool:
                """One collection, in a daemon thread so that a hung one is reported, not waited for."""
                done: list[tuple[float, dict[str, int]]] = []
                runner = threading.Thread(target=lambda: done.append(collect(bundle, dask_scheduler)), daemon=True)
                runner.start()
                runner.join(limit)
                if not done:
                    print(f"| {label} | **hung** (no result in {limit:.0f} s) | - | - |", flush=True)
                    return False
                seconds, outcomes = done[0]
                others = ", ".join(f"{count} {outcome}" for outcome, count in outcomes.items() if outcome != "ok")
                print(f"| {label} | {seconds:.1f} | {outcomes.get('ok', 0)}/{nodes} | {others or 0} |", flush=True)
                return True

            print("| shards run on | wall (s) | nodes ok | the others |", flush=True)
            print("| --- | ---: | ---: | ---: |", flush=True)
            row("the flow's threads (one process)", str(work / "b-threads"), None)
            shards = -(-nodes // 48)
            for workers in (1, 2):
                threads = -(-shards // workers)
                with dask_cluster(work / f"dask-{workers}", workers=workers, threads=threads) as address:
                    for index in range(runs):
                        label = (f"Dask, {workers} worker process(es) of {threads} threads, collection {index + 1}"
                                 + (" (cold)" if index == 0 else " on the same workers"))
                        if not row(label, str(work / f"b-dask-{workers}-{index}"), address):
                            break


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--nodes", type=int, default=1024, help="nodes for the collection part (0: skip it)")
    parser.add_argument("--skip-incidents", action="store_true")
    parser.add_argument("--dask-runs", type=int, default=2,
                        help="consecutive collections on each Dask worker set (the first one cold)")
    parser.add_argument("--collection-limit", type=float, default=900,
                        help="seconds a collection may take before it is reported as hung")
    args = parser.parse_args()
    if not args.skip_incidents:
        part_incidents(args.sizes, args.layouts)
    if args.nodes:
        part_collection(args.nodes, args.dask_runs, args.collection_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
