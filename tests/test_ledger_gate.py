"""The ledger's gate over the approval policy (``IncidentMemory.gate``), on a real SQLite
ledger and the Slack outbox: the restart budget, never the same checkpoint with the same plan,
an unknown budget, a job already resubmitted, a dry run; and the approval page's lineage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spikeops.config import IncidentSettings
from spikeops.ledger.store import Ledger, stamp
from spikeops.notify import SlackNotifier
from spikeops.response import Gate
from spikeops.tasks.ledger import IncidentMemory, read_lineage

#: The budget is reserved in a Prefect task: the session's Prefect server, not a temporary one.
pytestmark = pytest.mark.usefixtures("prefect_server")
ONCALL = "<@U0ONCALL>"
DIAGNOSIS = {"primary": {"cause": "poisoned_checkpoint", "layer": "checkpoint", "confidence": 0.85},
             "culprit_nodes": [], "resume_from": {"step": 900, "path": "/ckpt/1/step-900"}, "symptom": "instant_nan",
             "spike_step": 1345, "actions": []}


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)
    monkeypatch.delenv("SPIKEOPS_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("SPIKEOPS_LEDGER_URL", url)
    return url


def _resume(ledger: Ledger, incident: str, job: str, new: str, path: str, *, auto: bool = True,
            env: dict[str, str] | None = None) -> None:
    plan = {"excluded": [], "env": env or {}}
    now = stamp()
    ledger.apply({"incident": {"incident_id": incident, "cluster": "c", "job_id": job, "lineage": "1", "opened": now,
                               "cause": "gpu_xid", "spike_step": 1345, "resumed_as": new,
                               "resumed_from": {"step": 1000, "path": path}, "plan": plan},
                  "jobs": [{"cluster": "c", "job_id": job, "lineage": "1"},
                           {"cluster": "c", "job_id": new, "lineage": "1", "parent_job": job, "incident_id": incident,
                            "checkpoint_path": path, "plan": plan}],
                  "resume": {"incident_id": incident, "cluster": "c", "lineage": "1", "job_id": job, "new_job": new,
                             "time": now, "auto": auto, "status": "done", "checkpoint_path": path, "plan": plan}})


def _memory(tmp_path: Path, job: str, **settings: Any) -> IncidentMemory:
    config = IncidentSettings(job_id=job, inventory="i", run_dir="r", cluster="c", incidents_dir=str(tmp_path / "inc"),
                              incident_id=f"inc-now-{job}", oncall=ONCALL, **settings)
    bundle = tmp_path / "inc" / config.incident_id
    bundle.mkdir(parents=True, exist_ok=True)
    lineage = read_lineage.fn("c", job, config.incident_id, config.incidents_dir)
    return IncidentMemory(config, lineage, config.incident_id, str(bundle), notifier=SlackNotifier(bundle))


def _said(memory: IncidentMemory) -> str:
    path = memory.bundle / "outbox.jsonl"
    return " | ".join(json.loads(line).get("text", "") for line in path.read_text().splitlines()) if path.is_file() else ""


def test_within_the_budget_the_policy_decides_and_a_resume_is_reserved(ledger: str, tmp_path: Path) -> None:
    with Ledger(ledger) as book:
        _resume(book, "inc-a", "1", "2", "/ckpt/1/step-1000")
    memory = _memory(tmp_path, "2")
    gate = memory.gate(Gate(None), DIAGNOSIS, {}, stopped=True, can_resume=True)
    assert gate == Gate(None) and memory.context["reserved"] and memory.context["auto_resumes_in_window"] == 2
    assert _said(memory) == ""


def test_past_the_budget_a_person_decides_whatever_the_policy(ledger: str, tmp_path: Path) -> None:
    with Ledger(ledger) as book:
        _resume(book, "inc-a", "1", "2", "/ckpt/1/step-1000")
        _resume(book, "inc-b", "2", "3", "/ckpt/1/step-950")
        _resume(book, "inc-p", "0", "1", "/ckpt/1/step-800", auto=False)  # a person's: not in the budget
    memory = _memory(tmp_path, "3")
    isolate = Gate("isolate", approved=True, why="policy: auto-approved", question="")
    diagnosis = {**DIAGNOSIS, "culprit_nodes": ["gpu-9"]}
    gate = memory.gate(isolate, diagnosis, {}, stopped=True, can_resume=True)
    assert gate.action == "isolate" and gate.ask and "restart budget spent: 2 of 2" in gate.question
    assert f"{ONCALL} Restart budget spent" in _said(memory)
    note = memory.approval_note()
    assert "Lineage 1" in note and "inc-a" in note and "inc-b" in note and "Held for a person" in note
    assert memory.context["auto_resumes_in_window"] == 2 and "reserved" not in memory.context


def test_never_twice_from_the_same_checkpoint_with_the_same_plan(ledger: str, tmp_path: Path) -> None:
    with Ledger(ledger) as book:
        _resume(book, "inc-a", "1", "2", DIAGNOSIS["resume_from"]["path"], env={"NCCL_DEBUG": "INFO"})
    memory = _memory(tmp_path, "2", max_auto_resumes=10)
    gate = memory.gate(Gate(None), DIAGNOSIS, {"NCCL_DEBUG": "INFO"}, stopped=True, can_resume=True)
    assert gate.action == "resume" and gate.ask and "same plan (inc-a, as job 2)" in gate.question
    # another plan (a skip the first resume did not have) is another resume
    other = _memory(tmp_path, "2", max_auto_resumes=10)
    assert other.gate(Gate(None), DIAGNOSIS, {"SPIKEOPS_SKIP_STEPS": "1345"}, stopped=True, can_resume=True) \
        == Gate(None)


def test_a_job_already_resubmitted_spends_nothing_and_a_dry_run_nothing(ledger: str, tmp_path: Path) -> None:
    with Ledger(ledger) as book:
        _resume(book, "inc-a", "1", "2", DIAGNOSIS["resume_from"]["path"])
    again = _memory(tmp_path, "1")  # a second alert about job 1: its resume will find job 2
    assert again.gate(Gate(None), DIAGNOSIS, {}, stopped=True, can_resume=True) == Gate(None)
    dry = _memory(tmp_path, "2", dry_run=True)
    assert dry.gate(Gate(None), DIAGNOSIS, {"SPIKEOPS_SKIP_STEPS": "1"}, stopped=True, can_resume=True) == Gate(None)
    with Ledger(ledger) as book:
        assert [r["incident_id"] for r in book.resumes_of("c", "1")] == ["inc-a"]  # nothing reserved


def test_an_unknown_budget_waits_for_a_person(ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPIKEOPS_LEDGER_URL", "postgresql://u:verysecret@127.0.0.1:9/x")
    memory = _memory(tmp_path, "5")
    assert memory.lineage.error and "verysecret" not in memory.lineage.error
    gate = memory.gate(Gate(None), DIAGNOSIS, {}, stopped=True, can_resume=True)
    assert gate.ask and "restart budget cannot be checked" in gate.question and "verysecret" not in gate.question
    assert "history unknown" in memory.approval_note()
    # a job that is not stopped, or a gate that asks anyway, is not the ledger's to hold
    assert memory.gate(Gate(None), DIAGNOSIS, {}, stopped=False, can_resume=True) == Gate(None)
    asked = Gate("resume", ask=True, question="resume from X")
    assert memory.gate(asked, DIAGNOSIS, {}, stopped=True, can_resume=True) is asked
