"""Keeping the resume checkpoint out of reach of the job's own retention.

Training jobs delete old checkpoints (keep the last N). During an incident the last good one
may be older than N saves, and a job restarted, or still running, would delete it. Hard
links in a folder the job does not manage (``ROOT/.spikeops-keep/NAME/``) keep the data
alive whatever happens to the original path: no copy, no extra space, on any POSIX file
system that supports hard links; removing the folder undoes it.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

from spikeops.checkpoints.manifest import MANIFEST_NAME, list_files, locate
from spikeops.errors import InputError
from spikeops.timeparse import iso

__all__ = ["KEEP_DIR", "protect", "protected_copy"]

KEEP_DIR = ".spikeops-keep"


def protected_copy(path: str | Path) -> Path:
    checkpoint = locate(path)
    return checkpoint.path.parent / KEEP_DIR / checkpoint.path.name


def protect(path: str | Path, reason: str = "") -> tuple[Path, int]:
    """Hard-link every file of the checkpoint (and its manifest) under ``KEEP_DIR``;
    idempotent. Returns the folder and how many links were made now."""
    checkpoint = locate(path)
    target = protected_copy(path)
    files, _ = list_files(checkpoint)
    extra = [MANIFEST_NAME] if checkpoint.single_file is None and checkpoint.manifest_path.is_file() else []
    if checkpoint.single_file is not None and checkpoint.manifest_path.is_file():
        extra = [checkpoint.manifest_path.name]
    made = 0
    try:
        for rel in files + extra:
            source = checkpoint.root / rel
            link = target / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.exists():
                if os.path.samefile(source, link):
                    continue
                link.unlink()
            os.link(source, link)
            made += 1
        record = {"protected": str(checkpoint.path), "when": iso(datetime.now(UTC)), "reason": reason,
                  "files": len(files)}
        # beside the kept folder, not in it: the kept copy must verify against its manifest
        (target.parent / f"{target.name}.keep.json").write_text(json.dumps(record, indent=1) + "\n")
    except OSError as exc:
        raise InputError(f"cannot protect {checkpoint.path}: {exc.strerror or exc} "
                         "(hard links need the same file system)") from None
    return target, made
