"""The entry points (a log, ``metrics.jsonl``, ``trainer_state.json``) and the tables built
from their records."""

from __future__ import annotations

from typing import TYPE_CHECKING
import json
import math
import re
from collections.abc import Iterable
from itertools import chain
from typing import Any
from spikeops.probes.base import (
    LineSource,
    join_text,
    numbered_lines,
)
from spikeops.probes.training_log.model import (
    MAX_DOCUMENT_CHARS,
    FRAME_COLUMNS,
    StepRecord,
    TrainingLog,
)
from spikeops.probes.training_log.builder import (
    _Builder,
)
from spikeops.probes.training_log.formats import (
    _flush_wrap,
    _from_mapping,
    _feed_line,
)

if TYPE_CHECKING:  # pandas is imported lazily: detection must stay cheap
    import pandas as pd

__all__ = ["parse", "parse_metrics_jsonl", "parse_trainer_state", "latest_per_step", "to_frame", "first_loss_doubling"]


# --------------------------------------------------------------------------- entry points


def parse(source: LineSource) -> TrainingLog:
    """Read a job's log (any mix of the supported formats), streaming.

    A file that opens with a lone ``{`` may be a whole JSON document (trainer_state.json
    saved as ``train.log``): it is buffered (bounded) and read as one when it has a
    ``log_history``; otherwise its lines are replayed through the line reader."""
    lines = numbered_lines(source)
    head: list[tuple[int, str]] = []
    for number, line in lines:
        head.append((number, line))
        if line.strip():
            break
    if head and head[-1][1].strip() == "{":
        size = 0
        complete = True
        for number, line in lines:
            head.append((number, line))
            size += len(line) + 1
            if size > MAX_DOCUMENT_CHARS:
                complete = False
                break
        if complete:
            text = "\n".join(line for _, line in head)
            if '"log_history"' in text:
                return parse_trainer_state(text)
    builder = _Builder()
    for number, line in chain(head, lines):
        builder.lines = number
        try:
            _feed_line(builder, number, line)
        except Exception as exc:  # noqa: BLE001 - a reader bug must not lose the rest of the log
            builder.gap(f"line not read ({type(exc).__name__})", number)
    return builder.finish(flush=_flush_wrap)


