"""Verifying a checkpoint against its manifest, file by file, by name.

Only a checkpoint whose every listed file is present, has its recorded size, and hashes to
its recorded digest, with nothing unexpected beside it, is verified. Anything else is named
(missing, extra, truncated, grown, mismatch, unreadable, changed while read), because "the
checkpoint is bad" is not something an engineer can act on and "mp_rank_03/model.pt is
3 GiB short" is. A size that already differs skips the digest: no need to read a file to
know it is wrong.
"""

from __future__ import annotations

import errno
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spikeops.checkpoints.manifest import (
    Checkpoint,
    Manifest,
    hash_files,
    default_workers,
    list_files,
    locate,
    read_manifest,
)

__all__ = ["Problem", "VerifyReport", "verify", "PROBLEM_KINDS"]

PROBLEM_KINDS = ("missing", "truncated", "grown", "mismatch", "unreadable", "changed", "extra")


@dataclass(frozen=True)
class Problem:
    path: str
    kind: str
    detail: str

    def line(self) -> str:
        return f"{self.path}: {self.kind} ({self.detail})"


@dataclass
class VerifyReport:
    checkpoint: Checkpoint
    manifest: Manifest
    problems: list[Problem] = field(default_factory=list)
    bytes_hashed: int = 0
    files_checked: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: what checkpoints.json's ``problem`` says."""
        if self.ok:
            return "verified"
        first = self.problems[0].line()
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return first + more

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.checkpoint.path),
            "manifest": str(self.checkpoint.manifest_path),
            "algorithm": self.manifest.algorithm,
            "step": self.manifest.step,
            "verified": self.ok,
            "files": len(self.manifest.files),
            "bytes": self.manifest.total_bytes,
            "bytes_hashed": self.bytes_hashed,
            "seconds": round(self.seconds, 3),
            "throughput_mb_s": round(self.bytes_hashed / self.seconds / 1e6, 1) if self.seconds > 0 else None,
            "problems": [{"path": p.path, "kind": p.kind, "detail": p.detail} for p in self.problems],
        }


def _size_of(checkpoint: Checkpoint, rel: str) -> int | OSError:
    try:
        info = (checkpoint.root / rel).stat()
    except OSError as exc:
        return exc
    if not stat.S_ISREG(info.st_mode):
        return OSError(errno.EISDIR if stat.S_ISDIR(info.st_mode) else errno.EINVAL, "not a regular file")
    return info.st_size


def verify(path: str | Any, *, workers: int | None = None,
           progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Verify the checkpoint at ``path``. InputError (ManifestError) when there is no
    trustworthy manifest or the path is unreadable; a report otherwise."""
    t0 = time.monotonic()
    checkpoint = locate(path)
    manifest = read_manifest(checkpoint)
    report = VerifyReport(checkpoint, manifest)
    to_hash = []
    for entry in manifest.files:
        size = _size_of(checkpoint, entry.path)
        if isinstance(size, FileNotFoundError):
            report.problems.append(Problem(entry.path, "missing", f"listed with {entry.size:,} bytes"))
        elif isinstance(size, OSError):
            report.problems.append(Problem(entry.path, "unreadable", size.strerror or str(size)))
        elif size < entry.size:
            report.problems.append(Problem(entry.path, "truncated", f"{size:,} of {entry.size:,} bytes"))
        elif size > entry.size:
            report.problems.append(Problem(entry.path, "grown", f"{size:,} bytes, manifest says {entry.size:,}"))
        else:
            to_hash.append(entry)
    expected = {entry.path: entry for entry in to_hash}
    for rel, outcome in hash_files(checkpoint, [e.path for e in to_hash], manifest.algorithm,
                                  workers or default_workers(), progress):
        entry = expected[rel]
        if isinstance(outcome, OSError):
            report.problems.append(Problem(rel, "unreadable", outcome.strerror or str(outcome)))
            continue
        report.files_checked += 1
        report.bytes_hashed += outcome.size
        if outcome.changed:
            report.problems.append(Problem(rel, "changed", "modified while being read; not verified"))
        elif outcome.size != entry.size:
            report.problems.append(Problem(rel, "truncated" if outcome.size < entry.size else "grown",
                                           f"read {outcome.size:,} of {entry.size:,} bytes"))
        elif outcome.digest != entry.digest:
            report.problems.append(Problem(rel, "mismatch",
                                           f"{manifest.algorithm} {outcome.digest[:16]}…, manifest {entry.digest[:16]}…"))
    if checkpoint.single_file is None:
        listed = {entry.path for entry in manifest.files}
        present, notes = list_files(checkpoint)
        for rel in present:
            if rel not in listed:
                report.problems.append(Problem(rel, "extra", "not in the manifest"))
        for note in notes:
            if "permission" in note.lower() or "denied" in note.lower():
                rel, _, why = note.partition(": ")
                report.problems.append(Problem(rel, "unreadable", why))
    order = {kind: index for index, kind in enumerate(PROBLEM_KINDS)}
    report.problems.sort(key=lambda p: (order.get(p.kind, 99), p.path))
    report.seconds = time.monotonic() - t0
    return report
