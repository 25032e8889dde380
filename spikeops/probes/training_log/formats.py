"""The format readers: Megatron-LM iteration lines, DeepSpeed (overflows, engine and pipeline
steps), Hugging Face Trainer dicts, JSON lines, and the long tail through the generic
step-line reader (``spikeops.probes.step_lines``); wrapped lines joined first."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from typing import Any
from spikeops.probes.base import (
    clip,
)
from spikeops.probes import step_lines
from spikeops.probes.step_lines import PROGRESS as _PROGRESS
from spikeops.probes.step_lines import TIMESTAMP as _DATE
from spikeops.probes.step_lines import bounded_int as _bounded
from spikeops.probes.step_lines import parse_number as _float
from spikeops.probes.step_lines import rank_tag as _rank_tag
from spikeops.probes.step_lines import strip_launcher as _strip_launcher
from spikeops.probes.step_lines import time_in as _time_in
from spikeops.timeparse import parse_any
from spikeops.probes.training_log.model import (
    MAX_DICT_CHARS,
    StepRecord,
    RankMemory,
    OverflowEvent,
    _int,
    _value,
    _step_value,
    _ANSI,
    _MEGATRON,
    _OVERFLOW,
    _SCALE_CHANGE,
    _ATTEMPTED,
    _REDUCED,
    _RANK,
    _MEMORY,
    _MEMORY_FIELD,
    _DS_ENGINE,
    _DS_STEPS,
    _ELISION,
    _BARE_PAIR,
    _EPOCH_HEADER,
    _NAN_MESSAGE,
    _NAN_AT,
    _FAIRSEQ_OVERFLOW,
    _SCALE_MINIMUM,
    _LOSS_KEY_QUOTED,
    _BARE_NONFINITE,
    _STEP_KEYS,
    _LOSS_KEYS,
    _LR_KEYS,
    _GRAD_KEYS,
    _TOKEN_KEYS,
    _EPOCH_KEYS,
    _TIME_KEYS,
    _first,
)
from spikeops.probes.training_log.builder import (
    _Builder,
)

__all__ = ["MAX_WRAP_LINES"]


# --------------------------------------------------------------------------- per-line readers


def _pipe_fields(rest: str) -> dict[str, str]:
    """Megatron's ``| key: value |`` fields; keys lower-cased, values raw."""
    result: dict[str, str] = {}
    for part in rest.split("|"):
        key, sep, value = part.rpartition(":")
        if sep and key.strip():
            result[key.strip().lower()] = value.strip()
    return result


def _field_number(builder: _Builder, values: dict[str, str], key: str, line: int) -> float | None:
    raw = values.get(key)
    if raw is None:
        return None
    number = _float(raw)
    if number is None:
        builder.gap(f"unreadable {key!r} value {raw[:40]!r}", line)
    return number


def _field_int(builder: _Builder, values: dict[str, str], key: str, line: int) -> int | None:
    raw = values.get(key)
    if raw is None:
        return None
    number = _int(raw)
    if number is None:
        builder.gap(f"unreadable {key!r} value {raw[:40]!r}", line)
    return number


_MEGATRON_THROUGHPUT = (
    ("samples per second", "samples/s"),
    ("tokens per gpu per second (tgs)", "tokens/s/GPU"),
    ("throughput per gpu (tflop/s/gpu)", "TFLOP/s/GPU"),
    ("tflops", "TFLOP/s"),
)


