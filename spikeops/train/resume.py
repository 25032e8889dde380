"""Resume hygiene: RNG and sampler state saved with the checkpoint, and checked on resume.

A resume that does not restore the RNG (or the sampler position) silently changes the data
order: the loss creeps up and nobody knows why (the seed's ``rng_not_restored``). The fix is
to save every generator's state with the checkpoint and restore it; the check is to compare
the first steps' batch fingerprints after the resume with the ones the run recorded before
(``batches.jsonl``), and to say so, loudly, when they differ.
"""

from __future__ import annotations

import json
import pickle
import random
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["capture_state", "restore_state", "save_state", "load_state", "FingerprintCheck", "DataOrderWarning",
           "STATE_FILE"]

STATE_FILE = "spikeops-train-state.pkl"


def capture_state(*, sampler_position: int | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Python's, NumPy's and torch's (CPU and every CUDA device) RNG states, and the sampler."""
    state: dict[str, Any] = {"python": random.getstate(), "sampler_position": sampler_position,
                             "extra": dict(extra or {})}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_state(state: Mapping[str, Any]) -> int | None:
    """Put every generator back; returns the sampler position to continue from."""
    random.setstate(state["python"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        numpy.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        torch.set_rng_state(state["torch"])
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["torch_cuda"])
    return state.get("sampler_position")


def save_state(checkpoint_dir: str | Path, state: Mapping[str, Any]) -> Path:
    """Beside the checkpoint (so its manifest covers it)."""
    from spikeops.bundle import atomic_write

    target = Path(checkpoint_dir) / STATE_FILE
    atomic_write(target, pickle.dumps(dict(state)))
    return target


def load_state(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        return None
    return pickle.loads(path.read_bytes())  # noqa: S301 - written by the job itself, beside its weights


class DataOrderWarning(UserWarning):
    """The batches after a resume are not the ones the run saw before it."""


@dataclass
class FingerprintCheck:
    """Feed it the fingerprints of the first ``steps`` steps after a resume; it compares them
    with the ones recorded before (``reference``: a ``batches.jsonl``) and warns on the first
    mismatch. ``mismatches`` keeps (step, rank, expected, got)."""

    reference: str | Path
    steps: int = 20
    rank: int | None = None
    mismatches: list[tuple[int, int, str, str]] = field(default_factory=list)
    matched: int = 0
    _expected: dict[tuple[int, int], str] = field(default_factory=dict, repr=False)
    _first: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        path = Path(self.reference)
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                    key = (int(record["step"]), int(record.get("rank", 0)))
                except (ValueError, KeyError, TypeError):
                    continue
                if self.rank is None or key[1] == self.rank:
                    self._expected[key] = str(record.get("fingerprint"))

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def observe(self, step: int, fingerprint: str, rank: int = 0) -> bool:
        """True when the step matches (or is outside the window or unknown)."""
        if self._first is None:
            self._first = step
        if step >= self._first + self.steps:
            return True
        expected = self._expected.get((step, rank))
        if expected is None:
            return True
        if expected == fingerprint:
            self.matched += 1
            return True
        self.mismatches.append((step, rank, expected, fingerprint))
        if len(self.mismatches) == 1:
            warnings.warn(f"data order changed after the resume: step {step} rank {rank} saw batch {fingerprint[:12]}, "
                          f"the run before saw {expected[:12]} (RNG or sampler state not restored?)",
                          DataOrderWarning, stacklevel=2)
        return False

    def observe_records(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.observe(int(record["step"]), str(record["fingerprint"]), int(record.get("rank", 0)))
