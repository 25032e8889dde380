"""``MANIFEST.json``: what a checkpoint held when it was written (format spikeops-manifest/1).

Every file's relative path, size and digest, the algorithm, the step and the time, written
atomically (temp file, fsync, rename, fsync of the directory) so a crash during the write
leaves either no manifest or a whole one, never half a list that would verify a half
checkpoint. The layouts people use are recognised only to name them and find the step:
every regular file under the directory is listed whatever the layout, because a loader
that reads one more file than we guessed would otherwise be reading something unchecked.

A single-file checkpoint (``model.pt``) gets a sidecar ``model.pt.MANIFEST.json``.
"""

from __future__ import annotations

import json
import os
import re
import stat as statmod
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from concurrent.futures import Future

from spikeops.checkpoints.digest import ALGORITHMS, CHUNK, DEFAULT_ALGORITHM, hash_file
from spikeops.errors import InputError
from spikeops.timeparse import iso

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "QUARANTINE_MARKER",
    "ManifestError",
    "Manifest",
    "ManifestEntry",
    "Checkpoint",
    "locate",
    "detect_layout",
    "step_from_name",
    "list_files",
    "build_manifest",
    "write_manifest",
    "save_manifest",
    "read_manifest",
    "default_workers",
    "hash_files",
]

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "spikeops-manifest/1"
#: The quarantine marker (``pick --quarantine``); never listed, never hashed.
QUARANTINE_MARKER = "SPIKEOPS-QUARANTINE.json"
#: A manifest listing more files than this is refused: no checkpoint has a million shards,
#: and reading one must not cost unbounded memory.
MAX_FILES = 1_000_000
_STEP = re.compile(r"(?:global_step|iter_|step[-_]?|checkpoint[-_]|ckpt[-_]?|epoch[-_]?\d+[-_]step[-_]?)(\d+)",
                   re.IGNORECASE)
_HEX = re.compile(r"^[0-9a-f]{16,128}$")


class ManifestError(InputError):
    """No manifest, or one that cannot be trusted (not JSON, paths escaping the checkpoint)."""


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    size: int
    digest: str


@dataclass
class Manifest:
    algorithm: str
    files: list[ManifestEntry]
    step: int | None = None
    written: str | None = None
    layout: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint's files and its manifest are: a directory holding MANIFEST.json,
    or a single file with a sidecar."""

    path: Path
    root: Path  # the directory file paths are relative to
    manifest_path: Path
    single_file: str | None = None


def locate(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path`` (directory or single file); InputError if neither."""
    target = Path(path)
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"{target}: no such checkpoint") from None
    except OSError as exc:
        raise InputError(f"{target}: cannot read ({exc.strerror or exc})") from None
    if statmod.S_ISDIR(mode):
        if not os.access(target, os.R_OK | os.X_OK):
            raise InputError(f"{target}: directory not readable (permission denied)")
        return Checkpoint(target, target, target / MANIFEST_NAME)
    if statmod.S_ISREG(mode):
        return Checkpoint(target, target.parent, target.parent / f"{target.name}.{MANIFEST_NAME}", target.name)
    raise InputError(f"{target}: not a file or directory")


def step_from_name(name: str) -> int | None:
    """``global_step12000``, ``iter_0012000``, ``step-12000``, ``checkpoint-12000`` -> 12000."""
    matches = _STEP.findall(name)
    return int(matches[-1]) if matches else None


def detect_layout(names: list[str]) -> str:
    """Name the layout from the relative file paths (for people and for the record only)."""
    base = [PurePosixPath(n).name for n in names]
    parts = {part for n in names for part in PurePosixPath(n).parts}
    if ".metadata" in base and any(n.endswith(".distcp") for n in base):
        return "pytorch-dcp"
    if any(p.startswith(("mp_rank_", "zero_pp_rank_")) for p in parts):
        return "deepspeed" if any("zero_pp_rank_" in p or p.endswith("_optim_states.pt") for p in parts) else "megatron"
    if any(n.endswith(".safetensors") for n in base):
        return "safetensors"
    if len(names) == 1:
        return "single-file"
    return "directory"


