"""The generic step-line reader: one training log line in, its step's numbers out.

Every training loop prints its progress its own way, and most of them are nobody's named
format: a hand-written ``print``, a vision toolbox's logger, a progress bar. What they share
is a step counter, a loss and, often, the learning rate, as keys and values in any order and
with any separator. This module reads that long tail; the formats with a grammar of their
own (Megatron's ``iteration N/ M |`` lines, DeepSpeed's overflow and engine lines, Hugging
Face Trainer dicts, metrics.jsonl) stay with their specific parsers in ``training_log``, which
hands every line none of them claimed to ``read_line`` here.

What it recognises (each from real logs, ``tests/fixtures/step-lines/``):

- the step counter: ``iter``/``iteration``/``step``/``global_step``/``num_updates``/``batch``
  with ``:``, ``=``, `` : `` or a space (``iteration : 7``, ``global step 124370:``,
  ``step = 63717``); fairseq's ``num_updates`` and ``global_step`` win over a micro-batch
  count; a step within its epoch (``Epoch: [127/300][ 35/464]``, ``Epoch [1][50/1084]``,
  ``| epoch 010  2000 / 8223``) is read as a global count; a bare ``[ 40/5000000]``
  counter (``MetricLogger``); a leading table number (``1220 | loss ...``); a leading
  ``epoch batch`` pair (``333 154 Loss=nan``), numbered on by ``EpochCounter``; Keras and
  tqdm/Lightning bars (``4/18 [00:17<01:02, ...]``);
- darknet's ``N: loss, avg avg loss, rate rate, ...`` (values before their labels; the
  first, unlabelled value is the iteration's loss, ``rate`` its learning rate);
- the loss by any of its names (``loss``, ``losses``, ``total_loss``, ``lm loss``,
  ``step_loss``...), the training loss preferred over smoothed and component losses, never
  an evaluation's;
- the learning rate as ``lr``, ``learning rate``, ``LR``, ``cur_lr``/``Cur_lr``,
  ``current lr``; a line that announces only the learning rate (``>>> lr: 0.01``,
  ``Iteration 200, lr = 0.01``) is an ``LrLine``: it sets the rate of its step, or of the
  steps that follow when it names none;
- the grad norm, the fp16 loss scale, throughput, tokens, the epoch and perplexity, when a
  line carries them.

Nothing here keys on a number: a value is read where a key names it, or where a format's
grammar puts it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime

from spikeops.timeparse import parse_iso

__all__ = [
    "NUMBER",
    "NUMBER_END",
    "parse_number",
    "bounded_int",
    "TIMESTAMP",
    "time_in",
    "strip_launcher",
    "rank_tag",
    "StepLine",
    "LrLine",
    "EpochCounter",
    "read_line",
    "read_lr_line",
    "loss_rank",
    "PROGRESS",
]

# --------------------------------------------------------------------------- numbers

#: A number as logs print it, non-finite spellings included.
NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:nan|inf(?:inity)?)"
#: What may not follow a number (it would be part of a word or a longer number).
NUMBER_END = r"(?![\w.])"
_NONFINITE = {
    "nan": math.nan, "+nan": math.nan, "-nan": math.nan,
    "inf": math.inf, "+inf": math.inf, "infinity": math.inf, "+infinity": math.inf,
    "-inf": -math.inf, "-infinity": -math.inf,
}
_FLOAT_TEXT = re.compile(rf"^(?:{NUMBER})$", re.I)


def parse_number(text: str | None) -> float | None:
    """A float as tools print it, non-finite spellings included (Python's ``{:.6E}`` of a NaN
    prints ``NAN``; json writes ``NaN``/``Infinity``); anything else is None."""
    if text is None:
        return None
    value = text.strip()
    if "_" not in value:  # float() alone accepts 1_000, which no tool prints
        try:
            return float(value)  # the hot path: also reads nan/inf/infinity in any case
        except ValueError:
            pass
    value = value.replace(",", "")
    if not _FLOAT_TEXT.match(value):
        return None
    special = _NONFINITE.get(value.lower())
    if special is not None:
        return special
    try:
        return float(value)
    except ValueError:
        return None


#: Steps and counters beyond int64 are not steps (a run of digits in a corrupt line); they
#: would not fit the step table's integer columns either.
_INT64_MAX = 2**63 - 1


def bounded_int(value: int) -> int | None:
    """``value`` when it fits the step table's int64 columns, else None."""
    return value if -_INT64_MAX <= value <= _INT64_MAX else None


