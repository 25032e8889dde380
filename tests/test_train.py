"""spikeops.train without the example: the logger's files, the guards, the filters, resume
hygiene and the anomaly locator (with real torch where it needs it)."""

from __future__ import annotations

import json
import multiprocessing
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from spikeops.probes import bundle_files
from spikeops.probes.training_log import parse_metrics_jsonl
from spikeops.train import (
    AnomalyLocator,
    DataOrderWarning,
    FilterStats,
    FingerprintCheck,
    GradGuard,
    MetricsLogger,
    NanGuard,
    NonFiniteLoss,
    capture_state,
    filter_samples,
    fingerprint,
    load_state,
    on_checkpoint_saved,
    restore_state,
)


def test_importable_without_torch() -> None:
    code = "import sys, spikeops.train; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_logger_writes_the_bundle_formats(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, flush_every=3) as log:
        for step in range(1, 8):
            log.step(step, loss=2.0 / step, lr=3e-4, grad_norm=0.9, loss_scale=65536.0, tokens=4096,
                     time_=1_700_000_000 + step)
            log.rank_row(step, loss=2.0, grad_norm=0.5, rank=3)
            log.batch(step, sample_ids=[f"s:{step}", "s:0"], token_counts=[17, 0], source="shard-1")
        log.step(8, loss=float("nan"), time_=1_700_000_008)
    metrics = parse_metrics_jsonl((tmp_path / "metrics.jsonl").read_text())
    assert [r.step for r in metrics.records] == list(range(1, 9)) and not metrics.gaps
    assert metrics.records[-1].nan and metrics.records[1].throughput == pytest.approx(4096.0)
    ranks = bundle_files.parse_ranks((tmp_path / "ranks.jsonl").read_text())
    batches = bundle_files.parse_batches((tmp_path / "batches.jsonl").read_text())
    assert not ranks.gaps and not batches.gaps
    first = json.loads((tmp_path / "batches.jsonl").read_text().splitlines()[0])
    assert first == {"step": 1, "rank": 0, "fingerprint": fingerprint(["s:1", "s:0"]), "num_samples": 2,
                     "max_tokens": 17, "min_tokens": 0, "num_empty": 1, "sample_ids": ["s:1", "s:0"],
                     "source": "shard-1"}
    assert fingerprint(["a", "b"]) != fingerprint(["b", "a"])  # the order is the point


def _worker(directory: str, rank: int) -> None:
    with MetricsLogger(directory, rank=rank, flush_every=7) as log:
        for step in range(500):
            log.rank_row(step, loss=1.0 + rank, grad_norm=0.5)
            log.batch(step, sample_ids=[f"r{rank}:{step}:{i}" for i in range(8)], token_counts=[100] * 8)
            log.step(step, loss=1.0)


def test_several_processes_share_the_files_without_torn_lines(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_worker, args=(str(tmp_path), rank)) for rank in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    lines = (tmp_path / "batches.jsonl").read_text().splitlines()
    assert len(lines) == 4 * 500 and all(json.loads(line)["num_samples"] == 8 for line in lines)
    assert len((tmp_path / "ranks.jsonl").read_text().splitlines()) == 2000
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 500  # rank 0 only


def test_grad_guard_clips_alarms_on_a_climb_and_flags_nonfinite() -> None:
    guard = GradGuard(max_norm=1.0, z_threshold=3.0, warmup=20)
    rng = random.Random(0)
    for step in range(100):
        check = guard.check(0.8 + rng.gauss(0, 0.05), step)
        assert not check.alarm
    climb = [guard.check(value, 100 + i) for i, value in enumerate((1.0, 1.4, 2.5, 6.0))]
    assert climb[-1].alarm and climb[-1].clipped and guard.alarms[0][0] <= 103
    assert guard.check(float("inf"), 200).nonfinite


