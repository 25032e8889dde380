"""What to do about it: the seed's rapid-response matrix, turned into an action list.

| symptom | protect | recovery |
| instant NaN | stop, preserve state | fix the cause, resume from the nearest good checkpoint |
| single spike | record, observe 50 steps | no recurrence: continue; a named data cause: skip it |
| no recovery | stop, test 0.3x LR | LR issue: lower it; else data/checkpoint |
| creeping after resume | verify RNG restore | fix the resume logic, resume |

Action kinds beyond the spec's examples are documented in docs/diagnosis.md. Every action
the scheduler will carry out (stop, isolate, resume) is listed explicitly, so an approval
gate can show exactly what will happen.
"""

from __future__ import annotations

from typing import Any

from spikeops.diagnosis.model import Finding

__all__ = ["plan_actions", "ACTION_KINDS"]

ACTION_KINDS = (
    "stop_job", "preserve_state", "observe", "isolate_nodes", "skip_batches", "filter_data", "fix_rng_restore",
    "check_dataloader", "clip_grad", "detect_anomaly", "lr_test", "check_loss_scale", "enable_nccl_debug",
    "check_fabric", "align_nccl_version", "quarantine_checkpoint", "check_cooling", "collect_evidence", "resume",
    "notify", "doubt_conviction", "check_ranks", "fix_parallel_config", "enable_flight_recorder",
)

#: Causes precise enough to act on at once, even for a spike that recovered.
_ACTIONABLE = {"overlong_sample", "corrupted_sample", "rng_not_restored", "corrupted_checkpoint",
               "gpu_xid", "gpu_ecc", "ib_link_flap", "nccl_version_mismatch"}


def _cause_actions(primary: Finding, findings: list[Finding], culprits: list[str]) -> list[dict[str, Any]]:
    cause = primary.cause
    if cause in ("overlong_sample", "corrupted_sample"):
        samples = [f for f in findings if f.cause == cause and f.confidence >= 0.5]
        steps = sorted({f.step for f in samples if f.step is not None})
        ranks = sorted({r for f in samples for r in f.ranks})
        which = "length filter and max_length truncation" if cause == "overlong_sample" else "empty-sample filter"
        return [{"kind": "skip_batches", "steps": steps, "ranks": ranks},
                {"kind": "filter_data", "filter": which}]
    if cause == "rng_not_restored":
        return [{"kind": "fix_rng_restore"}]
    if cause == "rank_data_misalignment":
        return [{"kind": "check_dataloader", "ranks": sorted(primary.ranks)}]
    if cause == "grad_explosion":
        return [{"kind": "clip_grad", "max_norm": 1.0}, {"kind": "detect_anomaly", "steps": 10}]
    if cause == "lr_too_high":
        return [{"kind": "lr_test", "factor": 0.3}]
    if cause == "loss_scale_collapse":
        return [{"kind": "check_loss_scale"}, {"kind": "detect_anomaly", "steps": 10}]
    if cause in ("nccl_error", "network_congestion"):
        actions: list[dict[str, Any]] = [{"kind": "enable_nccl_debug", "env": {"NCCL_DEBUG": "INFO"}}]
        if cause == "network_congestion":
            actions.append({"kind": "check_fabric", "nodes": sorted(primary.nodes)})
        return actions
    if cause == "nccl_version_mismatch":
        return [{"kind": "align_nccl_version", "nodes": sorted(primary.nodes)}]
    if cause == "collective_hang":
        return [{"kind": "check_ranks", "ranks": sorted(primary.ranks), "nodes": sorted(primary.nodes)}]
    if cause == "collective_mismatch":
        return [{"kind": "fix_parallel_config", "ranks": sorted(primary.ranks), "why": primary.summary}]
    if cause == "thermal_throttle":
        return [{"kind": "check_cooling", "nodes": sorted(primary.nodes)}]
    return []