# --------------------------------------------------------------------------- prefixes

TIMESTAMP = re.compile(
    r"(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|\s?UTC|[+-]\d{2}:?\d{2})?)"
)
_RANK_TAG = re.compile(r"^\s*(\[(?:default|rank)\s*\d+\]:|\d+:\s|\[\d+,\d+\]<\w+>:)")
_LEADING_STAMP = re.compile(r"^\s*\[?\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\]?")


def time_in(text: str) -> datetime | None:
    """The first wall-clock timestamp in a line's prefix (launcher, logger or Megatron's
    ``[2024-05-01 12:00:00]``); zone-less times are UTC, per the bundle spec."""
    match = TIMESTAMP.search(text)
    return parse_iso(match.group(1)) if match else None


def rank_tag(line: str) -> str | None:
    """The launcher's rank prefix, to tell a step printed by two ranks from a re-logged one."""
    match = _RANK_TAG.match(line)
    return match.group(1).strip() if match else None


def strip_launcher(line: str) -> str:
    """The line without its launcher's rank tag and a leading timestamp (which would read as a
    leading step number)."""
    tag = _RANK_TAG.match(line)
    rest = line[tag.end():] if tag else line
    stamp = _LEADING_STAMP.match(rest)
    return rest[stamp.end():] if stamp else rest


# --------------------------------------------------------------------------- line shapes

#: A word that makes a loss an evaluation's, when it comes before the loss key on the line
#: (``Evaluation result for step 5: loss = 2.1``, ``valid loss at iteration 7000``).
_EVAL_WORD = re.compile(r"(?<![A-Za-z])(?:eval(?:uation)?|validation|valid|val|test(?:ing)?|dev)(?![A-Za-z])", re.I)
#: The parts of a loss key that make it not a training loss.
_EVAL_PARTS = frozenset({"val", "valid", "validation", "eval", "evaluation", "test", "dev", "scale"})
#: A step's number, by keyword; ``num_updates`` (fairseq, metaseq) and ``global_step`` name
#: the optimizer step even where an epoch or a micro-batch counter is printed too. A word
#: glued to the key by ``/`` is another counter (fairseq's ``words/batch``).
_GEN_STEP = re.compile(
    r"(?<![\w./-])(?P<key>global[_ ]?step|num_updates|steps?|iter(?:ation)?|batch)\b\s*[:=#]?\s*(?P<step>\d{1,18})"
    r"(?:\s*/\s*\d+)?(?!\d|\.\d)",
    re.I,
)
_PRIMARY_KEYS = ("global_step", "globalstep", "num_updates")
#: ``(epoch, step)`` as some loggers print it (``LOG ... - (0, 14) step_loss : 11.25``).
_TUPLE_STEP = re.compile(r"(?<![\w.])\(\s*\d{1,9}\s*,\s*(?P<step>\d{1,18})\s*\)")
#: A table row that starts with the step (``1220 | loss 3.2969 | lr 2.64e-04 | 13880ms``,
#: Keras' ``  12/102 [====>....] - loss: 0.62``).
_LEADING_STEP = re.compile(r"^\s*(?P<step>\d{1,12})(?:\s*\||/\d{1,12}\s+\[)")
#: A row that starts with two whole numbers, an epoch and the iteration within it
#: (``333 154 Loss=nan Time=0.040``), followed by a keyed value.
_LEADING_PAIR = re.compile(r"^\s*(?P<epoch>\d{1,9})\s+(?P<i>\d{1,12})\s+(?=[A-Za-z])")
#: mmengine (MMDetection, XTuner...): ``Epoch(train) [1][200/735]`` or ``Iter(train) [200/40000]``.
_MMENGINE_STEP = re.compile(r"\b(?:Epoch\((?:train)\)\s*\[(?P<epoch>\d{1,9})\]\[\s*(?P<i>\d{1,12})/(?P<n>\d{1,12})\]"
                            r"|Iter\((?:train)\)\s*\[\s*(?P<iter>\d{1,12})/\d{1,12}\])")
