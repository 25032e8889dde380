"""The training-side logger: the bundle's step, rank and batch files, written by the job.

Half of the data layer is invisible unless the job records it: which samples were in the
spike batch, how long they were before truncation, whether the data order survived a resume.
This logger writes exactly the bundle formats (shared/spec/bundle.md), so the files of a
running job are evidence as they are, with no conversion at incident time:

- ``metrics.jsonl`` (rank 0): step, time, loss, lr, grad_norm, loss_scale, tokens, throughput;
- ``ranks.jsonl``: per-rank loss, grad norm, memory;
- ``batches.jsonl``: per-rank batch descriptors, ``fingerprint`` = a hash of the sample ids
  in order (the same on every run of the same data order), token counts before truncation,
  empty samples, source shard.

Cheap by construction: records are formatted into a buffer and written with one
``os.write`` per flush (every ``flush_every`` steps and at close). Files are opened with
``O_APPEND``, so several ranks may share one file: each flush lands whole, never
interleaved mid-line (a single append of whole lines is atomic on local file systems).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

__all__ = ["MetricsLogger", "fingerprint", "batch_record"]

_FILES = {"metrics": "metrics.jsonl", "ranks": "ranks.jsonl", "batches": "batches.jsonl"}


def fingerprint(sample_ids: Iterable[Any]) -> str:
    """A hash of the sample ids in order: equal exactly when the data order is equal."""
    joined = "\x1f".join(map(str, sample_ids)) + "\x1f"
    return hashlib.blake2b(joined.encode(), digest_size=16).hexdigest()


def batch_record(step: int, rank: int, sample_ids: Sequence[Any], token_counts: Sequence[int],
                 source: str | None = None, *, keep_ids: int = 64) -> dict[str, Any]:
    """One ``batches.jsonl`` record; ``token_counts`` are the counts before truncation."""
    counts = [int(c) for c in token_counts]
    record: dict[str, Any] = {
        "step": int(step), "rank": int(rank), "fingerprint": fingerprint(sample_ids),
        "num_samples": len(sample_ids), "max_tokens": max(counts, default=0), "min_tokens": min(counts, default=0),
        "num_empty": sum(1 for c in counts if c == 0),
        "sample_ids": [str(s) for s in sample_ids[:keep_ids]],
    }
    if source is not None:
        record["source"] = source
    return record


def _number(value: Any) -> Any:
    """Tensors and numpy scalars to plain numbers; NaN/Inf kept (written as bare tokens)."""
    if value is None or type(value) is float or type(value) is int:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


_ENCODER = json.JSONEncoder(allow_nan=True, separators=(",", ":"))


def _line(record: Mapping[str, Any]) -> str:
    """orjson where it can (several times faster); the stdlib for NaN/Inf, which orjson would
    write as null and the spec wants as bare tokens."""
    compact = {k: v for k, v in record.items() if v is not None}
    if any(type(v) is float and not math.isfinite(v) for v in compact.values()):
        return _ENCODER.encode(compact)
    return orjson.dumps(compact).decode()


class MetricsLogger:
    """Writes the bundle files into ``directory``. Use one per process::

        log = MetricsLogger("/ckpt/run7/spikeops", rank=rank)
        log.step(step, loss=loss, lr=lr, grad_norm=gn, loss_scale=scaler.get_scale(), tokens=n)
        log.rank(step, loss=loss, grad_norm=gn)        # every rank, when per-rank rows are wanted
        log.batch(step, sample_ids=ids, token_counts=lengths, source=shard)
        log.close()

    ``metrics.jsonl`` is written by rank 0 only (``step`` is a no-op elsewhere). With an
    ``exporter`` (``spikeops.train.exporter.PrometheusExporter``), each step's record is also
    what Prometheus scrapes; ``close`` closes it.
    """

    def __init__(self, directory: str | Path, *, rank: int = 0, flush_every: int = 20,
                 per_rank_files: bool = False, exporter: Any = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.flush_every = max(1, flush_every)
        self._buffers: dict[str, list[str]] = {name: [] for name in _FILES}
        self._fds: dict[str, int] = {}
        self._steps_since_flush = 0
        self._last_time: float | None = None
        self._lock = threading.Lock()
        self._suffix = f".rank{rank}" if per_rank_files else ""
        self.exporter = exporter
        self.closed = False

    def path(self, kind: str) -> Path:
        name = _FILES[kind]
        if self._suffix and kind != "metrics":
            name = name.replace(".jsonl", f"{self._suffix}.jsonl")
        return self.directory / name

    # ------------------------------------------------------------------ records
    def step(self, step: int, *, loss: Any, lr: Any = None, grad_norm: Any = None, loss_scale: Any = None,
             tokens: Any = None, throughput: Any = None, time_: float | None = None) -> None:
        """A ``metrics.jsonl`` row (rank 0 only). ``throughput`` defaults to tokens per
        second since the previous step when ``tokens`` is given."""
        if self.rank != 0:
            return
        now = time.time() if time_ is None else time_
        if throughput is None and tokens is not None and self._last_time is not None and now > self._last_time:
            throughput = float(_number(tokens)) / (now - self._last_time)
        self._last_time = now
        # Unix seconds (the spec allows them): formatting an ISO date costs more than the rest
        record = {"step": int(step), "time": round(now, 3),
                  "loss": _number(loss), "lr": _number(lr), "grad_norm": _number(grad_norm),
                  "loss_scale": _number(loss_scale), "tokens": _number(tokens),
                  "throughput": round(throughput, 3) if isinstance(throughput, float) and math.isfinite(throughput)
                  else _number(throughput)}
        self._add("metrics", record)
        if self.exporter is not None:
            self.exporter.observe(record)
        self._tick()

    def rank_row(self, step: int, *, loss: Any = None, grad_norm: Any = None, mem_allocated_gb: Any = None,
                 rank: int | None = None) -> None:
        """A ``ranks.jsonl`` row for this (or the given) rank; memory from torch.cuda when
        available and not given."""
        if mem_allocated_gb is None:
            mem_allocated_gb = _cuda_memory_gb()
        self._add("ranks", {"step": int(step), "rank": self.rank if rank is None else int(rank),
                            "loss": _number(loss), "grad_norm": _number(grad_norm),
                            "mem_allocated_gb": _number(mem_allocated_gb)})

    def batch(self, step: int, *, sample_ids: Sequence[Any], token_counts: Sequence[int], source: str | None = None,
              rank: int | None = None) -> dict[str, Any]:
        """A ``batches.jsonl`` record; returns it (its fingerprint feeds the resume check)."""
        record = batch_record(step, self.rank if rank is None else rank, sample_ids, token_counts, source)
        self._add("batches", record)
        return record

    # ------------------------------------------------------------------ writing
    def _add(self, kind: str, record: Mapping[str, Any]) -> None:
        if self.closed:
            raise ValueError("MetricsLogger is closed")
        with self._lock:
            self._buffers[kind].append(_line(record))

    def _tick(self) -> None:
        self._steps_since_flush += 1
        if self._steps_since_flush >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write what is buffered: one append per file, whole lines only."""
        with self._lock:
            for kind, lines in self._buffers.items():
                if not lines:
                    continue
                data = ("\n".join(lines) + "\n").encode()
                fd = self._fds.get(kind)
                if fd is None:
                    fd = self._fds[kind] = os.open(self.path(kind), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                lines.clear()
            self._steps_since_flush = 0

    def close(self) -> None:
        if self.closed:
            return
        self.flush()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self.closed = True
        if self.exporter is not None:
            self.exporter.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cuda_memory_gb() -> float | None:
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        return None
    return round(torch.cuda.memory_allocated() / 1e9, 3)


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")  # used when the job imported it; never imported here
