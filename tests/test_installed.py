"""spikeops as a user installs it (issue 24): the wheel, built from a clean copy of the tree,
installed without ``-e`` into a fresh virtual environment, and run from a directory that is
not the checkout, with nothing of the checkout on the path.

- the wheel puts only ``spikeops`` at the top of site-packages (its flows, tasks, deployments
  and demo install under it);
- ``spikeops config check`` reads the user's ``spikeops.toml``;
- ``spikeops serve`` answers an Alertmanager webhook and the incident flow runs to its end on
  the local cluster: once with a local Prefect server of its own (no ``PREFECT_API_URL``),
  once against a real ``prefect server start``;
- ``spikeops demo --nodes 4`` runs in the same environment.

The fresh environment takes its dependencies from pip's cache or the index, as a user's would
(about 40 s here when cached).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_e2e_serve import _free, _post, _stop, _wait_http, local_incident

_IGNORE = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                 ".hypothesis", ".ruff_cache", ".mypy_cache", "out")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment with the wheel installed (not editable); yields its bin/."""
    work = tmp_path_factory.mktemp("installed")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=_IGNORE, symlinks=True)
    wheels = work / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(source)], check=True, cwd=work, capture_output=True)
    wheel = next(wheels.glob("spikeops-*.whl"))
    venv = work / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, cwd=work)
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
                          cwd=work, capture_output=True, text=True, env=_user_env())
    assert done.returncode == 0, done.stderr[-3000:]
    yield venv / "bin"


def _user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: nothing of this checkout or its venv, no Prefect
    server of the tests."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PREFECT_API_URL", "PREFECT_HOME", "SPIKEOPS_CONFIG")}
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if ".venv" not in p)
    env.update(extra)
    return env


def test_the_wheel_installs_only_spikeops_at_the_top_level(installed: Path) -> None:
    site = subprocess.run([str(installed / "python"), "-c", "import spikeops, sys; print(spikeops.__file__)"],
                          capture_output=True, text=True, check=True, cwd="/", env=_user_env()).stdout.strip()
    package = Path(site).parent
    assert package.parent.name == "site-packages" and not str(package).startswith(str(ROOT))
    record = next(package.parent.glob("spikeops-*.dist-info")) / "RECORD"
    tops = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines() if line}
    assert {t for t in tops if not t.endswith(".dist-info") and t != ".."} == {"spikeops"}, tops
    assert (next(package.parent.glob("spikeops-*.dist-info")) / "top_level.txt").read_text().split() == ["spikeops"]
    for name in ("flows", "tasks", "deployments", "demo"):
        assert not (package.parent / name).exists()
        assert (package / name / "__init__.py").is_file() and not (package / name).is_symlink()
    code = ("import importlib, sys\n"
            "for m in ('spikeops.flows.incident_response', 'spikeops.deployments.serve', 'spikeops.tasks.collect'):\n"
            "    importlib.import_module(m)\n"
            "for bare in ('flows', 'tasks', 'deployments', 'demo'):\n"
            "    try:\n"
            "        importlib.import_module(bare); print('importable', bare)\n"
            "    except ImportError:\n"
            "        pass\n")
    done = subprocess.run([str(installed / "python"), "-c", code], capture_output=True, text=True, cwd="/",
                          env=_user_env())
    assert done.returncode == 0 and "importable" not in done.stdout, (done.stdout, done.stderr[-2000:])


