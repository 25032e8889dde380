"""Guards for the training loop: grad norm, non-finite loss, and the seed's data filters.

- ``GradGuard``: clip at 1.0 by default (the seed's default), flag a non-finite norm, and
  raise a z-score alarm the way ZClip does, against an exponential moving mean and variance
  of the norm, so a norm that climbs for several steps before the loss spikes (the numeric
  layer's precursor) is seen while it happens.
- ``NanGuard``: records the first non-finite loss step to a file the collector can pick up,
  optionally POSTs an alert to the spikeops alert receiver, and optionally raises.
- ``filter_samples``: max-length truncation, empty-sample filter and dedup by content hash,
  around any iterable of samples, with counts of what it did.
"""

from __future__ import annotations

import hashlib
import json
import math
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["GradGuard", "GradCheck", "NanGuard", "NonFiniteLoss", "FilterStats", "filter_samples"]


@dataclass
class GradCheck:
    norm: float
    clipped: bool
    nonfinite: bool
    zscore: float | None
    alarm: bool


class GradGuard:
    """``check(norm)`` after backward; ``clip(parameters)`` does the clipping with torch and
    checks in one call. ``alarms`` keeps the steps that raised the z-score alarm."""

    def __init__(self, max_norm: float = 1.0, z_threshold: float = 3.0, alpha: float = 0.97,
                 warmup: int = 25) -> None:
        self.max_norm = max_norm
        self.z_threshold = z_threshold
        self.alpha = alpha
        self.warmup = warmup
        self.mean: float | None = None
        self.var = 0.0
        self.seen = 0
        self.alarms: list[tuple[int | None, float, float]] = []

    def check(self, norm: float, step: int | None = None) -> GradCheck:
        value = float(norm)
        if not math.isfinite(value):
            self.alarms.append((step, value, math.inf))
            return GradCheck(value, False, True, None, True)
        zscore = None
        alarm = False
        if self.mean is not None and self.seen >= self.warmup:
            std = math.sqrt(self.var) if self.var > 0 else 0.0
            zscore = (value - self.mean) / std if std > 0 else 0.0
            alarm = zscore > self.z_threshold
        if alarm:
            self.alarms.append((step, value, zscore or 0.0))
        else:  # an outlier must not pull the baseline it is judged against
            if self.mean is None:
                self.mean = value
            else:
                delta = value - self.mean
                self.mean += (1 - self.alpha) * delta
                self.var = self.alpha * (self.var + (1 - self.alpha) * delta * delta)
            self.seen += 1
        return GradCheck(value, value > self.max_norm, False, zscore, alarm)

    def clip(self, parameters: Iterable[Any], step: int | None = None) -> GradCheck:
        """``torch.nn.utils.clip_grad_norm_`` at ``max_norm``, then ``check`` of the total norm."""
        import torch

        norm = torch.nn.utils.clip_grad_norm_(list(parameters), self.max_norm)
        return self.check(float(norm), step)


class NonFiniteLoss(FloatingPointError):
    """Raised by ``NanGuard`` when asked to stop the loop on a NaN/Inf loss."""


class NanGuard:
    def __init__(self, record: str | Path | None = None, *, webhook: str | None = None,
                 webhook_token: str | None = None, job: str | None = None, raise_on_nan: bool = False,
                 post: Callable[[str, bytes, dict[str, str]], None] | None = None) -> None:
        self.record = Path(record) if record else None
        self.webhook = webhook
        self.webhook_token = webhook_token
        self.job = job
        self.raise_on_nan = raise_on_nan
        self.first_step: int | None = None
        self._post = post or _post_json

    def check(self, step: int, loss: Any) -> bool:
        """True when ``loss`` is finite. The first non-finite step is recorded (and alerted) once."""
        value = float(loss.item() if hasattr(loss, "item") else loss)
        if math.isfinite(value):
            return True
        if self.first_step is None:
            self.first_step = step
            event = {"step": step, "loss": str(value), "time": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
                     "job": self.job}
            if self.record is not None:
                self.record.parent.mkdir(parents=True, exist_ok=True)
                self.record.write_text(json.dumps(event) + "\n")
            if self.webhook:
                payload = {"alerts": [{"status": "firing", "labels": {"alertname": "TrainingLossNaN",
                                                                      "job": self.job or "", "step": str(step)},
                                       "annotations": {"summary": f"loss is {value} at step {step}"},
                                       "startsAt": event["time"]}]}
                headers = {"Content-Type": "application/json"}
                if self.webhook_token:
                    headers["Authorization"] = f"Bearer {self.webhook_token}"
                try:
                    self._post(self.webhook, json.dumps(payload).encode(), headers)
                except Exception:  # an unreachable receiver must not kill the training loop
                    pass
        if self.raise_on_nan:
            raise NonFiniteLoss(f"loss is {value} at step {step}")
        return False


def _post_json(url: str, body: bytes, headers: dict[str, str]) -> None:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=5):  # noqa: S310 - the operator's own receiver
        pass


@dataclass
class FilterStats:
    seen: int = 0
    kept: int = 0
    empty: int = 0
    duplicate: int = 0
    truncated: int = 0
    longest: int = 0
    truncated_ids: list[Any] = field(default_factory=list)


def filter_samples(samples: Iterable[Any], *, max_length: int | None = None, tokens: Callable[[Any], Any] | None = None,
                   set_tokens: Callable[[Any, Any], Any] | None = None, drop_empty: bool = True, dedup: bool = True,
                   key: Callable[[Any], Any] | None = None, stats: FilterStats | None = None) -> Iterator[Any]:
    """Yield the samples a job should train on: empty ones dropped, exact duplicates (by a
    hash of their content) dropped, and token sequences cut to ``max_length``.

    ``tokens(sample)`` gives the token sequence (default: the sample itself);
    ``set_tokens(sample, cut)`` returns the sample with its tokens replaced (default: the cut
    sequence). ``stats`` counts what was done, and keeps the ids of truncated samples."""
    stats = stats if stats is not None else FilterStats()
    get = tokens or (lambda sample: sample)
    put = set_tokens or (lambda sample, cut: cut)
    seen_hashes: set[bytes] = set()
    for sample in samples:
        stats.seen += 1
        sequence = get(sample)
        length = len(sequence)
        stats.longest = max(stats.longest, length)
        if drop_empty and length == 0:
            stats.empty += 1
            continue
        if dedup:
            digest = hashlib.blake2b(repr(list(sequence) if not isinstance(sequence, (str, bytes)) else sequence)
                                     .encode(), digest_size=16).digest()
            if digest in seen_hashes:
                stats.duplicate += 1
                continue
            seen_hashes.add(digest)
        if max_length is not None and length > max_length:
            stats.truncated += 1
            if len(stats.truncated_ids) < 1000:
                stats.truncated_ids.append(key(sample) if key else stats.seen - 1)
            sample = put(sample, sequence[:max_length])
        stats.kept += 1
        yield sample
