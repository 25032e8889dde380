"""Loading a bundle into what the rules judge: the step table, per-rank windows, node facts.

This is the diagnosis's only I/O. It is also where the time goes on a 256-node incident, so:
step metrics are read with orjson into columns (not one object per step); per-rank and batch
files are read only for the steps around the trouble (binary search by byte offset when the
file is in step order, as the spec writes it); nodes are parsed in parallel worker processes;
and a baseline byte-identical to the current capture is not parsed twice (no growth).

Everything unreadable becomes a line in ``missing`` in the spec's wording; nothing raises
past ``load_bundle`` except BundleError for a bundle that cannot be opened at all.
"""

from __future__ import annotations

import bisect
import gc
import json
import math
import mmap
import re
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd

from spikeops.bundle import Bundle, open_bundle
from spikeops.diagnosis.counters import IB_WATCHED, congestion_counter_high
from spikeops.errors import InputError, UnrecognisedInput
from spikeops.history import HISTORY_FILE, NODE_HISTORY_FILE, PastConviction, PastIncident, parse_history, parse_node_history
from spikeops.probes.bundle_files import (
    BatchRecord,
    Checkpoint,
    Incident,
    ProbeStatus,
    RankRecord,
    parse_checkpoints,
    parse_probes,
    read_float,
)
from spikeops.probes.base import clip
from spikeops.probes.slurm import fold_nodes
from spikeops.reading import read_evidence
from spikeops.timeparse import year_for

__all__ = [
    "read_checkpoints",
    "read_history",
    "read_node_history",
    "with_fresh_checkpoints",
    "MetricsTable",
    "Replay",
    "JobOutput",
    "read_job_output",
    "NodeFacts",
    "BundleFacts",
    "load_bundle",
    "load_metrics",
    "load_node",
    "incident_time",
    "read_jsonl_window",
    "first_step",
    "rank_records",
    "batch_records",
]

METRIC_COLUMNS = ("loss", "grad_norm", "lr", "loss_scale", "throughput")
#: Steps of history read from a long run (from its end): weeks of training at a few seconds
#: a step; an incident and its precursors, or a creep since a resume, live well inside it.
MAX_METRIC_LINES = 100_000


@dataclass
class MetricsTable:
    """One row per step (later runs win over re-logged steps), indexed by step.

    Columns: ``loss``, ``grad_norm``, ``lr``, ``loss_scale``, ``throughput`` (float, NaN when
    absent *or* non-finite), ``loss_bad`` / ``grad_bad`` (a value was logged and it was
    non-finite: a NaN loss is not a missing loss), ``skipped`` (bool), ``time`` (UTC,
    NaT when unknown), ``line`` (line in ``file``, for evidence).
    """

    frame: pd.DataFrame
    file: str
    gaps: list[str] = field(default_factory=list)
    #: The fp16 scaler's own lines in a training log (DeepSpeed's ``OVERFLOW! ... reducing
    #: to``, fairseq's ``setting loss scale to``, ``already at minimum``), in file order:
    #: loss-scale evidence even when the log has no step lines at all.
    overflows: list[Any] = field(default_factory=list)
    #: Lines of the log the steps were read from (0 when unknown).
    lines: int = 0
    #: Steps a resumed run re-logged, with the first run's value (class 8's evidence).
    replays: list[Replay] = field(default_factory=list)

    def line_of(self, step: int | None) -> int | None:
        if step is None or step not in self.frame.index:
            return None
        return int(self.frame.at[step, "line"])

    def step_at_or_after(self, moment: Any) -> int | None:
        """The first step logged at or after ``moment`` (spec: a hardware event's step).

        When only some lines carry a time (DeepSpeed stamps its own lines, not the trainer's),
        the answer is the first step after the last timed step before ``moment``: an untimed
        step after it may already be past the moment, so the earliest candidate is kept."""
        if moment is None or "time" not in self.frame or not len(self.frame):
            return None
        times = self.frame["time"]
        timed = times.notna().to_numpy()
        if not timed.any():
            return None
        stamp = pd.Timestamp(moment)
        before = timed & (times < stamp).to_numpy()
        if not before.any():
            return int(self.frame.index[0])
        position = int(np.flatnonzero(before)[-1]) + 1
        return int(self.frame.index[position]) if position < len(self.frame) else None


def _later_run_wins(steps: np.ndarray) -> np.ndarray:
    """Rows kept when a resumed run re-logs steps: a row survives only if every later row
    (in file order) has a larger step, so the newest run supersedes all it re-covered."""
    if len(steps) == 0:
        return np.zeros(0, dtype=bool)
    suffix_min = np.minimum.accumulate(steps[::-1])[::-1]
    after = np.append(suffix_min[1:], np.iinfo(np.int64).max)
    return steps < after


def _value(raw: Any) -> tuple[float, bool]:
    """(value, non-finite-was-logged) from a JSON value; absent -> (nan, False)."""
    if raw is None or isinstance(raw, bool):
        return math.nan, False
    if isinstance(raw, int | float):
        value = float(raw)
    else:
        parsed = read_float(raw)
        if parsed is None:
            return math.nan, False
        value = parsed
    if math.isfinite(value):
        return value, False
    return math.nan, True


