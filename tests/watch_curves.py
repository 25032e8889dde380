"""Synthetic training curves for the watcher's tests (seeded numpy), healthy and broken.

Healthy, as real runs look and as the watcher must tolerate: a loss falling as a power law
from ln(vocab) with 0.5-3 % multiplicative noise, an LR that warms up linearly and decays
(cosine or linear), a grad norm that settles with heavy-ish lognormal noise and a rare benign
bump to 1.5-2.5x, an fp16 loss scale that searches down from 2^16 in the first steps, halves
on an overflow (that step's grad norm is inf) and doubles after a clean growth interval, with
an overflow probability that rises with the scale (the feedback that keeps real scalers
breathing around one level) and the odd burst of two or three overflows (near that level:
an overflow means the scale is too high for the gradients); a throughput that
ramps up over the first steps, jitters, and dips for a checkpoint save or an eval.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

__all__ = ["Curve", "healthy", "jsonl", "megatron_lines"]

START = datetime(2026, 11, 29, 9, 0, 0, tzinfo=UTC)


@dataclass
class Curve:
    """Column arrays of one run; ``records()`` gives the metrics.jsonl dicts."""

    step: np.ndarray
    loss: np.ndarray
    lr: np.ndarray
    grad_norm: np.ndarray
    loss_scale: np.ndarray | None
    throughput: np.ndarray
    seconds: np.ndarray

    def records(self, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
        rows = []
        for i in range(start, len(self.step) if stop is None else stop):
            row: dict[str, Any] = {
                "step": int(self.step[i]),
                "time": (START + timedelta(seconds=float(self.seconds[i]))).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                "loss": float(self.loss[i]), "lr": float(self.lr[i]), "grad_norm": float(self.grad_norm[i]),
                "tokens": 4_194_304, "throughput": float(self.throughput[i]),
            }
            if self.loss_scale is not None:
                row["loss_scale"] = float(self.loss_scale[i])
            rows.append(row)
        return rows


def _loss_scale(rng: np.random.Generator, n: int) -> np.ndarray:
    equilibrium = 2.0 ** int(rng.integers(12, 18))
    growth = int(rng.choice([500, 1000, 2000]))
    scale, since = 2.0 ** 32, 0
    out = np.empty(n)
    burst = 0
    for i in range(n):
        overflow = False
        if burst > 0:
            overflow, burst = True, burst - 1
        elif i < 40 and scale > 4 * equilibrium:
            overflow = True  # the search down from the initial scale
        elif rng.random() < min(0.5, 2e-4 * (scale / equilibrium) ** 2):
            overflow = True
        elif scale >= equilibrium / 2 and rng.random() < 1 / 8000:
            overflow, burst = True, int(rng.integers(1, 3))
        if overflow:
            scale, since = scale / 2, 0
        else:
            since += 1
            if since >= growth:
                scale, since = scale * 2, 0
        out[i] = scale
    return out


def healthy(seed: int, n: int = 6000, *, fp16: bool = True, schedule: str = "cosine") -> Curve:
    rng = np.random.default_rng(seed)
    step = np.arange(n)
    warmup = int(rng.integers(200, 1000))
    peak = 10 ** rng.uniform(-4.5, -3.0)
    progress = np.clip((step - warmup) / max(1, n - warmup), 0, 1)
    decay = 0.5 * (1 + np.cos(np.pi * progress)) if schedule == "cosine" else 1 - progress
    lr = np.where(step < warmup, peak * step / warmup, peak * (0.1 + 0.9 * decay))
    floor, tau, alpha = rng.uniform(1.6, 2.6), rng.uniform(50, 400), rng.uniform(0.5, 1.0)
    noise = rng.uniform(0.005, 0.03)
    loss = (floor + (math.log(50257) - floor) * (1 + step / tau) ** -alpha) * (1 + rng.normal(0, noise, n))
    grad_floor, grad_start = rng.uniform(0.2, 1.2), rng.uniform(2.0, 12.0)
    grad = (grad_floor + (grad_start - grad_floor) * np.exp(-step / rng.uniform(200, 3000))) \
        * np.exp(rng.normal(0, rng.uniform(0.05, 0.2), n))
    bumps = rng.random(n) < 1 / 400
    grad[bumps] *= rng.uniform(1.5, 2.5, bumps.sum())
    scale = _loss_scale(rng, n) if fp16 else None
    if scale is not None:
        overflow = np.r_[False, scale[1:] < scale[:-1]]
        grad[overflow] = np.inf
    base = rng.uniform(2e5, 4e6)
    throughput = base * (1 + rng.normal(0, rng.uniform(0.005, 0.04), n))
    ramp = min(30, n)
    throughput[:ramp] *= np.linspace(0.2, 1.0, 30)[:ramp]
    throughput[(step % 500 == 499)] *= 0.3  # checkpoint saves
    evals = (step % 1000 >= 998)
    throughput[evals] *= 0.5
    seconds = np.cumsum(4_194_304 / throughput)
    return Curve(step, loss, lr, grad, scale, throughput, seconds)


def jsonl(records: list[dict[str, Any]]) -> str:
    """metrics.jsonl text: NaN/Infinity as bare tokens, as Python's json writes them."""
    return "".join(json.dumps(record, allow_nan=True) + "\n" for record in records)


def megatron_lines(curve: Curve, start: int = 0, stop: int | None = None) -> list[str]:
    """Megatron-LM iteration lines for the curve's steps (newer Megatron's time prefix)."""
    lines = []
    for record in curve.records(start, stop):
        when = record["time"][:19].replace("T", " ")
        grad = record["grad_norm"]
        skipped = int(not math.isfinite(grad))
        fields = [
            f"consumed samples: {record['step'] * 1024:12d}",
            f"elapsed time per iteration (ms): {4_194_304 / record['throughput'] * 1000:.1f}",
            f"learning rate: {record['lr']:.6E}", "global batch size:  1024",
            f"lm loss: {record['loss']:.6E}",
        ]
        if "loss_scale" in record:
            fields.append(f"loss scale: {record['loss_scale']:.1f}")
        if not skipped:
            fields.append(f"grad norm: {grad:.3f}")
        fields += [f"number of skipped iterations: {skipped:3d}", "number of nan iterations:   0"]
        lines.append(f"[{when}] iteration {record['step']:8d}/ 500000 | " + " | ".join(fields) + " |")
    return lines
