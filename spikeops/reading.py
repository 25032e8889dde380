"""Reading one evidence file (or captured directory) into a parse result: the I/O edge.

Parsers are pure; this is where a path meets them. It refuses unreadable input with a
one-line reason, detects the kind by content when none is given, streams log kinds, caps
whole-document kinds, and merges the reader's repairs with the parser's gaps so a person
sees everything that was not read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.errors import InputError, UnrecognisedInput
from spikeops.probes import Gap, Kind, detect_kind, get_kind, kind_names, registry
from spikeops.textio import ReadReport, head_bytes, iter_lines, open_binary, read_bytes, read_text, sniff

__all__ = ["Reading", "read_evidence", "is_empty"]


@dataclass
class Reading:
    """A file as spikeops read it: its kind, the parse, and every gap on the way."""

    path: str
    kind: Kind
    result: Any
    report: ReadReport
    gaps: list[Gap] = field(default_factory=list)
    detected: bool = True
    confidence: float | None = None


def is_empty(result: Any) -> bool:
    """True when a parse found nothing at all: every field but ``gaps`` is empty or None.

    Used to tell "this is not a KIND file" from "a KIND file with some gaps" when the user
    forces ``--kind``; it needs no per-parser knowledge.
    """
    if isinstance(result, list | tuple | dict | set):
        return not result
    if not dataclasses.is_dataclass(result):
        return result is None
    for item in dataclasses.fields(result):
        if item.name in {"gaps", "lines", "format"}:
            continue
        value = getattr(result, item.name)
        if value is None or value is False or value == 0:
            continue
        if isinstance(value, list | tuple | dict | set | frozenset | str) and not value:
            continue
        return False
    return True


def _resolve_kind(name: str) -> Kind:
    kind = get_kind(name)
    if kind is None:
        raise InputError(f"unknown kind {name!r}; known kinds: {', '.join(kind_names())}")
    return kind


def _read_directory(path: Path, kind_name: str | None) -> Reading:
    kinds = [_resolve_kind(kind_name)] if kind_name else list({k.name: k for k in registry().values()}.values())
    for kind in kinds:
        if kind.from_directory is None:
            continue
        text = kind.from_directory(path)
        if text is None:
            continue
        report = ReadReport(path=str(path), size=len(text), lines=text.count("\n"))
        result = kind.parse(text)
        return Reading(str(path), kind, result, report, list(getattr(result, "gaps", [])), kind_name is None)
    raise UnrecognisedInput(f"{path}: a directory spikeops does not read (not a captured sysfs tree or bundle)")


#: Windows of the file read beyond its head when detection needs them (64 KiB each).
FURTHER_WINDOWS = 8
#: Kinds whose lines a job's training log carries too: when step lines show up later in the
#: file (a Slurm .out that opens with 64 KiB of NCCL init and tracebacks), it is the log.
_EMBEDDED_IN_TRAINING_LOG = frozenset({"nccl-log", "job-errors"})


def _windows(path: Path, count: int, size: int) -> list[str]:
    """Text of ``count`` windows spread over the file after its head, the last one its tail."""
    try:
        total = path.stat().st_size
    except OSError:
        return []
    if total <= size:
        return []
    starts = sorted({size + (total - 2 * size) * index // max(1, count - 1) for index in range(count)} | {total - size})
    texts = []
    try:
        with open_binary(path) as handle:
            for start in starts:
                handle.seek(max(0, start))
                raw = handle.read(size)
                cut = raw.find(b"\n")
                texts.append(raw[cut + 1:].decode("utf-8", errors="replace") if cut >= 0 else "")
    except (OSError, EOFError, ValueError):
        return texts
    return texts


def _detect(path: Path, head: str) -> list[tuple[float, Kind]]:
    """Kinds for a file, best first: its head first; when nothing claims the head for sure,
    or a job log's NCCL/error lines fill it, windows further into the file are looked at too
    (detection must not stop at a long preamble)."""
    candidates = detect_kind(head)
    best = candidates[0] if candidates else None
    if best is not None and best[0] >= 0.9 and best[1].name not in _EMBEDDED_IN_TRAINING_LOG:
        return candidates
    scores = {kind.name: (score, kind) for score, kind in candidates}
    for window in _windows(path, FURTHER_WINDOWS, len(head.encode("utf-8", errors="replace")) or 65536):
        for score, kind in detect_kind(window):
            if score > scores.get(kind.name, (0.0, kind))[0]:
                scores[kind.name] = (score, kind)
    training = scores.get("training-log")
    if best is not None and best[1].name in _EMBEDDED_IN_TRAINING_LOG and training and training[0] >= 0.85:
        return [training] + [pair for name, pair in scores.items() if name != "training-log"]
    if best is not None and best[0] >= 0.9:
        return candidates
    return sorted(scores.values(), key=lambda pair: (-pair[0], pair[1].name))


#: The most a binary kind's file is read (its parser says what a real one weighs).
MAX_BINARY_BYTES = 256 << 20


def _read_binary(target: Path, kind: Kind, detected: bool, confidence: float | None) -> Reading:
    report = ReadReport(path=str(target))
    try:
        report.size = target.stat().st_size
    except OSError:
        pass
    result = kind.parse(read_bytes(target, report, max_bytes=MAX_BINARY_BYTES))
    gaps = report.gaps() + list(getattr(result, "gaps", []))
    return Reading(str(target), kind, result, report, gaps, detected, confidence)


def read_evidence(
    path: str | Path,
    kind: str | None = None,
    *,
    progress: Callable[[ReadReport], None] | None = None,
    confidence: bool = True,
) -> Reading:
    """Parse ``path`` as ``kind`` (detected by content when None). ``confidence`` False skips
    scoring a given kind against the file's head (the diagnosis reads a bundle's files by
    their spec'd names and has no use for the score: ``Reading.confidence`` is then None).

    Raises InputError (missing, binary, empty, unknown kind) or UnrecognisedInput (text that
    no parser claims, or that the forced kind reads nothing from); never a foreign error.
    """
    target = Path(path)
    if target.is_dir():
        return _read_directory(target, kind)
    try:
        head, report = sniff(target, decode=kind is None or confidence)
    except InputError:
        raw = head_bytes(target)  # InputError itself when missing or empty
        if kind is not None:
            forced = _resolve_kind(kind)
            if forced.binary:
                score = forced.detect_bytes(raw) if forced.detect_bytes else None
                return _read_binary(target, forced, False, score)
        elif (claims := detect_kind(raw)):
            return _read_binary(target, claims[0][1], True, claims[0][0])
        raise
    detected = kind is None
    score: float | None = None
    if kind is None:
        candidates = _detect(target, head)
        if not candidates:
            raise UnrecognisedInput(
                f"{target}: not a kind of output spikeops reads (use --kind; `spikeops parse --list-kinds`)"
            )
        score, chosen = candidates[0]
    else:
        chosen = _resolve_kind(kind)
        score = float(chosen.detect(head)) if confidence else None
    if chosen.binary:
        return _read_binary(target, chosen, detected, score)
    if chosen.streaming:
        result = chosen.parse(iter_lines(target, report, progress=progress))
    else:
        result = chosen.parse(read_text(target, report, progress=progress))
    gaps = report.gaps() + list(getattr(result, "gaps", []))
    if not detected and is_empty(result):
        raise UnrecognisedInput(f"{target}: nothing in it reads as {chosen.name} ({chosen.description})")
    return Reading(str(target), chosen, result, report, gaps, detected, score)
