"""Training logs and metrics files, read into one table of steps.

A loss spike is first seen in the job's own numbers: the loss, the gradient norm, the fp16
loss scale, skipped steps. Jobs print them in many shapes, often several in one file, so the
log parser recognises each line on its own, whatever launcher prefix (``[default7]:``,
``srun -l``'s ``0: ``, ``[rank0]:``) or timestamp sits in front of it:

- Megatron-LM / Megatron-DeepSpeed ``iteration N/ M | key: value | ...`` lines, with or
  without the leading ``[2024-05-01 12:00:00(.ffffff)]`` newer Megatron-LM prints;
- DeepSpeed ``OVERFLOW! ... Skipping step. Attempted loss scale: A, reducing to B`` lines
  (the *next* step record is the skipped one), the engine's ``[Rank 0] step=N, skipped=K,
  lr=[...]`` and the pipeline engine's ``steps: N loss: X iter time (s): T samples/sec: S``;
- Hugging Face Trainer stdout dicts ``{'loss': 1.37, 'grad_norm': 3.4, ...}`` (no step
  number is printed, so steps are numbered 1..n and ``step_is_ordinal`` is set);
- JSON lines in the bundle's ``metrics.jsonl`` shape;
- generic ``step/iter/Batch N ... loss: X ... lr: Y`` key-value lines.

Two more entry points read the whole-file forms: ``parse_metrics_jsonl`` (the bundle's
canonical file, every line must be a metrics object) and ``parse_trainer_state`` (Hugging
Face ``trainer_state.json``). All three return a ``TrainingLog``; ``to_frame`` turns its
records into one pandas row per step, where a step logged twice (a job resumed from a
checkpoint re-logs the steps after it) keeps its *later* occurrence.

Values stay as printed; only the quirks that would mislead are normalised: Megatron prints
``grad norm: 0.000`` when it did not compute the norm (None here), and non-finite values
(``NAN``, ``nan``, ``inf``, ``Infinity``, ``"-inf"``) become float NaN/inf, never dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from itertools import chain
from typing import TYPE_CHECKING, Any

from spikeops.probes.base import (
    RemoteProbe,
    register_remote,
    MAX_EVENTS,
    Gap,
    Kind,
    LineSource,
    clip,
    join_text,
    numbered_lines,
    register,
)
from spikeops.probes import step_lines
from spikeops.probes.step_lines import NUMBER as _NUM
from spikeops.probes.step_lines import NUMBER_END as _NUM_END
from spikeops.probes.step_lines import PROGRESS as _PROGRESS
from spikeops.probes.step_lines import TIMESTAMP as _DATE
from spikeops.probes.step_lines import bounded_int as _bounded
from spikeops.probes.step_lines import parse_number as _float
from spikeops.probes.step_lines import rank_tag as _rank_tag
from spikeops.probes.step_lines import strip_launcher as _strip_launcher
from spikeops.probes.step_lines import time_in as _time_in
from spikeops.timeparse import parse_any

if TYPE_CHECKING:  # pandas is imported lazily: detection must stay cheap
    import pandas as pd

__all__ = [
    "REMOTE",
    "StepRecord",
    "RankMemory",
    "OverflowEvent",
    "Restart",
    "TrainingLog",
    "parse",
    "parse_metrics_jsonl",
    "parse_trainer_state",
    "to_frame",
    "latest_per_step",
    "first_loss_doubling",
    "detect",
    "detect_metrics_jsonl",
    "detect_trainer_state",
    "summarize",
    "FRAME_COLUMNS",
    "MAX_STEPS",
    "KIND",
    "METRICS_KIND",
    "TRAINER_STATE_KIND",
]

#: Step records kept from one input. A run that logs every step for weeks has more than
#: MAX_EVENTS of them, and the incident is at the end of the log, so the *latest* records
#: are kept and the dropped earliest ones are counted in a gap.
MAX_STEPS = 100_000
#: A learning rate announced without a step (`` >>> lr: 0.01``) belongs to the step logged
#: at most this many lines above it (the step's block of component losses in between).
ANNOUNCE_REACH = 8
#: A Trainer log dict is a few hundred characters; a longer ``{...}`` is something else and
#: is not handed to the Python parser.
MAX_DICT_CHARS = 8192
#: A whole JSON document (trainer_state.json) is buffered up to this many characters.
MAX_DOCUMENT_CHARS = 64 * 1024 * 1024

#: Columns of ``to_frame``, in order.
FRAME_COLUMNS = (
    "step", "time", "loss", "lr", "grad_norm", "loss_scale", "skipped", "nan",
    "tokens", "throughput", "line",
)


# --------------------------------------------------------------------------- results


@dataclass(slots=True)
class StepRecord:
    """One logged training step, as the job printed it.

    ``skipped`` is True when the optimizer did not apply the step (fp16 overflow: Megatron's
    ``number of skipped iterations`` > 0, a DeepSpeed ``OVERFLOW!`` line, or DeepSpeed's
    cumulative ``skipped=`` counter rising). ``nan`` is True when the loss or the grad norm is
    non-finite or Megatron counted a nan iteration. Both are None when the log says nothing.
    A Megatron line is a summary over its log interval, so its values are averages over it.
    """

    step: int
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped: bool | None = None
    nan: bool | None = None
    time: datetime | None = None
    tokens: int | float | None = None
    throughput: float | None = None
    epoch: float | None = None
    line: int = 0
    text: str = ""
    #: Which format the line was in: megatron, deepspeed, deepspeed-engine, hf-trainer,
    #: metrics-jsonl, trainer-state or generic.
    source: str = ""
    #: Unit of ``throughput`` as printed (samples/s, TFLOP/s/GPU, tokens/s, ...).
    throughput_unit: str | None = None
    #: Megatron's ``elapsed time per iteration``, in seconds whatever unit it printed.
    iteration_time_s: float | None = None
    #: Megatron's per-interval counters, raw.
    skipped_iterations: int | None = None
    nan_iterations: int | None = None
    #: The line's format prints a loss on every training step, this line has none, and
    #: nothing says the step was skipped: Megatron leaves ``lm loss`` out when its average is
    #: NaN (``if avg > 0.0`` is False for NaN). The diagnosis reads it as a non-finite loss.
    loss_missing: bool = False
    #: ``ppl``/``perplexity`` as printed (an infinite perplexity is an absurd loss).
    perplexity: float | None = None


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Megatron's ``[Rank R] (after N iterations) memory (MB) | allocated: ...`` report.

    One rank far above its peers hints at a rank-specific batch (an overlong sample)."""

    step: int
    rank: int
    allocated_mb: float | None
    max_allocated_mb: float | None
    reserved_mb: float | None
    max_reserved_mb: float | None
    line: int
    text: str = ""


