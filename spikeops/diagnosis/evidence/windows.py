"""Per-step JSONL files (``ranks.jsonl``, ``batches.jsonl``) read only around the trouble: a
binary search by byte offset when the file is in step order, as the spec writes it."""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path
from typing import Any
import orjson
from spikeops.probes.bundle_files import (
    BatchRecord,
    RankRecord,
    read_float,
)
from spikeops.probes.base import clip
from spikeops.diagnosis.evidence.metrics import (
    _count_newlines,
)

__all__ = ["Row", "first_step", "read_jsonl_window", "rank_records", "batch_records"]


# --------------------------------------------------------------------- JSONL step windows


def _load(line: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            obj = json.loads(line)  # NaN / Infinity tokens (every rank's row at a NaN step)
        except (ValueError, RecursionError):
            return None
    return obj if type(obj) is dict else None


def _step_of(line: bytes) -> int | None:
    obj = _load(line)
    step = obj.get("step") if obj is not None else None
    return step if type(step) is int else None


def _line_at(mm: mmap.mmap, offset: int) -> tuple[int, int]:
    """(start, end) of the first complete line starting at or after ``offset``."""
    start = offset if offset == 0 else mm.find(b"\n", offset - 1) + 1
    if start <= 0 and offset > 0:
        return len(mm), len(mm)
    end = mm.find(b"\n", start)
    return start, (len(mm) if end < 0 else end)


def _first_offset_at_or_after(mm: mmap.mmap, target: int) -> int:
    """Byte offset of the first line whose step >= target (file in step order)."""
    lo, hi = 0, len(mm)
    while lo < hi:
        mid = (lo + hi) // 2
        start, end = _line_at(mm, mid)
        if start >= len(mm):
            hi = mid
            continue
        step = _step_of(mm[start:end])
        if step is None or step >= target:
            hi = mid
        else:
            lo = end + 1
    start, _ = _line_at(mm, lo)
    return start


def _sorted_by_step(mm: mmap.mmap, samples: int = 33) -> bool:
    steps = []
    size = len(mm)
    for index in range(samples):
        start, end = _line_at(mm, size * index // samples)
        if start < size:
            step = _step_of(mm[start:end])
            if step is not None:
                steps.append(step)
    return all(a <= b for a, b in zip(steps, steps[1:]))


Row = tuple[int, dict[str, Any], bytes]


def first_step(path: Path) -> int | None:
    """The step of a JSONL file's first readable line (files are in step order)."""
    if not path.is_file():
        return None
    with open(path, "rb") as handle:
        for _ in range(100):
            line = handle.readline(1 << 20)
            if not line:
                return None
            step = _step_of(line)
            if step is not None:
                return step
    return None


def read_jsonl_window(path: Path, lo: int, hi: int, *, limit: int = 2_000_000) -> tuple[list[Row], list[str]]:
    """Rows (line number, object, raw line) of a JSONL file whose ``step`` is in [lo, hi].

    In a file in step order (the spec's), finds the range by binary search over byte offsets
    and numbers the lines by counting newlines before it; otherwise scans every line. Each
    line in the range is parsed once.
    """
    notes: list[str] = []
    size = path.stat().st_size
    if size == 0:
        return [], notes
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if _sorted_by_step(mm):
            offset = _first_offset_at_or_after(mm, lo)
            number = 1 + _count_newlines(handle, offset)
            end_offset = _first_offset_at_or_after(mm, hi + 1)
            return _rows_in(mm[offset:end_offset], number, lo, hi, limit), notes
        notes.append(f"{path.name}: not in step order; read whole")
        return _rows_in(mm[:], 1, lo, hi, limit), notes


def _rows_in(block: bytes, first_number: int, lo: int, hi: int, limit: int) -> list[Row]:
    rows: list[Row] = []
    for number, raw in enumerate(block.split(b"\n"), start=first_number):
        obj = _load(raw) if raw and not raw.isspace() else None
        step = obj.get("step") if obj is not None else None
        if type(step) is int and lo <= step <= hi:
            rows.append((number, obj, raw))
            if len(rows) >= limit:
                break
    return rows


def _float(value: Any) -> float | None:
    if type(value) is float or type(value) is int:
        return float(value)
    return read_float(value)


def _int(value: Any) -> int | None:
    if type(value) is int:
        return value
    number = read_float(value)
    return int(number) if number is not None and math.isfinite(number) else None


def rank_records(rows: list[Row]) -> list[RankRecord]:
    records = []
    for number, obj, _raw in rows:
        step, rank = obj.get("step"), obj.get("rank")
        if type(step) is not int or type(rank) is not int:
            continue
        records.append(RankRecord(step, rank, _float(obj.get("loss")), _float(obj.get("grad_norm")),
                                  _float(obj.get("mem_allocated_gb")), number))
    return records


def batch_records(rows: list[Row]) -> list[BatchRecord]:
    records = []
    for number, obj, raw in rows:
        step = obj.get("step")
        if type(step) is not int:
            continue
        ids = obj.get("sample_ids")
        fingerprint = obj.get("fingerprint")
        source = obj.get("source")
        records.append(BatchRecord(
            step=step, rank=_int(obj.get("rank")),
            fingerprint=None if fingerprint is None else str(fingerprint),
            num_samples=_int(obj.get("num_samples")), max_tokens=_int(obj.get("max_tokens")),
            min_tokens=_int(obj.get("min_tokens")), num_empty=_int(obj.get("num_empty")),
            sample_ids=list(map(str, ids)) if type(ids) is list else [],
            source=source if type(source) is str else None,
            line=number, text=clip(raw.decode("utf-8", "replace")),
        ))
    return records
