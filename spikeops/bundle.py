"""Reading and writing incident bundles (shared/spec/bundle.md, format 1).

A bundle is the one record of what spikeops knew when it diagnosed an incident: the
collector writes it, the diagnosis reads it, a person opens it in the post-mortem. Raw tool
output is stored byte for byte; every write is atomic (temp file, fsync, rename) so a
collector killed mid-write never leaves a half file that later reads as evidence.

Reading is forgiving by design: only ``incident.json`` is required; every other file is
optional, unknown files are ignored, and a file that cannot be parsed is reported in
``missing`` rather than stopping the use of the rest.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.errors import BundleError, InputError
from spikeops.jsonable import to_jsonable
from spikeops.probes import bundle_files
from spikeops.probes.base import Gap
from spikeops.probes.bundle_files import (
    BUNDLE_FORMAT,
    PROBE_ERRORS,
    CheckpointList,
    Incident,
    JsonlRecords,
    ProbesFile,
    ProbeStatus,
)
from spikeops.reading import Reading, read_evidence

__all__ = [
    "BUNDLE_FORMAT",
    "PROBE_FILES",
    "Bundle",
    "BundleWriter",
    "open_bundle",
    "probe_kind_for",
    "ARCHIVES",
    "unpack_archive",
    "atomic_write",
    "AtomicSink",
]

#: Probe file names (spec table) to the parser kind that reads them. ``ethtool-IFACE.txt``
#: is matched by pattern. Keeping the kind here, not detecting it, means a probe whose
#: output is odd (an error message instead of counters) is still read as what it should be.
PROBE_FILES: dict[str, str] = {
    "nvidia-smi-q.txt": "nvidia-smi-q",
    "nvidia-smi-q.xml": "nvidia-smi-xml",
    "kernel.log": "kernel-log",
    "ibstat.txt": "ibstat",
    "ib-counters.txt": "ib-counters",
    "nccl.log": "nccl-log",
    "nccl-version.txt": "nccl-version",
    "train.log": "training-log",
    "nvml.json": "nvml-json",
    "ncclras.txt": "ncclras",
}
#: Probes whose output is a tar archive of several files, unpacked into a folder of the node
#: (the archive itself is a transport, not kept): folder -> the kind of each file in it.
ARCHIVES: dict[str, str] = {"flight-recorder": "flight-recorder", "stacks": "py-spy"}
#: Files one archive may bring (a node with thousands of ranks' dumps is not a node).
MAX_ARCHIVE_FILES = 4096
_ETHTOOL = re.compile(r"^ethtool-(?P<iface>[^/]+)\.txt$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]*$")


def probe_kind_for(filename: str) -> str | None:
    """The parser kind for a probe file name, or None for files the spec does not name."""
    if filename in PROBE_FILES:
        return PROBE_FILES[filename]
    if _ETHTOOL.match(filename):
        return "ethtool"
    if filename.endswith(".tar") and filename[:-4] in ARCHIVES:
        return ARCHIVES[filename[:-4]]
    return None


def unpack_archive(archive: Path, folder: Path) -> tuple[list[str], str | None]:
    """Unpack a probe's tar archive into ``folder``: regular files only, each under its own
    plain name (a path, a link, a device or a name that is not plain is skipped), each
    written atomically. Returns the names written and, when the archive could not be read
    to its end (cut at the probe's cap, or corrupt), why; the files before that are kept."""
    import tarfile

    written: list[str] = []
    problem: str | None = None
    skipped = 0
    try:
        with tarfile.open(archive, mode="r:", ignore_zeros=True) as tar:
            while True:
                try:
                    member = tar.next()
                except (tarfile.TarError, EOFError, OSError) as exc:
                    problem = f"the archive is cut or corrupt after {len(written)} file(s) ({exc})"
                    break
                if member is None:
                    break
                name = member.name.removeprefix("./")
                if not member.isreg() or "/" in name or not _SAFE_NAME.match(name) or name in written:
                    skipped += 1
                    continue
                if len(written) >= MAX_ARCHIVE_FILES:
                    problem = f"more than {MAX_ARCHIVE_FILES} files: the rest were not kept"
                    break
                try:
                    handle = tar.extractfile(member)
                    data = handle.read() if handle is not None else b""
                except (tarfile.TarError, EOFError, OSError) as exc:
                    problem = f"the archive is cut inside {name} ({exc}); {len(written)} file(s) kept"
                    break
                if len(data) != member.size:
                    problem = f"the archive is cut inside {name}; {len(written)} file(s) kept"
                    break
                atomic_write(folder / name, data)
                written.append(name)
    except (tarfile.TarError, EOFError, OSError) as exc:
        problem = f"not a readable tar archive ({exc})"
    if skipped and problem is None:
        problem = f"{skipped} archive member(s) that are not plain files were skipped"
    if not written and problem is None and archive.stat().st_size:
        problem = "no file could be read from the archive (not a tar archive?)"
    return written, problem


def atomic_write(path: Path, data: bytes, *, sync_dir: bool = False) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one.
    ``sync_dir`` also flushes the directory entry, so the rename itself survives a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync_dir:
        try:
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass


class AtomicSink:
    """A file written in pieces that appears whole or not at all: output streamed from a
    node goes to a temp file beside the target, so a capped 16 MiB probe never sits in
    memory, and ``commit`` renames it into place (``discard`` removes it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self._handle = os.fdopen(fd, "wb")
        self.size = 0

    def write(self, data: bytes) -> None:
        self._handle.write(data)
        self.size += len(data)

    def commit(self) -> Path:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        os.replace(self._tmp, self.path)
        return self.path

    def discard(self) -> None:
        if not self._handle.closed:
            self._handle.close()
        try:
            os.unlink(self._tmp)
        except OSError:
            pass


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(to_jsonable(value), indent=2, ensure_ascii=False, allow_nan=True) + "\n").encode()


def _check_name(kind: str, name: str) -> str:
    """Node and probe names become path components: refuse anything that could escape."""
    if not _SAFE_NAME.match(name) or name in {".", ".."}:
        raise BundleError(f"unsafe {kind} name {name!r} (letters, digits and ._@+- only)")
    return name


@dataclass
class Bundle:
    """A bundle opened for reading. Everything but ``incident`` is read lazily, on demand."""

    path: Path
    incident: Incident
    missing: list[str] = field(default_factory=list)

    # -- nodes ---------------------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Node folders present, in the job's order first, then any others by name."""
        folder = self.path / "nodes"
        present = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
        ordered = [n for n in self.incident.job.nodes if n in present]
        return ordered + [n for n in present if n not in ordered]

    def node_dir(self, node: str) -> Path:
        return self.path / "nodes" / _check_name("node", node)

    def probes(self, node: str) -> ProbesFile:
        """probes.json of a node; a missing or broken one is an empty result with a gap."""
        path = self.node_dir(node) / "probes.json"
        if not path.is_file():
            result = ProbesFile()
            result.gaps.append(Gap(f"nodes/{node}/probes.json missing"))
            return result
        return bundle_files.parse_probes(path.read_text(encoding="utf-8", errors="replace"))

    def probe_files(self, node: str, *, baseline: bool = False) -> list[Path]:
        """Raw probe outputs (``*.txt``, ``*.log``, ``*.xml``, ``*.json``) of a node, then the
        files of its unpacked folders (``flight-recorder/``, ``stacks/``)."""
        folder = self.node_dir(node) / "baseline" if baseline else self.node_dir(node)
        if not folder.is_dir():
            return []
        files = sorted(p for p in folder.iterdir() if p.is_file() and probe_kind_for(p.name))
        for name in ARCHIVES:
            if (folder / name).is_dir():
                files.extend(sorted(p for p in (folder / name).iterdir() if p.is_file() and not p.name.startswith(".")))
        return files

    def read_probe(self, node: str, filename: str, *, baseline: bool = False) -> Reading:
        """Parse one probe file with the kind its name fixes (``flight-recorder/NAME`` and
        ``stacks/NAME`` by their folder); raises InputError if unreadable."""
        folder = self.node_dir(node) / "baseline" if baseline else self.node_dir(node)
        parent, _, name = filename.rpartition("/")
        kind = ARCHIVES.get(parent) if parent else probe_kind_for(filename)
        if parent and (kind is None or not _SAFE_NAME.match(name)):
            raise InputError(f"{filename}: not a probe file of the bundle")
        return read_evidence(folder / filename, kind)

    def stderr_of(self, node: str, probe_file: str) -> str | None:
        err = self.node_dir(node) / (Path(probe_file).stem + ".err")
        return err.read_text(encoding="utf-8", errors="replace") if err.is_file() else None

    # -- job-level files -----------------------------------------------------------------
    def _optional(self, relative: str) -> Path | None:
        path = self.path / relative
        if path.is_file():
            return path
        return None

    def metric_sources(self) -> list[tuple[str, str]]:
        """Where step metrics may come from, in order: ``metrics.jsonl``, the job's
        ``train.log``, and last the log lines of the node running rank 0."""
        sources = [("metrics.jsonl", "metrics-jsonl"), ("train.log", "training-log")]
        job = self.incident.job
        first = job.node_of_rank(0) or next(iter(job.nodes), None)
        if first:
            sources.append((f"nodes/{first}/train.log", "training-log"))
        return sources

    def metrics(self) -> Reading | None:
        """The first readable source of ``metric_sources()``, parsed."""
        for relative, kind in self.metric_sources():
            path = self._optional(relative)
            if path is None:
                continue
            try:
                return read_evidence(path, kind)
            except InputError as exc:
                self.missing.append(f"{relative}: {exc}")
        return None

    def _records(self, relative: str, kind: str) -> JsonlRecords | None:
        path = self._optional(relative)
        if path is None:
            return None
        try:
            return read_evidence(path, kind).result
        except InputError as exc:
            self.missing.append(f"{relative}: {exc}")
            return None

    def ranks(self) -> JsonlRecords | None:
        return self._records("ranks.jsonl", "ranks-jsonl")

    def batches(self) -> JsonlRecords | None:
        return self._records("batches.jsonl", "batches-jsonl")

    def reference_batches(self) -> JsonlRecords | None:
        return self._records("reference/batches.jsonl", "batches-jsonl")

    def checkpoints(self) -> CheckpointList | None:
        path = self._optional("checkpoints.json")
        if path is None:
            return None
        return bundle_files.parse_checkpoints(path.read_text(encoding="utf-8", errors="replace"))


def open_bundle(path: str | Path) -> Bundle:
    """Open a bundle; BundleError (one line) when it is not a directory or lacks incident.json."""
    root = Path(path)
    if not root.exists():
        raise BundleError(f"{root}: no such bundle")
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    incident_path = root / "incident.json"
    if not incident_path.is_file():
        raise BundleError(f"{root}: not a bundle (no incident.json)")
    try:
        text = incident_path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise BundleError(f"{incident_path}: unreadable ({exc.strerror or exc})") from exc
    incident = bundle_files.parse_incident(text)
    if not incident.raw:
        reason = incident.gaps[0].reason if incident.gaps else "empty"
        raise BundleError(f"{incident_path}: {reason}")
    if incident.format is not None and not str(incident.format).startswith("spikeops-bundle/1"):
        raise BundleError(f"{incident_path}: unsupported bundle format {incident.format!r} (this is {BUNDLE_FORMAT})")
    bundle = Bundle(root, incident)
    if incident.format is None:
        bundle.missing.append(f"incident.json: no format field (read as {BUNDLE_FORMAT})")
    bundle.missing.extend(f"incident.json: {gap.reason}" for gap in incident.gaps)
    return bundle


class BundleWriter:
    """Writes a bundle; every method is idempotent (rewriting a file replaces it whole)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def write_incident(self, incident: Mapping[str, Any]) -> Path:
        """Write incident.json; ``format`` is filled in, and the spec's required keys checked."""
        document = dict(incident)
        document.setdefault("format", BUNDLE_FORMAT)
        if document["format"] != BUNDLE_FORMAT:
            raise BundleError(f"refusing to write format {document['format']!r}; this writer is {BUNDLE_FORMAT}")
        for key in ("incident_id", "job"):
            if key not in document:
                raise BundleError(f"incident.json needs {key!r}")
        target = self.path / "incident.json"
        atomic_write(target, _json_bytes(document))
        return target

    def write_probe_output(
        self,
        node: str,
        filename: str,
        stdout: bytes,
        stderr: bytes = b"",
        *,
        baseline: bool = False,
    ) -> Path:
        """Store a probe's raw stdout verbatim (and its stderr beside it when not empty)."""
        if probe_kind_for(filename) is None:
            raise BundleError(f"{filename!r} is not a probe file name of the bundle spec")
        folder = self.path / "nodes" / _check_name("node", node)
        if baseline:
            folder = folder / "baseline"
        _check_name("probe file", filename)
        target = folder / filename
        atomic_write(target, stdout)
        err = folder / (Path(filename).stem + ".err")
        if stderr:
            atomic_write(err, stderr)
        elif err.exists():
            err.unlink()
        return target

    def node_folder(self, node: str, *, baseline: bool = False) -> Path:
        folder = self.path / "nodes" / _check_name("node", node)
        return folder / "baseline" if baseline else folder

    def probe_sink(self, node: str, filename: str, *, baseline: bool = False) -> AtomicSink:
        """A streaming writer for one probe's stdout (see ``AtomicSink``)."""
        if probe_kind_for(filename) is None:
            raise BundleError(f"{filename!r} is not a probe file name of the bundle spec")
        return AtomicSink(self.node_folder(node, baseline=baseline) / _check_name("probe file", filename))

    def existing_evidence(self, node: str, *, baseline: bool = False) -> list[str]:
        """Probe files (and probes.json) already in a node's folder: what a new collection
        would replace."""
        folder = self.node_folder(node, baseline=baseline)
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir()
                      if (p.is_file() and (probe_kind_for(p.name) or p.name == "probes.json" or p.suffix == ".err"))
                      or (p.is_dir() and p.name in ARCHIVES and any(p.iterdir())))

    def clear_node(self, node: str, *, baseline: bool = False) -> None:
        """Remove a node's probe files before a new collection replaces them (the folder's
        other files, and ``baseline/`` when clearing the current evidence, stay); the
        unpacked folders (``flight-recorder/``, ``stacks/``) lose their files."""
        folder = self.node_folder(node, baseline=baseline)
        for name in self.existing_evidence(node, baseline=baseline):
            target = folder / name
            if target.is_dir():
                for item in target.iterdir():
                    if item.is_file() or item.is_symlink():
                        item.unlink(missing_ok=True)
            else:
                target.unlink(missing_ok=True)

    def unpack_probe_archive(self, node: str, archive: str, *, baseline: bool = False) -> tuple[list[str], str | None]:
        """Unpack ``archive`` (a probe's ``*.tar`` in the node's folder) into the folder of
        the same name, and remove the archive (see ``unpack_archive``)."""
        folder = self.node_folder(node, baseline=baseline)
        source = folder / _check_name("probe file", archive)
        target = folder / archive.removesuffix(".tar")
        if archive.removesuffix(".tar") not in ARCHIVES:
            raise BundleError(f"{archive!r} is not an archive probe of the bundle")
        if not source.is_file():
            return [], None
        try:
            return unpack_archive(source, target)
        finally:
            source.unlink(missing_ok=True)

    def write_probes_json(self, node: str, statuses: Iterable[ProbeStatus], *, baseline: bool = False) -> Path:
        document: dict[str, Any] = {}
        for status in statuses:
            if status.error is not None and status.error not in PROBE_ERRORS:
                raise BundleError(f"probe {status.name!r}: error {status.error!r} is not in the spec")
            document[status.name] = {
                "command": status.command,
                "exit": status.exit,
                "started": status.started,
                "seconds": status.seconds,
                "error": status.error,
            }
        target = self.node_folder(node, baseline=baseline) / "probes.json"
        atomic_write(target, _json_bytes(document))
        return target

    def write_unreachable(self, node: str, probes: Mapping[str, str], seconds: float | None = None,
                          *, error: str = "unreachable", baseline: bool = False) -> Path:
        """The spec's form for a node that could not be reached: only probes.json, every entry
        carrying the same error (``unreachable``; ``host-key`` or ``auth`` when the node
        answered but the connection was refused)."""
        self.clear_node(node, baseline=baseline)
        statuses = [ProbeStatus(name, command, None, None, seconds, error) for name, command in probes.items()]
        return self.write_probes_json(node, statuses, baseline=baseline)

    def write_jsonl(self, relative: str, records: Iterable[Mapping[str, Any]]) -> Path:
        """metrics.jsonl, ranks.jsonl, batches.jsonl, reference/batches.jsonl (NaN as bare tokens)."""
        if relative not in {"metrics.jsonl", "ranks.jsonl", "batches.jsonl", "reference/batches.jsonl"}:
            raise BundleError(f"{relative!r} is not a JSONL file of the bundle spec")
        body = "".join(json.dumps(to_jsonable(record), allow_nan=True) + "\n" for record in records)
        target = self.path / relative
        atomic_write(target, body.encode())
        return target

    def write_checkpoints(self, checkpoints: Iterable[Mapping[str, Any]]) -> Path:
        target = self.path / "checkpoints.json"
        atomic_write(target, _json_bytes(list(checkpoints)))
        return target

    def write_text(self, relative: str, text: str) -> Path:
        """Other job-level files (train.log, diagnosis.json written elsewhere), verbatim."""
        parts = Path(relative).parts
        if not parts or any(part in {"..", ""} or part.startswith("/") for part in parts):
            raise BundleError(f"unsafe bundle path {relative!r}")
        target = self.path.joinpath(*parts)
        atomic_write(target, text.encode())
        return target