def test_nan_guard_records_alerts_once_and_can_stop(tmp_path: Path) -> None:
    posted = []
    guard = NanGuard(tmp_path / "nan.json", webhook="http://127.0.0.1:8787/alerts/generic", webhook_token="t0k",
                     job="4412", post=lambda url, body, headers: posted.append((url, json.loads(body), headers)))
    assert guard.check(1, 2.5)
    assert not guard.check(7, float("nan")) and not guard.check(8, float("inf"))
    assert json.loads((tmp_path / "nan.json").read_text())["step"] == 7 and len(posted) == 1
    assert posted[0][1]["alerts"][0]["labels"] == {"alertname": "TrainingLossNaN", "job": "4412", "step": "7"}
    assert posted[0][2]["Authorization"] == "Bearer t0k"
    with pytest.raises(NonFiniteLoss):
        NanGuard(raise_on_nan=True).check(3, float("nan"))
    unreachable = NanGuard(webhook="http://127.0.0.1:9/alerts")  # nothing listens: the loop goes on
    assert not unreachable.check(1, float("nan"))


def test_filters_truncate_drop_empty_and_dedup() -> None:
    samples = [("a", [1, 2, 3]), ("b", []), ("c", [1, 2, 3]), ("d", list(range(10))), ("e", [4])]
    stats = FilterStats()
    kept = list(filter_samples(samples, max_length=4, tokens=lambda s: s[1], set_tokens=lambda s, cut: (s[0], cut),
                               key=lambda s: s[0], stats=stats))
    assert kept == [("a", [1, 2, 3]), ("d", [0, 1, 2, 3]), ("e", [4])]
    assert (stats.seen, stats.kept, stats.empty, stats.duplicate, stats.truncated, stats.longest) == (5, 3, 1, 1, 1, 10)
    assert stats.truncated_ids == ["d"]


def test_rng_state_round_trip_and_the_fingerprint_check(tmp_path: Path) -> None:
    import numpy
    import torch

    random.seed(1), numpy.random.seed(1), torch.manual_seed(1)
    state = capture_state(sampler_position=42)
    before = (random.random(), float(numpy.random.rand()), float(torch.rand(1)))
    random.seed(9), numpy.random.seed(9), torch.manual_seed(9)
    assert restore_state(state) == 42
    assert (random.random(), float(numpy.random.rand()), float(torch.rand(1))) == before

    reference = tmp_path / "batches.jsonl"
    reference.write_text("".join(json.dumps({"step": s, "rank": 0, "fingerprint": fingerprint([s])}) + "\n"
                                 for s in range(100, 130)))
    good = FingerprintCheck(reference, steps=10)
    assert all(good.observe(s, fingerprint([s])) for s in range(101, 111)) and good.ok and good.matched == 10
    bad = FingerprintCheck(reference, steps=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(101, 111):
            bad.observe(s, fingerprint([s + 1000]))
    assert not bad.ok and len(bad.mismatches) == 10
    assert [w.category for w in caught] == [DataOrderWarning]  # one warning, not ten


def test_checkpoint_hook_writes_state_and_a_verifying_manifest(tmp_path: Path) -> None:
    from spikeops.checkpoints import verify

    ckpt = tmp_path / "step-100"
    ckpt.mkdir()
    (ckpt / "model.pt").write_bytes(b"weights" * 1000)
    future = on_checkpoint_saved(ckpt, 100, sampler_position=800)
    future.result(timeout=30)
    assert load_state(ckpt)["sampler_position"] == 800
    report = verify(ckpt)
    assert report.ok and {e.path for e in report.manifest.files} == {"model.pt", "spikeops-train-state.pkl"}


def test_anomaly_locator_names_the_operator(caplog) -> None:
    import torch

    locator = AnomalyLocator(steps=2, reraise=False)
    x = torch.tensor([1.0, -1.0], requires_grad=True)
    with locator.step(11):
        (torch.sqrt(x) * 0).sum().backward()
    assert locator.operator == "SqrtBackward0" and locator.step_found == 11
    assert "spikeops: first NaN at step 11: produced by SqrtBackward0" in caplog.text
    with locator.step(12):  # found: the rest of the run goes at full speed
        assert not torch.is_anomaly_enabled()
