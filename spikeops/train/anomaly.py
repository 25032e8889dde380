"""Locating the operator that made the first NaN, as the seed's numeric layer asks.

``torch.autograd.detect_anomaly()`` makes backward raise at the first function that returns
NaN, naming it (``Function 'SoftmaxBackward0' returned nan values in its 0th output``). It
slows the step several times over, so it runs only for the first ``steps`` steps after a
resume (where a bad checkpoint or a data problem shows first). The finding goes into the
job's own log, as a line ``spikeops: first NaN ...`` that ``spikeops diagnose`` quotes.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["AnomalyLocator", "NAN_LINE_PREFIX"]

NAN_LINE_PREFIX = "spikeops: first NaN"
_FUNCTION = re.compile(r"Function '([A-Za-z0-9_]+)' returned nan values in its (\d+)(?:st|nd|rd|th) output")


class AnomalyLocator:
    """``with locator.step(step): loss.backward()`` for every step; under anomaly detection
    for the first ``steps`` of them. ``operator`` and ``step_found`` hold the finding."""

    def __init__(self, steps: int = 20, *, log: logging.Logger | None = None, reraise: bool = True) -> None:
        self.steps = steps
        self.log = log or logging.getLogger("spikeops.train")
        self.reraise = reraise
        self.seen = 0
        self.operator: str | None = None
        self.output_index: int | None = None
        self.step_found: int | None = None
        self.message: str | None = None

    @property
    def active(self) -> bool:
        return self.seen < self.steps and self.operator is None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if not self.active:
            self.seen += 1
            yield
            return
        import torch

        self.seen += 1
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                yield
        except RuntimeError as exc:
            match = _FUNCTION.search(str(exc))
            if match is None:
                raise
            self.operator, self.output_index, self.step_found = match.group(1), int(match.group(2)), step
            self.message = (f"{NAN_LINE_PREFIX} at step {step}: produced by {self.operator} "
                            f"(output {self.output_index}) during backward")
            self.log.error(self.message)
            if self.reraise:
                raise

    def summary(self) -> dict[str, Any]:
        return {"operator": self.operator, "output": self.output_index, "step": self.step_found,
                "steps_checked": min(self.seen, self.steps)}
