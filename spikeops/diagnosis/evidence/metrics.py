"""The step table: ``metrics.jsonl`` read into columns with orjson (not one object per step),
or the training log when there is none; the later run wins a step logged twice."""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
import numpy as np
import orjson
import pandas as pd
from spikeops.bundle import Bundle
from spikeops.errors import InputError, UnrecognisedInput
from spikeops.probes.bundle_files import (
    read_float,
)
from spikeops.reading import read_evidence

__all__ = ["METRIC_COLUMNS", "MAX_METRIC_LINES", "MetricsTable", "Replay", "MAX_REPLAYS", "load_metrics"]


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
