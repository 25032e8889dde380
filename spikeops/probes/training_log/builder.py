"""Collects step records as lines are read: merges a step logged twice, keeps the latest
``MAX_STEPS``, ties an overflow or an announced LR to its step."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from spikeops.probes.base import (
    MAX_EVENTS,
    Gap,
)
from spikeops.probes import step_lines
from spikeops.probes.training_log.model import (
    MAX_STEPS,
    ANNOUNCE_REACH,
    StepRecord,
    RankMemory,
    OverflowEvent,
    Restart,
    TrainingLog,
    _nonfinite,
)

__all__ = []


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

    def finish(self, fmt: str | None = None, flush: Callable[[_Builder], None] | None = None) -> TrainingLog:
        """The log read so far; ``flush`` first reads a wrapped line still being joined (the
        format readers' ``_flush_wrap``: they sit above the builder)."""
        try:
            if flush is not None:
                flush(self)
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
