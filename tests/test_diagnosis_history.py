"""The diagnosis's History rules (shared/spec/diagnosis.md, "History"), on simulated incidents
resumed and failing again: the diagnosis reads history.json and nothing else of the ledger.

Each second bundle is what the second incident's collection gives: the job resubmitted (a new
id, without the nodes its resume excluded, ``job.resumed_from`` the checkpoint), its log with
the steps after the checkpoint logged again up to the same anomaly, and the lineage's first
incident in history.json, as the flow writes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from spikeops.diagnosis import diagnose
from spikeops.diagnosis.history import MAX_SKIPPED_STEPS, HistoryVerdict, Recurrence, safe_resume, widened_skip
from spikeops.history import PastIncident, parse_history, plan_of
from spikeops.remediation import resume_plan
from spikeops.sim import build_bundle


def _first(root: Path, cause: str, seed: int) -> tuple[Path, dict[str, Any]]:
    bundle = root / "first"
    build_bundle(bundle, cause, seed=seed, nodes=4, distractors=False)
    return bundle, diagnose(bundle).to_json()


def _again(root: Path, first: Path, d1: dict[str, Any], *, shift: int = 0, excluded: list[str] | None = None,
           history: Any = None, name: str = "second") -> Path:
    """The resumed job's bundle: its spike ``shift`` steps from the first one's."""
    bundle = root / name
    shutil.copytree(first, bundle)
    resume, excluded = d1["resume_from"], d1["culprit_nodes"] if excluded is None else excluded
    incident = json.loads((bundle / "incident.json").read_text())
    incident["job"]["id"] = "J2"
    incident["job"]["resumed_from"] = resume
    incident["job"]["nodes"] = [n for n in incident["job"]["nodes"] if n not in excluded]
    (bundle / "incident.json").write_text(json.dumps(incident))
    for node in excluded:
        shutil.rmtree(bundle / "nodes" / node, ignore_errors=True)
    lines = (first / "metrics.jsonl").read_text().splitlines()
    again = []
    for line in lines:
        record = json.loads(line)
        if record["step"] > resume["step"]:
            record["step"] += shift
            again.append(json.dumps(record))
    (bundle / "metrics.jsonl").write_text("\n".join(lines + again) + "\n")
    if history is None:
        history = [{"incident_id": "inc-1", "job_id": "J1", "opened": "2026-11-29T18:03:12Z", "symptom": d1["symptom"],
                    "spike_step": d1["spike_step"], "onset_step": d1["onset_step"], "cause": d1["primary"]["cause"],
                    "culprit_nodes": d1["culprit_nodes"], "resumed_as": "J2", "resumed_from": resume,
                    "plan": {"excluded": excluded, "env": resume_plan(d1["actions"], d1["findings"]).env}}]
    (bundle / "history.json").write_text(history if isinstance(history, str) else json.dumps(history))
    return bundle


def test_a_nan_again_at_the_same_step_after_the_resume_makes_the_checkpoint_suspect(tmp_path: Path) -> None:
    first, d1 = _first(tmp_path, "gpu_xid", 1)
    assert d1["primary"]["cause"] == "gpu_xid" and len(d1["culprit_nodes"]) == 1
    d2 = diagnose(_again(tmp_path, first, d1)).to_json()
    c = d1["resume_from"]
    assert d2["primary"]["cause"] == "poisoned_checkpoint" and d2["primary"]["layer"] == "checkpoint"
    finding = d2["findings"][0]
    assert "inc-1" in finding["summary"] and f"excluded {d1['culprit_nodes'][0]}" in finding["summary"]
    assert finding["evidence"][0]["file"] == "history.json"
    # never the same checkpoint again: the newest verified one before it
    assert d2["onset_step"] == c["step"] and d2["resume_from"]["step"] < c["step"]
    assert d2["culprit_nodes"] == []  # history alone never convicts
    actions = {a["kind"]: a for a in d2["actions"]}
    assert actions["quarantine_checkpoint"] == {"kind": "quarantine_checkpoint", "step": c["step"], "path": c["path"],
                                                "reason": "poisoned"}
    assert actions["resume"]["path"] == d2["resume_from"]["path"]
    # the culprit drained by the first incident is not there, and the NaN came back anyway
    assert actions["doubt_conviction"] == {"kind": "doubt_conviction", "nodes": d1["culprit_nodes"],
                                           "incident_id": "inc-1", "cause": "gpu_xid"}
    doubt = next(f for f in d2["findings"] if "in doubt" in f["summary"])
    assert doubt["nodes"] == d1["culprit_nodes"] and doubt["cause"] == "inconclusive"
    plan = resume_plan(d2["actions"], d2["findings"])
    assert any("fails again after every load" in line for line in plan.for_a_person)


def test_a_recurring_data_cause_gets_a_wider_skip(tmp_path: Path) -> None:
    first, d1 = _first(tmp_path, "overlong_sample", 0)
    assert d1["primary"]["cause"] == "overlong_sample"
    before = resume_plan(d1["actions"]).env
    d2 = diagnose(_again(tmp_path, first, d1)).to_json()
    assert d2["primary"]["layer"] == "data" and d2["resume_from"] == d1["resume_from"]  # the data is the cause
    skip = next(a for a in d2["actions"] if a["kind"] == "skip_batches")
    earlier = {int(s) for s in before["SPIKEOPS_SKIP_STEPS"].split(":")}
    assert set(skip["steps"]) >= earlier and skip["ranks"] == []  # every rank's, at least the same steps
    after = resume_plan(d2["actions"]).env
    assert "SPIKEOPS_SKIP_RANKS" not in after and after != before
    assert any("recurred" in f["summary"] and "inc-1" in f["summary"] for f in d2["findings"])
    assert not any(a["kind"] == "quarantine_checkpoint" for a in d2["actions"])


def test_a_skip_that_already_covered_every_rank_widens_around_the_spike() -> None:
    earlier = PastIncident(0, "inc-1", "J1", None, "single_spike", 1000, 1000, "overlong_sample",
                           resumed_step=900, resumed_path="/c/900", plan=plan_of([], {"SPIKEOPS_SKIP_STEPS": "1000"}))
    wider = widened_skip(earlier, [1000], onset=1000, spike=1000)
    assert set(wider["steps"]) > {1000} and min(wider["steps"]) > 900 and wider["ranks"] == []
    huge = PastIncident(0, "inc-1", "J1", None, "single_spike", 100_000, 1, "overlong_sample", resumed_step=0,
                        resumed_path="/c/0")
    assert len(widened_skip(huge, [], onset=1, spike=100_000)["steps"]) == MAX_SKIPPED_STEPS


def test_an_anomaly_elsewhere_is_not_a_recurrence(tmp_path: Path) -> None:
    first, d1 = _first(tmp_path, "gpu_xid", 1)
    d2 = diagnose(_again(tmp_path, first, d1, shift=5000, excluded=[])).to_json()
    assert d2["primary"]["cause"] == "gpu_xid"  # the node's fault again, far from the earlier spike
    assert not any(a["kind"] in ("doubt_conviction", "quarantine_checkpoint") for a in d2["actions"])
    # the node convicted before is named so (and convicted on its own evidence, not the history)
    culprit = d1["culprit_nodes"][0]
    named = [f for f in d2["findings"] if culprit in f["nodes"] and "convicted before" in f["summary"]]
    assert named and "inc-1 (gpu_xid)" in named[0]["summary"]


def test_without_a_resume_of_this_job_there_is_no_recurrence(tmp_path: Path) -> None:
    first, d1 = _first(tmp_path, "grad_explosion", 0)
    history = [{"incident_id": "inc-0", "job_id": "J0", "symptom": "instant_nan", "spike_step": d1["spike_step"],
                "cause": "gpu_xid", "culprit_nodes": ["gpu-x"], "resumed_as": "OTHER",
                "resumed_from": {"step": 1, "path": "/elsewhere"}, "plan": {"excluded": ["gpu-x"], "env": {}}}]
    d2 = diagnose(_again(tmp_path, first, d1, excluded=[], history=history)).to_json()
    plain = diagnose(_again(tmp_path, first, d1, excluded=[], history=[], name="plain")).to_json()
    assert d2["primary"] == plain["primary"] and d2["resume_from"] == plain["resume_from"]
    assert d2["culprit_nodes"] == plain["culprit_nodes"] and d2["actions"] == plain["actions"]


@pytest.mark.parametrize("text, gap", [
    ("{ torn", "history.json: not JSON"),
    ('{"incident_id": "x"}', "history.json: not a list"),
    ('[{"incident_id": "inc-1"}, 7, {"no": "id"}]', "history.json: entry #1 unreadable"),
])
def test_a_bad_history_is_a_gap_never_a_crash(tmp_path: Path, text: str, gap: str) -> None:
    first, d1 = _first(tmp_path, "gpu_xid", 1)
    d2 = diagnose(_again(tmp_path, first, d1, history=text)).to_json()
    assert any(m.startswith(gap) for m in d2["missing"]), d2["missing"]
    assert d2["primary"]["cause"] != "poisoned_checkpoint"
    entries, gaps = parse_history(text)
    assert len(gaps) == (2 if "#1" in gap else 1)


def test_a_suspect_checkpoint_is_never_the_resume_point() -> None:
    class Checkpoint:
        def __init__(self, step: int, verified: bool | None) -> None:
            self.step, self.path, self.verified = step, f"/c/{step}", verified

    earlier = PastIncident(0, "inc-1", "J1", None, "instant_nan", 1345, 1345, "gpu_xid", resumed_step=1000,
                           resumed_path="/c/1000")
    verdict = HistoryVerdict(Recurrence(earlier, 1345), poisoned={"step": 1000, "path": "/c/1000"})
    checkpoints = [Checkpoint(500, True), Checkpoint(750, None), Checkpoint(1000, True), Checkpoint(1200, True)]
    assert safe_resume({"step": 1000, "path": "/c/1000"}, verdict, checkpoints) == {"step": 500, "path": "/c/500"}
    assert safe_resume({"step": 1200, "path": "/c/1200"}, verdict, checkpoints) == {"step": 500, "path": "/c/500"}
    assert safe_resume({"step": 400, "path": "/c/400"}, verdict, checkpoints) == {"step": 400, "path": "/c/400"}
    assert safe_resume({"step": 1000, "path": "/c/1000"}, verdict, [Checkpoint(1000, True)]) is None
    unknown = HistoryVerdict(Recurrence(earlier, 1345), poisoned={"step": None, "path": "/c/1000"})
    assert safe_resume({"step": 1000, "path": "/c/1000"}, unknown, checkpoints) is None