def test_the_installed_ledger_migrates_from_the_package(installed: Path, tmp_path: Path) -> None:
    """The Alembic migrations ship inside the wheel: the ledger is created and migrated from a
    directory that is not the checkout, and imports a bundle."""
    from spikeops.sim import build_bundle

    bundle = tmp_path / "incidents" / "inc-installed"
    build_bundle(bundle, "gpu_xid", seed=1, nodes=4, distractors=False)
    env = _user_env(SPIKEOPS_LEDGER_URL=f"sqlite:///{tmp_path / 'state' / 'ledger.db'}")
    commands = (["ledger", "upgrade"], ["ledger", "import", str(tmp_path / "incidents")],
                ["incidents", "list", "--json", "--since", "all"])
    outputs = []
    for argv in commands:
        done = subprocess.run([str(installed / "spikeops"), *argv], capture_output=True, text=True, cwd="/", env=env,
                              timeout=120)
        assert done.returncode == 0, (argv, done.stdout, done.stderr[-2000:])
        outputs.append(done.stdout)
    assert "schema 0002" in outputs[0] and "1 incident(s) imported" in outputs[1]
    assert [i["job_id"] for i in json.loads(outputs[2])] == [json.loads((bundle / "incident.json").read_text())
                                                           ["job"]["id"]]


