"""From an alert to a flow run: the configuration maps labels to parameters, and the Prefect
starter creates exactly one run of the served deployment per alert occurrence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from spikeops.config import load_config
from spikeops.errors import InputError

CONFIG = """
[incidents]
dir = "{root}/incidents"
[clusters.sim]
inventory = "{root}/sim.toml"
run_dir = "/shared/runs/{{job}}"
checkpoint_root = "/ckpt/{{job}}"
approval = "auto-hardware"
"""

ALERT = {"alerts": [{"status": "firing", "labels": {"alertname": "TrainingLossNaN", "job_id": "4412",
                                                     "cluster": "sim"},
                     "startsAt": "2026-11-29T18:03:12Z", "fingerprint": "9f2c11aa"}]}


def test_config_maps_labels_to_parameters_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.format(root=tmp_path))
    config = load_config(path)
    params = config.flow_parameters("4412", "sim")
    assert params["run_dir"] == "/shared/runs/4412" and params["checkpoint_root"] == "/ckpt/4412"
    assert params["inventory"] == f"{tmp_path}/sim.toml" and params["approval"] == "auto-hardware"
    assert config.flow_parameters("4412", None)["job_id"] == "4412"  # one cluster: it is the one
    for job, cluster in (("1;reboot", "sim"), ("4412", "prod"), ("../x", "sim")):
        with pytest.raises(InputError):
            config.flow_parameters(job, cluster)
    path.write_text(CONFIG.format(root=tmp_path) + "surprise = 1\n")
    with pytest.raises(InputError, match="unknown key"):
        load_config(path)


def test_alert_storm_creates_one_flow_run(tmp_path: Path, prefect_server: None) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from spikeops.deployments.receiver import ReceiverConfig, create_app
    from spikeops.deployments.serve import incident_deployment
    from spikeops.tasks.start import prefect_starter

    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.format(root=tmp_path))
    deployment_id = incident_deployment().apply()
    client = TestClient(create_app(prefect_starter(load_config(path)), ReceiverConfig(token="t")))
    answers = {client.post("/alerts/alertmanager", json=ALERT, headers={"Authorization": "Bearer t"}).json()[
        "accepted"][0]["flow_run"] for _ in range(20)}
    assert len(answers) == 1
    with get_client(sync_client=True) as prefect:
        runs = prefect.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    # other tests start runs of the same deployment: count the ones for this alert
    runs = [r for r in runs if ((r.parameters or {}).get("overrides") or {}).get("alert", {}).get(
        "payload", {}).get("fingerprint") == "9f2c11aa"]
    assert [str(r.id) for r in runs] == list(answers)  # one run for the twenty repeats
    params = runs[0].parameters
    assert params["job_id"] == "4412" and params["cluster"] == "sim"  # the worker's spikeops.toml has the rest
    assert params["overrides"]["incident_id"].startswith("inc-") and set(params["overrides"]) == {"incident_id", "alert"}
    assert {"job:4412", "cluster:sim"} <= set(runs[0].tags)
    unknown = {"alerts": [{**ALERT["alerts"][0], "labels": {"alertname": "x", "job_id": "9", "cluster": "prod"}}]}
    answer = client.post("/alerts/alertmanager", json=unknown, headers={"Authorization": "Bearer t"})
    assert answer.status_code == 400 and "not configured" in answer.json()["error"]


@pytest.mark.parametrize("line, key", [
    ('scheduler = "slurmm"', "scheduler"),
    ('observe_steps = "fifty"', "observe_steps"),
    ("observe_timeout_s = -5", "observe_timeout_s"),
    ("approval_timeout_s = 0", "approval_timeout_s"),
    ('approval = "maybe"', "approval"),
    ("control_command = \"rm -rf /\"", "control_command"),
    ('checkpoint_root = ""', "checkpoint_root"),
])
def test_a_bad_value_is_refused_with_one_line_naming_its_key(tmp_path: Path, line: str, key: str) -> None:
    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.replace('approval = "auto-hardware"\n', "").replace(
        'checkpoint_root = "/ckpt/{{job}}"\n', "").format(root=tmp_path) + line + "\n")
    with pytest.raises(InputError) as error:
        load_config(path)
    assert key in str(error.value) and "\n" not in str(error.value) and "[clusters.sim]" in str(error.value)


def test_sections_are_checked_too(tmp_path: Path) -> None:
    path = tmp_path / "spikeops.toml"
    for extra, key in (("[incidents]\nmax_concurrent = 0\n", "max_concurrent"),
                       ('[receiver]\naddr = "nowhere"\n', "addr")):
        path.write_text(extra + CONFIG.replace("[incidents]\ndir = \"{root}/incidents\"\n", "").format(root=tmp_path))
        with pytest.raises(InputError, match=key):
            load_config(path)


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spikeops", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, check=False)


def test_config_check_and_serve_refuse_a_missing_inventory_before_listening(tmp_path: Path) -> None:
    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.format(root=tmp_path))  # sim.toml does not exist
    checked = _cli("config", "check", "--config", str(path))
    assert checked.returncode == 2 and "inventory" in checked.stderr and "no such file" in checked.stderr
    assert len(checked.stderr.strip().splitlines()) == 1 and "Traceback" not in checked.stderr
    served = _cli("serve", "--config", str(path), "--addr", "127.0.0.1:1")
    assert served.returncode == 2 and "inventory" in served.stderr and "Traceback" not in served.stderr
    (tmp_path / "sim.toml").write_text('[cluster]\nnodes = "gpu-[001-002]"\n')
    checked = _cli("config", "check", "--config", str(path))
    assert checked.returncode == 0, checked.stderr
    assert "1 cluster(s): sim" in checked.stdout


def test_serve_says_in_one_line_when_the_prefect_api_is_unreachable(tmp_path: Path) -> None:
    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.format(root=tmp_path))
    (tmp_path / "sim.toml").write_text('[cluster]\nnodes = "gpu-[001-002]"\n')
    served = _cli("serve", "--config", str(path), "--addr", "127.0.0.1:0",
                  env={"PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert served.returncode == 2, served.stderr
    assert "cannot reach the Prefect API at http://127.0.0.1:9/api" in served.stderr
    assert "Traceback" not in served.stderr and len(served.stderr.strip().splitlines()) == 1


def test_the_served_runner_polls_every_second_although_prefect_is_already_imported(monkeypatch) -> None:
    """spikeops serve imports Prefect before it starts the runner: an environment variable set
    then is never read (the runner polled every 10 s), so the poll is a Prefect setting."""
    import prefect  # noqa: F401 (imported first, as in `spikeops serve`)
    from prefect.settings import get_current_settings

    from spikeops.deployments.serve import runner_settings

    monkeypatch.delenv("PREFECT_RUNNER_POLL_FREQUENCY", raising=False)
    default = get_current_settings().runner.poll_frequency
    with runner_settings():
        assert get_current_settings().runner.poll_frequency == 1
    assert get_current_settings().runner.poll_frequency == default
    monkeypatch.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "3")  # an operator's own choice wins
    with runner_settings():
        assert get_current_settings().runner.poll_frequency == 3


def test_the_served_runner_looks_for_runs_every_half_second_unless_told(monkeypatch) -> None:
    from spikeops.deployments.serve import runner_poll_s

    monkeypatch.delenv("PREFECT_RUNNER_POLL_FREQUENCY", raising=False)
    assert runner_poll_s() == 0.5
    monkeypatch.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "3")
    assert runner_poll_s() == 3.0
    monkeypatch.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "often")
    assert runner_poll_s() == 0.5
