"""From an alert to a flow run: the configuration maps labels to parameters, and the Prefect
starter creates exactly one run of the served deployment per alert occurrence."""

from __future__ import annotations

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

    from deployments.receiver import ReceiverConfig, create_app
    from deployments.serve import incident_deployment
    from tasks.start import prefect_starter

    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.format(root=tmp_path))
    deployment_id = incident_deployment().apply()
    client = TestClient(create_app(prefect_starter(load_config(path)), ReceiverConfig(token="t")))
    answers = {client.post("/alerts/alertmanager", json=ALERT, headers={"Authorization": "Bearer t"}).json()[
        "accepted"][0]["flow_run"] for _ in range(20)}
    assert len(answers) == 1
    with get_client(sync_client=True) as prefect:
        runs = prefect.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    assert [str(r.id) for r in runs] == list(answers)
    params = runs[0].parameters["params"]
    assert params["job_id"] == "4412" and params["inventory"] == f"{tmp_path}/sim.toml"
    assert params["incident_id"].startswith("inc-")
    unknown = {"alerts": [{**ALERT["alerts"][0], "labels": {"alertname": "x", "job_id": "9", "cluster": "prod"}}]}
    answer = client.post("/alerts/alertmanager", json=unknown, headers={"Authorization": "Bearer t"})
    assert answer.status_code == 400 and "not configured" in answer.json()["error"]