def _read_megatron(builder: _Builder, number: int, line: str, match: re.Match[str]) -> StepRecord:
    """An ``iteration N/ M | ...`` line. A missing ``lm loss`` is kept as None: Megatron
    leaves the field out when every iteration of the interval was skipped or, in versions
    with ``if avg > 0.0``, when the average is NaN."""
    values = _pipe_fields(line[match.end():])
    record = StepRecord(step=int(match["step"]), line=number, text=clip(line), source="megatron")
    record.time = _time_in(line[: match.start()])
    ranked = [(rank, key) for key in values if "loss" in key and (rank := step_lines.loss_rank(key)) is not None]
    loss_key = min(ranked)[1] if ranked else None
    record.loss = _field_number(builder, values, loss_key, number) if loss_key else None
    record.lr = _field_number(builder, values, _present(values, "learning rate", "lr"), number)
    record.loss_scale = _field_number(builder, values, _present(values, "loss scale", "loss_scale"), number)
    grad = _field_number(builder, values, _present(values, "grad norm", "grad_norm", "gnorm"), number)
    if grad == 0.0:
        builder.zero_grad_lines += 1
        builder.zero_grad_first = builder.zero_grad_first or number
        grad = None
    record.grad_norm = grad
    record.skipped_iterations = _field_int(builder, values, "number of skipped iterations", number)
    record.nan_iterations = _field_int(builder, values, "number of nan iterations", number)
    if record.skipped_iterations is not None:
        record.skipped = record.skipped_iterations > 0
    # The fields Megatron prints after the loss are there, the loss is not, and no iteration
    # of the interval was skipped: the average was NaN (or the fork prints no loss at all,
    # which finish() tells apart by the file's other lines).
    printed_after = any(key in values for key in ("loss scale", "grad norm", "number of skipped iterations",
                                                  "number of nan iterations"))
    if loss_key is None and printed_after and not record.skipped_iterations:
        record.loss_missing = True
    record.tokens = _field_int(builder, values, "consumed tokens", number)
    if "elapsed time per iteration (ms)" in values:
        ms = _field_number(builder, values, "elapsed time per iteration (ms)", number)
        record.iteration_time_s = ms / 1000.0 if ms is not None else None
    elif "elapsed time per iteration (s)" in values:
        record.iteration_time_s = _field_number(builder, values, "elapsed time per iteration (s)", number)
    for key, unit in _MEGATRON_THROUGHPUT:
        if key in values:
            record.throughput = _field_number(builder, values, key, number)
            record.throughput_unit = unit
            break
    return record


def _present(values: dict[str, str], *keys: str) -> str:
    """The first of ``keys`` the line has (the first one when none: reads as absent)."""
    return next((key for key in keys if key in values), keys[0])


def _read_overflow(number: int, line: str, match: re.Match[str], step: int | None = None) -> OverflowEvent:
    attempted = _ATTEMPTED.search(line)
    reduced = _REDUCED.search(line)
    rank = _RANK.search(line, match.start())
    return OverflowEvent(
        time=_time_in(line[: match.start()]),
        line=number,
        attempted=_float(attempted["v"]) if attempted else None,
        reduced_to=_float(reduced["v"]) if reduced else None,
        rank=int(rank.group(1)) if rank else None,
        text=clip(line),
        step=step,
    )


def _read_memory(number: int, line: str) -> list[RankMemory]:
    """Per-rank memory reports; two can be glued on one line when ranks print at once."""
    heads = list(_MEMORY.finditer(line))
    entries = []
    for index, head in enumerate(heads):
        end = heads[index + 1].start() if index + 1 < len(heads) else len(line)
        values = {key.lower(): _float(value) for key, value in _MEMORY_FIELD.findall(line[head.end():end])}
        entries.append(RankMemory(
            step=int(head["step"]), rank=int(head["rank"]),
            allocated_mb=values.get("allocated"), max_allocated_mb=values.get("max allocated"),
            reserved_mb=values.get("reserved"), max_reserved_mb=values.get("max reserved"),
            line=number, text=clip(line[head.start():end]),
        ))
    return entries


def _read_ds_engine(builder: _Builder, number: int, line: str, match: re.Match[str]) -> StepRecord:
    """DeepSpeed's ``[Rank 0] step=N, skipped=K, lr=[...]``: K counts skipped steps since the
    start, so this step was skipped when K rose since the previous report."""
    skipped_total = int(match["skipped"])
    previous = builder.ds_skipped
    if previous is not None and skipped_total >= previous:
        skipped: bool | None = skipped_total > previous
    else:
        skipped = False if skipped_total == 0 else None
    builder.ds_skipped = skipped_total
    return StepRecord(
        step=int(match["step"]), lr=_float(match["lr"]), skipped=skipped,
        time=_time_in(line[: match.start()]), line=number, text=clip(line), source="deepspeed-engine",
    )


def _read_ds_steps(number: int, line: str, match: re.Match[str]) -> StepRecord:
    """DeepSpeed pipeline engine's ``steps: N loss: X iter time (s): T samples/sec: S``."""
    return StepRecord(
        step=int(match["step"]), loss=_float(match["loss"]),
        throughput=_float(match["sps"]), throughput_unit="samples/s" if match["sps"] else None,
        iteration_time_s=_float(match["iter"]), time=_time_in(line[: match.start()]),
        line=number, text=clip(line), source="deepspeed",
    )


