"""Checkpoint integrity: manifests, fast verification, and the nearest good checkpoint.

- ``digest``: BLAKE3 (default) and SHA-256 over bounded, reused read buffers;
- ``manifest``: MANIFEST.json written atomically, read strictly; ``save_manifest`` for
  training scripts (optionally in a background thread);
- ``verify``: every listed file by size and digest, every problem by name;
- ``pick``: newest verified checkpoint strictly before a step; quarantine, never delete.
"""

from __future__ import annotations

from spikeops.checkpoints.manifest import MANIFEST_NAME, ManifestError, save_manifest, write_manifest
from spikeops.checkpoints.pick import PickResult, bundle_entries, find_checkpoints, pick
from spikeops.checkpoints.verify import VerifyReport, verify

__all__ = [
    "MANIFEST_NAME",
    "ManifestError",
    "save_manifest",
    "write_manifest",
    "verify",
    "VerifyReport",
    "pick",
    "PickResult",
    "find_checkpoints",
    "bundle_entries",
]
