"""Prefect tasks for checkpoint integrity: verify one checkpoint, pick the resume point.

Thin over ``spikeops.checkpoints``; what they add is the bundle: the pick's view of every
checkpoint (verified, corrupt with the file and how, or not checked) becomes the bundle's
``checkpoints.json``, which the diagnosis reads to name ``resume_from``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from spikeops.bundle import BundleWriter
from spikeops.checkpoints import bundle_entries, pick, verify

__all__ = ["verify_checkpoint", "pick_checkpoint"]


@task(name="verify-checkpoint", task_run_name="verify {path}")
def verify_checkpoint(path: str, workers: int | None = None) -> dict[str, Any]:
    """The verification report as JSON (``verified``, per-file ``problems``)."""
    return verify(path, workers=workers).to_json()


@task(name="pick-checkpoint", task_run_name="pick before step {before}")
def pick_checkpoint(root: str, before: int, bundle: str | None = None, quarantine: str | None = None,
                    workers: int | None = None) -> dict[str, Any]:
    """The newest verified checkpoint under ``root`` strictly before ``before``; when
    ``bundle`` is given its ``checkpoints.json`` is (re)written from what was seen."""
    result = pick(root, before, quarantine_mode=quarantine, workers=workers)
    if bundle is not None:
        BundleWriter(Path(bundle)).write_checkpoints(bundle_entries(result))
    return result.to_json()