def _python_literal(body: str) -> Any:
    """A Trainer dict's Python repr; ``nan``/``inf`` are bare names there, which
    ``ast.literal_eval`` refuses, so they are quoted first and read back as floats."""
    quoted = _BARE_NONFINITE.sub(lambda m: f"{m['pre']}'{m['sign']}{m['word']}'", body)
    return ast.literal_eval(quoted)


def _load_mapping(body: str) -> tuple[Mapping[str, Any] | None, bool]:
    """``(mapping, is_json)``; JSON first (it has NaN/Infinity), then a Python literal."""
    if len(body) > MAX_DICT_CHARS:
        return None, False
    try:
        value = json.loads(body)
        if isinstance(value, dict):
            return value, True
        return None, True
    except (ValueError, RecursionError):
        pass
    try:
        value = _python_literal(body)
    except Exception:  # noqa: BLE001 - literal_eval raises many types on bad text; never ours to raise
        return None, False
    return (value, False) if isinstance(value, dict) else (None, False)


def _from_mapping(
    builder: _Builder,
    mapping: Mapping[str, Any],
    number: int,
    text: str,
    source: str,
    *,
    strict: bool,
    ordinal: bool = False,
) -> StepRecord | None:
    """A step from a metrics mapping (metrics.jsonl object, Trainer dict, log_history entry).

    Returns None for mappings that are not training steps: eval dicts (``eval_loss``), the
    Trainer's final ``train_runtime`` summary, or, unless ``strict``, anything without a loss.
    In ``strict`` mode (metrics.jsonl) a missing loss is kept as None with a gap, because the
    file promises one. A missing step is a gap unless ``ordinal`` (Trainer stdout, which
    never prints steps) lets the record be numbered 1..n."""
    if "train_runtime" in mapping:
        return None
    loss_key, raw_loss = _first(mapping, _LOSS_KEYS)
    if loss_key is None and not strict:
        return None
    step_key, raw_step = _first(mapping, _STEP_KEYS)
    step = _step_value(raw_step) if step_key else None
    if step_key is not None and step is None:
        builder.gap(f"step {str(raw_step)[:40]!r} is not a whole number", number)
        return None
    if step is None:
        if not ordinal:
            builder.gap("metrics object without a 'step'", number)
            return None
        # The Trainer prints no step, but its progress bar counts the steps done.
        step = builder.bar_step()
        if step is None:
            step = builder.next_ordinal()
    record = StepRecord(step=step, line=number, text=clip(text), source=source)
    if loss_key is None:
        builder.gap("metrics object without a 'loss'", number)
    else:
        record.loss = _value(raw_loss)
        if record.loss is None and raw_loss is not None:
            builder.gap(f"unreadable loss {str(raw_loss)[:40]!r}", number)
    record.lr = _value(_first(mapping, _LR_KEYS)[1])
    record.grad_norm = _value(_first(mapping, _GRAD_KEYS)[1])
    record.loss_scale = _value(mapping.get("loss_scale"))
    record.throughput = _value(mapping.get("throughput"))
    record.epoch = _value(_first(mapping, _EPOCH_KEYS)[1])
    tokens = _value(_first(mapping, _TOKEN_KEYS)[1])
    if tokens is not None and math.isfinite(tokens):
        record.tokens = _bounded(int(tokens)) if tokens.is_integer() else tokens
    if isinstance(mapping.get("skipped"), bool):
        record.skipped = mapping["skipped"]
    time_key, raw_time = _first(mapping, _TIME_KEYS)
    if time_key is not None and raw_time is not None:
        record.time = parse_any(raw_time)
        if record.time is None:
            builder.gap(f"unreadable {time_key} {str(raw_time)[:40]!r}", number)
    return record