#: A step counted within its epoch (``Epoch [2/10], Step [100/600], Loss: ...``, timm's
#: ``Epoch: [3]  [ 100/1251]``, PyTorch's MNIST ``Train Epoch: 1 [2560/60000 (4%)]``,
#: fairseq's ``| epoch 010  2000 / 8223 loss=``): read as a global count, so the next epoch
#: is not a restart.
_EPOCH_STEP = re.compile(
    r"\bEpoch\b[:\s]*\[?\s*(?P<epoch>\d{1,9})(?:\s*/\s*\d{1,9})?\s*\]?[,\s|:-]*"
    r"(?:(?:Step|Iter(?:ation)?|Batch)\b[:\s]*)?\[\s*(?P<i>\d{1,12})\s*/\s*(?P<n>\d{1,12})"
    r"|\bEpoch\b[:\s]*\[?\s*(?P<epoch2>\d{1,9})(?:\s*/\s*\d{1,9})?\s*\]?[,\s|:-]*"
    r"(?:Step|Iter(?:ation)?|Batch)\b[:\s]*(?P<i2>\d{1,12})\s*/\s*(?P<n2>\d{1,12})"
    r"|\bepoch\s+(?P<epoch3>\d{1,9}):?\s+(?P<i3>\d{1,12})\s*/\s*(?P<n3>\d{1,12})\b",
    re.I,
)
#: A counter in brackets on its own (``Training  [     40/5000000]``, detectron's and DINO's
#: MetricLogger): the iteration, when nothing else on the line names one.
_BRACKET_STEP = re.compile(r"(?<![\]\w])\[\s*(?P<i>\d{1,12})\s*/\s*(?P<n>\d{1,12})\s*\](?!\s*\[)")
#: tqdm's bar (``380/2724 [14:02:33<86:01:24, 132.12s/it]``): steps completed so far.
PROGRESS = re.compile(r"(?<![\d/.])(?P<done>\d{1,12})/(?P<total>\d{1,12})\s*\[(?:\d|\?)")
#: A loss by any of the names loops give it: ``loss``, ``losses``, ``lm loss``,
#: ``train/loss``, ``total_loss``, ``per_token_loss``, ``step_loss``, ``average_loss``,
#: ``loss_avg``...
_LOSS_ANY = re.compile(
    rf"(?<![\w.-])(?P<key>(?:[A-Za-z][A-Za-z0-9]*[ _/]){{0,2}}loss(?:es)?(?:[_ ](?:avg|mean|value|net))?)(?![\w-])"
    rf"\s*[:=]?\s*\[?\s*(?P<v>{NUMBER})(?:(?![\w.])|(?=\.(?:\s|$)))",
    re.I,
)
_PPL = re.compile(rf"(?<![\w.-])(?:ppl|perplexity)\b\s*[:=]?\s*(?P<v>{NUMBER}){NUMBER_END}", re.I)
#: The learning rate by its names: ``lr``, ``LR``, ``learning rate``, ``learning_rate``, and
#: the current one (``cur_lr``, ``Cur_lr``, ``current lr``); not another group's rate
#: (``last_layer_lr``, ``aux_lr``) or a bound (``min_lr``).
_GEN_LR = re.compile(
    rf"(?<![\w.-])(?:(?:cur|curr|current|now)[_ ]?)?(?:lr|learning[_ ]rate)\b\s*[:=]?\s*\[?\s*(?P<v>{NUMBER}){NUMBER_END}",
    re.I,
)
_GEN_GRAD = re.compile(
    rf"(?<![\w.-])(?:grad(?:ient)?[_ -]?norm|gnorm|grad_l2_norm)\b\s*[:=]?\s*(?P<v>{NUMBER}){NUMBER_END}", re.I
)
_GEN_SCALE = re.compile(rf"(?<![\w.-])loss[_ ]scale\b\s*[:=]?\s*(?P<v>{NUMBER}){NUMBER_END}", re.I)
_GEN_SPEED = re.compile(
    rf"(?<![\w.-])(?P<key>speed|throughput|tps)\b\s*[:=]?\s*(?P<v>\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|{NUMBER}){NUMBER_END}\s*"
    r"(?P<unit>[A-Za-z][\w]*(?:/[\w]+)*)?",
    re.I,
)
_GEN_TOKENS = re.compile(r"(?<![\w.-])(?:tokens|num_tokens|consumed[_ ]tokens)\b\s*[:=]\s*(?P<v>\d[\d,]*)", re.I)
_GEN_EPOCH = re.compile(rf"(?<![\w.-])epoch\b\s*[:=]?\s*(?P<v>{NUMBER}){NUMBER_END}", re.I)
#: Keras' end-of-epoch bar (``10954/10954 [=====] - 659s - loss: 0.05 - val_loss: 0.06``):
#: a training line even when it also reports the validation loss.
_KERAS_BAR = re.compile(r"^\s*\d{1,12}/\d{1,12}\s+\[[=>.]*\]")
#: darknet (pjreddie and AlexeyAB): ``  99: 469.80, 848.94 avg loss, 0.000000 rate, 20.45
#: seconds, 6336 images``. The values come before their labels.
_DARKNET = re.compile(
    rf"^\s*(?:>\s*)?(?P<step>\d{{1,12}}):\s*(?P<loss>{NUMBER}),\s*(?P<avg>{NUMBER})\s+avg(?:\s+loss)?,\s*"
    rf"(?P<rate>{NUMBER})\s+rate\b(?:,\s*(?P<seconds>{NUMBER})\s+seconds)?(?:,\s*(?P<images>\d{{1,15}})\s+images)?",
    re.I,
)
#: A line that announces the learning rate and nothing else but, perhaps, its step or epoch
#: (``>>> lr: 0.01``, ``Cur_lr: 0.4``, caffe's ``Iteration 200, lr = 0.01``).
_LR_ONLY = re.compile(
    rf"^(?P<lead>[\s>*#|:.-]*)(?:(?P<key>iter(?:ation)?|step|epoch)\s*[:=#]?\s*(?P<step>\d{{1,18}})[\s,;:|/-]*)?"
    rf"(?P<cur>(?:cur|curr|current|now)[_ ]?)?(?:lr|learning[_ ]rate)\s*(?:[:=]\s*|\s+)\[?\s*(?P<v>{NUMBER})\]?"
    rf"\s*[,;]?\s*$",
    re.I,
)
#: Logger prefixes in front of an announcement (glog ``I0425 10:13:21.2 9167 solver.cpp:208]``,
#: Python logging ``INFO:root:``, ``2020-05-18 09:24:01,065 - mmdet - INFO -``).
_LOGGER_PREFIX = re.compile(
    r"^\s*(?:[IWEF]\d{4} \d{2}:\d{2}:\d{2}(?:\.\d+)?\s+\d+\s+[\w.]+:\d+\]\s*"
    r"|(?:INFO|WARNING|DEBUG|ERROR)(?::[\w.]+)*:\s*"
    r"|(?:-\s*[\w.]+\s*-\s*(?:INFO|WARNING|DEBUG)\s*-\s*))"
)