@dataclass(frozen=True, slots=True)
class OverflowEvent:
    """A skipped fp16 step announced by DeepSpeed (``OVERFLOW!``) or apex (``Gradient
    overflow``): the loss scale went from ``attempted`` to ``reduced_to`` (None when the
    line says the hysteresis absorbed it)."""

    time: datetime | None
    line: int
    attempted: float | None
    reduced_to: float | None
    rank: int | None = None
    text: str = ""
    #: The step it happened in, when the log tells (a progress bar before it); else None.
    step: int | None = None
    #: The scaler said it cannot go lower (DeepSpeed's ``Current loss scale already at
    #: minimum``, fairseq's ``Minimum loss scale reached``): the run stops on overflow.
    minimum: bool = False


@dataclass(frozen=True, slots=True)
class Restart:
    """The step number went back: the job was resumed from a checkpoint (or restarted)."""

    line: int
    from_step: int
    to_step: int
    text: str = ""


@dataclass
class TrainingLog:
    """Everything read from one training log or metrics file.

    ``records`` are in file order, restarts included; ``to_frame``/``latest_per_step`` give
    one record per step. ``step_is_ordinal`` warns that step numbers were invented (1..n)
    because the format (Hugging Face Trainer stdout) does not print them.
    """

    format: str
    records: list[StepRecord] = field(default_factory=list)
    rank_memory: list[RankMemory] = field(default_factory=list)
    overflow_events: list[OverflowEvent] = field(default_factory=list)
    lines: int = 0
    gaps: list[Gap] = field(default_factory=list)
    step_is_ordinal: bool = False
    restarts: list[Restart] = field(default_factory=list)


# --------------------------------------------------------------------------- numbers

def _int(text: str | None) -> int | None:
    value = _float(text)
    if value is None or not math.isfinite(value) or not value.is_integer():
        return None
    return _bounded(int(value))


def _value(raw: Any) -> float | None:
    """A number from a parsed JSON/Python mapping; numeric strings are accepted because
    recent Trainer versions print ``{'loss': '1.374'}`` and the bundle allows ``"nan"``."""
    if isinstance(raw, bool) or raw is None:
        return None
    if isinstance(raw, int | float):
        return float(raw)
    if isinstance(raw, str):
        return _float(raw)
    return None


