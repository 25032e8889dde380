"""A person in the loop, on real servers: `prefect server start` (with its UI) and
`spikeops serve` as subprocesses, the local sshd cluster and scheduler, headless Chromium.

Three incidents of three jobs run at once from one configuration:
- cluster ``sim`` (approval always, an hour to answer): the approval is given only after the
  run has been going for 240 s, past the point (225 s) where Prefect's engine renewed, and
  lost, the lease of a deployment concurrency slot, which used to crash every paused incident.
  The flow's own leases are shortened to Prefect's minimum (60 s, renewed at 45 s), so the
  pause outlasts five renewals too;
- cluster ``short`` (approval always, 20 s to answer): nobody answers; the job stays stopped;
- cluster ``auto`` (approval auto-hardware): started from the UI's run form by typing the job
  id and choosing the cluster, the way an on-call engineer would.
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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.test_e2e_serve import BIN, _free, _post, _stop, _wait_http, local_incident

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
LONG_PAUSE_S = 240
CLUSTERS = """
[clusters.short]
inventory = "{inventory}"
run_dir = "{run_dir}"
checkpoint_root = "{work}/ckpt"
scheduler = "local"
scheduler_state_dir = "{work}/sched"
approval = "always"
approval_timeout_s = 20

[clusters.auto]
inventory = "{inventory}"
run_dir = "{run_dir}"
checkpoint_root = "{work}/ckpt"
scheduler = "local"
scheduler_state_dir = "{work}/sched"
approval = "auto-hardware"
"""


@dataclass
class Served:
    api: str
    ui: str
    work: Path
    scheduler: Any
    jobs: dict[str, str]  # cluster -> job id
    runs: dict[str, str]  # cluster -> flow run id (alert-started ones)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def _call(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read() or b"null")


def _run(served: Served, run_id: str) -> dict[str, Any]:
    return _get(f"{served.api}/flow_runs/{run_id}")


def _wait_state(served: Served, run_id: str, states: set[str], seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    run = _run(served, run_id)
    while run["state"]["type"] not in states and time.monotonic() < deadline:
        time.sleep(1)
        run = _run(served, run_id)
    assert run["state"]["type"] in states, (run["state"], (served.work / "servers.log").read_text()[-4000:])
    return run


def _limits(served: Served) -> dict[str, int]:
    return {limit["name"]: limit["active_slots"] for limit in _call(f"{served.api}/v2/concurrency_limits/filter", {})}


def _outbox(served: Served, incident_dir: Path) -> list[dict[str, Any]]:
    path = incident_dir / "outbox.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _bundle(served: Served, run: dict[str, Any]) -> Path:
    return served.work / "incidents" / run["parameters"]["overrides"]["incident_id"]


def _culprit(bundle: Path) -> str:
    """The one node the incident's diagnosis convicts (an Xid scenario has exactly one)."""
    culprits = json.loads((bundle / "diagnosis.json").read_text())["culprit_nodes"]
    assert len(culprits) == 1, culprits
    return culprits[0]


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1400"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(90)
    return driver


