"""The checkpoint hook: RNG and sampler state beside the weights, then the manifest.

Call it right after the job's own save returned (``torch.save``, ``dcp.save``, DeepSpeed's
``save_checkpoint``): it writes the resume state (``resume.save_state``) into the checkpoint
directory, then its ``MANIFEST.json`` (``spikeops.checkpoints``), in a background thread when
asked, so the next training step does not wait for the digest.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from spikeops.checkpoints import save_manifest
from spikeops.train.resume import capture_state, save_state

__all__ = ["on_checkpoint_saved"]


def on_checkpoint_saved(checkpoint_dir: str | Path, step: int, *, sampler_position: int | None = None,
                        background: bool = True, extra: dict[str, Any] | None = None) -> Path | Future[Path]:
    """Resume state + manifest for a checkpoint just written; the manifest's path (or Future)."""
    save_state(checkpoint_dir, capture_state(sampler_position=sampler_position, extra=extra))
    return save_manifest(checkpoint_dir, step=step, background=background)
