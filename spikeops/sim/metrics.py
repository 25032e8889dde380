"""Per-step training metrics: the healthy curves, the plan's effects on them, and the two
forms a bundle may carry them in (``metrics.jsonl`` and a Megatron-LM ``train.log``).

The healthy run is what a diagnosis must not flag: a loss that decays as a power law from
ln(vocab) towards a floor with 0.5-2 % multiplicative noise, an LR that warms up linearly
and then decays (cosine or linear), a noisy grad norm that settles between 0.2 and 1.5 with
a rare benign bump, and, in fp16 runs, a dynamic loss scale that halves on the odd overflow
(a skipped step) and doubles back after a quiet window. Causes only multiply or replace
these values at the steps the plan names, so the healthy part of every bundle is the same
kind of curve whatever the cause.

Rows are produced lazily (500,000 steps must not become a list of dicts) and formatted with
plain string formatting, not ``json.dumps`` per row.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from spikeops.sim.plan import Plan, sub_rng
from spikeops.sim.world import Curve

__all__ = [
    "healthy_loss",
    "lr_at",
    "healthy_grad",
    "breathing_loss_scale",
    "MetricRow",
    "iter_rows",
    "jsonl_line",
    "megatron_line",
    "megatron_header",
    "iso_time",
    "tokens_per_step",
    "BUMP_GUARD",
]

#: Steps around an incident kept free of benign grad-norm bumps, so a precursor's first
#: step is unambiguous.
BUMP_GUARD = 25


def healthy_loss(curve: Curve, step: int) -> float:
    """Power-law decay from ~ln(vocab) at step 0 towards ``loss_floor``."""
    return curve.loss_floor + (curve.loss_start - curve.loss_floor) * (1.0 + step / curve.tau) ** (-curve.alpha)


def lr_at(curve: Curve, step: int, peak_factor: float = 1.0) -> float:
    """Linear warmup to the peak, then cosine or linear decay to ``min_lr`` at ``total_steps``."""
    peak = curve.peak_lr * peak_factor
    if step < curve.warmup:
        return peak * step / curve.warmup
    span = max(1, curve.total_steps - curve.warmup)
    progress = min(1.0, (step - curve.warmup) / span)
    low = curve.min_lr * peak_factor
    if curve.schedule == "linear":
        return peak - (peak - low) * progress
    return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def healthy_grad(curve: Curve, step: int) -> float:
    """Grad norm is large early in training and settles to ``grad_floor``."""
    return curve.grad_floor + (curve.grad_start - curve.grad_floor) * math.exp(-step / 4000.0)


def breathing_loss_scale(
    rng: random.Random, n: int, *, quiet: tuple[int, int] | None = None
) -> tuple[list[float], set[int]]:
    """fp16 dynamic loss scaling as Megatron/DeepSpeed do it: halve on overflow (the step is
    skipped), double after ``window`` clean steps. ``quiet`` is a plan index range kept free
    of overflows so a collapse that starts after it is not blurred by normal breathing."""
    scale = 2.0 ** rng.randint(13, 17)
    window = rng.choice((200, 250, 500, 1000))
    rate = 1.0 / rng.uniform(150.0, 700.0)
    since = rng.randrange(window)
    scales: list[float] = []
    skipped: set[int] = set()
    for i in range(n):
        calm = quiet is not None and quiet[0] <= i < quiet[1]
        if not calm and rng.random() < rate and scale > 1.0:
            scale /= 2.0
            skipped.add(i)
            since = 0
        else:
            since += 1
            if since >= window and scale < 2.0**24:
                scale *= 2.0
                since = 0
        scales.append(scale)
    return scales, skipped


@dataclass(slots=True)
class MetricRow:
    step: int
    time: float
    loss: float
    lr: float
    grad_norm: float | None
    loss_scale: float | None
    tokens: int
    throughput: float
    skipped: bool
    iteration_s: float


def tokens_per_step(plan: Plan) -> int:
    """Tokens one optimizer step consumes: every rank's samples (``micro_batch`` counts a
    rank's samples per step, accumulation included) at ``max_length`` after truncation."""
    world = plan.world
    return world.ranks * world.micro_batch * world.max_length


