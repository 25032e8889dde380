"""The diagnosis and the watcher on the third round of real-world classes (issue 28).

Each test states a class as a behaviour, on real lines where there are some
(tests/fixtures/step-lines, tests/fixtures/watch, tests/fixtures/real-incidents) and on lines in
the real tools' formats where a class needs a shape no captured log has (a checkpoints.json, a
rank map). The negative half of each rule is tested beside it: what must not fire.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from spikeops.bundle import BundleWriter
from spikeops.diagnosis import diagnose
from spikeops.diagnosis.symptom import classify
from spikeops.response import approval_gate
from spikeops.watch.detect import Detector, WatchConfig
from spikeops.watch.sources import follow_log
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
STEP_LINES = FIXTURES / "step-lines"
HEALTHY_PER_STEP = FIXTURES / "watch" / "modded-nanogpt-modernarch-steps-500-1300.log"
WIDE = {"start": "2000-01-01T00:00:00Z", "end": "2030-01-01T00:00:00Z"}


def incident(nodes: list[str], window: dict[str, str] | None = WIDE, created: str = "2026-11-29T18:03:12Z",
             **job: Any) -> dict[str, Any]:
    return {
        "incident_id": "inc-round3", "created": created,
        "alert": {"source": "test", "received": created, "payload": {}},
        "job": {"id": "1", "scheduler": "slurm", "name": "t", "nodes": nodes, "gpus_per_node": 8, "ranks": {},
                "started": None, "resumed_from": None, **job},
        "window": window,
    }


def diagnose_log(tmp_path: Path, text: str, nodes: list[str] | None = None, *, checkpoints: list | None = None,
                 window: dict[str, str] | None = WIDE, created: str = "2026-11-29T18:03:12Z",
                 **job: Any) -> dict[str, Any]:
    writer = BundleWriter(tmp_path)
    writer.write_incident(incident(nodes or ["n1"], window, created, **job))
    if checkpoints is not None:
        writer.write_checkpoints(checkpoints)
    (tmp_path / "train.log").write_text(text)
    return diagnose(tmp_path).to_json()


def fixture(name: str) -> str:
    return (STEP_LINES / name).read_text(encoding="utf-8")


def kinds(got: dict[str, Any]) -> list[str]:
    return [action["kind"] for action in got["actions"]]


# ------------------------------------------------------------------ a guess is a guess


def test_a_nan_no_rule_explains_is_inconclusive_with_the_seeds_direction_and_what_to_collect(tmp_path):
    got = diagnose_log(tmp_path, fixture("maskrcnn-iteration-losses.log"))
    assert got["symptom"] == "instant_nan"
    assert got["primary"] == {"layer": "none", "cause": "inconclusive", "confidence": 0.2}
    summary = got["findings"][0]["summary"]
    assert "numeric layer" in summary and "a direction, not a finding" in summary
    assert "grad norm" in summary and "learning rate" in summary and "detect_anomaly" in summary
    assert got["culprit_nodes"] == []
    # The matrix's protective move does not wait for a cause; the confirmation test is the seed's.
    assert kinds(got)[:3] == ["stop_job", "preserve_state", "detect_anomaly"]
    assert "collect_evidence" in kinds(got) and "isolate_nodes" not in kinds(got)
    assert not any(f["cause"] == "grad_explosion" for f in got["findings"])  # the old guess is gone


def test_an_inconclusive_resume_is_always_a_persons_decision(tmp_path):
    checkpoints = [{"step": 2, "path": "/ckpt/step-2", "verified": True, "problem": None}]
    got = diagnose_log(tmp_path, fixture("maskrcnn-iteration-losses.log"), checkpoints=checkpoints)
    assert got["primary"]["cause"] == "inconclusive" and got["resume_from"] == {"step": 2, "path": "/ckpt/step-2"}
    assert {"kind": "resume", "step": 2, "path": "/ckpt/step-2"} in got["actions"]
    for policy in ("auto-hardware", "never"):
        gate = approval_gate(policy, got, stopped=True)
        assert gate.action == "resume" and gate.ask, policy


# ------------------------------------------------------------------ warm-up


def test_a_nan_while_the_lr_still_climbs_in_warmup_is_lr_too_high(tmp_path):
    # detectron2's own lines: the LR ramps 0.0002 -> 0.0014, then its NaN check fires.
    text = fixture("detectron2.log") + "FloatingPointError: Loss became infinite or NaN at iteration=159!\n"
    got = diagnose_log(tmp_path, text)
    assert (got["symptom"], got["spike_step"]) == ("instant_nan", 159)
    assert got["primary"]["cause"] == "lr_too_high" and got["primary"]["confidence"] >= 0.5
    assert "warm-up" in got["findings"][0]["summary"]


def test_a_nan_at_a_flat_lr_is_not_blamed_on_the_lr(tmp_path):
    got = diagnose_log(tmp_path, fixture("tf-faster-rcnn.log"))  # lr 0.01 throughout, NaN from the start
    assert got["symptom"] == "instant_nan"
    assert got["primary"]["cause"] == "inconclusive"


# ------------------------------------------------------------------ checkpoints the job printed

LOAD_ERROR = """load checkpoint from local path: work_dirs/formal_basicvsr_plusplus_360new_cb/iter_90000.pth
Traceback (most recent call last):
  File "tools/test.py", line 99, in main
    _ = load_checkpoint(model, args.checkpoint, map_location='cpu')
  File "D:\\Anaconda3\\envs\\pytorch\\lib\\site-packages\\torch\\serialization.py", line 600, in load
    with _open_zipfile_reader(opened_file) as opened_zipfile:
RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory
"""


def test_a_checkpoint_the_job_could_not_load_is_corrupted_and_the_resume_skips_it(tmp_path):
    """The run went NaN; its restart could not load the newest checkpoint (the path it printed):
    the diagnosis names that checkpoint, quarantines it, and resumes from the one before."""
    folder = "/data/work_dirs/formal_basicvsr_plusplus_360new_cb"
    checkpoints = [{"step": 2, "path": f"{folder}/iter_85000.pth", "verified": True, "problem": None},
                   {"step": 3, "path": f"{folder}/iter_90000.pth", "verified": True, "problem": None}]
    got = diagnose_log(tmp_path, fixture("maskrcnn-iteration-losses.log") + LOAD_ERROR, checkpoints=checkpoints)
    finding = next(f for f in got["findings"] if f["cause"] == "corrupted_checkpoint")
    assert finding["layer"] == "checkpoint" and finding["confidence"] >= 0.5
    assert "iter_90000.pth" in finding["summary"]
    assert got["primary"]["cause"] == "corrupted_checkpoint"
    quarantine = next(a for a in got["actions"] if a["kind"] == "quarantine_checkpoint")
    assert quarantine["path"].endswith("iter_90000.pth")
    assert got["resume_from"] == {"step": 2, "path": f"{folder}/iter_85000.pth"}
    clean = diagnose_log(tmp_path / "clean", fixture("maskrcnn-iteration-losses.log"), checkpoints=checkpoints)
    assert clean["resume_from"] == {"step": 3, "path": f"{folder}/iter_90000.pth"}  # nothing said it was bad


@pytest.mark.parametrize("saving, expected", [(True, True), (False, False)])
def test_no_space_left_is_checkpoint_evidence_only_while_saving(tmp_path, saving, expected):
    frame = ('  File "/opt/conda/lib/python3.7/site-packages/torch/serialization.py", line 379, in save\n'
             if saving else '  File "/opt/conda/lib/python3.7/site-packages/datasets/cache.py", line 88, in write\n')
    text = fixture("detectron2.log") + "Traceback (most recent call last):\n" + frame + \
        "OSError: [Errno 28] No space left on device\n"
    got = diagnose_log(tmp_path, text)
    assert any(f["cause"] == "corrupted_checkpoint" for f in got["findings"]) is expected
    assert got["primary"]["cause"] != "false_alarm"  # the job died either way


# ------------------------------------------------------------------ devices, nodes, crashes

WATCHDOG = ("[rank9]:[E1224 13:23:05.483840160 ProcessGroupNCCL.cpp:1536] [PG 0 (default_pg) Rank 9] Process group "
            "watchdog thread terminated with exception: CUDA error: unknown error\n")


def test_a_device_cuda_error_names_its_node_at_low_confidence_and_convicts_nobody(tmp_path):
    ranks = {str(rank): ("node-a" if rank < 8 else "node-b") for rank in range(16)}
    got = diagnose_log(tmp_path, fixture("detectron2.log") + WATCHDOG, ["node-a", "node-b"], ranks=ranks)
    finding = next(f for f in got["findings"] if f["layer"] == "hardware" and f["cause"] == "inconclusive")
    assert finding["nodes"] == ["node-b"] and finding["confidence"] <= 0.3 and 9 in finding["ranks"]
    assert got["culprit_nodes"] == [] and "isolate_nodes" not in kinds(got)


def test_slurm_node_failure_names_the_host(tmp_path):
    text = fixture("detectron2.log") + "srun: error: Node failure on gpu-node-18\n"
    got = diagnose_log(tmp_path, text, ["gpu-node-17", "gpu-node-18"])
    finding = next(f for f in got["findings"] if f["layer"] == "hardware" and f["cause"] == "inconclusive")
    assert finding["nodes"] == ["gpu-node-18"] and got["culprit_nodes"] == []


def test_a_crash_after_a_flat_loss_keeps_its_symptom_and_is_not_a_false_alarm(tmp_path):
    flat = fixture("detectron2.log").replace("lr: 0.000400", "lr: 0.000200")
    text = flat + "Traceback (most recent call last):\n  File \"tools/train_net.py\", line 161, in <module>\n" \
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    got = diagnose_log(tmp_path, text)
    assert got["symptom"] == "none"
    assert got["primary"]["cause"] == "inconclusive" and "died" in got["findings"][0]["summary"]
    quiet = diagnose_log(tmp_path / "quiet", flat)  # the same steps, no crash: a false alarm
    assert quiet["primary"]["cause"] == "false_alarm"


@pytest.mark.parametrize("created, inside", [("2026-05-19T07:10:00Z", True), ("2027-01-03T00:00:00Z", False)])
def test_a_yearless_syslog_xid_copied_into_the_job_log_takes_the_incidents_year(tmp_path, created, inside):
    """May 19 in a May 2026 incident is this incident's; in a January 2027 one it is last May's
    (the year before, never the future), outside the window: history."""
    line = ("May 19 07:08:57 gpu-node-17 kernel: [1234.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, "
            "GPU has fallen off the bus.\n")
    window = {"start": created[:11] + "06:00:00Z", "end": created[:11] + "08:00:00Z"}
    got = diagnose_log(tmp_path, fixture("detectron2.log") + line, ["gpu-node-17", "gpu-node-18"], window=window,
                       created=created)
    if inside:
        assert got["primary"]["cause"] == "gpu_xid" and got["culprit_nodes"] == ["gpu-node-17"]
    else:
        assert got["culprit_nodes"] == []


# ------------------------------------------------------------------ slowdowns


def _metrics(tmp_path: Path, loss: np.ndarray, throughput: np.ndarray) -> dict[str, Any]:
    writer = BundleWriter(tmp_path)
    writer.write_incident(incident(["n1"]))
    writer.write_jsonl("metrics.jsonl", [{"step": int(i), "loss": float(v), "throughput": float(t)}
                                         for i, (v, t) in enumerate(zip(loss, throughput, strict=True))])
    return diagnose(tmp_path).to_json()


def test_a_throughput_drop_with_a_flat_loss_is_a_slowdown_never_a_false_alarm(tmp_path):
    rng = np.random.default_rng(3)
    loss = 2.5 + rng.normal(0, 0.01, 400)
    throughput = np.where(np.arange(400) < 300, 150.0, 120.0) + rng.normal(0, 1.0, 400)
    got = _metrics(tmp_path, loss, throughput)
    assert got["symptom"] == "none"
    assert got["primary"]["cause"] == "inconclusive" and "throughput fell" in got["findings"][0]["summary"]
    assert any(f["layer"] == "hardware" and "slowdown" in f["summary"] for f in got["findings"])
    steady = _metrics(tmp_path / "steady", loss, 150.0 + rng.normal(0, 1.0, 400))
    assert steady["primary"]["cause"] == "false_alarm"


# ------------------------------------------------------------------ the scaler's calibration


def _scaled(scale: list[float]) -> pd.DataFrame:
    n = len(scale)
    return pd.DataFrame({"loss": 3.0 - 0.001 * np.arange(n), "loss_bad": np.zeros(n, dtype=bool),
                         "grad_norm": np.full(n, 1.0), "grad_bad": np.zeros(n, dtype=bool), "lr": np.full(n, 1e-4),
                         "loss_scale": scale, "throughput": np.full(n, np.nan),
                         "skipped": np.zeros(n, dtype=bool), "line": np.arange(1, n + 1)},
                        index=np.arange(1, n + 1) * 5)


@pytest.mark.parametrize("plateau_first, collapse", [(False, False), (True, True)])
def test_the_scalers_start_up_calibration_is_not_a_collapse(tmp_path, plateau_first, collapse):
    """2^32 halving to 2^15 in the run's first steps, then holding, is the scaler finding its
    level; the same fall after the scale had held for a long while is a collapse."""
    fall = [2.0 ** (32 - i) for i in range(18)]
    scale = ([2.0 ** 32] * 150 if plateau_first else []) + fall + [2.0 ** 15] * 100
    writer = BundleWriter(tmp_path)
    writer.write_incident(incident(["n1"]))
    frame = _scaled(scale)
    writer.write_jsonl("metrics.jsonl", [{"step": int(step), "loss": float(row.loss), "loss_scale": float(row.loss_scale),
                                          "grad_norm": 1.0, "lr": 1e-4} for step, row in frame.iterrows()])
    got = diagnose(tmp_path).to_json()
    assert any(f["cause"] == "loss_scale_collapse" for f in got["findings"]) is collapse
    if not collapse:
        assert any("calibration" in item["why"] for item in got["ruled_out"])


# ------------------------------------------------------------------ a run's own texture


def _records(path: Path) -> list[dict[str, Any]]:
    return list(follow_log(path, from_start=True, once=True))


def _flagged_by_median_noise(records: list[dict[str, Any]]) -> list[int]:
    """What the spike test alone (z > 6 against median noise, 10 % above the level) flags."""
    loss = pd.Series([r["loss"] for r in records], dtype=float)
    level = loss.rolling(50, min_periods=2).median().shift(1)
    noise = 1.4826 * loss.diff().abs().rolling(50, min_periods=1).median().shift(1) / math.sqrt(2)
    flags = ((loss - level) / noise > 6) & ((loss - level) / level > 0.1)
    return [records[i]["step"] for i in np.flatnonzero(flags.to_numpy())]


def test_a_healthy_per_step_log_pages_once_not_at_every_jump_it_makes():
    records = _records(HEALTHY_PER_STEP)
    assert len(_flagged_by_median_noise(records)) >= 4  # the jumps are there, beyond the median noise
    detector = Detector()
    for record in records:
        detector.feed(record)
    assert len(detector.incidents) <= 1
    assert len(detector.recorded) >= 3  # the jumps it makes routinely, recorded
    steps = [r["step"] for r in records]
    for jump in detector.recorded:  # each came back the next step
        after = records[steps.index(jump.step) + 1]["loss"]
        assert after < jump.value * 0.9


def test_a_routine_size_jump_that_stays_up_is_an_incident():
    records = _records(HEALTHY_PER_STEP)
    last, level = records[-1]["step"], records[-1]["loss"]
    stays = [{"step": last + i, "loss": level * 1.3} for i in range(1, 8)]
    detector = Detector()
    for record in records:
        detector.feed(record)
    before = len(detector.incidents)
    fired = [detector.feed(record) for record in stays]
    assert len(detector.incidents) == before + 1
    assert fired.index(next(a for a in fired if a is not None)) == WatchConfig().persist_steps - 1


def test_a_jump_that_stays_fires_with_a_short_history():
    """litgpt #628: 1.70 -> 11.46 at the second logged iteration and it stays up (the watcher
    once fired on nothing with so little history)."""
    records = _records(FIXTURES / "real-incidents" / "litgpt-codellama-jump-stays-high" / "train.log")
    detector = Detector()
    fired = [detector.feed(record) for record in records]
    incidents = [a for a in fired if a is not None]
    assert len(incidents) == 1 and incidents[0].kind == "loss_spike"
    assert incidents[0].step == records[1 + WatchConfig().persist_steps - 1]["step"]


def test_an_order_of_magnitude_fires_at_once_however_short_the_history():
    detector = Detector()
    fired = [detector.feed({"step": 500 + i, "loss": value}) for i, value in enumerate([2.1, 2.0, 31.0])]
    assert fired[:2] == [None, None] and fired[2] is not None and fired[2].kind == "loss_spike"


def test_the_diagnosis_does_not_call_a_routine_jump_a_spike(tmp_path):
    """The same healthy per-step log as a bundle whose window is its end: the jumps before the
    window are the run's texture, and the last stretch is judged against them."""
    text = HEALTHY_PER_STEP.read_text(encoding="utf-8")
    frame_steps = [int(line.split("/")[0].split(":")[1]) for line in text.splitlines() if "train_loss" in line]
    loss = [float(line.split("train_loss:")[1].split()[0]) for line in text.splitlines() if "train_loss" in line]
    frame = pd.DataFrame({"loss": loss, "loss_bad": False, "grad_norm": np.nan, "grad_bad": False, "lr": np.nan,
                          "loss_scale": np.nan, "throughput": np.nan, "skipped": False, "line": range(len(loss))},
                         index=frame_steps)
    assert classify(frame, focus_from=940).symptom == "none"   # 947 and 1106: jumps it made before
    assert classify(frame, focus_from=900).symptom == "single_spike"  # 919: larger than any before it