@dataclass(frozen=True)
class Replay:
    """A step logged twice, before and after the run went back (a resume): the same step's
    loss in the first run and in the replay, with the lines they came from."""

    step: int
    first: float
    again: float
    first_line: int
    again_line: int


#: Replayed steps kept for the comparison (a long overlap says no more than this).
MAX_REPLAYS = 5000


def _replays(columns: dict[str, Any]) -> list[Replay]:
    """Steps a later run re-logged, paired with the first run's value (file order)."""
    steps = np.asarray(columns["step"], dtype=np.int64)
    if len(steps) < 2 or not (np.diff(steps) < 0).any():
        return []
    losses = np.asarray(columns["loss"], dtype=float)
    lines = np.asarray(columns["line"], dtype=np.int64)
    last: dict[int, int] = {}
    for index, step in enumerate(steps.tolist()):
        last[step] = index
    pairs = []
    for index in np.flatnonzero(~_later_run_wins(steps)).tolist():
        again = last[int(steps[index])]
        if again != index and math.isfinite(losses[index]) and math.isfinite(losses[again]):
            pairs.append(Replay(int(steps[index]), float(losses[index]), float(losses[again]),
                                int(lines[index]), int(lines[again])))
            if len(pairs) >= MAX_REPLAYS:
                break
    return pairs


def _frame_from_columns(columns: dict[str, list[Any]], times: pd.Series) -> pd.DataFrame:
    steps = np.asarray(columns["step"], dtype=np.int64)
    keep = _later_run_wins(steps)
    frame = pd.DataFrame({name: values for name, values in columns.items() if name != "step"}, index=steps)
    frame["time"] = times.array if len(times) else pd.Series([], dtype="datetime64[ns, UTC]").array
    frame = frame.loc[keep]
    frame.index.name = "step"
    return frame.sort_index()


def _times(raw: list[Any]) -> pd.Series:
    """ISO strings or Unix seconds (or a mix), vectorised, to UTC; anything else NaT."""
    series = pd.Series(raw, dtype=object)
    if len(series) == 0:
        return pd.Series([], dtype="datetime64[ns, UTC]")
    is_text = (series.map(type) == str).to_numpy()
    parts = []
    if is_text.any():
        text = series[is_text]
        parsed = pd.to_datetime(text, utc=True, errors="coerce", format="ISO8601").dt.as_unit("ns")
        numeric_text = parsed.isna()
        if numeric_text.any():  # "1764439262.5": Unix seconds written as a string
            seconds = pd.to_numeric(text[numeric_text], errors="coerce")
            parsed = parsed.where(~numeric_text, pd.to_datetime(seconds, unit="s", utc=True, errors="coerce").dt.as_unit("ns"))
        parts.append(parsed)
    if (~is_text).any():
        seconds = pd.to_numeric(series[~is_text], errors="coerce")
        parts.append(pd.to_datetime(seconds, unit="s", utc=True, errors="coerce").dt.as_unit("ns"))
    return pd.concat(parts).reindex(series.index)


def _numeric(raw: pd.Series) -> pd.Series:
    """Numbers, NaN/Infinity and their string spellings ("nan", "-inf") to floats; junk NaN."""
    if raw.dtype != object:
        return raw.astype(float)
    if raw.isna().all():
        return pd.Series(np.full(len(raw), np.nan), index=raw.index)
    return pd.to_numeric(raw, errors="coerce").astype(float)


def _count_newlines(handle: Any, end: int) -> int:
    """Newlines in the first ``end`` bytes, read with plain reads: counting through the mmap
    would map every page of a multi-GB file into this process's resident set."""
    handle.seek(0)
    count, remaining = 0, end
    while remaining > 0:
        chunk = handle.read(min(1 << 22, remaining))
        if not chunk:
            break
        count += chunk.count(b"\n")
        remaining -= len(chunk)
    return count