@dataclass(slots=True)
class StepLine:
    """What one line says about one training step. ``step`` is None only with ``within``
    set: the line numbers its iteration within an epoch of unknown length (``EpochCounter``
    makes it a global count)."""

    step: int | None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    throughput: float | None = None
    throughput_unit: str | None = None
    tokens: int | None = None
    epoch: float | None = None
    perplexity: float | None = None
    time: datetime | None = None
    #: ``(epoch, iteration within it)`` when the line numbers no global step.
    within: tuple[int, int] | None = None
    #: The shape it was read in: ``darknet`` or ``key-value``.
    shape: str = "key-value"


@dataclass(frozen=True, slots=True)
class LrLine:
    """A learning rate announced on a line without a loss: for ``step``, or, with no step,
    for the step just logged and those after it. ``header``: the line heads its step's record
    (``Step: 1000/300000 ----- Cur_lr: 0.001 ----- Time: 0.53 sec.``) and the loss follows on
    the next line, which prints no step of its own."""

    lr: float
    step: int | None = None
    header: bool = False


class EpochCounter:
    """Global steps from ``(epoch, iteration within it)`` pairs whose epoch length is not
    printed: the first epoch's iterations count from its first one; each later epoch starts
    after the largest iteration seen in the one before. A log that goes back to an earlier
    epoch (a resume) starts counting that epoch again from where it began."""

    def __init__(self) -> None:
        self._start: dict[int, int] = {}
        self._largest: dict[int, int] = {}
        self._last_epoch: int | None = None

    def step(self, epoch: int, index: int) -> int:
        if epoch not in self._start:
            previous = self._last_epoch
            if previous is None or epoch < previous:
                self._start[epoch] = 0 if previous is None else self._start.get(epoch, 0)
            else:
                self._start[epoch] = self._start[previous] + self._largest.get(previous, 0)
        self._largest[epoch] = max(self._largest.get(epoch, 0), index)
        self._last_epoch = epoch
        return self._start[epoch] + index