def _inconclusive_actions(symptom: str, resume_from: dict[str, Any] | None,
                          collect: list[str] | None) -> list[dict[str, Any]]:
    """No rule names a cause: protect the run as the symptom requires (the matrix's first
    column does not wait for a cause), run the seed's confirmation tests (detect_anomaly for
    a NaN, 0.3x LR for a spike that stays), say what to collect, and resume only from a
    verified checkpoint, which the approval gate puts to a person. Nothing is isolated, and
    with nothing judged (unknown) or a flat loss, nothing is stopped."""
    actions: list[dict[str, Any]] = []
    stop = symptom in ("instant_nan", "spike_no_recovery", "creeping_increase")
    if stop:
        actions.append({"kind": "stop_job"})
        if symptom in ("instant_nan", "spike_no_recovery"):
            actions.append({"kind": "preserve_state"})
    elif symptom == "single_spike":
        actions.append({"kind": "observe", "steps": 50})
    if symptom == "instant_nan":
        actions.append({"kind": "detect_anomaly", "steps": 10})
    if symptom == "spike_no_recovery":
        actions.append({"kind": "lr_test", "factor": 0.3})
    actions.append({"kind": "collect_evidence", "what": list(collect or [])})
    if stop and resume_from is not None:
        actions.append({"kind": "resume", "step": resume_from["step"], "path": resume_from["path"]})
    why = ("no rule names a cause: see the summary and what to collect" if symptom in ("instant_nan", "single_spike",
           "spike_no_recovery", "creeping_increase") else "the evidence needed to judge could not be read: see missing")
    actions.append({"kind": "notify", "why": why})
    return actions


def plan_actions(
    symptom: str,
    primary: Finding,
    findings: list[Finding],
    culprits: list[str],
    resume_from: dict[str, Any] | None,
    corrupt_checkpoint: dict[str, Any] | None,
    collect: list[str] | None = None,
) -> list[dict[str, Any]]:
    if primary.cause == "false_alarm":
        return [{"kind": "notify", "why": "the metrics show nothing anomalous"}]
    if primary.cause == "inconclusive" and symptom == "stalled":
        # A hung job trains nothing: stopping it (its live state collected) loses nothing,
        # but nothing says why it hung, so the resume is a person's call.
        return [{"kind": "stop_job"}, {"kind": "preserve_state"},
                {"kind": "collect_evidence", "what": list(collect or [])},
                {"kind": "enable_flight_recorder", "env": {"TORCH_FR_BUFFER_SIZE": "2000"}},
                {"kind": "notify", "why": "the job hung and nothing read names the rank it waits for: "
                                          "resuming it is a person's call"}]
    if primary.cause == "inconclusive":
        return _inconclusive_actions(symptom, resume_from, collect)
    strong = primary.confidence >= 0.8 and primary.cause in _ACTIONABLE
    # A GPU or link fault the job printed without naming its node: a faulty node keeps
    # polluting the gradients (the seed), so the job stops until the node is found.
    untied = primary.cause in ("gpu_xid", "gpu_ecc", "ib_link_flap") and not culprits
    # A stalled job trains no more: it is stopped once its live state (stacks, flight
    # recorder) is collected, and resumed from the checkpoint before the step it never finished.
    stop = symptom in ("instant_nan", "spike_no_recovery", "creeping_increase", "stalled") or bool(culprits) \
        or strong or untied
    actions: list[dict[str, Any]] = []
    if stop:
        actions.append({"kind": "stop_job"})
        if symptom in ("instant_nan", "spike_no_recovery", "stalled") or culprits:
            actions.append({"kind": "preserve_state"})
    elif symptom != "unknown":  # nothing says the run is training on: nothing to observe
        actions.append({"kind": "observe", "steps": 50})
    if untied:
        actions.append({"kind": "collect_evidence", "what": [
            "nvidia-smi -q and the kernel log of every node of the job: the error names no node, and the faulty "
            "one must be found (and isolated) before the job runs again"]})
    if culprits:
        actions.append({"kind": "isolate_nodes", "nodes": list(culprits), "reason": primary.cause})
    if corrupt_checkpoint is not None:
        actions.append({"kind": "quarantine_checkpoint", **corrupt_checkpoint})
    for action in _cause_actions(primary, findings, culprits):
        if action not in actions:
            actions.append(action)
    if symptom == "stalled" and not any(f.cause in ("collective_hang", "collective_mismatch") and f.evidence
                                        and "flight-recorder/" in f.evidence[0].file for f in findings):
        # the next hang must name its rank: the resumed job records its collectives
        actions.append({"kind": "enable_flight_recorder", "env": {"TORCH_FR_BUFFER_SIZE": "2000"}})
    if symptom == "spike_no_recovery" and not any(a["kind"] == "lr_test" for a in actions) \
            and primary.layer in ("numeric", "data") and primary.cause not in ("overlong_sample", "corrupted_sample"):
        actions.append({"kind": "lr_test", "factor": 0.3})
    if stop and resume_from is not None:
        resume = {"kind": "resume", "step": resume_from["step"], "path": resume_from["path"]}
        if culprits:
            resume["exclude"] = list(culprits)
        actions.append(resume)
    elif stop:
        actions.append({"kind": "notify", "why": "no verified checkpoint before the onset: resume needs a person"})
    return actions
