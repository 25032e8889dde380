"""Which of the three forms a sample is, from its lines' shapes."""

from __future__ import annotations

import json
import re
from spikeops.probes.step_lines import strip_launcher as _strip_launcher
from spikeops.probes.training_log.model import (
    _MEGATRON,
    _OVERFLOW,
    _SCALE_CHANGE,
    _DS_ENGINE,
    _DS_STEPS,
    _BARE_PAIR,
    _FAIRSEQ_OVERFLOW,
    _LOSS_KEY_QUOTED,
    _STEP_KEYS,
    _LOSS_KEYS,
    _first,
)
from spikeops.probes.training_log.formats import (
    _read_generic,
)

__all__ = ["detect", "detect_metrics_jsonl", "detect_trainer_state"]


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