def list_files(checkpoint: Checkpoint) -> tuple[list[str], list[str]]:
    """Regular files under the checkpoint, as sorted POSIX relative paths, and what was not
    listed (symlinks, special files, unreadable directories) with why."""
    if checkpoint.single_file is not None:
        return [checkpoint.single_file], []
    files: list[str] = []
    notes: list[str] = []

    def refuse(error: OSError) -> None:
        notes.append(f"{error.filename}: {error.strerror or error}")

    for folder, dirs, names in os.walk(checkpoint.root, onerror=refuse, followlinks=False):
        rel_folder = Path(folder).relative_to(checkpoint.root)
        for name in dirs:
            if (Path(folder) / name).is_symlink():
                notes.append(f"{(rel_folder / name).as_posix()}: symlinked directory not followed")
        for name in names:
            rel = (rel_folder / name).as_posix()
            if rel in (MANIFEST_NAME, QUARANTINE_MARKER) or (name.startswith(f".{MANIFEST_NAME}.") and name.endswith(".tmp")):
                continue
            full = Path(folder) / name
            try:
                mode = full.lstat().st_mode
            except OSError as exc:
                notes.append(f"{rel}: {exc.strerror or exc}")
                continue
            if statmod.S_ISREG(mode):
                files.append(rel)
            elif statmod.S_ISLNK(mode):
                notes.append(f"{rel}: symlink not followed")
            else:
                notes.append(f"{rel}: not a regular file")
    return sorted(files), notes


def default_workers() -> int:
    return max(2, min(8, os.cpu_count() or 2))


