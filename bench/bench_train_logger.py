"""Benchmark: what spikeops.train's logger costs a training step.

Per step, one process logs what a rank logs: a metrics row (rank 0), its per-rank row, and
its batch descriptor (fingerprint of 16 sample ids, their token counts). Measured against
two named baselines: a naive logger (json.dumps and a write + flush per record, as a quick
script does) and doing nothing. Run by hand: `python bench/bench_train_logger.py`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from spikeops.train import MetricsLogger

STEPS = 20_000


def _ids(step: int) -> list[str]:
    return [f"shard-{step % 97:04d}:{step * 16 + i}" for i in range(16)]


def spikeops_logger(directory: Path) -> float:
    counts = [512 + i for i in range(16)]
    t0 = time.perf_counter()
    with MetricsLogger(directory) as log:
        for step in range(STEPS):
            log.step(step, loss=2.5, lr=3e-4, grad_norm=0.9, loss_scale=65536.0, tokens=8192)
            log.rank_row(step, loss=2.5, grad_norm=0.9, mem_allocated_gb=61.2)
            log.batch(step, sample_ids=_ids(step), token_counts=counts, source="s3://corpus/shard")
    return (time.perf_counter() - t0) / STEPS


def naive_logger(directory: Path) -> float:
    counts = [512 + i for i in range(16)]
    t0 = time.perf_counter()
    with open(directory / "m.jsonl", "a") as m, open(directory / "r.jsonl", "a") as r, \
            open(directory / "b.jsonl", "a") as b:
        for step in range(STEPS):
            for handle, record in ((m, {"step": step, "loss": 2.5, "lr": 3e-4, "grad_norm": 0.9}),
                                   (r, {"step": step, "rank": 0, "loss": 2.5}),
                                   (b, {"step": step, "sample_ids": _ids(step), "tokens": counts})):
                handle.write(json.dumps(record) + "\n")
                handle.flush()
    return (time.perf_counter() - t0) / STEPS


def nothing(directory: Path) -> float:
    t0 = time.perf_counter()
    for step in range(STEPS):
        _ids(step)
    return (time.perf_counter() - t0) / STEPS


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name, fn in (("spikeops.train MetricsLogger (metrics + rank row + batch)", spikeops_logger),
                         ("baseline: naive json.dumps + write + flush per record", naive_logger),
                         ("baseline: nothing (building the id list only)", nothing)):
            best = min(fn(Path(tempfile.mkdtemp(dir=tmp))) for _ in range(3))
            rows.append((name, best))
    print(f"{STEPS:,} steps, best of 3")
    print("| logger | µs per step |")
    print("| --- | ---: |")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