def _tail(path: Path, lines: int) -> tuple[int, int, bytes]:
    """(lines skipped, lines in the file, the bytes of the last ``lines`` lines), reading
    only the tail into memory (the head is counted, not kept)."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0, b""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        end = size - 1 if mm[size - 1:size] == b"\n" else size
        position = end
        for _ in range(lines):
            position = mm.rfind(b"\n", 0, position)
            if position < 0:
                break
        start = 0 if position < 0 else position + 1
        skipped = _count_newlines(handle, start)
        tail = mm[start:end]
    return skipped, skipped + tail.count(b"\n") + 1, tail


def _metrics_jsonl(path: Path) -> MetricsTable:
    """metrics.jsonl in columns: orjson per line (json only for NaN tokens), then vectorised
    conversions; one Python pass over 500,000 lines is the floor, everything else is numpy."""
    skipped_head, total_lines, tail = _tail(path, MAX_METRIC_LINES)
    objects: list[dict[str, Any]] = []
    numbers: list[int] = []
    bad_lines: list[int] = []
    loads = orjson.loads
    for number, raw in enumerate(tail.split(b"\n"), start=skipped_head + 1):
        if not raw or raw.isspace():
            continue
        try:
            obj = loads(raw)
        except orjson.JSONDecodeError:
            try:
                obj = json.loads(raw)  # NaN / Infinity tokens, which orjson refuses
            except (ValueError, RecursionError):
                bad_lines.append(number)
                continue
        if type(obj) is not dict:
            bad_lines.append(number)
            continue
        objects.append(obj)
        numbers.append(number)
    fields = ["step", *METRIC_COLUMNS, "skipped", "time"]
    raw = pd.DataFrame.from_records(objects, columns=fields) if objects else pd.DataFrame(columns=fields)
    lines = np.asarray(numbers, dtype=np.int64)
    step = raw["step"] if raw["step"].dtype.kind in "iu" else pd.to_numeric(raw["step"], errors="coerce")
    valid = (step.notna() & (step == step.round())).to_numpy()
    if not valid.all():
        bad_lines.extend(lines[~valid].tolist())
    columns: dict[str, Any] = {"step": step.to_numpy()[valid].astype(np.int64)}
    for name in METRIC_COLUMNS:
        columns[name] = _numeric(raw[name]).to_numpy()[valid]
    for name, flag in (("loss", "loss_bad"), ("grad_norm", "grad_bad")):
        logged = np.fromiter((o.get(name) is not None for o in objects), dtype=bool, count=len(objects))[valid]
        values = columns[name]
        columns[flag] = logged & ~np.isfinite(values)
        columns[name] = np.where(np.isfinite(values), values, np.nan)
    for name in ("lr", "loss_scale", "throughput"):
        columns[name] = np.where(np.isfinite(columns[name]), columns[name], np.nan)
    skipped = raw["skipped"]
    columns["skipped"] = (skipped.to_numpy() == True)[valid] if skipped.notna().any() else np.zeros(int(valid.sum()), dtype=bool)  # noqa: E712
    columns["line"] = lines[valid]
    times = _times(raw["time"].to_numpy()[valid].tolist())
    replays = _replays(columns)
    frame = _frame_from_columns(columns, times)
    gaps = []
    if bad_lines:
        gaps.append(f"metrics.jsonl: {len(bad_lines)} unreadable line(s), first at line {min(bad_lines)}")
    if skipped_head:
        gaps.append(f"metrics.jsonl: only the last {MAX_METRIC_LINES:,} of {total_lines:,} lines were read "
                    f"(earlier history is not needed to judge this incident)")
    return MetricsTable(frame, path.name, gaps, replays=replays, lines=total_lines)


def _metrics_from_log(path: Path, kind: str) -> MetricsTable:
    reading = read_evidence(path, kind)
    records = reading.result.records
    columns: dict[str, list[Any]] = {k: [] for k in ("step", *METRIC_COLUMNS, "loss_bad", "grad_bad", "skipped", "time", "line")}
    for record in records:
        columns["step"].append(record.step)
        loss, loss_bad = _value(record.loss)
        grad, grad_bad = _value(record.grad_norm)
        columns["loss"].append(loss)
        columns["loss_bad"].append(loss_bad or bool(getattr(record, "nan_iterations", None))
                                   or bool(getattr(record, "loss_missing", False)))
        columns["grad_norm"].append(grad)
        columns["grad_bad"].append(grad_bad)
        columns["lr"].append(_value(record.lr)[0])
        columns["loss_scale"].append(_value(record.loss_scale)[0])
        columns["throughput"].append(_value(record.throughput)[0])
        columns["skipped"].append(bool(record.skipped))
        columns["time"].append(record.time)
        columns["line"].append(record.line)
    times = pd.to_datetime(pd.Series(columns.pop("time"), dtype=object), utc=True, errors="coerce")
    replays = _replays(columns)
    frame = _frame_from_columns(columns, times)
    frame["perplexity_bad"] = _perplexity_bad(records, frame)
    gaps = [f"{path.name}: {gap.line and f'line {gap.line}: ' or ''}{gap.reason}" for gap in reading.gaps[:5]
            if gap.reason != "no training step lines found"]  # said once, with the line count, by load_metrics
    return MetricsTable(frame, path.name, gaps, list(reading.result.overflow_events), reading.result.lines, replays)


def _perplexity_bad(records: list[Any], frame: pd.DataFrame) -> np.ndarray:
    """Steps whose printed perplexity is infinite (the loss behind it overflowed exp())."""
    bad = {record.step for record in records
           if getattr(record, "perplexity", None) is not None and not math.isfinite(record.perplexity)}
    return np.fromiter((step in bad for step in frame.index), dtype=bool, count=len(frame))


def load_metrics(bundle: Bundle) -> tuple[MetricsTable | None, list[str]]:
    """metrics.jsonl, else train.log; (None, reasons) when neither gives a step."""
    missing: list[str] = []
    for name, kind in bundle.metric_sources():
        path = bundle.path / name
        if not path.is_file():
            continue
        try:
            table = _metrics_jsonl(path) if name == "metrics.jsonl" else _metrics_from_log(path, kind)
        except UnrecognisedInput:
            missing.append(f"{name}: no training step lines (no iteration/step line with a loss was recognised, "
                           "and no loss-scale line)")
            continue
        except (InputError, OSError) as exc:
            missing.append(f"{name}: {str(exc).split(': ', 1)[-1]}")
            continue
        table.file = name
        missing.extend(table.gaps)
        if len(table.frame):
            if name.startswith("nodes/"):
                missing.append(f"metrics.jsonl / train.log: absent; step metrics read from {name}")
            return table, missing
        lines = f" in its {table.lines} line(s)" if table.lines else ""
        missing.append(f"{name}: no training step lines{lines} (no iteration/step line with a loss was recognised)")
        if table.overflows:
            # Only the fp16 scaler's lines: no steps, but loss-scale evidence all the same.
            return table, missing
    if not missing:
        missing.append("metrics.jsonl / train.log: absent (no step metrics: symptom cannot be classified)")
    return None, missing


# --------------------------------------------------------------------- JSONL step windows


def _load(line: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            obj = json.loads(line)  # NaN / Infinity tokens
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
            sample_ids=[str(i) for i in ids] if type(ids) is list else [],
            source=source if type(source) is str else None,
            line=number, text=clip(raw.decode("utf-8", "replace")),
        ))
    return records


# ------------------------------------------------------------------------------ job output

#: What the job printed is read from its end: a crash, an ECC error, a watchdog timeout are
#: the last things a failing job prints, and a weeks-long log must not cost the diagnosis.
JOB_OUTPUT_TAIL = 8 << 20


@dataclass
class JobOutput:
    """The errors one log of the job's own output holds: its NCCL / PyTorch-distributed
    events and the hardware and scheduler errors it printed. ``node`` is the node the file
    belongs to (``nodes/NODE/train.log``); None for the bundle's own ``train.log``."""

    file: str
    node: str | None
    nccl: Any = None
    errors: Any = None
    notes: list[str] = field(default_factory=list)


