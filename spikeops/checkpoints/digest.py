"""File digests for checkpoint manifests: BLAKE3 by default, SHA-256 for compliance.

BLAKE3 because verification runs on every resume of a multi-terabyte checkpoint and the
digest, not the page cache, is the limit on a CPU: BLAKE3 hashes several GB/s a core and
uses every core on one large file, where coreutils' SHA-256 reads ~220 MB/s (README,
"Checkpoint verification"). SHA-256 stays available for teams whose policy names it.

Files are read in fixed chunks into one reused buffer, so memory does not grow with the
checkpoint, and a file truncated while it is read is a short read rather than the SIGBUS a
memory map would raise (a map measured 10-25 % faster here; not worth a crash). A file's identity
(size, mtime, inode) is compared before and after: a file rewritten while it was being read
is reported as changed, never as verified.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "CHUNK", "FileDigest", "hash_file", "new_hasher"]

DEFAULT_ALGORITHM = "blake3"
ALGORITHMS = ("blake3", "sha256")
#: Large enough that Python's per-call overhead vanishes, small enough that the chunk just
#: copied out of the page cache is still in the CPU's cache when BLAKE3 reads it: 1 MiB took
#: 25 % less CPU than 8 MiB on a warm checkpoint here (bench/bench_checkpoint.py).
CHUNK = 1 << 20


def new_hasher(algorithm: str, *, threads: bool = True) -> Any:
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    if algorithm == "sha256":
        import hashlib  # only for SHA-256 manifests: OpenSSL's loading is a BLAKE3 verify's start-up otherwise

        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


@dataclass(frozen=True)
class FileDigest:
    size: int
    digest: str
    #: The file's size, mtime or inode changed while it was read: the digest means nothing.
    changed: bool = False


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return (stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev)


def hash_file(path: str | os.PathLike[str], algorithm: str = DEFAULT_ALGORITHM, *,
              threads: bool = True, progress: Callable[[int], None] | None = None,
              buffer: bytearray | None = None) -> FileDigest:
    """Digest one file; OSError propagates (the caller reports it per file)."""
    hasher = new_hasher(algorithm, threads=threads)
    chunk = buffer if buffer is not None else bytearray(CHUNK)
    view = memoryview(chunk)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        before = os.fstat(handle.fileno())
        while True:
            count = handle.readinto(chunk)
            if not count:
                break
            hasher.update(view[:count])
            size += count
            if progress is not None:
                progress(count)
        after = os.fstat(handle.fileno())
    try:
        now = os.stat(path)
    except OSError:
        now = None
    changed = _identity(before) != _identity(after) or now is None or _identity(now) != _identity(before) \
        or size != before.st_size
    return FileDigest(size, hasher.hexdigest(), changed)
