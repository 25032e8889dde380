"""The rapid-response matrix and the approval policy, without Prefect or a cluster."""

from __future__ import annotations

import pytest

from spikeops.response import (
    Gate,
    approval_gate,
    describe_actions,
    must_stop_before_resume,
    outcome_summary,
    protective_move,
    resume_decision,
)

CKPT = {"step": 1000, "path": "/ckpt/step-1000"}


def _diagnosis(layer="hardware", cause="gpu_xid", confidence=0.95, culprits=("gpu-002",), resume_from=CKPT):
    return {"primary": {"layer": layer, "cause": cause, "confidence": confidence},
            "culprit_nodes": list(culprits), "resume_from": resume_from}


@pytest.mark.parametrize("symptom, move", [
    ("instant_nan", "stop"), ("spike_no_recovery", "stop"), ("single_spike", "observe"),
    ("creeping_increase", "none"), ("none", "none"), ("unknown", "none"), (None, "none"),
    ("stalled", "stop_after_collection")])
def test_the_matrix_stops_for_nan_and_no_recovery_and_observes_a_single_spike(symptom, move):
    assert protective_move(symptom) == move


def test_a_single_spike_is_not_observed_when_no_steps_are_asked():
    assert protective_move("single_spike", observe_steps=0) == "none"


def test_always_asks_a_person_before_a_drain_even_for_a_certain_hardware_fault():
    gate = approval_gate("always", _diagnosis(), stopped=True)
    assert gate.action == "isolate" and gate.ask and not gate.approved
    assert "gpu-002" in gate.question


def test_auto_hardware_approves_only_confident_hardware_convictions():
    assert approval_gate("auto-hardware", _diagnosis(), stopped=True) == Gate(
        "isolate", approved=True, why="policy: auto-approved (gpu_xid, confidence 0.95)")
    assert approval_gate("auto-hardware", _diagnosis(confidence=0.79), stopped=True).ask
    communication = _diagnosis(layer="communication", cause="nccl_version_mismatch", confidence=0.95)
    assert approval_gate("auto-hardware", communication, stopped=True).ask


def test_never_refuses_every_drain_without_asking():
    gate = approval_gate("never", _diagnosis(), stopped=True)
    assert gate.action == "isolate" and not gate.ask and not gate.approved and "never" in gate.why


def test_the_question_folds_many_culprits():
    gate = approval_gate("always", _diagnosis(culprits=[f"gpu-{i:03d}" for i in range(1, 9)]), stopped=True)
    assert "gpu-[001-008]" in gate.question


def test_always_gates_the_resume_of_a_stopped_job_with_no_culprit():
    gate = approval_gate("always", _diagnosis(layer="data", cause="overlong_sample", culprits=()), stopped=True,
                         remediation="skip step 33")
    assert gate.action == "resume" and gate.ask and CKPT["path"] in gate.question and "skip step 33" in gate.question
    # nothing to ask: the job still runs, there is no checkpoint, or resuming is skipped
    assert approval_gate("always", _diagnosis(culprits=()), stopped=False).action is None
    assert approval_gate("always", _diagnosis(culprits=(), resume_from=None), stopped=True).action is None
    assert approval_gate("always", _diagnosis(culprits=()), stopped=True, can_resume=False).action is None
    assert approval_gate("auto-hardware", _diagnosis(culprits=()), stopped=True).action is None


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="approval policy"):
        approval_gate("sometimes", _diagnosis(), stopped=True)


def test_a_drained_node_under_a_running_job_means_stop_before_resuming():
    assert must_stop_before_resume(["gpu-002"], stopped=False, can_resume=True, resume_from=CKPT)
    assert not must_stop_before_resume([], stopped=False, can_resume=True, resume_from=CKPT)
    assert not must_stop_before_resume(["gpu-002"], stopped=True, can_resume=True, resume_from=CKPT)
    assert not must_stop_before_resume(["gpu-002"], stopped=False, can_resume=True, resume_from=None)