def _step_value(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return _bounded(raw)
    if isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        return _bounded(int(raw))
    if isinstance(raw, str) and re.fullmatch(r"\s*\d{1,19}\s*", raw):
        return _bounded(int(raw))
    return None


def _nonfinite(value: float | None) -> bool:
    return value is not None and not math.isfinite(value)


# --------------------------------------------------------------------------- line shapes

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MEGATRON = re.compile(r"\biteration:?\s+(?P<step>\d{1,18})\s*/\s*(?P<total>\d+)\s*\|")
_OVERFLOW = re.compile(r"(?:overflow!|gradient overflow\.|overflow detected\.).*?skipping step", re.I)
#: DeepSpeed's fused optimizer: ``Reducing dynamic loss scale from 1 to 1``; MindSpore's
#: ``overflow, still update, loss scale adjust to 1024.0`` (the step is applied anyway).
_SCALE_CHANGE = re.compile(
    rf"Reducing dynamic loss scale from\s*(?P<a>{_NUM})\s*to\s*(?P<b>{_NUM})|overflow, still update, loss scale adjust to\s*(?P<c>{_NUM})",
    re.I,
)
_ATTEMPTED = re.compile(rf"Attempted loss scale:\s*(?P<v>{_NUM}){_NUM_END}", re.I)
_REDUCED = re.compile(rf"reducing (?:loss scale )?to\s*(?P<v>{_NUM}){_NUM_END}", re.I)
_RANK = re.compile(r"\bRank (\d{1,18})\b")
_MEMORY = re.compile(r"\[Rank (?P<rank>\d{1,18})\]\s*\(after (?P<step>\d{1,18}) iterations\)\s*memory \(MB\)")
_MEMORY_FIELD = re.compile(rf"\|\s*(max allocated|allocated|max reserved|reserved):\s*({_NUM})", re.I)
_DS_ENGINE = re.compile(
    rf"\bstep=(?P<step>\d{{1,18}}),\s*skipped=(?P<skipped>\d{{1,18}}),\s*lr=\[?\s*(?P<lr>{_NUM}){_NUM_END}", re.I
)
_DS_STEPS = re.compile(
    rf"\bsteps:\s*(?P<step>\d{{1,18}})\s+loss:\s*(?P<loss>{_NUM}){_NUM_END}"
    rf"(?:\s+iter time \(s\):\s*(?P<iter>{_NUM}))?"
    rf"(?:\s+(?:total )?samples/sec:\s*(?P<sps>{_NUM}))?",
    re.I,
)
_ELISION = re.compile(r"^\s*(?:\d+:\s*)?(?:\[\s*(?:\.\.\.|…)\s*\]|\.{3,}|…)\s*$")
#: A bare two-column table of step and loss (``76930 2.6496577``, ``76980 nan``): the whole
#: line is the two numbers, the first a whole one.
_BARE_PAIR = re.compile(rf"^\s*(?P<step>\d{{1,12}})\s+(?P<v>{_NUM})\s*$", re.I)
#: Keras prints ``Epoch 65/1000`` on its own line and the epoch's loss on the bar after it.
_EPOCH_HEADER = re.compile(r"^\s*Epoch\s+(?P<epoch>\d{1,9})/\d{1,9}\s*$")
#: A non-finite loss announced in words, with no step (TensorFlow's ``Model diverged with
#: loss = NaN.``, ``Loss is nan, stopping training``).
_NAN_MESSAGE = re.compile(
    r"diverged with loss\s*=\s*nan|\bloss\s+(?:is|became|becomes|=|:)\s*(?:nan|inf)\b|\bnan loss\b"
    r"|\bloss became infinite or nan\b|\bloss(?:tensor)? is inf or nan\b|\bnon-finite loss\b", re.I
)
#: The step a NaN message names (detectron2's ``Loss became infinite or NaN at iteration=1029!``).
_NAN_AT = re.compile(r"\bat (?:iteration|iter|step)\s*[=:]?\s*(?P<step>\d{1,18})\b", re.I)
#: fairseq / metaseq: ``| WARNING: overflow detected, setting loss scale to: 0.25``.
_FAIRSEQ_OVERFLOW = re.compile(rf"overflow detected, setting loss scale to:?\s*(?P<v>{_NUM})", re.I)
#: The scaler at its floor: the run stops on the next overflow.
_SCALE_MINIMUM = re.compile(
    rf"loss scale already at minimum|minimum loss scale reached(?:\s*\(\s*(?P<v>{_NUM})\s*\))?", re.I
)
_LOSS_KEY_QUOTED = re.compile(r"""['"](?:train/)?loss['"]\s*:""")
_BARE_NONFINITE = re.compile(r"(?P<pre>[:,\[(]\s*)(?P<sign>-?)(?P<word>nan|inf)(?=\s*[,}\])])")

# Mapping keys (HF Trainer dicts, trainer_state.json, metrics.jsonl, wandb-style keys).
_STEP_KEYS = ("step", "global_step", "train/global_step", "iteration")
_LOSS_KEYS = ("loss", "train/loss", "lm_loss", "lm loss")
_LR_KEYS = ("lr", "learning_rate", "train/learning_rate")
_GRAD_KEYS = ("grad_norm", "train/grad_norm", "gradient_norm")
_TOKEN_KEYS = ("tokens", "num_tokens", "num_input_tokens_seen", "consumed_tokens")
_EPOCH_KEYS = ("epoch", "train/epoch")
_TIME_KEYS = ("time", "timestamp")






def _first(mapping: Mapping[str, Any], keys: Iterable[str]) -> tuple[str | None, Any]:
    for key in keys:
        if key in mapping:
            return key, mapping[key]
    return None, None


# --------------------------------------------------------------------------- merging


def _either(first: bool | None, second: bool | None) -> bool | None:
    if first or second:
        return True
    if first is None and second is None:
        return None
    return False


def _set_nan(record: StepRecord) -> None:
    """``nan`` from the values: non-finite loss/grad norm or a Megatron nan iteration."""
    if (
        _nonfinite(record.loss)
        or _nonfinite(record.grad_norm)
        or (record.nan_iterations or 0) > 0
    ):
        record.nan = True
    elif record.nan is None and (
        record.loss is not None or record.grad_norm is not None or record.nan_iterations is not None
    ):
        record.nan = False


_VALUE_FIELDS = tuple(
    f.name for f in fields(StepRecord) if f.name not in ("step", "line", "text", "source", "skipped", "nan")
)


def _merge(old: StepRecord, new: StepRecord) -> StepRecord:
    """One step printed by two complementary lines (DeepSpeed's ``step=`` and ``steps:``, or
    two ranks): one record, citing the line that carries the loss (the earlier on a tie)."""
    cited, other = (new, old) if new.loss is not None and old.loss is None else (old, new)
    merged = replace(cited)
    for name in _VALUE_FIELDS:
        if getattr(merged, name) is None:
            setattr(merged, name, getattr(other, name))
    merged.skipped = _either(old.skipped, new.skipped)
    merged.nan = _either(old.nan, new.nan)
    _set_nan(merged)
    return merged


# --------------------------------------------------------------------------- builder


class _Builder:
    """State shared by the three entry points: bounded record store, restarts, gaps, and
    the pending DeepSpeed overflow that belongs to the next step record."""

    def __init__(self) -> None:
        self.records: deque[StepRecord] = deque(maxlen=MAX_STEPS)
        self.dropped_records = 0
        self.memory: deque[RankMemory] = deque(maxlen=MAX_EVENTS)
        self.dropped_memory = 0
        self.overflows: deque[OverflowEvent] = deque(maxlen=MAX_EVENTS)
        self.dropped_overflows = 0
        self.restarts: list[Restart] = []
        self.gaps: list[Gap] = []
        self.dropped_gaps = 0
        self.lines = 0
        self.ordinal = 0
        self.pending: OverflowEvent | None = None
        self.zero_grad_lines = 0
        self.zero_grad_first: int | None = None
        self.ds_skipped: int | None = None
        self.last_tag: str | None = None
        #: A record wrapped over physical lines: (first line, text so far, pieces).
        self.wrap: tuple[int, str, int] | None = None
        #: Steps done by the latest training progress bar (the bar with the largest total:
        #: evaluation bars count other things).
        self.progress_done: int | None = None
        self.progress_total = 0
        self.progress_fresh = False
        #: The epoch a Keras ``Epoch N/M`` header line announced (the step of its bar line).
        self.epoch: int | None = None
        #: Global steps for ``epoch iteration`` pairs (epoch length not printed).
        self.epochs = step_lines.EpochCounter()
        #: A learning rate announced on a line of its own: for one step ahead (caffe prints
        #: ``Iteration N, lr = X`` before the step's loss line), or from here on (``>>> lr:``).
        self.lr_for: tuple[int, float] | None = None
        self.lr_now: float | None = None
        #: The step a header line announced, for the loss line after it (which prints none).
        self.step_for: int | None = None

    def gap(self, reason: str, line: int | None) -> None:
        if len(self.gaps) < MAX_EVENTS:
            self.gaps.append(Gap(reason, line))
        else:
            self.dropped_gaps += 1

    def progress(self, bar: re.Match[str]) -> int | None:
        """Take a tqdm bar's count; returns the steps done (None for an evaluation's bar)."""
        total = int(bar["total"])
        if total >= self.progress_total:
            self.progress_total = total
            self.progress_done = int(bar["done"])
            self.progress_fresh = True
            return self.progress_done
        return None

    def bar_step(self) -> int | None:
        """The step of a record that prints none, from the progress bar: the bar's count when
        it moved since the last record; the step after the last one when it did not (still
        counted as invented: ``step_is_ordinal``); None without a bar."""
        if self.progress_done is None:
            return None
        if self.progress_fresh:
            self.progress_fresh = False
            return self.progress_done
        last = self.records[-1].step if self.records else self.progress_done
        self.ordinal += 1
        return last + 1

    def announce_lr(self, announced: step_lines.LrLine) -> None:
        """A learning rate printed on a line of its own: the logged step's when it names that
        step, the named step's when that step comes next, every later step's when it names
        none (until another announcement)."""
        last = self.records[-1] if self.records else None
        if announced.step is None:
            # Printed under its step's line (tf-faster-rcnn's `` >>> lr:``) or ahead of the
            # steps it governs: the step just logged, when close above, and those to come.
            if last is not None and last.lr is None and self.lines - last.line <= ANNOUNCE_REACH:
                last.lr = announced.lr
            self.lr_now = announced.lr
        elif last is not None and last.step == announced.step:
            last.lr = announced.lr if last.lr is None else last.lr
        else:
            self.lr_for = (announced.step, announced.lr)
            self.step_for = announced.step if announced.header else None

    def add(self, record: StepRecord, tag: str | None = None) -> None:
        """Store a step; a DeepSpeed overflow seen since the last step marks this one skipped,
        dates it and supplies its loss scale when the line has none (unless the overflow's own
        step is known and is another one)."""
        self.step_for = None
        if record.lr is None:
            if self.lr_for is not None and self.lr_for[0] == record.step:
                record.lr = self.lr_for[1]
            elif self.lr_now is not None:
                record.lr = self.lr_now
        if self.pending is not None and self.pending.step not in (None, record.step):
            self.pending = None
        if self.pending is not None:
            record.skipped = True
            if record.loss_scale is None:
                record.loss_scale = self.pending.reduced_to
            if record.time is None:
                record.time = self.pending.time
            self.pending = None
        _set_nan(record)
        last = self.records[-1] if self.records else None
        other_rank = bool(tag and self.last_tag and tag != self.last_tag)
        if last is not None and last.step == record.step and (last.source != record.source or other_rank):
            self.records[-1] = _merge(last, record)
            return
        if last is not None and last.step == record.step:
            # The same step printed again by the same kind of line (a progress bar's updates, a
            # logger that repeats its last entry): one step, the later line's values.
            self.records[-1] = _merge(record, last)
            self.last_tag = tag
            return
        if last is not None and record.step < last.step and len(self.restarts) < MAX_EVENTS:
            self.restarts.append(Restart(record.line, last.step, record.step, record.text))
        if len(self.records) == MAX_STEPS:
            self.dropped_records += 1
        self.records.append(record)
        self.last_tag = tag

    def overflow(self, event: OverflowEvent, marks_next: bool = True) -> None:
        """Keep an overflow; DeepSpeed's marks the next step record skipped (``marks_next``),
        fairseq's and the at-minimum notices do not name a step."""
        if len(self.overflows) == MAX_EVENTS:
            self.dropped_overflows += 1
        self.overflows.append(event)
        self.pending = event if marks_next else None

    def rank_memory(self, entry: RankMemory) -> None:
        if len(self.memory) == MAX_EVENTS:
            self.dropped_memory += 1
        self.memory.append(entry)

    def _judge_missing_losses(self) -> None:
        """A Megatron line without a loss means a NaN average only when the run prints a loss
        on its other lines (a fork that never prints one says nothing by omitting it)."""
        missing = [r for r in self.records if r.loss_missing]
        if not missing:
            return
        prints_loss = any(r.source == "megatron" and r.loss is not None for r in self.records)
        if prints_loss:  # read, not a gap: the summary says it
            for record in missing:
                record.nan = True
            return
        for record in missing:
            record.loss_missing = False
        self.gap("no iteration line prints a loss (this log's format, or every average was NaN): "
                 "losses not read", missing[0].line)

    def next_ordinal(self) -> int:
        self.ordinal += 1
        return self.ordinal

    def finish(self, fmt: str | None = None) -> TrainingLog:
        try:
            _flush_wrap(self)
        except Exception as exc:  # noqa: BLE001 - a reader bug must not lose the log
            self.gap(f"wrapped line not read ({type(exc).__name__})", None)
        self._judge_missing_losses()
        gaps = list(self.gaps)
        if self.zero_grad_lines:
            gaps.append(Gap(
                f"'grad norm: 0.000' on {self.zero_grad_lines} iteration line(s): Megatron prints 0 "
                "when it does not compute the norm (no clipping); stored as None",
                self.zero_grad_first,
            ))
        if self.dropped_records:
            gaps.append(Gap(f"only the last {MAX_STEPS} step records kept; {self.dropped_records} earlier dropped"))
        if self.dropped_memory:
            gaps.append(Gap(f"{self.dropped_memory} earlier rank memory reports dropped (limit {MAX_EVENTS})"))
        if self.dropped_overflows:
            gaps.append(Gap(f"{self.dropped_overflows} earlier overflow lines dropped (limit {MAX_EVENTS})"))
        if self.dropped_gaps:
            gaps.append(Gap(f"{self.dropped_gaps} more unreadable lines not listed"))
        if self.pending is not None:
            gaps.append(Gap("overflow (skipped step) after the last step record: its step was not logged",
                            self.pending.line))
        if not self.records:
            gaps.append(Gap("no training step lines found"))
        return TrainingLog(
            format=fmt or _format_name(self.records),
            records=list(self.records),
            rank_memory=list(self.memory),
            overflow_events=list(self.overflows),
            lines=self.lines,
            gaps=gaps,
            step_is_ordinal=self.ordinal > 0,
            restarts=self.restarts,
        )


def _format_name(records: Iterable[StepRecord]) -> str:
    """The formats the steps came in, most frequent first (``megatron``, ``hf-trainer+generic``)."""
    counts: dict[str, int] = {}
    for record in records:
        name = "deepspeed" if record.source == "deepspeed-engine" else record.source
        counts[name] = counts.get(name, 0) + 1
    if not counts:
        return "unknown"
    return "+".join(name for name, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


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
    return builder.finish()


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


# --------------------------------------------------------------------------- detection


def _sample_lines(sample: str, limit: int = 4000) -> list[str]:
    """Non-empty head lines; a last line cut by the 64 KiB head is left out."""
    lines = sample.splitlines()
    if len(lines) > 1 and not sample.endswith(("\n", "\r")):
        lines = lines[:-1]
    return [line for line in lines[:limit] if line.strip()]


def _line_shape(line: str) -> str | None:
    if "iteration" in line and _MEGATRON.search(line):
        return "megatron"
    if _OVERFLOW.search(line):
        return "overflow"
    if ("skipped=" in line and _DS_ENGINE.search(line)) or ("steps:" in line and _DS_STEPS.search(line)):
        return "deepspeed"
    if "{" in line and _LOSS_KEY_QUOTED.search(line):
        return "json" if line.lstrip().startswith('{"') and '"step"' in line else "dict"
    if _read_generic(0, line) is not None:
        return "generic"
    if _BARE_PAIR.match(_strip_launcher(line)):
        return "table"
    if ("scale" in line and _SCALE_CHANGE.search(line)) or ("verflow" in line and _FAIRSEQ_OVERFLOW.search(line)):
        return "overflow"
    return None


def detect(sample: str) -> float:
    """High on Megatron iteration lines and DeepSpeed overflow lines, high on Trainer dicts
    and DeepSpeed step lines, by count on generic step lines; 0 without any step line (a
    pure NCCL log is not a training log, one with many step lines is)."""
    shapes: dict[str, int] = {}
    for line in _sample_lines(sample):
        shape = _line_shape(line)
        if shape:
            shapes[shape] = shapes.get(shape, 0) + 1
    if shapes.get("megatron") or shapes.get("overflow"):
        return 0.95
    if shapes.get("deepspeed") or shapes.get("dict"):
        return 0.85
    generic = shapes.get("generic", 0)
    if shapes.get("table", 0) >= 3 and shapes.get("table", 0) >= 0.3 * len(_sample_lines(sample)):
        return 0.6  # a bare "step loss" table: nothing else claims two-number lines
    if generic >= 5:
        return 0.85
    if generic >= 3:
        return 0.7
    if shapes.get("json"):
        return 0.4  # metrics.jsonl claims these with more certainty
    if generic:
        return 0.45
    return 0.0


def detect_metrics_jsonl(sample: str) -> float:
    """High when most non-empty head lines are JSON objects with ``step`` and ``loss``."""
    lines = _sample_lines(sample, limit=200)
    if not lines:
        return 0.0
    good = 0
    for line in lines:
        body = line.strip()
        if not body.startswith("{"):
            continue
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict) and _first(value, _STEP_KEYS)[0] and _first(value, _LOSS_KEYS)[0]:
            good += 1
    share = good / len(lines)
    if share >= 0.8:
        return 0.95 if good >= 2 else 0.8
    if share >= 0.5:
        return 0.6
    return 0.2 if good else 0.0


def detect_trainer_state(sample: str) -> float:
    """High on a JSON document holding a ``log_history`` list."""
    if not re.search(r'"log_history"\s*:\s*\[', sample):
        return 0.0
    return 0.95 if sample.lstrip().startswith("{") else 0.3


# --------------------------------------------------------------------------- summary


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}"