def _tail_text(path: Path, limit: int) -> tuple[int, str]:
    """(number of the first line kept, the text of the last ``limit`` bytes, whole lines)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        start = max(0, size - limit)
        skipped = 0
        if start:
            skipped = _count_newlines(handle, start)
            handle.seek(start)
            handle.readline()  # the partial line the cut fell in
            skipped += 1
        text = handle.read().decode("utf-8", errors="replace")
    return skipped + 1, text


#: Words one of which every line the NCCL reader or the error reader acts on holds: the
#: readers cost ~0.1 ms a line, a training log is mostly step lines, so only the lines that
#: can matter (and the line after each: a wrapped message's tail) are handed to them, as the
#: collector's own grep does for nccl.log.
_GATE = (
    "NCCL", "nccl", "c10d", "ProcessGroup", "atchdog", "DistBackendError", "torch.distributed", "Connection",
    "Broken pipe", "No route", "imed out", "TIMED OUT", "imeout", "terminate called", "CUDA error", "uda failure",
    "CUDA failure", "Last error", "completion", "async event", "IBV_", "collective", "Socket", "what():",
    "Exception", "frame #", "ECC", "Xid", "fallen off", "GPU is lost", "been lost", "device handle", "reset",
    "link down", "link is down", "Node failure", "NODE FAIL", "NODE_FAIL", "launch failure", "LAUNCH_FAILED", "Error",
    # device-pointing CUDA errors; checkpoints that could not be loaded or written, and the
    # lines around them that say which checkpoint (loading it, saving it)
    "illegal", "PytorchStream", "central directory", "state_dict", "afetensor", "HeaderTooLarge", "No space left",
    "Errno", "StorageFull", "quota", "load key", "checkpoint", "ckpt", "save", "Saving", "serializ", "oading", "resum",
)
#: Lines one keyword may let through (a log full of one word is not read line by line).
_GATE_LIMIT = 200_000


def _gated(text: str) -> tuple[list[int], list[str]]:
    """(0-based line indexes, lines) of the lines the gate lets through, each with the next.
    Plain ``str.find`` per keyword: a scan in C, where one regex alternation of them costs
    seconds on a 16 MiB tail."""
    starts = [0] + [match.end() for match in re.finditer("\n", text)]
    lines_total = len(starts)
    wanted: set[int] = set()
    for key in _GATE:
        position, found = text.find(key), 0
        while position >= 0 and found < _GATE_LIMIT:
            index = bisect.bisect_right(starts, position) - 1
            wanted.update((index, index + 1))
            found += 1
            following = starts[index + 1] if index + 1 < lines_total else len(text)
            position = text.find(key, following)
    indexes = sorted(index for index in wanted if index < lines_total)
    lines = []
    for index in indexes:
        end = starts[index + 1] - 1 if index + 1 < lines_total else len(text)
        lines.append(text[starts[index]:end])
    return indexes, lines


def read_job_output(path: Path, relative: str, node: str | None, *, nccl: bool = True,
                    reference: datetime | None = None) -> JobOutput:
    """NCCL and hardware errors in a log of the job's output (its last JOB_OUTPUT_TAIL bytes);
    ``nccl=False`` for a file the NCCL reader already read whole (a node's nccl.log).
    ``reference``, the incident's time, dates the yearless syslog stamps of copied lines."""
    from spikeops.probes import job_errors, nccl_log

    output = JobOutput(relative, node)
    try:
        first, text = _tail_text(path, JOB_OUTPUT_TAIL)
    except OSError as exc:
        output.notes.append(f"{relative}: unreadable ({exc.strerror})")
        return output
    if first > 1:
        output.notes.append(f"{relative}: errors looked for in its last {JOB_OUTPUT_TAIL >> 20} MiB only")
    indexes, lines = _gated(text)
    output.nccl = nccl_log.parse(lines) if nccl else None
    output.errors = job_errors.parse(lines, reference=reference)
    # The readers numbered the lines they were given: back to the file's own numbers.
    for event in [*(output.nccl.events if output.nccl else []), *output.errors.events]:
        event.line = first + indexes[event.line - 1]
    if output.errors.last_exception_line is not None:
        output.errors.last_exception_line = first + indexes[output.errors.last_exception_line - 1]
    return output


# ------------------------------------------------------------------------------ node facts


@dataclass
class NodeFacts:
    """What one node's folder says, parsed; None where a probe gave nothing readable."""

    name: str
    unreachable: bool = False
    probes: dict[str, ProbeStatus] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stderr: dict[str, str] = field(default_factory=dict)
    kernel: Any = None
    smi: Any = None
    smi_file: str | None = None
    smi_base: Any = None
    smi_base_file: str | None = None
    ethtool: dict[str, Any] = field(default_factory=dict)
    ethtool_base: dict[str, Any] = field(default_factory=dict)
    ibstat: Any = None
    ib: Any = None
    ib_base: Any = None
    nccl: Any = None
    nccl_version: Any = None
    #: Probe files that have a baseline capture (parsed only when it could matter).
    baselines: set[str] = field(default_factory=set)
    #: The job's own output on this node (``train.log``), and the hardware errors its
    #: ``nccl.log`` lines carry (a watchdog that died of an ECC error).
    output: list[JobOutput] = field(default_factory=list)
    #: The job's flight recorder dumps found on this node, by file name (``flight-recorder/``).
    flight_recorder: dict[str, Any] = field(default_factory=dict)
    #: ``ncclras.txt``: NCCL RAS's job-wide view, as this node's client got it.
    ncclras: Any = None
    #: ``py-spy dump`` of the job's processes here, by file name (``stacks/PID.txt``).
    stacks: dict[str, Any] = field(default_factory=dict)
    #: Addresses the node is known by (the collector's, its ranks' NCCL bootstrap addresses):
    #: NCCL RAS names nodes by IP address.
    addresses: set[str] = field(default_factory=set)

    def file(self, name: str, *, baseline: bool = False) -> str:
        return f"nodes/{self.name}/{'baseline/' if baseline else ''}{name}"


_PROBE_FILES = {
    "kernel.log": ("kernel", "kernel-log"),
    "ibstat.txt": ("ibstat", "ibstat"),
    "ib-counters.txt": ("ib", "ib-counters"),
    "nccl.log": ("nccl", "nccl-log"),
    "nccl-version.txt": ("nccl_version", "nccl-version"),
    "ncclras.txt": ("ncclras", "ncclras"),
}
#: Probes of the job's live state (flight recorder, stacks, NCCL RAS): a node without the tool or
#: without a dump says the same as its neighbours, so their failures are said once per reason.
_JOB_STATE_PROBES = frozenset({"flight-recorder", "stacks", "ncclras"})
#: Entries of one flight recorder dump kept for the diagnosis: the newest, where a hang's
#: frontier is (a ring of 20,000 entries per rank on a 2,048-rank job is not kept whole).
MAX_FR_ENTRIES = 2000
_SMI_FILES = (("nvidia-smi-q.txt", "nvidia-smi-q"), ("nvidia-smi-q.xml", "nvidia-smi-xml"), ("nvml.json", "nvml-json"))


def _read(folder: Path, name: str, kind: str, facts: NodeFacts, *, baseline: bool = False,
          current: tuple[bytes, Any] | None = None) -> tuple[bytes, Any] | None:
    path = folder / name
    if not path.is_file():
        return None
    try:
        raw = path.read_bytes()
    except OSError as exc:
        facts.notes.append(f"{facts.file(name, baseline=baseline)}: unreadable ({exc.strerror})")
        return None
    if current is not None and current[0] == raw:
        return raw, current[1]  # byte-identical baseline: same values, nothing grew
    try:
        result = read_evidence(path, kind).result
    except InputError as exc:
        facts.notes.append(f"{facts.file(name, baseline=baseline)}: {str(exc).split(': ', 1)[-1]}")
        return None
    return raw, result


def _ethtool_could_have_grown(stats: Any) -> bool:
    """Growth can only exceed the congestion thresholds if the counter is that high now;
    below them the baseline cannot change the verdict, so it is not parsed."""
    return any(congestion_counter_high(name, value) for name, value in stats.counters.items())


def _ib_could_have_grown(counters: Any) -> bool:
    return any(port.counters.get(name, 0) or port.hw_counters.get(name, 0)
               for port in counters.ports for name in IB_WATCHED)


def _memory_trouble(report: Any) -> bool:
    """Any uncorrectable ECC, remapped row or retired page now: the baseline then matters."""
    for gpu in getattr(report, "gpus", []):
        rows, pages = gpu.remapped_rows, gpu.retired_pages
        if (gpu.uncorrectable_ecc() or 0) > 0:
            return True
        if rows is not None and ((rows.uncorrectable or 0) > 0 or rows.failure or rows.pending):
            return True
        if pages is not None and ((pages.double_bit or 0) > 0 or pages.pending):
            return True
    return False


def _kernel_with_year(folder: Path, facts: NodeFacts, reference: datetime | None) -> None:
    """A syslog-format kernel log carries no year: read it again in the year its first line
    falls in near the incident (the incident's, or the one before when that is the future),
    so its Xids are placed in the window instead of being "time unknown"."""
    if reference is None or facts.kernel is None or getattr(facts.kernel, "format", None) != "syslog":
        return
    from spikeops.probes import kernel_log

    path = folder / "kernel.log"
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return
    first = next((m for m in (_SYSLOG_DAY.match(line) for line in lines[:200]) if m), None)
    if first is None or first["mon"] not in _MONTHS:
        return
    year = year_for(_MONTHS.index(first["mon"]) + 1, int(first["day"]), reference)
    try:
        facts.kernel = kernel_log.parse(lines, year=year)
    except Exception as exc:  # noqa: BLE001 - the yearless reading stays
        facts.notes.append(f"{facts.file('kernel.log')}: not dated ({type(exc).__name__})")


_SYSLOG_DAY = re.compile(r"^(?P<mon>[A-Z][a-z]{2}) +(?P<day>\d{1,2}) \d{2}:\d{2}:\d{2}")
_MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()


def _read_folder(folder: Path, name: str, kind: str, facts: NodeFacts, into: dict[str, Any]) -> None:
    """Every file of a node's ``flight-recorder/`` or ``stacks/`` as ``kind``; what could
    not be read whole is a note (a truncated dump is a gap, never a healthy rank)."""
    directory = folder / name
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir(), key=lambda p: p.name)[:4096]:
        if not path.is_file() or path.name.startswith("."):
            continue
        where = facts.file(f"{name}/{path.name}")
        try:
            result = read_evidence(path, kind).result
        except (InputError, UnrecognisedInput) as exc:
            facts.notes.append(f"{where}: {str(exc).split(': ', 1)[-1]}")
            continue
        gaps = [gap.reason for gap in getattr(result, "gaps", [])]
        if kind == "flight-recorder" and not result.complete:
            facts.notes.append(f"{where}: not read ({'; '.join(gaps[:2]) or 'no dump in it'})")
        elif kind == "py-spy" and not result.processes:
            facts.notes.append(f"{where}: no stack in it ({'; '.join(gaps[:2])})")
        into[path.name] = result