def _read_generic(number: int, line: str, epoch: int | None = None,
                  counter: step_lines.EpochCounter | None = None, step: int | None = None) -> StepRecord | None:
    """A line no specific parser claims, read by the generic step-line reader
    (``step_lines.read_line``: hand-written loops, vision toolboxes, darknet, TensorFlow,
    fairseq, progress bars...). ``counter`` numbers ``epoch iteration`` pairs globally;
    ``step`` is the one a header line announced for a loss line that prints none."""
    found = step_lines.read_line(line, epoch=epoch, step=step)
    if found is None:
        return None
    step = found.step
    if step is None and found.within is not None:
        step = (counter or step_lines.EpochCounter()).step(*found.within)
    if step is None:
        return None
    return StepRecord(
        step=step, loss=found.loss, lr=found.lr, grad_norm=found.grad_norm, loss_scale=found.loss_scale,
        time=found.time, tokens=found.tokens, throughput=found.throughput, epoch=found.epoch, line=number,
        text=clip(line), source="darknet" if found.shape == "darknet" else "generic",
        throughput_unit=found.throughput_unit, perplexity=found.perplexity,
    )


def _read_nan_message(builder: _Builder, number: int, line: str) -> StepRecord | None:
    """A non-finite loss announced in words: at the step it names, else the step after the
    last one logged (one record however many ranks print it)."""
    last = builder.records[-1] if builder.records else None
    if last is not None and last.source == "nan-message":
        return None
    named = _NAN_AT.search(line)
    if named is not None:
        step = int(named["step"])
    else:
        step = last.step + 1 if last is not None else builder.next_ordinal()
    return StepRecord(step=step, loss=math.nan, line=number, text=clip(line), source="nan-message",
                      time=_time_in(line))


#: Physical lines one logical line may be wrapped over (a terminal, a chat, a document).
MAX_WRAP_LINES = 6


def _wrap_kind(line: str) -> str | None:
    """Is this the first piece of a wrapped record? A Megatron iteration line ends with
    ``|``; a Trainer dict closes its ``}``. Without the end, the rest follows on the next
    physical lines."""
    if "iteration" in line and _MEGATRON.search(line):
        return "megatron"
    brace = line.rfind("{")
    if brace >= 0 and "}" not in line[brace:] and _LOSS_KEY_QUOTED.search(line, brace):
        return "dict"
    return None


#: A piece of a Megatron record printed over several lines, each ending in ``|``
#: (``learning rate: 1.35E-04 | global batch size: 4096 |``).
_FIELDS_PIECE = re.compile(r"^\s*[A-Za-z][\w ()/.-]{0,60}:\s*[^|:]{1,60}(?:\|\s*[A-Za-z][\w ()/.-]{0,60}:\s*[^|:]{1,60})*\|?\s*$")


def _continues(line: str, previous: str) -> bool:
    """A physical line that can be the rest of a wrapped record: not a record of its own, not
    a line the launcher stamped or tagged (those are new lines of the log). After a piece that
    ended its field (``|``), only a line of more ``key: value |`` fields continues it."""
    stripped = line.strip()
    if previous.rstrip().endswith("|") and not _FIELDS_PIECE.match(line):
        return False
    if not stripped or len(stripped) > 2000 or _rank_tag(line) is not None or _DATE.match(stripped):
        return False
    if "iteration" in line and _MEGATRON.search(line):
        return False
    return not (stripped.startswith(("time (ms)", "[Rank", "[before", "{", "Traceback")) or _OVERFLOW.search(line))


def _join(first: str, rest: str) -> str:
    """Glue a wrapped piece back: a word wrap may have dropped the space at the break
    (``number of nan`` / ``iterations``), a hard wrap inside a number must not gain one."""
    if not first or not rest or first[-1].isspace() or rest[0].isspace():
        return first + rest
    if first[-1].isalpha() and rest[0].isalpha():
        return first + " " + rest
    return first + rest


def _flush_wrap(builder: _Builder) -> None:
    if builder.wrap is None:
        return
    number, text, _ = builder.wrap
    builder.wrap = None
    _dispatch(builder, number, text)


def _feed_line(builder: _Builder, number: int, raw: str) -> None:
    """Recognise one log line; lines of no known shape (NCCL, bash traces, timers) pass. A
    record wrapped over several physical lines is joined first and cites its first line."""
    line = _ANSI.sub("", raw) if "\x1b" in raw else raw
    if builder.wrap is not None:
        first, text, pieces = builder.wrap
        if _continues(line, text):
            joined = _join(text, line)
            kind = _wrap_kind(joined)
            if kind is None or pieces + 1 >= MAX_WRAP_LINES:
                builder.wrap = None
                _dispatch(builder, first, joined)
            else:
                builder.wrap = (first, joined, pieces + 1)
            return
        _flush_wrap(builder)
    if not line.strip():
        return
    if _wrap_kind(line) is not None:
        builder.wrap = (number, line, 1)
        return
    _dispatch(builder, number, line)