def _scale_drops(steps: list[StepRecord]) -> list[tuple[float, float, int]]:
    drops = []
    previous: float | None = None
    for record in steps:
        if record.loss_scale is None:
            continue
        if previous is not None and record.loss_scale < previous:
            drops.append((previous, record.loss_scale, record.step))
        previous = record.loss_scale
    return drops


def _list_steps(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(value) for value in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def summarize(log: TrainingLog) -> list[str]:
    """What was read (format, step range) and what is alarming (non-finite values, skipped
    steps, loss-scale drops, grad-norm peak, the first loss doubling as a hint)."""
    steps = latest_per_step(log.records)
    if not steps:
        out = [f"{log.format}: {log.lines} lines, no training steps found"]
        if log.overflow_events:
            scales = [e.reduced_to for e in log.overflow_events if e.reduced_to is not None]
            out.append(f"{len(log.overflow_events)} loss-scale line(s) (overflows)"
                       + (f": scale {_fmt(scales[0])} -> {_fmt(scales[-1])}" if scales else "")
                       + ("; the scaler reached its minimum" if any(e.minimum for e in log.overflow_events) else ""))
        out += [f"  gap: {gap.reason}" for gap in log.gaps[:3]]
        return out
    ordinal = " (ordinal: the log prints no step numbers)" if log.step_is_ordinal else ""
    out = [f"{log.format}: {len(steps)} steps {steps[0].step}..{steps[-1].step}{ordinal} from {log.lines} lines"]
    read = [name for name in ("loss", "lr", "grad_norm", "loss_scale", "throughput", "tokens", "time", "perplexity")
            if any(getattr(r, name) is not None for r in steps)]
    unread = [name for name in ("loss", "lr", "grad_norm", "loss_scale") if name not in read]
    out.append(f"fields read: {', '.join(read) or 'none'}" + (f"; not in the log: {', '.join(unread)}" if unread else ""))
    with_loss = [r for r in steps if r.loss is not None]
    finite = [r for r in with_loss if math.isfinite(r.loss or 0.0)]
    if with_loss:
        last = with_loss[-1]
        line = f"last loss {_fmt(last.loss)} at step {last.step}"
        if finite:
            low = min(finite, key=lambda r: r.loss or 0.0)
            high = max(finite, key=lambda r: r.loss or 0.0)
            line += f"; min {_fmt(low.loss)} (step {low.step}), max {_fmt(high.loss)} (step {high.step})"
        out.append(line)
    vanished = [r.step for r in steps if r.loss_missing]
    missing = [r.step for r in steps if r.loss is None and not r.loss_missing]
    if vanished:
        out.append(f"NO LOSS PRINTED at step(s) {_list_steps(vanished)} while the other lines print one: "
                   "Megatron leaves out a NaN average, read as non-finite")
    if missing:
        out.append(f"no loss logged at step(s) {_list_steps(missing)}")
    nonfinite = [r.step for r in steps if r.nan]
    if nonfinite:
        out.append(f"NON-FINITE loss/grad norm at step(s) {_list_steps(nonfinite)}")
    kept = {id(r) for r in steps}
    superseded = sorted({r.step for r in log.records if r.nan and id(r) not in kept})
    if superseded:
        out.append(f"NON-FINITE loss/grad norm before a restart at step(s) {_list_steps(superseded)} "
                   "(re-logged later)")
    skipped = [r.step for r in steps if r.skipped]
    if skipped:
        out.append(f"skipped step(s) {_list_steps(skipped)}")
    drops = _scale_drops(steps)
    if drops:
        shown = ", ".join(f"{_fmt(a)} -> {_fmt(b)} (step {s})" for a, b, s in drops[:6])
        out.append(f"loss scale drops: {shown}" + (f", ... ({len(drops)} in all)" if len(drops) > 6 else ""))
    grads = [r for r in steps if r.grad_norm is not None and math.isfinite(r.grad_norm)]
    if grads:
        peak = max(grads, key=lambda r: r.grad_norm or 0.0)
        out.append(f"grad norm max {_fmt(peak.grad_norm)} at step {peak.step}")
    doubling = first_loss_doubling(steps)
    if doubling:
        before, at = doubling
        out.append(f"hint: loss more than doubled at step {at.step} ({_fmt(before.loss)} -> {_fmt(at.loss)})")
    if log.overflow_events:
        out.append(f"{len(log.overflow_events)} overflow (skipped step) line(s)")
    for restart in log.restarts[:3]:
        out.append(f"restart at line {restart.line}: step {restart.from_step} -> {restart.to_step}")
    if log.rank_memory:
        peak_mem = max(log.rank_memory, key=lambda m: m.max_allocated_mb or 0.0)
        out.append(
            f"memory reports from {len({m.rank for m in log.rank_memory})} ranks; "
            f"max allocated {_fmt(peak_mem.max_allocated_mb)} MB on rank {peak_mem.rank}"
        )
    if log.gaps:
        out.append(f"{len(log.gaps)} gap(s), first: {log.gaps[0].reason}")
    return out


# --------------------------------------------------------------------------- registration

KIND = register(
    Kind(
        name="training-log",
        description="the job's own log: Megatron/DeepSpeed/HF Trainer/generic step lines -> step table",
        command="the job's stdout/stderr log",
        parse=parse,
        detect=detect,
        summarize=summarize,
        streaming=True,
    )
)

METRICS_KIND = register(
    Kind(
        name="metrics-jsonl",
        description="the bundle's canonical metrics.jsonl: one JSON object per step (step, loss, ...)",
        command=None,
        parse=parse_metrics_jsonl,
        detect=detect_metrics_jsonl,
        summarize=summarize,
        streaming=True,
    )
)

TRAINER_STATE_KIND = register(
    Kind(
        name="trainer-state",
        description="Hugging Face trainer_state.json: log_history steps (eval entries left out)",
        command=None,
        parse=parse_trainer_state,
        detect=detect_trainer_state,
        summarize=summarize,
        streaming=False,
    )
)

#: The job's own log lines from this node's ranks (the inventory's ``[job] train_log``).
REMOTE = register_remote(RemoteProbe(
    name="train", filename="train.log", command="cat {files}",
    kind="training-log", order=80, max_bytes=64 << 20, keep="tail", needs="train_log",
))


# --------------------------------------------------------------------------- following a log


class LineReader:
    """The line recognisers of ``parse``, one line at a time, for following a growing log
    (``spikeops watch --log``).

    ``feed(line)`` returns the step records that are complete: a record is held back until a
    line of another step arrives, because two lines of one step (DeepSpeed's ``step=`` and
    ``steps:`` lines, or two ranks) merge into one record, and a DeepSpeed ``OVERFLOW!`` line
    marks the step after it. ``flush()`` releases the held record (call it when the log goes
    quiet, or at its end). Memory stays bounded: released records are not kept. A
    ``trainer_state.json`` document is not a log to follow; use ``parse_trainer_state``."""

    def __init__(self) -> None:
        self._builder = _Builder()
        self._released: StepRecord | None = None

    @property
    def lines(self) -> int:
        return self._builder.lines

    @property
    def gaps(self) -> list[Gap]:
        """Lines that looked like steps but could not be read (bounded, as in ``parse``)."""
        return list(self._builder.gaps)

    def feed(self, line: str) -> list[StepRecord]:
        builder = self._builder
        builder.lines += 1
        try:
            _feed_line(builder, builder.lines, line.rstrip("\r\n"))
        except Exception as exc:  # noqa: BLE001 - a reader bug must not stop the follower
            builder.gap(f"line not read ({type(exc).__name__})", builder.lines)
        done = []
        while len(builder.records) > 1:
            record = builder.records.popleft()
            if record is not self._released:
                done.append(record)
        return done

    def flush(self) -> list[StepRecord]:
        builder = self._builder
        try:
            _flush_wrap(builder)
        except Exception as exc:  # noqa: BLE001
            builder.gap(f"wrapped line not read ({type(exc).__name__})", builder.lines)
        records = builder.records
        fresh = [record for record in records if record is not self._released]
        if not fresh:
            return []
        while len(records) > 1:
            records.popleft()
        self._released = records[-1]
        return fresh


__all__ += ["LineReader"]
