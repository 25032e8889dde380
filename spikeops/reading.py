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
from spikeops.textio import ReadReport, iter_lines, read_text, sniff

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


def read_evidence(
    path: str | Path,
    kind: str | None = None,
    *,
    progress: Callable[[ReadReport], None] | None = None,
) -> Reading:
    """Parse ``path`` as ``kind`` (detected by content when None).

    Raises InputError (missing, binary, empty, unknown kind) or UnrecognisedInput (text that
    no parser claims, or that the forced kind reads nothing from); never a foreign error.
    """
    target = Path(path)
    if target.is_dir():
        return _read_directory(target, kind)
    head, report = sniff(target)
    detected = kind is None
    confidence: float | None = None
    if kind is None:
        candidates = detect_kind(head)
        if not candidates:
            raise UnrecognisedInput(
                f"{target}: not a kind of output spikeops reads (use --kind; `spikeops parse --list-kinds`)"
            )
        confidence, chosen = candidates[0]
    else:
        chosen = _resolve_kind(kind)
        confidence = float(chosen.detect(head))
    if chosen.streaming:
        result = chosen.parse(iter_lines(target, report, progress=progress))
    else:
        result = chosen.parse(read_text(target, report, progress=progress))
    gaps = report.gaps() + list(getattr(result, "gaps", []))
    if not detected and is_empty(result):
        raise UnrecognisedInput(f"{target}: nothing in it reads as {chosen.name} ({chosen.description})")
    return Reading(str(target), chosen, result, report, gaps, detected, confidence)