def load_node(bundle_path: str, node: str, reference: datetime | None = None) -> NodeFacts:
    """Parse one node's folder (run in a worker process for large bundles); ``reference``,
    the incident's time, dates the yearless syslog lines it holds."""
    folder = Path(bundle_path) / "nodes" / node
    facts = NodeFacts(node)
    probes_path = folder / "probes.json"
    if probes_path.is_file():
        probes = parse_probes(probes_path.read_text(encoding="utf-8", errors="replace"))
        facts.probes = probes.probes
        facts.unreachable = probes.unreachable
        facts.notes.extend(f"nodes/{node}/probes.json: {gap.reason}" for gap in probes.gaps)
    if facts.unreachable:
        return facts
    for err in folder.glob("*.err"):
        try:
            first = next((l.strip() for l in err.read_text(errors="replace").splitlines() if l.strip()), "")
        except OSError:
            first = ""
        if first:
            facts.stderr[err.stem] = clip(first, 300)
    for name, (attribute, kind) in _PROBE_FILES.items():
        got = _read(folder, name, kind, facts)
        if got is not None:
            setattr(facts, attribute, got[1])
            if attribute == "kernel":
                _kernel_with_year(folder, facts, reference)
            if attribute == "ib" and (folder / "baseline" / name).is_file():
                facts.baselines.add(name)
                if _ib_could_have_grown(got[1]):
                    base = _read(folder / "baseline", name, kind, facts, baseline=True, current=got)
                    facts.ib_base = base[1] if base else None
    for name, kind in _SMI_FILES:
        got = _read(folder, name, kind, facts)
        if got is None or not getattr(got[1], "gpus", None) and not getattr(got[1], "errors", None):
            continue
        facts.smi, facts.smi_file = got[1], name
        if _memory_trouble(got[1]):  # nothing uncorrectable now: nothing can have grown
            base = _read(folder / "baseline", name, kind, facts, baseline=True, current=got)
            if base is not None:
                facts.smi_base, facts.smi_base_file = base[1], name
        break
    train = folder / "train.log"
    if train.is_file():
        output = read_job_output(train, facts.file("train.log"), node, reference=reference)
        facts.output.append(output)
        facts.notes.extend(output.notes)
    nccl = folder / "nccl.log"
    if nccl.is_file() and facts.nccl is not None:
        output = read_job_output(nccl, facts.file("nccl.log"), node, nccl=False, reference=reference)
        if output.errors is not None and output.errors.events:
            facts.output.append(output)
    _read_folder(folder, "flight-recorder", "flight-recorder", facts, facts.flight_recorder)
    for dump in facts.flight_recorder.values():
        if len(dump.entries) > MAX_FR_ENTRIES:
            dump.entries = dump.entries[-MAX_FR_ENTRIES:]
    _read_folder(folder, "stacks", "py-spy", facts, facts.stacks)
    for path in sorted(folder.glob("ethtool-*.txt")):
        got = _read(folder, path.name, "ethtool", facts)
        if got is None:
            continue
        facts.ethtool[path.name] = got[1]
        if (folder / "baseline" / path.name).is_file():
            facts.baselines.add(path.name)
            if _ethtool_could_have_grown(got[1]):
                base = _read(folder / "baseline", path.name, "ethtool", facts, baseline=True, current=got)
                if base is not None:
                    facts.ethtool_base[path.name] = base[1]
    return facts


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while evidence is parsed: the parsers build tens of
    thousands of short-lived, acyclic objects per node (an 8-GPU ``nvidia-smi -q`` is a
    2,000-line tree), refcounting frees them, and the collections their allocations
    trigger were a quarter of the parse time in a flow process's large heap."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _load_node_quietly(bundle: str, node: str, reference: datetime | None = None) -> NodeFacts:
    with _gc_paused():
        return load_node(bundle, node, reference)