def _body_text(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def _wait_text(driver: Any, *needles: str, seconds: float = 90) -> str:
    deadline = time.monotonic() + seconds
    text = ""
    while time.monotonic() < deadline:
        text = _body_text(driver)
        if all(needle in text for needle in needles):
            return text
        time.sleep(0.5)
    raise AssertionError(f"{needles} not on the page: {text[:1500]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} missing: the approval tests drive Debian's chromium (apt-get install chromium "
                        "chromium-driver)")
    work = tmp_path_factory.mktemp("approval")
    prefect_port, receiver_port = _free(), _free()
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = dict(os.environ, PREFECT_HOME=str(work / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", SPIKEOPS_LEASE_S="60")
    env.pop("SLACK_BOT_TOKEN", None)  # Slack messages go to each bundle's outbox.jsonl
    env.pop("PREFECT_UI_URL", None)  # links are derived from the API URL, as Prefect does
    logs = open(work / "servers.log", "wb")  # noqa: SIM115
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                               str(prefect_port)], env=env, stdout=logs, stderr=subprocess.STDOUT,
                              start_new_session=True)
    serving = None
    try:
        with local_incident(work, work / "cluster", nodes=3, first_address="127.0.15.11") as (
                cluster, scheduler, job, config):
            others = {name: scheduler.submit([sys.executable, "-c", "import time; time.sleep(900)"], cluster.nodes)
                      for name in ("short", "auto")}
            text = config.read_text().replace('approval = "auto-hardware"', 'approval = "always"')
            config.write_text(text + CLUSTERS.format(inventory=cluster.inventory, run_dir=cluster.scenario_bundle,
                                                     work=work))
            _wait_http(f"{api}/health", 180, server)
            serving = subprocess.Popen([str(BIN / "spikeops"), "serve", "--config", str(config),
                                        "--addr", f"127.0.0.1:{receiver_port}"], env=env, stdout=logs,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            receiver = f"http://127.0.0.1:{receiver_port}"
            _wait_http(f"{receiver}/healthz", 120, serving)
            jobs = {"sim": job, **others}
            runs = {}
            for name in ("sim", "short"):
                alert = {"version": "4", "status": "firing", "alerts": [{
                    "status": "firing", "startsAt": "2026-11-29T18:03:12Z", "fingerprint": f"approval-{name}",
                    "labels": {"alertname": "TrainingLossNaN", "job_id": jobs[name], "cluster": name}}]}
                status, answer = _post(f"{receiver}/alerts/alertmanager", json.dumps(alert).encode(), None)
                assert status == 202, answer
                runs[name] = answer["accepted"][0]["flow_run"]
            yield Served(api, f"http://127.0.0.1:{prefect_port}", work, scheduler, jobs, runs)
    finally:
        if serving is not None:
            _stop(serving)
        _stop(server)
        logs.close()
        shutil.rmtree(work / "prefect-home", ignore_errors=True)


def test_the_run_form_offers_the_configured_clusters_and_checks_the_job_id(served: Served) -> None:
    deployment = next(d for d in _call(f"{served.api}/deployments/filter", {}) if d["name"] == "incident-response")
    schema = deployment["parameter_openapi_schema"]
    assert schema["properties"]["cluster"]["enum"] == ["auto", "short", "sim"]
    assert set(schema["required"]) == {"job_id", "cluster"}
    assert schema["properties"]["job_id"]["pattern"].startswith("^[A-Za-z0-9]")
    assert deployment["concurrency_limit"] is None  # a paused run must not lose a deployment slot


def test_an_approval_nobody_gives_is_a_no_and_the_job_stays_stopped(served: Served) -> None:
    run = _wait_state(served, served.runs["short"], {"COMPLETED", "FAILED", "CRASHED"}, 300)
    assert run["state"]["type"] == "COMPLETED"
    job = served.jobs["short"]
    assert served.scheduler.show_job(job).state != "RUNNING"
    assert not [j for j in served.scheduler.jobs() if (j.comment or "").startswith(f"spikeops-resume:{job}:")]  # nothing resubmitted
    bundle = _bundle(served, run)
    decisions = [a for a in map(json.loads, (bundle / "actions.jsonl").read_text().splitlines())
                 if a["action"] == "approval"]
    assert [d["outcome"] for d in decisions] == ["no-answer"]
    texts = [m.get("text", "") for m in _outbox(served, bundle)]
    assert any("no approval within 20 s" in t for t in texts), texts
    assert "no approval within 20 s" in (bundle / "report.md").read_text()


def test_an_incident_started_from_the_ui_form_with_a_cluster_and_a_job_id(served: Served) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    deployment = next(d for d in _call(f"{served.api}/deployments/filter", {}) if d["name"] == "incident-response")
    driver = _browser()
    try:
        driver.get(f"{served.ui}/deployments/deployment/{deployment['id']}/run")
        _wait_text(driver, "Job id", "Cluster", "Overrides (optional)")
        started: list[dict[str, Any]] = []
        page = ""
        # The form hydrates in steps (schema, then defaults); a value typed before the last step can be
        # re-rendered away and the click then lands on a form that does not submit. Fill, check what the
        # form holds, submit, and fill again only while no run exists and the page is still the form.
        for _attempt in range(3):
            box = driver.find_element(By.TAG_NAME, "textarea")
            if box.get_attribute("value") != served.jobs["auto"]:
                box.clear()
                box.send_keys(served.jobs["auto"])
            Select(driver.find_element(By.TAG_NAME, "select")).select_by_visible_text("auto")
            time.sleep(1)
            if driver.find_element(By.TAG_NAME, "textarea").get_attribute("value") != served.jobs["auto"]:
                continue
            next(b for b in driver.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Submit").click()
            deadline = time.monotonic() + 45
            while not started and time.monotonic() < deadline:
                time.sleep(1)
                started = [r for r in _call(f"{served.api}/flow_runs/filter", {})
                           if r["parameters"].get("job_id") == served.jobs["auto"]]
            if started or not driver.current_url.endswith("/run"):
                break
            page = _body_text(driver)[:1500]
    finally:
        driver.quit()
    assert len(started) == 1, f"the form started no run; the page showed: {page}"
    run = _wait_state(served, started[0]["id"], {"COMPLETED", "FAILED", "CRASHED"}, 300)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert {f"job:{served.jobs['auto']}", "cluster:auto"} <= set(run["tags"])
    assert run["name"] == f"job-{served.jobs['auto']}-gpu_xid"
    # a manual run's incident is named after the run's creation, in the configured incidents dir
    bundles = list((served.work / "incidents").glob(f"inc-*-{served.jobs['auto']}"))
    assert len(bundles) == 1 and (bundles[0] / "report.md").is_file()
    resumed = [j for j in served.scheduler.jobs() if (j.comment or "").startswith(f"spikeops-resume:{served.jobs['auto']}:")]
    assert len(resumed) == 1 and _culprit(bundles[0]) not in resumed[0].nodes


def test_an_approval_given_after_the_leases_were_renewed_is_honoured(served: Served) -> None:
    from prefect.flow_runs import resume_flow_run
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from selenium.webdriver.common.by import By

    run_id = served.runs["sim"]
    run = _wait_state(served, run_id, {"PAUSED"}, 300)
    assert run["name"] == f"job-{served.jobs['sim']}-gpu_xid"
    assert {f"job:{served.jobs['sim']}", "cluster:sim"} <= set(run["tags"])
    # while it waits: the job's own slot is held, the shared one given back to other incidents
    limits = _limits(served)
    assert limits[f"spikeops-job-sim-{served.jobs['sim']}"] == 1
    bundle = _bundle(served, run)
    culprit = _culprit(bundle)
    waiting = [m for m in _outbox(served, bundle) if "Waiting for approval" in m.get("text", "")]
    assert waiting and f"/runs/flow-run/{run_id}" in json.dumps(waiting[0]["blocks"])
    assert (bundle / "report.md").is_file()  # the report exists before the pause
    description = _get(f"{served.api}/flow_runs/{run_id}/input/paused-1-description")
    assert culprit in description and "gpu_xid" in description and "Resume from" in description
    # the approval page, as a person sees it
    driver = _browser()
    try:
        driver.get(f"{served.ui}/runs/flow-run/{run_id}")
        _wait_text(driver, "Resume")
        next(b for b in driver.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Resume").click()
        page = _wait_text(driver, "Approve: drain", culprit, "Approver")
    finally:
        driver.quit()
    assert "gpu_xid" in page
    # answer only once the run has been going past the old crash point and five lease renewals
    started = datetime.fromisoformat(run["start_time"].replace("Z", "+00:00")).timestamp()
    time.sleep(max(0.0, started + LONG_PAUSE_S - time.time()))
    assert _run(served, run_id)["state"]["type"] == "PAUSED", "the paused incident did not survive the wait"
    with temporary_settings({PREFECT_API_URL: served.api}):
        resume_flow_run(run_id, run_input={"approve": True, "approver": "carol", "note": "Xid confirmed on the node"})
    run = _wait_state(served, run_id, {"COMPLETED", "FAILED", "CRASHED"}, 300)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert [n.name for n in served.scheduler.drained()] == [culprit]
    resumed = [j for j in served.scheduler.jobs() if (j.comment or "").startswith(f"spikeops-resume:{served.jobs['sim']}:")]
    assert len(resumed) == 1 and culprit not in resumed[0].nodes
    # the audit trail: actions.jsonl, the report, the thread
    decision = [a for a in map(json.loads, (bundle / "actions.jsonl").read_text().splitlines())
                if a["action"] == "approval"]
    assert [(d["outcome"], d["extra"]["approver"], d["extra"]["note"]) for d in decision] == [
        ("approved", "carol", "Xid confirmed on the node")]
    assert "carol" in (bundle / "report.md").read_text()
    said = [m for m in _outbox(served, bundle) if "approved by carol" in m.get("text", "")]
    assert said and "Xid confirmed" in said[0]["text"] and f"/runs/flow-run/{run_id}" in json.dumps(said[0]["blocks"])
    # the report artifact shows its plot (the image is inlined: the UI cannot reach the bundle)
    artifacts = _call(f"{served.api}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
    report = next(a for a in artifacts if (a.get("key") or "").startswith("report-"))
    driver = _browser()
    try:
        driver.get(f"{served.ui}/artifacts/artifact/{report['id']}")
        _wait_text(driver, "Findings")
        deadline = time.monotonic() + 30
        widths: list[int] = []
        while not any(widths) and time.monotonic() < deadline:
            widths = [driver.execute_script("return arguments[0].naturalWidth", image)
                      for image in driver.find_elements(By.TAG_NAME, "img")
                      if (image.get_attribute("src") or "").startswith("data:image/png")]
            time.sleep(0.5)
    finally:
        driver.quit()
    assert widths and all(w > 100 for w in widths), widths
    # the slots: the shared one was taken again and given back; the job's limit is gone
    limits = _limits(served)
    assert limits.get("spikeops-incidents") == 0 and f"spikeops-job-sim-{served.jobs['sim']}" not in limits
    log = (served.work / "servers.log").read_text()
    assert "lease renewal failed" not in log.lower()
    # limits are read before they are created: the server never logs a duplicate-name failure
    assert "IntegrityError" not in log and "UNIQUE constraint failed" not in log