def test_resume_only_when_stopped_verified_without_culprits_and_approved():
    isolate = Gate("isolate", ask=True)
    assert resume_decision(isolate, True, "approved", stopped=True, can_resume=True, resume_from=CKPT,
                           culprits=["a"], excluded=["a"]) == (True, None)
    assert resume_decision(isolate, False, "declined", stopped=True, can_resume=True, resume_from=CKPT,
                           culprits=["a"], excluded=[]) == (False, "culprit nodes not isolated")
    assert resume_decision(Gate(None), False, "", stopped=True, can_resume=True, resume_from=None,
                           culprits=[], excluded=[]) == (False, "no verified checkpoint before the onset")
    asked = Gate("resume", ask=True)
    assert resume_decision(asked, False, "no approval within 60 s", stopped=True, can_resume=True,
                           resume_from=CKPT, culprits=[], excluded=[]) == (
        False, "resume not approved: no approval within 60 s")
    assert resume_decision(asked, True, "approved", stopped=True, can_resume=True, resume_from=CKPT,
                           culprits=[], excluded=[]) == (True, None)
    assert resume_decision(Gate(None), False, "", stopped=False, can_resume=True, resume_from=CKPT,
                           culprits=[], excluded=[]) is None
    assert resume_decision(Gate(None), False, "", stopped=True, can_resume=False, resume_from=CKPT,
                           culprits=[], excluded=[]) is None


def test_texts_for_the_thread():
    actions = [{"action": "stop", "target": "4412", "outcome": "done"},
               {"action": "drain", "target": "gpu-002", "outcome": "nothing-to-do"}]
    assert describe_actions(actions) == "stop 4412: done; drain gpu-002: nothing-to-do"
    assert outcome_summary({"outcome": "done", "detail": "job 9"}, stopped=True) == "resumed: job 9"
    assert outcome_summary({"outcome": "not resumed", "detail": "why"}, stopped=True) == "why"
    assert outcome_summary(None, stopped=False) == "kept running, observed"
    assert outcome_summary(None, stopped=True) == "stopped"


def test_an_inconclusive_diagnosis_never_resumes_a_stopped_job_on_the_policy_alone():
    unsure = _diagnosis(layer="none", cause="inconclusive", confidence=0.2, culprits=())
    for policy in ("auto-hardware", "never", "always"):
        gate = approval_gate(policy, unsure, stopped=True)
        assert gate.action == "resume" and gate.ask, policy
    assert "inconclusive" in approval_gate("auto-hardware", unsure, stopped=True).question
    assert approval_gate("auto-hardware", unsure, stopped=False).action is None  # still running: nothing to resume


def test_a_hang_resumes_on_the_policy_a_collective_mismatch_only_with_a_person():
    """collective_hang convicts nobody and a resume is what the matrix says; a mismatch is a
    software fault: the same code would hang again, so a person decides, whatever the policy."""
    hang = _diagnosis(layer="communication", cause="collective_hang", confidence=0.85, culprits=())
    assert approval_gate("auto-hardware", hang, stopped=True).action is None
    assert resume_decision(Gate(None), True, "", stopped=True, can_resume=True, resume_from=CKPT, culprits=[],
                           excluded=[]) == (True, None)
    mismatch = _diagnosis(layer="communication", cause="collective_mismatch", confidence=0.9, culprits=())
    for policy in ("auto-hardware", "never", "always"):
        gate = approval_gate(policy, mismatch, stopped=True)
        assert gate.action == "resume" and gate.ask, policy
    assert "parallel configuration" in approval_gate("auto-hardware", mismatch, stopped=True).question


def test_a_transient_replay_verdict_lets_the_policy_resume_an_inconclusive_diagnosis():
    """The replays on the original and on other nodes did not reproduce the spike with the same
    data: no persistent fault, and the seed's matrix keeps training. The policy may resume; any
    other verdict (or none) still needs a person."""
    unsure = _diagnosis(layer="none", cause="inconclusive", confidence=0.2, culprits=())
    assert approval_gate("auto-hardware", unsure, stopped=True, replayed="transient").action is None
    for other in (None, "inconclusive", "reproduced"):
        assert approval_gate("auto-hardware", unsure, stopped=True, replayed=other).ask
    assert approval_gate("always", unsure, stopped=True, replayed="transient").ask  # "always" is always