def incident_time(incident: Incident) -> datetime | None:
    """When the incident happened, for dating yearless times: its creation, else its window's end."""
    return incident.created or (incident.window.end if incident.window is not None else None)


def _load_nodes_and_metrics(bundle: Bundle, workers: int | None) -> tuple[list[NodeFacts], MetricsTable | None, list[str]]:
    """Nodes in worker processes while this process reads the step metrics: on a 256-node
    bundle both take seconds, and they need nothing from each other."""
    names = bundle.nodes()
    reference = incident_time(bundle.incident)
    if workers is None:
        workers = min(os.cpu_count() or 1, 8) if len(names) >= 24 else 1
    if workers <= 1 or len(names) < 2:
        metrics, notes = load_metrics(bundle)
        return [_load_node_quietly(str(bundle.path), name, reference) for name in names], metrics, notes
    with ProcessPoolExecutor(max_workers=workers) as pool:
        chunk = max(1, len(names) // (workers * 4))
        pending = pool.map(_load_node_quietly, [str(bundle.path)] * len(names), names, [reference] * len(names),
                           chunksize=chunk)
        metrics, notes = load_metrics(bundle)
        return list(pending), metrics, notes


@dataclass
class BundleFacts:
    bundle: Bundle
    incident: Incident
    metrics: MetricsTable | None
    nodes: list[NodeFacts]
    checkpoints: list[Checkpoint] | None
    missing: list[str]
    #: What the job printed, read for errors: the bundle's ``train.log`` and the nodes' logs.
    output: list[JobOutput] = field(default_factory=list)
    #: Windows of the bundle's files already read (``context._window``), shared with the copy
    #: ``with_fresh_checkpoints`` makes: the files do not change between the two diagnoses.
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    #: The lineage's earlier incidents (``history.json``; ``spikeops.history``), oldest first.
    history: list[PastIncident] = field(default_factory=list)
    #: The job's nodes' earlier convictions in every lineage (``node_history.json``).
    node_history: list[PastConviction] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.bundle.path

    def node(self, name: str) -> NodeFacts | None:
        return next((n for n in self.nodes if n.name == name), None)


def read_checkpoints(path: Path) -> tuple[list[Checkpoint] | None, list[str]]:
    """The bundle's ``checkpoints.json`` and what could not be read of it."""
    path_ckpt = path / "checkpoints.json"
    if not path_ckpt.is_file():
        return None, ["checkpoints.json: absent (no checkpoint to resume from is known)"]
    parsed = parse_checkpoints(path_ckpt.read_text(encoding="utf-8", errors="replace"))
    return parsed.checkpoints, [f"checkpoints.json: {gap.reason}" for gap in parsed.gaps]


def with_fresh_checkpoints(facts: BundleFacts) -> BundleFacts:
    """``facts`` with ``checkpoints.json`` read again (the checkpoints were verified after the
    first diagnosis named the onset); the nodes' evidence, the costly part, is not re-read."""
    checkpoints, gaps = read_checkpoints(facts.path)
    old = [i for i, m in enumerate(facts.missing) if m.startswith("checkpoints.json: ")]
    at = old[0] if old else len(facts.missing)  # where load_bundle put them, so the order is the same
    kept = [m for m in facts.missing if not m.startswith("checkpoints.json: ")]
    return replace(facts, checkpoints=checkpoints, missing=kept[:at] + gaps + kept[at:])


_IPV4 = re.compile(r"(?<![\d.])\d{1,3}(?:\.\d{1,3}){3}(?![\d.])")
#: NCCL's ``ib0:fe80::1%ib0<0>``: after the interface's colon, up to the port's ``<``.
_IPV6 = re.compile(r"^[^:]*:\[?([0-9a-fA-F]*(?::[0-9a-fA-F]*){2,7})(?:%[\w.-]+)?\]?<")


def _addresses(path: Path, nodes: list[NodeFacts]) -> None:
    """What each node is known by besides its name: the address the collector reached it
    at (``collection.json``) and the addresses its ranks bootstrapped NCCL on (``nccl.log``:
    ``Bootstrap : Using ib0:10.0.0.4<0>``), so NCCL RAS's "node 10.0.0.4" can be named."""
    by_name = {facts.name: facts for facts in nodes}
    try:
        record = json.loads((path / "collection.json").read_text(encoding="utf-8"))
        for entry in record.get("nodes") or []:
            facts = by_name.get(str(entry.get("node")))
            if facts is not None and isinstance(entry.get("address"), str):
                facts.addresses.add(entry["address"])
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    for facts in nodes:
        for process in (facts.nccl.processes.values() if facts.nccl is not None else ()):
            text = process.bootstrap or ""
            facts.addresses.update(_IPV4.findall(text))
            six = _IPV6.match(text)
            if six:
                facts.addresses.add(six.group(1))


def load_bundle(path: str | Path, *, workers: int | None = None) -> BundleFacts:
    """Open and read a bundle (BundleError if it cannot be opened at all)."""
    bundle = open_bundle(path)
    missing = list(bundle.missing)
    grouped: dict[tuple[str, str], list[str]] = {}
    nodes, metrics, metric_notes = _load_nodes_and_metrics(bundle, workers)
    missing.extend(metric_notes)
    for facts in nodes:
        if facts.unreachable:
            missing.append(f"nodes/{facts.name}: unreachable")
            continue
        if not facts.probes:
            missing.append(f"nodes/{facts.name}/probes.json: absent")
        for name, status in facts.probes.items():
            if status.error is not None:
                hint = facts.stderr.get(name)
                if name in _JOB_STATE_PROBES:  # the same on most nodes: said once per reason
                    reason = f"{status.error}" + (f" ({hint.replace(facts.name, '<node>')})" if hint else "")
                    grouped.setdefault((name, reason), []).append(facts.name)
                    continue
                missing.append(f"nodes/{facts.name}/{name}: {status.error}" + (f" ({hint})" if hint else ""))
        missing.extend(facts.notes)
    for (name, reason), where in sorted(grouped.items()):
        missing.append(f"{name} on {fold_nodes(where)}: {reason}" if len(where) > 1
                       else f"nodes/{where[0]}/{name}: {reason}")
    collected = {facts.name for facts in nodes}
    missing.extend(f"nodes/{node}: not collected" for node in bundle.incident.job.nodes if node not in collected)
    _addresses(bundle.path, nodes)
    checkpoints, gaps = read_checkpoints(bundle.path)
    missing.extend(gaps)
    output: list[JobOutput] = []
    train = bundle.path / "train.log"
    if train.is_file():
        output.append(read_job_output(train, "train.log", None, reference=incident_time(bundle.incident)))
        missing.extend(output[-1].notes)
    output.extend(item for facts in nodes for item in facts.output)
    history, gaps = read_history(bundle.path)
    missing.extend(gaps)
    convictions, gaps = read_node_history(bundle.path)
    missing.extend(gaps)
    return BundleFacts(bundle, bundle.incident, metrics, nodes, checkpoints, missing, output, history=history,
                       node_history=convictions)


def _read_list_file(path: Path, name: str, parse: Any, unknown: str) -> tuple[list[Any], list[str]]:
    """A bundle's list file read with ``parse`` (absent: empty), and what could not be read."""
    target = path / name
    if not target.is_file():
        return [], []
    try:
        text = target.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return [], [f"{name}: unreadable ({exc.strerror or exc}); {unknown}"]
    return parse(text)


def read_node_history(path: Path) -> tuple[list[PastConviction], list[str]]:
    """The bundle's ``node_history.json`` (absent: none known) and what could not be read of it."""
    return _read_list_file(path, NODE_HISTORY_FILE, parse_node_history, "the nodes' earlier convictions are unknown")


def read_history(path: Path) -> tuple[list[PastIncident], list[str]]:
    """The bundle's ``history.json`` (absent: no earlier incident known) and what could not be
    read of it."""
    return _read_list_file(path, HISTORY_FILE, parse_history, "the lineage's earlier incidents are unknown")