def _run_state(api: str, run_id: str, seconds: float) -> str:
    state, deadline = None, time.monotonic() + seconds
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{api}/flow_runs/{run_id}", timeout=10) as answer:
            state = json.loads(answer.read())["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(1)
    return f"still {state}"


def _serve_one_alert(installed: Path, tmp_path: Path, *, own_server: bool, first_address: str,
                     worker: bool = False) -> str:
    """Start ``spikeops serve`` from the user's directory, post one alert, see the incident
    complete, stop serve; returns everything serve printed."""
    user = tmp_path / "user"
    user.mkdir()
    (tmp_path / "home").mkdir()
    receiver_port, prefect_port = _free(), _free()
    api = f"http://127.0.0.1:{prefect_port}/api"
    logs = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    env = _user_env(SPIKEOPS_RECEIVER_TOKEN="tok-installed", HOME=str(tmp_path / "home"),
                    PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
    server = serving = pool_worker = None
    try:
        with local_incident(tmp_path, tmp_path / "cluster", nodes=3, first_address=first_address, seed=1,
                            extra_config="") as (_cluster, scheduler, job, config):
            text = config.read_text()
            if own_server:  # spikeops serve starts one: its port and home from spikeops.toml
                text += f'[prefect]\nport = {prefect_port}\nhome = "{tmp_path}/prefect-own"\n'
            (user / "spikeops.toml").write_text(text)
            check = subprocess.run([str(installed / "spikeops"), "config", "check"], cwd=user, env=env,
                                   capture_output=True, text=True)
            assert check.returncode == 0 and "ok (1 cluster(s): sim" in check.stdout, (check.stdout, check.stderr)
            if not own_server:
                env["PREFECT_API_URL"] = api
                server = subprocess.Popen([str(installed / "prefect"), "server", "start", "--host", "127.0.0.1",
                                           "--port", str(prefect_port)], cwd=user, stdout=logs,
                                          stderr=subprocess.STDOUT, env=dict(env, PREFECT_HOME=str(tmp_path / "ph")),
                                          start_new_session=True)
                _wait_http(f"{api}/health", 240, server)
            if worker:  # the scale-out layout: the cluster's pool, and a worker started elsewhere
                deployed = subprocess.run([str(installed / "python"), "-m", "spikeops.deployments.topology", "deploy",
                                           "--config", "spikeops.toml"], cwd=user, env=env, capture_output=True,
                                          text=True, timeout=120)
                assert deployed.returncode == 0, deployed.stderr[-2000:]
                elsewhere = tmp_path / "worker-dir"
                elsewhere.mkdir()
                pool_worker = subprocess.Popen(
                    [str(installed / "prefect"), "worker", "start", "--pool", "spikeops-sim", "--prefetch-seconds", "1"],
                    cwd=elsewhere, env=dict(env, SPIKEOPS_CONFIG=str(user / "spikeops.toml"),
                                            PREFECT_WORKER_QUERY_SECONDS="1"),
                    stdout=logs, stderr=subprocess.STDOUT, start_new_session=True)
            serve_argv = ["serve", "--addr", f"127.0.0.1:{receiver_port}"] + (["--receiver-only"] if worker else [])
            serving = subprocess.Popen([str(installed / "spikeops"), *serve_argv],
                                       cwd=user, env=env, stdout=logs, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            receiver = f"http://127.0.0.1:{receiver_port}"
            _wait_http(f"{receiver}/healthz", 600, serving)
            alert = {"version": "4", "status": "firing", "alerts": [{
                "status": "firing", "startsAt": "2026-12-02T03:00:00Z", "fingerprint": "inst01",
                "labels": {"alertname": "TrainingLossNaN", "job_id": job, "cluster": "sim"}}]}
            status, answer = _post(f"{receiver}/alerts/alertmanager", json.dumps(alert).encode(), "tok-installed")
            assert status == 202, answer
            state = _run_state(api, answer["accepted"][0]["flow_run"], 300)
            log = (tmp_path / "serve.log").read_text(errors="replace")
            assert state == "COMPLETED", (state, log[-4000:])
            assert "Traceback" not in log and "internal error" not in log, log[-4000:]
            assert [n.name for n in scheduler.drained()], "the Xid node was not drained"
            if own_server:
                assert f"UI http://127.0.0.1:{prefect_port}" in log and "local Prefect server up" in log
    finally:
        if pool_worker is not None:
            _stop(pool_worker)
        if serving is not None:
            _stop(serving)
            if own_server:  # serve stops the server it started
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and _answers(f"{api}/health"):
                    time.sleep(0.5)
                assert not _answers(f"{api}/health"), "serve left its local Prefect server running"
        if server is not None:
            _stop(server)
        logs.close()
    return (tmp_path / "serve.log").read_text(errors="replace")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def test_installed_serve_starts_its_own_prefect_server_and_answers_an_alert(installed: Path, tmp_path: Path) -> None:
    log = _serve_one_alert(installed, tmp_path, own_server=True, first_address="127.0.24.11")
    assert "no PREFECT_API_URL: starting a local Prefect server" in log
    assert "local Prefect server stopped" in log


def test_installed_serve_against_a_prefect_server_answers_an_alert(installed: Path, tmp_path: Path) -> None:
    log = _serve_one_alert(installed, tmp_path, own_server=False, first_address="127.0.25.11")
    assert "starting a local Prefect server" not in log


def test_an_installed_work_pool_worker_runs_the_flow_from_the_package(installed: Path, tmp_path: Path) -> None:
    """``topology deploy`` names the flow by module; a worker started in an empty directory,
    with no checkout anywhere on its path, loads it from the installed spikeops."""
    log = _serve_one_alert(installed, tmp_path, own_server=False, first_address="127.0.26.11", worker=True)
    assert "serving the alert receiver" in log and "Finished in state Completed" in log


def test_installed_serve_says_in_one_line_when_its_port_is_taken(installed: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "inv.toml").write_text('[cluster]\nnodes = "gpu-001"\n[hosts]\n"gpu-001" = "127.0.0.1"\n')
        (tmp_path / "spikeops.toml").write_text(
            f'[clusters.sim]\ninventory = "{tmp_path}/inv.toml"\nrun_dir = "{tmp_path}"\nscheduler = "local"\n'
            f'scheduler_state_dir = "{tmp_path}/s"\n[prefect]\nport = {port}\nhome = "{tmp_path}/ph"\n')
        done = subprocess.run([str(installed / "spikeops"), "serve"], cwd=tmp_path, capture_output=True, text=True,
                              env=_user_env(HOME=str(tmp_path)), timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and f"port {port} on 127.0.0.1 is taken" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_installed_demo_runs_from_anywhere(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(installed / "spikeops"), "demo", "--nodes", "4", "--scheduler", "local",
                           "--dir", str(tmp_path / "demo")], cwd=tmp_path, capture_output=True, text=True,
                          env=_user_env(HOME=str(tmp_path)), timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "DIAGNOSIS: gpu_xid" in done.stdout and "stopped everything" in done.stdout