def hash_files(checkpoint: Checkpoint, paths: list[str], algorithm: str, workers: int,
              progress: Callable[[int], None] | None) -> list[tuple[str, Any]]:
    """Hash files in parallel; a file's error is returned in its place, never raised."""
    local = threading.local()
    # With at least as many files as workers, one core a file (measured: as fast as BLAKE3's
    # own threads, without their hand-off); with fewer (one 100 GB file), BLAKE3 spreads each
    # file over the cores. Never a memory map: a file truncated under a map kills the process
    # with SIGBUS, and a checkpoint being overwritten during a verify must be a reported
    # problem, not a crash.
    spread = len(paths) < workers

    def one(rel: str) -> tuple[str, Any]:
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(CHUNK)
        try:
            return rel, hash_file(checkpoint.root / rel, algorithm, threads=spread, progress=progress,
                                  buffer=local.buffer)
        except OSError as exc:
            return rel, exc

    # Largest first, so one huge shard does not start last and finish alone. Plain threads over
    # a shared iterator, not concurrent.futures: its import (with logging) was a tenth of a warm
    # verify's start-up.
    order = iter(sorted(paths, key=lambda rel: -_size(checkpoint.root / rel)))
    results: dict[str, Any] = {}
    taking = threading.Lock()

    def work() -> None:
        while True:
            with taking:
                rel = next(order, None)
            if rel is None:
                return
            results[rel] = one(rel)[1]

    threads = [threading.Thread(target=work, name="spikeops-digest", daemon=True)
               for _ in range(max(1, min(workers, len(paths))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [(rel, results[rel]) for rel in paths]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def build_manifest(path: str | Path, *, algorithm: str = DEFAULT_ALGORITHM, step: int | None = None,
                   workers: int | None = None, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The manifest document of the checkpoint at ``path`` (not written)."""
    if algorithm not in ALGORITHMS:
        raise InputError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    checkpoint = locate(path)
    files, notes = list_files(checkpoint)
    if not files:
        raise InputError(f"{checkpoint.path}: no files to list")
    entries = []
    for rel, outcome in hash_files(checkpoint, files, algorithm, workers or default_workers(), progress):
        if isinstance(outcome, OSError):
            raise InputError(f"{checkpoint.root / rel}: cannot read ({outcome.strerror or outcome}); no manifest written")
        if outcome.changed:
            raise InputError(f"{checkpoint.root / rel}: changed while being read (is the checkpoint still being "
                             "written?); no manifest written")
        entries.append({"path": rel, "size": outcome.size, "digest": outcome.digest})
    name = checkpoint.path.name
    document: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "algorithm": algorithm,
        "step": step if step is not None else step_from_name(name),
        "written": iso(datetime.now(UTC)),
        "layout": detect_layout(files),
        "total_bytes": sum(entry["size"] for entry in entries),
        "files": entries,
    }
    if notes:
        document["not_listed"] = notes[:100]
    return document


def write_manifest(path: str | Path, *, algorithm: str = DEFAULT_ALGORITHM, step: int | None = None,
                   workers: int | None = None, progress: Callable[[int], None] | None = None) -> Path:
    """Build and atomically write the manifest; returns its path."""
    checkpoint = locate(path)
    document = build_manifest(path, algorithm=algorithm, step=step, workers=workers, progress=progress)
    try:
        from spikeops.bundle import atomic_write  # here: a verify never needs it, and it is a tenth of its start

        atomic_write(checkpoint.manifest_path, (json.dumps(document, indent=1) + "\n").encode(), sync_dir=True)
    except OSError as exc:
        raise InputError(f"{checkpoint.manifest_path}: cannot write ({exc.strerror or exc})") from None
    return checkpoint.manifest_path


_BACKGROUND: Any = None  # one thread, made on first use: background manifests are written in order


def save_manifest(path: str | Path, *, step: int | None = None, algorithm: str = DEFAULT_ALGORITHM,
                  background: bool = False, workers: int | None = None) -> Path | Future[Path]:
    """The call for a training script, right after its checkpoint save returned:
    ``save_manifest(ckpt_dir, step=step, background=True)`` hashes in a background thread
    (the digest releases the GIL) and returns a Future; otherwise the manifest's path.
    Background manifests are written one at a time, in the order they were asked for."""
    global _BACKGROUND
    if not background:
        return write_manifest(path, algorithm=algorithm, step=step, workers=workers)
    if _BACKGROUND is None:
        from concurrent.futures import ThreadPoolExecutor

        _BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spikeops-manifest")
    return _BACKGROUND.submit(write_manifest, path, algorithm=algorithm, step=step, workers=workers)


def _entry(raw: Any, index: int, where: Path) -> ManifestEntry:
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: files[{index}] is not an object")
    rel, size, digest = raw.get("path"), raw.get("size"), raw.get("digest")
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"{where}: files[{index}] has no path")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel or "\x00" in rel or rel != pure.as_posix():
        raise ManifestError(f"{where}: files[{index}] path {rel!r} is outside the checkpoint; manifest not trusted")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ManifestError(f"{where}: files[{index}] ({rel}) has no valid size")
    if not isinstance(digest, str) or not _HEX.match(digest):
        raise ManifestError(f"{where}: files[{index}] ({rel}) has no valid digest")
    return ManifestEntry(rel, size, digest)


def read_manifest(checkpoint: Checkpoint) -> Manifest:
    """Read and validate a manifest; ManifestError (one line) when missing or untrustworthy."""
    where = checkpoint.manifest_path
    try:
        raw_bytes = where.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{checkpoint.path}: no manifest ({where.name})") from None
    except OSError as exc:
        raise ManifestError(f"{where}: cannot read ({exc.strerror or exc})") from None
    try:
        document = json.loads(raw_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ManifestError(f"{where}: not a JSON object")
    if document.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{where}: unknown format {document.get('format')!r} (expected {MANIFEST_FORMAT})")
    algorithm = document.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise ManifestError(f"{where}: unknown algorithm {algorithm!r}")
    files = document.get("files")
    if not isinstance(files, list) or not files:
        raise ManifestError(f"{where}: lists no files")
    if len(files) > MAX_FILES:
        raise ManifestError(f"{where}: lists {len(files):,} files (more than {MAX_FILES:,}); not trusted")
    entries = [_entry(raw, index, where) for index, raw in enumerate(files)]
    paths = [entry.path for entry in entries]
    if len(set(paths)) != len(paths):
        raise ManifestError(f"{where}: lists a file twice")
    if checkpoint.single_file is not None and paths != [checkpoint.single_file]:
        raise ManifestError(f"{where}: does not describe {checkpoint.single_file}")
    step = document.get("step")
    return Manifest(
        algorithm=algorithm, files=entries,
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        written=document.get("written") if isinstance(document.get("written"), str) else None,
        layout=document.get("layout") if isinstance(document.get("layout"), str) else None,
        raw=document,
    )
