"""Remediations: the diagnosis's actions become the resumed job's environment, and the job
reads them back; nothing unsafe reaches a job's environment."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spikeops.remediation import check_env, resume_plan
from spikeops.train import ResumeRequest


def test_a_data_incident_skips_its_batches_on_the_named_ranks() -> None:
    plan = resume_plan([{"kind": "stop_job"}, {"kind": "skip_batches", "steps": [61, 60, 60], "ranks": [2]},
                        {"kind": "filter_data", "filter": "length filter and max_length truncation"},
                        {"kind": "resume", "step": 40, "path": "/ckpt/step-40"}])
    request = ResumeRequest.from_env(plan.env)
    assert request.skip_steps == {60, 61} and request.skips(60, 2) and not request.skips(60, 1)
    assert not request.skips(59, 2) and "max_length" in request.data_filters
    assert request.lr_scale == 1.0 and request.remediated and "60, 61" in plan.describe()


def test_lr_rng_anomaly_and_clip_remediations_round_trip() -> None:
    plan = resume_plan([{"kind": "lr_test", "factor": 0.3}, {"kind": "fix_rng_restore"},
                        {"kind": "detect_anomaly", "steps": 10}, {"kind": "clip_grad", "max_norm": 0.5}])
    request = ResumeRequest.from_env(plan.env)
    assert request.scale_lr(1e-3) == pytest.approx(3e-4)
    assert request.strict_rng and request.detect_anomaly_steps == 10 and request.clip_grad == 0.5
    assert plan.for_a_person == []


def test_communication_suspected_turns_nccl_debug_on_and_people_get_the_rest() -> None:
    plan = resume_plan([{"kind": "check_fabric", "nodes": ["gpu-003"]}],
                       findings=[{"layer": "communication", "cause": "network_congestion", "confidence": 0.4}])
    assert plan.env == {"NCCL_DEBUG": "INFO"}
    assert plan.for_a_person == ["check the fabric of gpu-003 (switch ports, cables, congestion control)"]
    assert resume_plan([], findings=[{"layer": "hardware"}]).env == {}


def test_malformed_and_hostile_actions_never_reach_the_environment() -> None:
    plan = resume_plan([{"kind": "skip_batches", "steps": ["x", None]}, {"kind": "lr_test", "factor": 3},
                        {"kind": "lr_test", "factor": "nope"}, {"kind": "no_such_kind"},
                        {"kind": "enable_nccl_debug", "env": {"LD_PRELOAD": "/tmp/evil.so"}}])
    assert plan.env == {"NCCL_DEBUG": "INFO"}
    for env in ({"PATH": "/tmp"}, {"SPIKEOPS_X": "a,b"}, {"SPIKEOPS_X": "a b"}, {"spikeops_x": "1"}):
        with pytest.raises(ValueError, match="refusing"):
            check_env(env)


def test_a_job_ignores_malformed_variables_with_a_warning() -> None:
    with pytest.warns(UserWarning):
        request = ResumeRequest.from_env({"SPIKEOPS_SKIP_STEPS": "12:x", "SPIKEOPS_LR_SCALE": "-1",
                                          "SPIKEOPS_RESUME_FROM": "/ckpt/step-9"})
    assert request.skip_steps == {12} and request.lr_scale == 1.0 and request.checkpoint == "/ckpt/step-9"
    assert ResumeRequest.from_env({"SPIKEOPS_LR_SCALE": "4"}).lr_scale == 1.0  # never raises an LR
    assert not ResumeRequest.from_env({}).remediated


@given(st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=50),
       st.lists(st.integers(min_value=0, max_value=4096), max_size=8))
def test_any_skip_list_survives_slurm_export(steps: list[int], ranks: list[int]) -> None:
    plan = resume_plan([{"kind": "skip_batches", "steps": steps, "ranks": ranks}])
    assert all("," not in value for value in plan.env.values())
    request = ResumeRequest.from_env(plan.env)
    assert request.skip_steps == set(steps) and request.skip_ranks == set(ranks)