def iter_rows(plan: Plan) -> Iterator[MetricRow]:
    """The job's logged steps, healthy values times the plan's effects."""
    world, curve = plan.world, plan.world.curve
    rng = sub_rng(plan.cause, plan.seed, "metrics")
    gauss, rand = rng.gauss, rng.random
    tokens = tokens_per_step(plan)
    guard: list[tuple[int, int]] = []
    for index in (plan.onset, plan.spike):
        if index is not None:
            guard.append((index - BUMP_GUARD, index + BUMP_GUARD))
    lr_from = plan.lr_factor_from
    for i in range(plan.n):
        step = plan.first_step + i
        loss = healthy_loss(curve, step) * plan.loss_factor.get(i, 1.0) * (1.0 + gauss(0.0, curve.noise))
        grad = healthy_grad(curve, step) * math.exp(gauss(0.0, curve.grad_noise))
        if rand() < 1.0 / 400.0 and not any(a <= i < b for a, b in guard):
            grad *= 1.5 + rand()
        grad *= plan.grad_factor.get(i, 1.0)
        lr = lr_at(curve, step, plan.lr_peak_factor)
        if lr_from is not None and i >= lr_from[0]:
            lr *= lr_from[1]
        if plan.nan_from is not None and i >= plan.nan_from:
            loss = math.nan
            grad = math.nan
        skipped = i in plan.skipped
        scale = plan.loss_scale[i] if plan.loss_scale is not None else None
        duration = plan.dur[i]
        throughput = tokens / duration * (1.0 + gauss(0.0, 0.002))
        yield MetricRow(step, plan.times[i], loss, lr, None if skipped else grad, scale, tokens,
                        throughput, skipped, duration)


def iso_time(moment: float, millis: bool = False) -> str:
    """UTC ISO 8601 with ``Z``, whole seconds or milliseconds (loggers print either)."""
    stamp = datetime.fromtimestamp(moment, UTC)
    if millis:
        return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_number(value: float, fmt: str, nan_form: str) -> str:
    if value != value:
        return "NaN" if nan_form == "bare" else '"nan"'
    if value in (math.inf, -math.inf):
        if nan_form == "bare":
            return "Infinity" if value > 0 else "-Infinity"
        return '"inf"' if value > 0 else '"-inf"'
    return fmt % value


def jsonl_line(plan: Plan, row: MetricRow) -> str:
    """One ``metrics.jsonl`` line in the bundle's canonical form (fixed key order)."""
    world = plan.world
    if world.time_form == "unix":
        when = f"{row.time:.3f}"
    else:
        when = '"' + iso_time(row.time, world.time_form == "iso-ms") + '"'
    parts = [
        f'{{"step": {row.step}, "time": {when}, "loss": {_json_number(row.loss, "%.6g", world.nan_form)}',
        f', "lr": {row.lr:.6g}',
    ]
    if row.grad_norm is not None:
        parts.append(f', "grad_norm": {_json_number(row.grad_norm, "%.6g", world.nan_form)}')
    if world.write_loss_scale:
        scale = row.loss_scale if row.loss_scale is not None else 1.0
        parts.append(f', "loss_scale": {scale!r}')
    parts.append(f', "tokens": {row.tokens}, "throughput": {row.throughput:.1f}}}\n')
    return "".join(parts)


def megatron_header(plan: Plan) -> str:
    """What Megatron-LM prints before its first iteration line (setup timers)."""
    start = datetime.fromtimestamp(plan.times[0] - plan.dur[0], UTC).strftime("%Y-%m-%d %H:%M:%S")
    return (
        "time (ms) | model-and-optimizer-setup: 4512.33 | train/valid/test-data-iterators-setup: 1890.27\n"
        f"[after dataloaders are built] datetime: {start} \n"
        "done with setup ...\n"
        "training ...\n"
        f"[before the start of training step] datetime: {start} \n"
    )


def megatron_line(plan: Plan, row: MetricRow) -> str:
    """A Megatron-LM ``training_log`` line, as recent Megatron prints it: the loss is left
    out when its average is not > 0 (NaN) or every iteration was skipped, the grad norm on
    skipped iterations, and nan iterations are counted only on skipped ones."""
    world = plan.world
    stamp = datetime.fromtimestamp(row.time, UTC).strftime("%Y-%m-%d %H:%M:%S")
    gbs = world.ranks * world.micro_batch
    total = int(world.extra.get("train_iters", plan.last_step + 1000))
    tflops = float(world.extra.get("tflops", 400.0)) * world.step_seconds / row.iteration_s
    parts = [
        f" [{stamp}] iteration {row.step:8d}/{total:8d} |",
        f" consumed samples: {row.step * gbs:12d} |",
        f" elapsed time per iteration (ms): {row.iteration_s * 1000.0:.1f} |",
        f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |",
        f" learning rate: {row.lr:.6E} |",
        f" global batch size: {gbs:5d} |",
    ]
    loss_finite = row.loss == row.loss and row.loss not in (math.inf, -math.inf)
    if not row.skipped and loss_finite and row.loss > 0.0:
        parts.append(f" lm loss: {row.loss:.6E} |")
    scale = row.loss_scale if row.loss_scale is not None else 1.0
    parts.append(f" loss scale: {scale:.1f} |")
    if not row.skipped and row.grad_norm is not None:
        parts.append(f" grad norm: {row.grad_norm:.3f} |")
    nan_iters = 1 if row.skipped and not loss_finite else 0
    parts.append(f" number of skipped iterations: {int(row.skipped):3d} |")
    parts.append(f" number of nan iterations: {nan_iters:3d} |\n")
    return "".join(parts)
