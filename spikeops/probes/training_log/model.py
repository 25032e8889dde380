"""The one table of steps every training log is read into, its limits, and the number and
line-shape helpers the format readers share."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from spikeops.probes.base import (
    Gap,
)
from spikeops.probes.step_lines import NUMBER as _NUM
from spikeops.probes.step_lines import NUMBER_END as _NUM_END
from spikeops.probes.step_lines import bounded_int as _bounded
from spikeops.probes.step_lines import parse_number as _float

__all__ = ["MAX_STEPS", "ANNOUNCE_REACH", "MAX_DICT_CHARS", "MAX_DOCUMENT_CHARS", "FRAME_COLUMNS", "StepRecord", "RankMemory", "OverflowEvent", "Restart", "TrainingLog"]


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
