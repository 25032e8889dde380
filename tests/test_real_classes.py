"""The diagnosis on the failure classes real evidence showed (issue 14, classes 1-11).

Each test states a class as a behaviour, on real text where there is some (the real-incident
corpus, tests/fixtures/real-incidents, whose labels are part A's; shared/fixtures/real) and on
bundles built here where a class needs a shape no real case has yet. The healthy-curve
properties at the end are the other half of every rule: real-looking healthy runs, logged
sparsely and cut into excerpts, never fire.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from spikeops.bundle import BundleWriter
from spikeops.diagnosis import diagnose
from spikeops.diagnosis.symptom import classify, departures
from tests import watch_curves
from tests.conftest import ROOT

CORPUS = ROOT / "tests" / "fixtures" / "real-incidents"
WIDE = {"start": "2000-01-01T00:00:00Z", "end": "2030-01-01T00:00:00Z"}


def incident(nodes: list[str], window: dict[str, str] | None = WIDE, **job: Any) -> dict[str, Any]:
    return {
        "incident_id": "inc-classes", "created": "2026-11-29T18:03:12Z",
        "alert": {"source": "test", "received": "2026-11-29T18:03:10Z", "payload": {}},
        "job": {"id": "1", "scheduler": "slurm", "name": "t", "nodes": nodes, "gpus_per_node": 8, "ranks": {},
                "started": None, "resumed_from": None, **job},
        "window": window,
    }


def case(name: str, tmp_path: Path) -> dict[str, Any]:
    """Diagnose a copy of a corpus case (the corpus is never written to)."""
    source = CORPUS / name
    if not source.is_dir():
        pytest.skip(f"corpus case {name} not present")
    copy = tmp_path / name
    shutil.copytree(source, copy)
    return diagnose(copy).to_json()


def bundle_with_log(tmp_path: Path, text: str, nodes: list[str] | None = None, **job: Any) -> dict[str, Any]:
    writer = BundleWriter(tmp_path)
    writer.write_incident(incident(nodes or ["n1"], **job))
    (tmp_path / "train.log").write_text(text)
    return diagnose(tmp_path).to_json()


def frame(loss: list[float], **columns: Any) -> pd.DataFrame:
    loss_array = np.asarray(loss, dtype=float)
    n = len(loss_array)
    data = {"loss": np.where(np.isfinite(loss_array), loss_array, np.nan), "loss_bad": ~np.isfinite(loss_array),
            "grad_norm": np.full(n, np.nan), "grad_bad": np.zeros(n, dtype=bool), "lr": np.full(n, np.nan),
            "loss_scale": np.full(n, np.nan), "throughput": np.full(n, np.nan), "skipped": np.zeros(n, dtype=bool),
            "line": np.arange(1, n + 1)}
    data.update(columns)
    step = columns.pop("step", None)
    index = np.asarray(step) if step is not None else np.arange(1000, 1000 + 10 * n, 10)
    return pd.DataFrame({k: v for k, v in data.items() if k != "step"}, index=index)


# ------------------------------------------------------------------ 1. unread is not healthy


def test_a_traceback_alone_is_unknown_and_inconclusive_never_a_false_alarm(tmp_path):
    got = case("bloom13b-dataloader-shm-bus-error", tmp_path)
    assert got["symptom"] == "unknown"
    assert got["primary"] == {"layer": "none", "cause": "inconclusive", "confidence": 0.2}
    assert got["culprit_nodes"] == [] and got["resume_from"] is None and got["onset_step"] is None
    assert any(item.startswith("train.log: no training step lines") for item in got["missing"])
    assert [a["kind"] for a in got["actions"]] == ["collect_evidence", "notify"]


@pytest.mark.parametrize("points, symptom, cause, confidence", [
    (1, "unknown", "inconclusive", 0.2),
    (2, "unknown", "inconclusive", 0.2),
    (3, "none", "false_alarm", 0.45),   # read and quiet, but little to go on
    (6, "none", "false_alarm", 0.85),
])
def test_too_few_points_to_judge_are_unknown(tmp_path, points, symptom, cause, confidence):
    text = "".join(f"step {10 * i} | loss {2.50 - 0.01 * i:.3f} | lr 1e-4\n" for i in range(points))
    got = bundle_with_log(tmp_path, text)
    assert (got["symptom"], got["primary"]["cause"], got["primary"]["confidence"]) == (symptom, cause, confidence)
    if symptom == "unknown":
        assert any(f"only {points} logged loss value" in item for item in got["missing"])


# ------------------------------------------------------------------ 2, 3. sparse logs, peaks


@pytest.mark.parametrize("name, symptom, spike", [
    ("litgpt-codellama-jump-stays-high", "spike_no_recovery", 1152),   # the second logged point
    ("bloom104b-exp1-jump-no-recovery", "spike_no_recovery", 7010),     # three points, an elision
    ("bloom104b-exp2-climb-after-warmup", "spike_no_recovery", 6940),   # a 60 % climb, its top
    ("bloom176b-lm-loss-spike-recovered", "single_spike", 31219),       # the peak, not the first bump
    ("mindyolo-overflow-loss-tens-of-thousands", "spike_no_recovery", 400),
    ("deepj-keras-epoch-loss-jump", "spike_no_recovery", 66),
])
def test_sparse_logs_and_the_peak_of_the_excursion(tmp_path, name, symptom, spike):
    got = case(name, tmp_path)
    assert (got["symptom"], got["spike_step"]) == (symptom, spike)


def test_precursors_come_before_the_peak_and_the_onset_is_the_excursions_start(tmp_path):
    got = case("bloom176b-lm-loss-spike-recovered", tmp_path)
    assert got["onset_step"] == 31215  # grad norm 0.24 -> 0.95 -> ... -> 960 before the 5.10 peak
    assert got["primary"]["cause"] == "grad_explosion"


def test_a_steady_early_rise_of_the_grad_norm_is_the_trend_not_a_precursor():
    steps = np.arange(1, 70)
    grad = 0.12 * 1.06 ** np.minimum(steps, 30)  # warm-up: +6 % a step, then flat
    rng = np.random.default_rng(7)
    grad = grad * np.exp(rng.normal(0, 0.03, len(steps)))
    flags = departures(pd.Series(grad), end=32)
    assert not flags[:32].any()
    spiked = grad.copy()
    spiked[28:32] = spiked[27] * np.array([1.8, 3.5, 7.0, 14.0])  # a real climb into the spike
    flags = departures(pd.Series(spiked), end=32)
    assert flags[28:32].all() and not flags[:28].any()


# ------------------------------------------------------------------ 4, 7, 9. formats and absurd levels


@pytest.mark.parametrize("name, symptom, cause", [
    ("megatron-llm-falcon40b-lm-loss-vanishes", "instant_nan", None),
    ("megatron-ds-grad-norm-nan-no-lm-loss", "instant_nan", None),
    ("megatron-bridge-wrapped-record-grad-norm-nan", "instant_nan", None),
    ("modernbert-hf-grad-norm-nan-loss-zero", "instant_nan", None),
    ("xtuner-mmengine-grad-norm-nan", "instant_nan", None),      # a NaN grad norm on the last lines
    ("yanmtt-bare-step-table-nan-reload", "instant_nan", None),
    ("deepspeed-hf-loss-scale-to-minimum", "unknown", "loss_scale_collapse"),
    ("fairseq-overflow-to-min-loss-scale", "unknown", "loss_scale_collapse"),
    ("cogvideo-deepspeed-overflow-startup", "unknown", "inconclusive"),  # start-up calibration
    ("opennmt-lr-above-one-absurd-loss", "spike_no_recovery", "lr_too_high"),
    ("bloom176b-throughput-drop-wrapped-lines", "none", "false_alarm"),
])
def test_formats_and_absurd_levels(tmp_path, name, symptom, cause):
    got = case(name, tmp_path)
    assert got["symptom"] == symptom
    if cause is not None:
        assert got["primary"]["cause"] == cause


def test_a_loss_stuck_at_exactly_zero_is_broken():
    result = classify(frame([2.1, 2.0, 1.98, 0.0, 0.0, 0.0]))
    assert (result.symptom, result.spike_step) == ("instant_nan", 1030)


def test_an_absurd_flat_loss_is_not_healthy():
    result = classify(frame([148890.0, 158771.0, 138000.0, 159760.0, 159738.0]))
    assert result.symptom == "spike_no_recovery" and result.spike_step == 1000


# ------------------------------------------------------------------ 5, 6, 10. what the job printed


@pytest.mark.parametrize("name, cause, culprits", [
    ("jade-node-uncorrectable-ecc", "gpu_ecc", []),           # the line names no host, rank or device
    ("deepfacelab-tf-ecc-uncorrectable", "gpu_ecc", ["node-0"]),  # device 0 of a one-node job
    ("torch-watchdog-ecc-multinode-rank-prefix", "gpu_ecc", []),  # rank 12 is on a node not in the bundle
    ("nccl-ib-port-error-flapping-link", "ib_link_flap", []),
    ("nccl-remote-error-connection-reset-ib", "nccl_error", []),
    ("gpu-burn-xid79-surprise-down", "gpu_xid", ["node-0"]),    # Xid 79 in plain dmesg, nothing to refute it
    ("returnn-gpu-pcie-aer-fatal", "gpu_xid", ["node-0"]),      # the GPU fell off PCIe: AER could not recover
])
def test_job_printed_and_node_side_errors(tmp_path, name, cause, culprits):
    got = case(name, tmp_path)
    assert got["primary"]["cause"] == cause
    assert got["culprit_nodes"] == culprits


def test_a_printed_ecc_error_ties_to_the_node_of_the_rank_that_printed_it(tmp_path):
    text = ("[rank12]:[E817 17:40:34.227531918 ProcessGroupNCCL.cpp:1515] [PG 0 (default_pg) Rank 12] Process group "
            "watchdog thread terminated with exception: CUDA error: uncorrectable ECC error encountered\n")
    got = bundle_with_log(tmp_path, text, nodes=["gpu-001", "gpu-002"])
    assert got["primary"]["cause"] == "gpu_ecc" and got["culprit_nodes"] == ["gpu-002"]
    assert got["culprit_ranks"] == [12]


def test_an_error_in_a_nodes_own_log_ties_to_that_node(tmp_path):
    writer = BundleWriter(tmp_path)
    writer.write_incident(incident(["gpu-001", "gpu-002"]))
    writer.write_probe_output("gpu-002", "train.log", b"RuntimeError: CUDA error: uncorrectable ECC error encountered\n")
    got = diagnose(tmp_path).to_json()
    assert got["culprit_nodes"] == ["gpu-002"]
    assert got["findings"][0]["evidence"][0]["file"] == "nodes/gpu-002/train.log"


def test_a_node_failure_is_a_finding_about_the_node_that_convicts_nobody(tmp_path):
    text = "".join(f"step {s} loss {2.0 - s / 1e4:.4f}\n" for s in range(10, 200, 10))
    text += "srun: error: Node failure on gpu-002\nsrun: error: gpu-001: task 3: Killed\n"
    got = bundle_with_log(tmp_path, text, nodes=["gpu-001", "gpu-002"])
    failure = [f for f in got["findings"] if f["layer"] == "hardware" and f["cause"] == "inconclusive"]
    assert failure and failure[0]["nodes"] == ["gpu-002"] and failure[0]["confidence"] < 0.5
    assert got["culprit_nodes"] == [] and got["primary"]["cause"] != "inconclusive"


def test_an_unreachable_node_among_answering_peers_is_a_finding(tmp_path):
    writer = BundleWriter(tmp_path)
    writer.write_incident(incident(["gpu-001", "gpu-002"]))
    writer.write_unreachable("gpu-002", {"kernel": "dmesg --time-format iso"})
    writer.write_probe_output("gpu-001", "kernel.log", b"2026-11-29T17:00:00,000000+00:00 eth0: link up\n")
    got = diagnose(tmp_path).to_json()
    finding = next(f for f in got["findings"] if f["cause"] == "inconclusive" and f["layer"] == "hardware")
    assert finding["nodes"] == ["gpu-002"] and "could not be reached" in finding["summary"]
    assert "nodes/gpu-002: unreachable" in got["missing"] and got["culprit_nodes"] == []


# ------------------------------------------------------------------ 8. restarts in the log


def _replayed_log(shift: float) -> str:
    rng = np.random.default_rng(3)
    first = 2.0 + rng.normal(0, 0.02, 60)
    lines = [f"step {100 + 10 * i} loss {value:.4f}" for i, value in enumerate(first)]
    again = first[30:] + shift + rng.normal(0, 0.002, 30)  # resumed from step 400
    lines += [f"step {400 + 10 * i} loss {value:.4f}" for i, value in enumerate(again)]
    return "\n".join(lines) + "\n"


def test_replayed_steps_with_other_losses_say_the_data_order_was_lost(tmp_path):
    got = bundle_with_log(tmp_path, _other_order())
    finding = next(f for f in got["findings"] if f["cause"] == "rng_not_restored")
    assert finding["step"] == 400 and "no batch fingerprints" in finding["summary"]


def _other_order() -> str:
    rng = np.random.default_rng(4)
    first = 2.0 + rng.normal(0, 0.03, 60)
    lines = [f"step {100 + 10 * i} loss {value:.4f}" for i, value in enumerate(first)]
    again = 2.02 + rng.normal(0, 0.03, 30)  # other batches: as far from the first run as step from step
    lines += [f"step {400 + 10 * i} loss {value:.4f}" for i, value in enumerate(again)]
    return "\n".join(lines) + "\n"


def test_replayed_steps_that_match_rule_the_data_order_out(tmp_path):
    got = bundle_with_log(tmp_path, _replayed_log(0.0))
    assert not [f for f in got["findings"] if f["cause"] == "rng_not_restored"]
    assert any("reproduce the first run's losses" in item["why"] for item in got["ruled_out"])


def test_rng_not_restored_is_never_guessed_for_a_run_that_never_resumed(tmp_path):
    rng = np.random.default_rng(1)
    loss = 2.0 + np.clip(np.arange(400) - 200, 0, None) * 0.002 + rng.normal(0, 0.01, 400)
    text = "".join(f"step {10 * i} loss {value:.4f}\n" for i, value in enumerate(loss))
    got = bundle_with_log(tmp_path, text)
    assert got["symptom"] == "creeping_increase"
    # No rule holds: a guess is labelled a guess, and its direction leaves the data order out.
    assert got["primary"] == {"layer": "none", "cause": "inconclusive", "confidence": 0.2}
    summary = got["findings"][0]["summary"]
    assert "never resumed" in summary and "a direction, not a finding" in summary
    assert not [f for f in got["findings"] if f["cause"] == "rng_not_restored"]


# ------------------------------------------------------------------ 11. harder incidents


def test_power_brake_throttling_is_throttling_and_the_software_power_cap_is_not():
    from types import SimpleNamespace

    from spikeops.diagnosis.hardware import _throttle_reasons

    brake = SimpleNamespace(clock_event_reasons={"sw_power_cap": False, "hw_power_brake_slowdown": True})
    capped = SimpleNamespace(clock_event_reasons={"sw_power_cap": True, "hw_power_brake_slowdown": False})
    assert _throttle_reasons(brake) == ["hw_power_brake_slowdown"]
    assert _throttle_reasons(capped) == []


def test_a_window_located_by_the_few_timed_lines_keeps_an_untimed_spike(tmp_path):
    rows = []
    for step in range(1, 301):
        row: dict[str, Any] = {"step": step, "loss": 2.0 + 0.01 * ((step * 7) % 5) / 5}
        if step % 100 == 0:  # only every 100th line carries a time (DeepSpeed's own lines)
            row["time"] = f"2026-11-29T{15 + step // 100:02d}:00:00Z"
        rows.append(row)
    rows[249]["loss"] = 9.0  # step 250: untimed, between 16:00 (step 200) and 17:00 (step 300)
    writer = BundleWriter(tmp_path)
    writer.write_incident(incident(["n1"], window={"start": "2026-11-29T16:40:00Z", "end": "2026-11-29T17:05:00Z"}))
    writer.write_jsonl("metrics.jsonl", rows)
    got = diagnose(tmp_path).to_json()
    assert (got["symptom"], got["spike_step"]) == ("single_spike", 250)


def test_a_rank_departing_while_the_global_loss_barely_moves_is_found(tmp_path):
    writer = BundleWriter(tmp_path)
    writer.write_incident(incident(["n1", "n2"], window=None))
    writer.write_jsonl("metrics.jsonl", [{"step": s, "loss": 2.0 + 0.002 * (s % 3)} for s in range(1, 201)])
    ranks = []
    for step in range(1, 201):
        for rank in range(16):
            loss = 2.0 + 0.01 * ((step + rank) % 3)
            if rank == 9 and step > 185:
                loss *= 12  # 12x its peers for the last 15 steps: the mean moves under 1 %
            ranks.append({"step": step, "rank": rank, "loss": loss, "grad_norm": 1.0})
    writer.write_jsonl("ranks.jsonl", ranks)
    got = diagnose(tmp_path).to_json()
    assert got["symptom"] == "none"
    assert got["primary"]["cause"] == "rank_data_misalignment" and got["culprit_ranks"] == [9]
    assert got["culprit_nodes"] == []


@pytest.mark.slow
def test_train_tiny_onset_is_not_warmup(tmp_path):
    """examples/train_tiny.py with an overlong sample on rank 1 at step 33 (seed 7): the
    early grad-norm rise is warm-up, so the onset is 33 and the step-20 checkpoint is used."""
    pytest.importorskip("torch")
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tiny_classes", ROOT / "examples" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "R"
    module.main(["--out", str(out), "--inject-overlong", "33", "--inject-rank", "1", "--seed", "7", "--steps", "70"])
    got = diagnose(out).to_json()
    assert got["primary"]["cause"] == "overlong_sample" and got["culprit_ranks"] == [1]
    assert (got["spike_step"], got["onset_step"]) == (33, 33)
    assert got["resume_from"]["step"] == 20
    assert any(a["kind"] == "resume" for a in got["actions"])


# ------------------------------------------------------------------ healthy runs never fire


def _curve_frame(curve: watch_curves.Curve, every: int, start: int, points: int) -> pd.DataFrame:
    index = np.arange(start, min(len(curve.step), start + every * points), every)
    grad = curve.grad_norm[index]
    scale = curve.loss_scale[index] if curve.loss_scale is not None else np.full(len(index), np.nan)
    return pd.DataFrame({
        "loss": curve.loss[index], "loss_bad": np.zeros(len(index), dtype=bool),
        "grad_norm": np.where(np.isfinite(grad), grad, np.nan), "grad_bad": ~np.isfinite(grad),
        "lr": curve.lr[index], "loss_scale": scale, "throughput": curve.throughput[index],
        "skipped": ~np.isfinite(grad), "line": np.arange(1, len(index) + 1),
    }, index=curve.step[index])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), every=st.sampled_from([1, 10, 25, 50, 100]),
       start=st.integers(0, 5000), points=st.integers(1, 120), fp16=st.booleans())
def test_healthy_runs_logged_sparsely_and_cut_into_excerpts_never_fire(seed, every, start, points, fp16):
    curve = watch_curves.healthy(seed, n=6000, fp16=fp16)
    data = _curve_frame(curve, every, min(start, 5999), points)
    result = classify(data)
    assert result.symptom in ("none", "unknown"), (result, seed, every, start, points)
    if len(data) >= 3:
        assert result.symptom == "none"


def test_a_fine_tune_whose_tiny_loss_rounds_to_zero_is_not_broken():
    result = classify(frame([0.05, 0.012, 0.003, 0.0007, 0.0, 0.0, 0.0]))
    assert result.symptom == "none"


def test_an_echoed_xid_with_its_gpu_address_ties_the_node_of_a_one_node_job(tmp_path):
    text = "[rank3]: NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"
    got = bundle_with_log(tmp_path, text, nodes=["gpu-007"])
    assert got["primary"]["cause"] == "gpu_xid" and got["culprit_nodes"] == ["gpu-007"]
    many = bundle_with_log(tmp_path / "two", "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n",
                           nodes=["gpu-007", "gpu-008"])
    assert many["primary"]["cause"] == "gpu_xid" and many["culprit_nodes"] == []


def test_the_scaler_at_its_minimum_is_a_collapse_even_alone(tmp_path):
    # DeepSpeed's exception as issue threads quote it (LlamaFactory #251, DeepSpeedExamples #418).
    text = ("Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.\n"
            "  4%|▍         | 17/387 [05:25<1:57:56, 19.13s/it]\n")
    got = bundle_with_log(tmp_path, text)
    assert got["symptom"] == "unknown"
    assert got["primary"] == {"layer": "numeric", "cause": "loss_scale_collapse", "confidence": 0.8}


def test_a_hardware_error_that_names_no_node_stops_the_job_and_asks_for_the_nodes_evidence(tmp_path):
    got = case("jade-node-uncorrectable-ecc", tmp_path)
    kinds = [action["kind"] for action in got["actions"]]
    assert kinds[0] == "stop_job" and "observe" not in kinds and "isolate_nodes" not in kinds
    collect = next(action for action in got["actions"] if action["kind"] == "collect_evidence")
    assert "nvidia-smi -q" in collect["what"][0]