def test_watch_config_takes_the_texture_keys():
    config = WatchConfig.from_table({"persist_steps": 8, "jump_factor": 3, "routine_memory": 500,
                                     "routine_margin": 2.0, "order_of_magnitude": 20})
    assert (config.persist_steps, config.jump_factor, config.routine_memory) == (8, 3.0, 500)


def test_a_syslog_kernel_log_is_dated_in_the_incidents_year(tmp_path):
    """A node's kernel log in syslog form (no year): its Xid is placed in the incident's year
    and, inside the window, convicts the node (it was 'time unknown' before)."""
    writer = BundleWriter(tmp_path)
    window = {"start": "2026-05-19T06:00:00Z", "end": "2026-05-19T08:00:00Z"}
    writer.write_incident(incident(["gpu-node-17", "gpu-node-18"], window, "2026-05-19T07:10:00Z"))
    (tmp_path / "train.log").write_text(fixture("detectron2.log"))
    for node in ("gpu-node-17", "gpu-node-18"):
        (tmp_path / "nodes" / node).mkdir(parents=True)
    (tmp_path / "nodes" / "gpu-node-17" / "kernel.log").write_text(
        "May 19 07:01:02 gpu-node-17 kernel: [1200.1] usb 1-1: new high-speed USB device number 2\n"
        "May 19 07:08:57 gpu-node-17 kernel: [1234.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, "
        "GPU has fallen off the bus.\n")
    (tmp_path / "nodes" / "gpu-node-18" / "kernel.log").write_text(
        "May 19 07:01:02 gpu-node-18 kernel: [1200.1] usb 1-1: new high-speed USB device number 2\n")
    got = diagnose(tmp_path).to_json()
    xid = next(f for f in got["findings"] if f["cause"] == "gpu_xid")
    assert "2026-05-19T07:08:57" in xid["summary"]
    assert got["culprit_nodes"] == ["gpu-node-17"]
