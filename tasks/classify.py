"""Classifying the symptom from the metrics alone, and watching a single spike play out."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from prefect import task

__all__ = ["classify_symptom", "observe", "last_step"]


@task(name="classify")
def classify_symptom(bundle: str) -> dict[str, Any]:
    """The symptom and spike step from the bundle's metrics (the matrix's first question)."""
    from spikeops.diagnosis.engine import classify_bundle

    result = classify_bundle(bundle)
    return {"symptom": result.symptom, "spike_step": result.spike_step}


@task(name="observe")
def observe(run_dir: str, bundle: str, spike_step: int | None, steps: int, timeout_s: float) -> dict[str, Any]:
    """After a single spike the job keeps training: watch up to ``steps`` more steps (at most
    ``timeout_s``), refresh the bundle's metrics, and classify again. A spike that did not
    recover is then treated as one."""
    metrics = Path(run_dir) / "metrics.jsonl"
    target = (spike_step or 0) + steps
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = last_step(metrics)
        if last is not None and last >= target:
            break
        time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
    if metrics.is_file():
        shutil.copy2(metrics, Path(bundle) / "metrics.jsonl")
    again = classify_symptom.fn(bundle)
    again["observed_until"] = last_step(metrics)
    return again


def last_step(path: Path) -> int | None:
    """The last logged step, read from the file's end (it may be large)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 65536))
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None