def loss_rank(key: str) -> int | None:
    """How much a loss key is the training loss: lower is better; None for an evaluation's
    loss or the loss scale. ``loss`` itself first, then the train/lm/step/total forms, then
    the smoothed ones (a running average blurs the very spike we look for), NLL last."""
    parts = [part for part in re.split(r"[\s_/]+", key.lower()) if part]
    if any(part in _EVAL_PARTS for part in parts):
        return None
    if parts in (["loss"], ["losses"]):
        return 0
    if parts[0] in ("train", "training"):
        return 1
    if parts[0] in ("lm", "mlm"):
        return 2
    if parts[0] == "step":
        return 3
    if parts[0] == "total":
        return 4
    if parts[0] in ("average", "avg", "mean", "running", "smoothed") or parts[-1] in ("avg", "mean"):
        return 6
    if parts[0] == "nll":
        return 7
    return 5


def _pick_loss(line: str) -> re.Match[str] | None:
    """The training loss of a line; None on an evaluation report, which is any line carrying
    an evaluation's loss (nanoGPT's ``step 400: train loss 2.30, val loss 2.40`` estimates
    both on held-out batches: it is not a training step), except Keras' epoch bar."""
    best: tuple[int, re.Match[str]] | None = None
    keras = bool(_KERAS_BAR.match(line))
    for match in _LOSS_ANY.finditer(line):
        rank = loss_rank(match["key"])
        if rank is None:
            if "scale" not in match["key"].lower() and not keras:
                return None
            continue
        if best is None or rank < best[0]:
            best = (rank, match)
    return best[1] if best else None


def _pick_step(line: str, loss_at: int, epoch: int | None = None) -> tuple[int | None, int, tuple[int, int] | None] | None:
    """(step, position, within) of a line's step number: ``global_step``/``num_updates``
    first, else mmengine's ``[epoch][i/n]`` (as a global step), an epoch's ``i/n``, the
    first step keyword, an ``(epoch, step)`` pair, a bracketed counter, a leading table
    number or ``epoch iteration`` pair, the epoch a Keras header announced, a bar."""
    mm = _MMENGINE_STEP.search(line)
    if mm is not None:
        if mm["iter"] is not None:
            return int(mm["iter"]), mm.start(), None
        return (int(mm["epoch"]) - 1) * int(mm["n"]) + int(mm["i"]), mm.start(), None
    keyed = list(_GEN_STEP.finditer(line))
    primary = [m for m in keyed if m["key"].lower().replace(" ", "_") in _PRIMARY_KEYS]
    if primary:
        return int(primary[0]["step"]), primary[0].start(), None
    within = _EPOCH_STEP.search(line)
    if within is not None:
        epoch_no = int(within["epoch"] or within["epoch2"] or within["epoch3"])
        index = int(within["i"] or within["i2"] or within["i3"])
        size = int(within["n"] or within["n2"] or within["n3"])
        return max(epoch_no - 1, 0) * size + index, within.start(), None
    if keyed:
        return int(keyed[0]["step"]), keyed[0].start(), None
    pair = _TUPLE_STEP.search(line)
    if pair is not None:
        return int(pair["step"]), pair.start(), None
    if epoch is not None and re.match(r"^\s*\d{1,12}/\d{1,12}\s+\[", line):
        return epoch, 0, None
    lead = _LEADING_STEP.match(line)
    if lead is not None and lead.end() <= loss_at:
        return int(lead["step"]), lead.start(), None
    bars = list(PROGRESS.finditer(line))
    if bars:
        return int(bars[-1]["done"]), bars[-1].start(), None
    bracket = _BRACKET_STEP.search(line, 0, loss_at)
    if bracket is not None:
        return int(bracket["i"]), bracket.start(), None
    leading = _LEADING_PAIR.match(line)
    if leading is not None and leading.end() <= loss_at:
        return None, leading.start(), (int(leading["epoch"]), int(leading["i"]))
    return None