def parse_metrics_jsonl(source: LineSource) -> TrainingLog:
    """Read the bundle's canonical ``metrics.jsonl``: one JSON object per line with ``step``
    and ``loss``; ``NaN``/``Infinity`` tokens and ``"nan"``/``"inf"`` strings are both
    accepted; a line that is not such an object is a gap and the others are kept."""
    builder = _Builder()
    for number, line in numbered_lines(source):
        builder.lines = number
        body = line.strip()
        if not body:
            continue
        try:
            value = json.loads(body)
        except (ValueError, RecursionError) as exc:
            builder.gap(f"not JSON ({str(exc)[:60]})", number)
            continue
        if not isinstance(value, dict):
            builder.gap("not a JSON object", number)
            continue
        try:
            record = _from_mapping(builder, value, number, line, "metrics-jsonl", strict=True)
        except Exception as exc:  # noqa: BLE001
            builder.gap(f"line not read ({type(exc).__name__})", number)
            continue
        if record is not None:
            builder.add(record)
    return builder.finish("metrics-jsonl")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _log_history(text: str) -> tuple[list[tuple[Any, int, int]], str | None, int]:
    """The ``log_history`` entries with their character spans, read one by one so a file
    cut mid-write (a crash while saving) still yields every complete entry.

    Returns ``(entries, problem, position of the problem)``."""
    start = re.search(r'"log_history"\s*:\s*\[', text)
    if start is None:
        return [], "no \"log_history\" list", 0
    decoder = json.JSONDecoder()
    entries: list[tuple[Any, int, int]] = []
    pos = _skip_space(text, start.end())
    if pos < len(text) and text[pos] == "]":
        return entries, None, pos
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return entries, "log_history entry not readable (file cut short?)", pos
        entries.append((value, pos, end))
        pos = _skip_space(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
            continue
        if pos < len(text) and text[pos] == "]":
            return entries, None, pos
        break
    return entries, "log_history list not closed (file cut short?)", pos


def parse_trainer_state(source: LineSource) -> TrainingLog:
    """Read Hugging Face ``trainer_state.json``: ``log_history`` entries with a ``loss``
    are training steps (their own ``step`` numbers); ``eval_loss`` entries and the final
    ``train_runtime`` summary are not. Each step cites the line where its entry starts."""
    builder = _Builder()
    text = join_text(source)
    builder.lines = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    try:
        json.loads(text)
    except (ValueError, RecursionError) as exc:
        line = getattr(exc, "lineno", None)
        builder.gap(f"not a complete JSON document ({str(exc)[:80]})", line)
    entries, problem, where = _log_history(text)
    line, counted = 1, 0
    for value, begin, end in entries:
        line += text.count("\n", counted, begin)
        counted = begin
        if not isinstance(value, dict):
            builder.gap("log_history entry is not an object", line)
            continue
        raw = " ".join(text[begin:end].split())
        try:
            record = _from_mapping(builder, value, line, raw, "trainer-state", strict=False)
        except Exception as exc:  # noqa: BLE001
            builder.gap(f"log_history entry not read ({type(exc).__name__})", line)
            continue
        if record is not None:
            builder.add(record)
    if problem is not None:
        builder.gap(problem, text.count("\n", 0, where) + 1)
    return builder.finish("trainer-state")


# --------------------------------------------------------------------------- tables


def latest_per_step(records: Iterable[StepRecord]) -> list[StepRecord]:
    """One record per step, sorted by step; when a resumed job re-logged a step, the later
    occurrence in the file wins (it describes the run that continued)."""
    latest: dict[int, StepRecord] = {}
    for record in records:
        latest.pop(record.step, None)
        latest[record.step] = record
    return sorted(latest.values(), key=lambda record: record.step)


def to_frame(records: Iterable[StepRecord]) -> pd.DataFrame:
    """One row per step (``FRAME_COLUMNS``), sorted by step, later occurrence winning.

    A loss that was not logged is NaN in the float column with ``nan`` False/None; a NaN
    loss has ``nan`` True: read the ``nan`` column, not the loss, to find non-finite steps."""
    import pandas as pd

    rows = latest_per_step(records)
    tokens = [row.tokens for row in rows]
    integral = all(value is None or isinstance(value, int) for value in tokens)
    frame = pd.DataFrame({
        "step": pd.Series([row.step for row in rows], dtype="int64"),
        "time": pd.Series(pd.to_datetime([row.time for row in rows], utc=True), dtype="datetime64[ns, UTC]"),
        "loss": pd.Series([row.loss for row in rows], dtype="float64"),
        "lr": pd.Series([row.lr for row in rows], dtype="float64"),
        "grad_norm": pd.Series([row.grad_norm for row in rows], dtype="float64"),
        "loss_scale": pd.Series([row.loss_scale for row in rows], dtype="float64"),
        "skipped": pd.Series([row.skipped for row in rows], dtype="boolean"),
        "nan": pd.Series([row.nan for row in rows], dtype="boolean"),
        "tokens": pd.Series(tokens, dtype="Int64" if integral else "float64"),
        "throughput": pd.Series([row.throughput for row in rows], dtype="float64"),
        "line": pd.Series([row.line for row in rows], dtype="int64"),
    })
    return frame[list(FRAME_COLUMNS)]


def first_loss_doubling(records: Iterable[StepRecord]) -> tuple[StepRecord, StepRecord] | None:
    """``(before, at)`` for the first step whose finite loss is more than twice the previous
    logged finite loss: a hint where to look, not a spike detector."""
    previous: StepRecord | None = None
    for record in latest_per_step(records):
        if record.loss is None or not math.isfinite(record.loss):
            continue
        if previous is not None and previous.loss is not None and previous.loss > 0 and record.loss > 2 * previous.loss:
            return previous, record
        previous = record
    return None
