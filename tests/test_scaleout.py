"""The scale-out layout with real components: Debian's PostgreSQL, a Prefect server on it, a
process work pool per cluster with its worker (``infra/prefect/up``), the receiver alone
(``spikeops serve --receiver-only``) routing each alert to its cluster's deployment; alerts
for three jobs on two clusters at once (and a second alert about one of them) become
completed runs on the right pools, with the right drains, resumes and Slack threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from spikeops.deployments import postgres
from spikeops.config import load_config
from spikeops.sim.slack import SlackServer
from tests.scaleout import world
from tests.test_e2e_serve import _free, _post, _stop, _wait_http

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TOKEN = "xoxb-scaleout-test-0000"
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=15) as answer:
        return json.loads(answer.read())


def _alert(job: str, cluster: str, fingerprint: str) -> bytes:
    return json.dumps({"version": "4", "status": "firing", "alerts": [{
        "status": "firing", "startsAt": "2026-11-29T18:03:12Z", "fingerprint": fingerprint,
        "labels": {"alertname": "TrainingLossNaN", "job_id": job, "cluster": cluster}}]}).encode()


@pytest.mark.skipif(os.geteuid() != 0 and postgres.bin_dir() is None, reason="needs PostgreSQL (or root to install it)")
def test_three_jobs_on_two_clusters_on_postgres_and_workers(tmp_path: Path) -> None:
    topo = tmp_path / "topology"
    receiver_port = _free()
    with world(tmp_path / "world", {"east": 2, "west": 1}, first_octets=(0, 220)) as sims, \
            SlackServer(token=TOKEN) as slack:
        env = dict(os.environ, SLACK_BOT_TOKEN=TOKEN, SPIKEOPS_SLACK_API_URL=slack.api_url,
                   SPIKEOPS_RECEIVER_TOKEN="scale-token")
        for name in ("PREFECT_API_URL", "SPIKEOPS_CONFIG", "PREFECT_HOME"):
            env.pop(name, None)
        receiver = None
        try:
            started = subprocess.run([str(ROOT / "infra" / "prefect" / "up"), str(topo), "--config",
                                      str(sims.config), "--no-ui"], env=env, capture_output=True, text=True,
                                     timeout=420, check=False)
            assert started.returncode == 0, started.stderr[-3000:]
            exported = dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.strip().splitlines())
            assert set(exported) == {"PREFECT_API_URL", "SPIKEOPS_LEDGER_URL", "PGPASSFILE"}, exported
            api = exported["PREFECT_API_URL"]
            assert api.startswith("http://127.0.0.1:")
            assert exported["SPIKEOPS_LEDGER_URL"].startswith("postgresql://spikeops_ledger@127.0.0.1:")
            state = json.loads((topo / "topology.json").read_text())
            assert set(state["pools"]) == {"spikeops-east", "spikeops-west"} and len(state["workers"]) == 2
            # the database password: in pgpass (0600) and the server's environment, nowhere else
            assert oct((topo / "pgpass").stat().st_mode & 0o777) == "0o600"
            password = (topo / "pgpass").read_text().strip().rsplit(":", 1)[1]
            assert password not in started.stdout + started.stderr + json.dumps(state)
            ledger_password = (topo / "ledger-pgpass").read_text().strip().rsplit(":", 1)[1]
            assert oct((topo / "ledger-pgpass").stat().st_mode & 0o777) == "0o600"
            for pid in state["workers"].values():
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                assert password.encode() not in environ and ledger_password.encode() not in environ
                assert f"SPIKEOPS_LEDGER_URL={exported['SPIKEOPS_LEDGER_URL']}".encode() in environ

            env["PREFECT_API_URL"] = api
            receiver = subprocess.Popen([str(BIN / "spikeops"), "serve", "--receiver-only", "--config",
                                         str(sims.config), "--addr", f"127.0.0.1:{receiver_port}"], env=env,
                                        stdout=open(tmp_path / "receiver.log", "wb"),  # noqa: SIM115
                                        stderr=subprocess.STDOUT, start_new_session=True)
            url = f"http://127.0.0.1:{receiver_port}"
            _wait_http(f"{url}/healthz", 90, receiver)

            # three jobs on two clusters, and a second alert about east's first job, all at once
            east_a, east_b = sims.of("east")
            (west,) = sims.of("west")
            alerts = [(east_a, "fa"), (east_b, "fb"), (west, "fc"), (east_a, "fa-again")]
            answers: dict[str, tuple[int, dict]] = {}

            def fire(job, fingerprint):
                answers[fingerprint] = _post(f"{url}/alerts/alertmanager", _alert(job.job, job.cluster, fingerprint),
                                             "scale-token")

            threads = [threading.Thread(target=fire, args=alert) for alert in alerts]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert all(status == 202 for status, _ in answers.values()), answers
            runs = {fp: answers[fp][1]["accepted"][0]["flow_run"] for _, fp in alerts}
            assert len(set(runs.values())) == 4

            states: dict[str, dict] = {}
            deadline = time.monotonic() + 360
            while time.monotonic() < deadline and len(states) < 4:
                for fp, run in runs.items():
                    try:
                        document = _get(f"{api}/flow_runs/{run}")
                    except OSError:  # this poll only; the runs' own states say whether the API failed them
                        continue
                    if document["state"]["type"] in FINAL:
                        states[fp] = document
                time.sleep(2)
            logs = "".join((topo / "log" / f"worker-{n}.log").read_text(errors="replace")[-2500:]
                           for n in ("east-1", "west-1"))
            assert {fp: d["state"]["type"] for fp, d in states.items()} == dict.fromkeys(runs, "COMPLETED"), logs
            # the workers are spikeops worker: each run forked warm, never python -m prefect.engine
            full = "".join((topo / "log" / f"worker-{n}.log").read_text(errors="replace") for n in ("east-1", "west-1"))
            assert full.count("warm (spikeops.flows.incident_response") == 4, full[-3000:]

            # each run on its cluster's pool, from its cluster's deployment
            for job, fp in alerts:
                document = states[fp]
                deployment = _get(f"{api}/deployments/{document['deployment_id']}")
                assert document["work_pool_name"] == f"spikeops-{job.cluster}"
                assert deployment["name"] == job.cluster and document["parameters"]["cluster"] == job.cluster
                assert document["parameters"]["job_id"] == job.job

            # the right drains: exactly each job's culprit, each on its own cluster's scheduler
            for cluster in ("east", "west"):
                drained = {n.name: n.reason for n in sims.schedulers[cluster].drained()}
                assert sorted(drained) == sorted(c for job in sims.of(cluster) for c in job.culprits), drained
            # each job resumed once, without its culprit; the second alert about east's job
            # waited for the first incident and then found nothing left to do
            for job in sims.jobs:
                scheduler = sims.schedulers[job.cluster]
                resumed = [j for j in scheduler.jobs() if j.comment and j.comment.startswith(f"spikeops-resume:{job.job}:")]
                assert len(resumed) == 1 and not set(job.culprits) & set(resumed[0].nodes), resumed
                assert scheduler.show_job(job.job).state != "RUNNING"
            incidents = {fp: answers[fp][1]["accepted"][0]["idempotency_key"].replace("alert-", "inc-")
                         for _, fp in alerts}
            actions = {fp: [json.loads(line) for line in (sims.work / "incidents" / inc / "actions.jsonl")
                            .read_text().splitlines()] for fp, inc in incidents.items()}
            done = {fp: {(a["action"], a["outcome"]) for a in acts} for fp, acts in actions.items()}
            first, second = sorted(("fa", "fa-again"), key=lambda fp: min(a["time"] for a in actions[fp]))
            assert {("drain", "done"), ("resume", "done")} <= done[first]
            assert not {o for a, o in done[second] if a in ("stop", "drain", "resume")} - {"nothing-to-do"}
            assert max(a["time"] for a in actions[first]) <= min(a["time"] for a in actions[second])

            # one Slack thread per incident, each about its own job and its own culprit (for
            # east's first job, the thread of whichever of its two alerts acted first). The
            # parent is found by its own Incident field: the second incident's thread names the
            # first one too (its History section), so the whole thread is not a key.
            messages = slack.messages
            for job, fp in [(east_a, first), (east_b, "fb"), (west, "fc")]:
                parents = [m for m in messages if m.thread_ts is None and incidents[fp] in _texts([], m)]
                assert len(parents) == 1, (fp, [m.text[:80] for m in messages if m.thread_ts is None])
                thread = _texts(messages, parents[0])
                assert f"job {job.job}" in thread and all(f"drain {c}: done" in thread for c in job.culprits), thread
                others = {c for other in sims.jobs if other is not job for c in other.culprits}
                assert not any(f"drain {c}" in thread for c in others)
            assert len([m for m in messages if m.thread_ts is None]) == 4

            # and it was all PostgreSQL's: the four runs are rows of its flow_run table
            rows = subprocess.run([str(postgres.bin_dir() / "psql"), "-h", "127.0.0.1", "-p",
                                   str(state["postgres_port"]), "-U", postgres.SUPERUSER, "-d", postgres.DATABASE,
                                   "-tAc", "SELECT count(*) FROM flow_run WHERE id IN (%s)" % ", ".join(
                                       f"'{run}'" for run in runs.values())],
                                  env={"PGPASSFILE": str(topo / "pgpass"), "PATH": "/usr/bin:/bin"},
                                  capture_output=True, text=True, timeout=30, check=False)
            assert rows.stdout.strip() == "4", rows.stderr
            # and the workers wrote the incidents into the ledger's database beside it
            from spikeops.ledger.store import Ledger

            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("PGPASSFILE", exported["PGPASSFILE"])
                with Ledger(exported["SPIKEOPS_LEDGER_URL"]) as ledger:
                    recorded = {row["incident_id"]: row for row in ledger.incidents()}
            assert set(incidents.values()) <= set(recorded), sorted(recorded)
            assert {recorded[incidents[fp]]["cluster"] for fp in ("fa", "fb", "fc")} == {"east", "west"}
        finally:
            if receiver is not None:
                _stop(receiver)
            stopped = subprocess.run([str(ROOT / "infra" / "prefect" / "down"), str(topo)], env=env,
                                     capture_output=True, text=True, timeout=120, check=False)
        assert stopped.returncode == 0, stopped.stderr
        status = json.loads(subprocess.run([str(ROOT / "infra" / "python"), "-m", "spikeops.deployments.topology", "status",
                                            str(topo)], capture_output=True, text=True, check=True).stdout)
        assert status["processes"] == 0 and not status["postgres"]["running"] and not status["server"]["running"]


def _texts(messages: list, parent) -> str:
    """The parent message and its replies, as one text (incident ids, job ids, stage lines)."""
    thread = [parent] + [m for m in messages if m.thread_ts == parent.ts]
    return "\n".join(m.text + json.dumps(m.blocks or []) for m in thread)


CONFIG = """
[incidents]
dir = "{root}/incidents"
[clusters.east]
inventory = "{root}/east.toml"
run_dir = "/runs/{{job}}"
[clusters.west]
inventory = "{root}/west.toml"
run_dir = "/runs/{{job}}"
"""


def test_the_receiver_routes_each_alert_to_its_clusters_deployment(tmp_path: Path, prefect_server: None) -> None:
    from prefect import get_client

    from spikeops.deployments.pools import deploy, pool_name
    from spikeops.deployments.receiver import ReceiverConfig, create_app
    from spikeops.tasks.start import CLUSTER_DEPLOYMENT, prefect_starter

    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.format(root=tmp_path))
    config = load_config(path)
    assert deploy(config) == {"spikeops-east": ["incident-response/east", "node-lifecycle/east"],
                              "spikeops-west": ["incident-response/west", "node-lifecycle/west"]}
    assert deploy(config) == deploy(config)  # idempotent
    with get_client(sync_client=True) as prefect:  # each cluster's node lifecycle, scheduled on its own pool
        lifecycle = prefect.read_deployment_by_name("node-lifecycle/east")
        assert lifecycle.work_pool_name == pool_name("east") and lifecycle.parameters == {"cluster": "east"}
        assert lifecycle.schedules and lifecycle.entrypoint.startswith("spikeops.flows.node_lifecycle")
    client = TestClient(create_app(prefect_starter(config, CLUSTER_DEPLOYMENT, announce=False),
                                   ReceiverConfig(token="t")))
    runs = {}
    for cluster, fingerprint in (("east", "r1"), ("west", "r2")):
        answer = client.post("/alerts/alertmanager", content=_alert("4412", cluster, fingerprint),
                             headers={"Authorization": "Bearer t"})
        assert answer.status_code == 202, answer.text
        runs[cluster] = answer.json()["accepted"][0]["flow_run"]
    with get_client(sync_client=True) as prefect:
        for cluster, run_id in runs.items():
            run = prefect.read_flow_run(run_id)
            deployment = prefect.read_deployment(run.deployment_id)
            assert (deployment.name, run.work_pool_name) == (cluster, pool_name(cluster))
            assert run.parameters["cluster"] == cluster and deployment.entrypoint.startswith("spikeops.flows.")
            schema = deployment.parameter_openapi_schema["properties"]["cluster"]
            assert schema["enum"] == [cluster] and schema["default"] == cluster
    unknown = client.post("/alerts/alertmanager", content=_alert("4412", "north", "r3"),
                          headers={"Authorization": "Bearer t"})
    assert unknown.status_code == 400 and "not configured" in unknown.json()["error"]
    # the watcher fires at the cluster's own deployment the same way
    from spikeops.watch import Anomaly
    from spikeops.tasks.start import deployment_target

    fire = deployment_target(config, "4413", "west", deployment=CLUSTER_DEPLOYMENT, announce=False)
    note = fire(Anomaly(kind="nan", step=120, value=None, score=None, detail="loss is nan",
                        time="2026-11-29T18:03:12Z"))
    with get_client(sync_client=True) as prefect:
        run = prefect.read_flow_run(note.removeprefix("flow run "))
        assert (prefect.read_deployment(run.deployment_id).name, run.work_pool_name) == ("west", "spikeops-west")


def test_receiver_only_refuses_in_one_line_without_the_clusters_deployments(tmp_path: Path,
                                                                            prefect_server: None) -> None:
    from prefect.settings import PREFECT_API_URL

    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.format(root=tmp_path).replace("east", "north").replace("west", "south"))
    # the inventories are not here: only the workers need them
    served = subprocess.run([sys.executable, "-m", "spikeops", "serve", "--receiver-only", "--config", str(path),
                             "--addr", f"127.0.0.1:{_free()}"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}, check=False)
    assert served.returncode == 2, served.stderr
    assert "no deployment incident-response/north, incident-response/south" in served.stderr
    assert "Traceback" not in served.stderr and len(served.stderr.strip().splitlines()) == 1


def test_up_and_down_say_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    up, down = str(ROOT / "infra" / "prefect" / "up"), str(ROOT / "infra" / "prefect" / "down")
    config = tmp_path / "spikeops.toml"

    def refused(argv: list[str], words: str) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and words in done.stderr, (argv, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr and not done.stdout

    refused([up, str(tmp_path / "t1"), "--config", str(tmp_path / "missing.toml")], "no such configuration file")
    config.write_text(CONFIG.format(root=tmp_path))
    refused([up, str(tmp_path / "t2"), "--config", str(config)], "inventory")  # east.toml does not exist
    for name in ("east", "west"):
        (tmp_path / f"{name}.toml").write_text('[cluster]\nnodes = "gpu-[001-002]"\n')
    refused([up, str(tmp_path / "t3"), "--config", str(config), "--workers", "0"], "--workers must be from 1 to 32")
    (tmp_path / "t4").mkdir()
    (tmp_path / "t4" / "notes.txt").write_text("someone's files")
    refused([up, str(tmp_path / "t4"), "--config", str(config)], "is not empty")
    assert sorted(p.name for p in (tmp_path / "t4").iterdir()) == ["notes.txt"]  # nothing of it touched
    stopped = subprocess.run([down, str(tmp_path / "never-used")], capture_output=True, text=True, timeout=60,
                             check=False)
    assert stopped.returncode == 0 and "stopped 0 process(es)" in stopped.stderr