def _darknet(line: str) -> StepLine | None:
    match = _DARKNET.match(line)
    if match is None:
        return None
    return StepLine(step=int(match["step"]), loss=parse_number(match["loss"]), lr=parse_number(match["rate"]),
                    shape="darknet")


def read_line(line: str, *, epoch: int | None = None, step: int | None = None) -> StepLine | None:
    """The step a line reports, or None. ``epoch``: the epoch a Keras ``Epoch N/M`` header
    line announced (its bar lines print no step); ``step``: the step a header line just
    announced, for a loss line that prints none. A line whose loss belongs to an evaluation
    is not a training step."""
    given = step
    if "loss" not in line.lower():
        return _darknet(line) if ("avg" in line and "rate" in line) else None
    body = strip_launcher(line)
    if "avg" in body and "rate" in body:
        found = _darknet(line) or _darknet(body)
        if found is not None:
            return found
    loss = _pick_loss(body)
    if loss is None or _EVAL_WORD.search(body, 0, loss.start()):
        return None
    picked = _pick_step(body, loss.start(), epoch)
    if picked is None:
        if given is None:
            return None
        picked = (given, loss.start(), None)
    offset = len(line) - len(body)
    record = StepLine(step=picked[0], within=picked[2], loss=parse_number(loss["v"]),
                      time=time_in(line[: offset + min(picked[1], loss.start())]))
    if (match := _GEN_LR.search(body)) is not None:
        record.lr = parse_number(match["v"])
    if (match := _GEN_GRAD.search(body)) is not None:
        record.grad_norm = parse_number(match["v"])
    if (match := _GEN_SCALE.search(body)) is not None:
        record.loss_scale = parse_number(match["v"])
    if (match := _GEN_SPEED.search(body)) is not None:
        record.throughput = parse_number(match["v"])
        record.throughput_unit = match["unit"] or ("tokens/s" if match["key"].lower() == "tps" else None)
    if (match := _GEN_TOKENS.search(body)) is not None:
        record.tokens = bounded_int(int(match["v"].replace(",", "")))
    if (match := _GEN_EPOCH.search(body)) is not None:
        record.epoch = parse_number(match["v"])
    if (match := _PPL.search(body)) is not None:
        record.perplexity = parse_number(match["v"])
    return record


def read_lr_line(line: str) -> LrLine | None:
    """A line without a loss that announces the learning rate (``>>> lr: 0.01``,
    ``Iteration 200, lr = 0.01``), or heads a step with it (``Step: 1000/300000 -----
    Cur_lr: 0.001 ----- Time: 0.53 sec.``); None otherwise. A configuration line is not one:
    ``lr: 0.001`` alone (a YAML dump) or an ``lr=`` among other settings without a step."""
    lowered = line.lower()
    if ("lr" not in lowered and "learning" not in lowered) or "loss" in lowered:
        return None
    body = strip_launcher(line)
    prefix = _LOGGER_PREFIX.match(body)
    if prefix is not None:
        body = body[prefix.end():]
    match = _LR_ONLY.match(body)
    if match is not None:
        if match["step"] is None and ">>" not in match["lead"] and not match["cur"]:
            return None  # ``lr: 0.001`` alone is a configuration line, not the rate now
        value = parse_number(match["v"])
        key = (match["key"] or "").lower()
        step = int(match["step"]) if match["step"] is not None and key != "epoch" else None
        return LrLine(value, step) if value is not None and math.isfinite(value) and value >= 0 else None
    rate, counter = _GEN_LR.search(body), _GEN_STEP.search(body)
    if rate is None or counter is None or counter.start() > rate.start():
        return None
    value = parse_number(rate["v"])
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return LrLine(value, int(counter["step"]), header=True)
