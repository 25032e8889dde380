"""What every evidence parser shares: the line source, the gap record, and the registry.

A parser is a pure function from text to typed values. It never raises on bad input: the
part it could not read becomes a ``Gap`` (line and reason) beside what it did read, because
a diagnosis built on 90 % of a truncated log beats no diagnosis. Parsers that read logs
accept an iterable of lines, so a 2 GB file is streamed rather than loaded.

Each parser module registers one or more ``Kind`` entries at import time (node_exporter
style); ``spikeops.probes.registry()`` discovers the modules, so adding an evidence kind is
one new file and no edits elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Gap",
    "Kind",
    "register",
    "numbered_lines",
    "join_text",
    "clip",
    "to_number",
    "MAX_EVIDENCE_TEXT",
    "MAX_EVENTS",
    "LineSource",
    "RemoteProbe",
    "register_remote",
    "remote_probes",
]

#: Evidence lines are quoted back to people; a single minified line can be megabytes.
MAX_EVIDENCE_TEXT = 400
#: Events of one kind kept from one input; the rest are counted in a gap. A log with a
#: million identical warnings must not cost a million objects.
MAX_EVENTS = 10_000


@dataclass(frozen=True, slots=True)
class Gap:
    """A part of the input that was not understood or not read, with the reason why."""

    reason: str
    line: int | None = None


LineSource = str | Iterable[str]


def numbered_lines(source: LineSource) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, line)`` from text or from an iterable of lines.

    Line numbers are 1-based so evidence can cite them as editors and ``grep -n`` do.
    Trailing newline characters are removed; nothing else is touched.
    """
    if isinstance(source, str):
        lines: Iterable[str] = source.splitlines()
    else:
        lines = source
    for number, line in enumerate(lines, start=1):
        yield number, line.rstrip("\r\n")


def join_text(source: LineSource) -> str:
    """Whole-document parsers (XML, tables) need the text in one piece."""
    if isinstance(source, str):
        return source
    return "\n".join(line.rstrip("\r\n") for line in source)


def clip(text: str, limit: int = MAX_EVIDENCE_TEXT) -> str:
    """Evidence text short enough to quote, marked when it was cut."""
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


_NUMBER = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")


def to_number(text: str | None) -> int | float | None:
    """Read an integer or float the way tools print them; ``N/A`` and the like are None."""
    if text is None:
        return None
    value = text.strip().replace(",", "")
    if len(value) > 64 or not _NUMBER.match(value):  # int() refuses >4300 digits; no tool prints 64
        return None
    if re.fullmatch(r"[+-]?\d+", value):
        return int(value)
    return float(value)


@dataclass(frozen=True)
class Kind:
    """One kind of evidence spikeops can read.

    ``detect`` looks at the head of an input (at most 64 KiB of text) and returns a score in
    [0, 1]: 0 is "certainly not mine", 1 is "certainly mine". Detection is by content, never
    by file name, because operators rename files and tools get wrapped in scripts.
    ``summarize`` turns a parse result into a few readable lines for ``spikeops parse``.
    """

    name: str
    description: str
    command: str | None
    parse: Callable[[Any], Any]
    detect: Callable[[str], float]
    summarize: Callable[[Any], list[str]]
    streaming: bool = False
    aliases: tuple[str, ...] = field(default=())
    #: For kinds captured as a directory tree (sysfs): renders the tree as the text the
    #: parser reads, or returns None when the directory is not of this kind.
    from_directory: Callable[[Path], str | None] | None = None
    #: ``parse`` takes the file's bytes (a binary format such as a pickle): the reader hands
    #: it the raw file, up to a cap, instead of decoded text.
    binary: bool = False
    #: Detection on the raw head (up to 64 KiB of bytes) for inputs that are not text;
    #: ``detect`` still judges text heads.
    detect_bytes: Callable[[bytes], float] | None = None


_REGISTRY: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add a kind to the registry; a second registration under one name is a bug."""
    for name in (kind.name, *kind.aliases):
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not kind:
            raise ValueError(f"evidence kind {name!r} registered twice")
        _REGISTRY[name] = kind
    return kind


def _registry() -> dict[str, Kind]:
    return _REGISTRY


@dataclass(frozen=True)
class RemoteProbe:
    """How the collector captures one kind of evidence on a node: the command beside the
    parser that reads its output, so a change of command and of parser land together.

    ``command`` is POSIX sh run on the node. It may use ``{files}`` (the job's log files,
    from the inventory template named by ``needs``), ``{iface}`` (for ``per_interface``
    probes) and ``$SPIKEOPS_SYSFS`` (``/sys`` unless the node's environment moves it, as
    containers that mount the host's sysfs elsewhere do). ``keep`` says which end of an
    output longer than the cap is worth keeping: the head of a report, the tail of a log
    (the collector pipes a ``keep="tail"`` probe through ``tail -c`` on the node).
    ``unpack`` names a folder of the node's bundle directory: the probe prints a tar archive
    of files (the job's flight recorder dumps, one stack per process) that the collector
    unpacks there (regular files only, plain names). ``baseline=False`` probes are not run
    for a baseline capture (what a hang leaves behind means nothing at job start).
    """

    name: str
    filename: str
    command: str
    kind: str
    order: int
    max_bytes: int = 16 << 20
    keep: str = "head"
    needs: str | None = None
    per_interface: bool = False
    unpack: str | None = None
    baseline: bool = True


_REMOTE: dict[str, RemoteProbe] = {}


def register_remote(probe: RemoteProbe) -> RemoteProbe:
    if probe.name in _REMOTE and _REMOTE[probe.name] is not probe:
        raise ValueError(f"remote probe {probe.name!r} registered twice")
    _REMOTE[probe.name] = probe
    return probe


def remote_probes() -> list[RemoteProbe]:
    """Registered remote probes in collection order (modules must be imported first)."""
    return sorted(_REMOTE.values(), key=lambda probe: probe.order)