def _dispatch(builder: _Builder, number: int, line: str) -> None:
    bars = list(_PROGRESS.finditer(line)) if "/" in line and "[" in line else []
    bar_step = builder.progress(bars[0]) if bars else None
    if "iteration" in line and (match := _MEGATRON.search(line)) is not None:
        builder.add(_read_megatron(builder, number, line, match), _rank_tag(line))
        return
    if "verflow" in line or "OVERFLOW" in line:
        if (match := _OVERFLOW.search(line)) is not None:
            # A bar printed before the overflow on the same line counts the steps done: this
            # overflow belongs to the step after them.
            done = builder.progress(bars[-1]) if bars and bars[-1].start() < match.start() else builder.progress_done
            builder.overflow(_read_overflow(number, line, match, done + 1 if done is not None else None))
            return
        if (match := _FAIRSEQ_OVERFLOW.search(line)) is not None:
            builder.overflow(OverflowEvent(time=_time_in(line[: match.start()]), line=number, attempted=None,
                                           reduced_to=_float(match["v"]), text=clip(line)), marks_next=False)
            return
    if "inimum" in line and (match := _SCALE_MINIMUM.search(line)) is not None:
        builder.overflow(OverflowEvent(time=_time_in(line[: match.start()]), line=number, attempted=None,
                                       reduced_to=_float(match["v"]) if match["v"] else None, text=clip(line),
                                       minimum=True), marks_next=False)
        return
    if "scale" in line and (match := _SCALE_CHANGE.search(line)) is not None:
        if match["c"] is not None:  # applied anyway: the scale moved, no step was skipped
            builder.overflow(OverflowEvent(time=_time_in(line[: match.start()]), line=number, attempted=None,
                                           reduced_to=_float(match["c"]), text=clip(line)), marks_next=False)
        else:
            builder.overflow(OverflowEvent(time=_time_in(line[: match.start()]), line=number,
                                           attempted=_float(match["a"]), reduced_to=_float(match["b"]),
                                           text=clip(line)), marks_next=False)
        return
    if "memory (MB)" in line and _MEMORY.search(line):
        for entry in _read_memory(number, line):
            builder.rank_memory(entry)
        return
    if "Epoch" in line and (match := _EPOCH_HEADER.match(line)) is not None:
        builder.epoch = int(match["epoch"])
        return
    if "skipped=" in line and (match := _DS_ENGINE.search(line)) is not None:
        builder.add(_read_ds_engine(builder, number, line, match), _rank_tag(line))
        return
    if "steps:" in line and (match := _DS_STEPS.search(line)) is not None:
        builder.add(_read_ds_steps(number, line, match), _rank_tag(line))
        return
    start, end = line.find("{"), line.rfind("}")
    if 0 <= start < end and "loss" in line:
        body = line[start:end + 1]
        mapping, is_json = _load_mapping(body)
        if mapping is not None:
            source = "metrics-jsonl" if is_json and _first(mapping, _STEP_KEYS)[0] else "hf-trainer"
            record = _from_mapping(builder, mapping, number, line, source, strict=False, ordinal=True)
            if record is not None:
                builder.add(record, _rank_tag(line))
            return
        if _LOSS_KEY_QUOTED.search(body):
            builder.gap("unreadable training log dict", number)
            return
    if _ELISION.match(line):
        builder.gap("elided lines in the log ('...'): steps between may be missing", number)
        return
    record = _read_generic(number, line, builder.epoch, builder.epochs, builder.step_for)
    if record is None and (announced := step_lines.read_lr_line(line)) is not None:
        builder.announce_lr(announced)
        return
    if record is None and (match := _BARE_PAIR.match(_strip_launcher(line))) is not None:
        record = StepRecord(step=int(match["step"]), loss=_float(match["v"]), line=number, text=clip(line),
                            source="table")
    if record is None and bar_step is None and _NAN_MESSAGE.search(line):
        record = _read_nan_message(builder, number, line)
    if record is not None:
        builder.add(record, _rank_tag(line))
