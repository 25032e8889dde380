"""Reading evidence files without trusting them.

Evidence comes off sick machines: logs cut mid-line by a crash, runs of NUL bytes where a
node died while writing, a Latin-1 line in a UTF-8 log, a multi-gigabyte file, a core dump
named ``train.log``. This module is the one place that opens such files. It refuses what is
not text with a one-line reason, streams the rest line by line with bounded memory, and
counts every repair it made so the caller can report it as a gap instead of hiding it.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from spikeops.errors import InputError
from spikeops.probes.base import Gap

__all__ = ["ReadReport", "open_binary", "sniff", "head_bytes", "read_bytes", "iter_lines", "read_text", "HEAD_BYTES"]

#: How much of a file detection looks at.
HEAD_BYTES = 64 * 1024
#: A longer line is cut: no tool we read prints one, and a binary blob can be one "line".
MAX_LINE_BYTES = 1024 * 1024
#: Whole-document kinds (XML, tables) are read up to this size; more is reported, not read.
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024
PROGRESS_EVERY = 200_000
CHUNK_BYTES = 1024 * 1024

_GZIP_MAGIC = b"\x1f\x8b"
_TEXT_CONTROLS = {0x09, 0x0A, 0x0C, 0x0D, 0x08, 0x1B}


@dataclass
class ReadReport:
    """What reading a file cost and repaired; turned into gaps for the user."""

    path: str
    size: int = 0
    compressed: bool = False
    lines: int = 0
    bytes_read: int = 0
    recoded_lines: int = 0
    long_lines: int = 0
    nul_lines: int = 0
    truncated_at: int | None = None
    unterminated_last_line: bool = False

    def gaps(self) -> list[Gap]:
        gaps = []
        if self.recoded_lines:
            gaps.append(Gap(f"{self.recoded_lines} line(s) were not UTF-8 and were read as Latin-1"))
        if self.long_lines:
            gaps.append(Gap(f"{self.long_lines} line(s) longer than {MAX_LINE_BYTES} bytes were cut"))
        if self.nul_lines:
            gaps.append(Gap(f"{self.nul_lines} line(s) held NUL bytes (a crash while writing?); NULs dropped"))
        if self.truncated_at is not None:
            gaps.append(Gap(f"only the first {self.truncated_at} bytes were read (size limit)"))
        return gaps


def open_binary(path: str | Path) -> BinaryIO:
    """Open a file for reading, transparently decompressing gzip (rotated logs are .gz)."""
    target = Path(path)
    try:
        if target.is_dir():
            raise InputError(f"{target}: is a directory")
        handle = open(target, "rb")  # noqa: SIM115 - returned to the caller
    except FileNotFoundError as exc:
        raise InputError(f"{target}: no such file") from exc
    except PermissionError as exc:
        raise InputError(f"{target}: permission denied") from exc
    except IsADirectoryError as exc:
        raise InputError(f"{target}: is a directory") from exc
    except OSError as exc:
        raise InputError(f"{target}: cannot open ({exc.strerror or exc})") from exc
    magic = handle.read(2)
    handle.seek(0)
    if magic == _GZIP_MAGIC:
        return gzip.GzipFile(fileobj=handle, mode="rb")  # type: ignore[return-value]
    return handle


_CONTROL_BYTES = bytes(b for b in range(0x20) if b not in _TEXT_CONTROLS) + b"\x7f"


def _looks_binary(head: bytes) -> bool:
    if not head:
        return False
    # bytes.translate deletes the control bytes in C; what is gone is what was there.
    controls = len(head) - len(head.translate(None, _CONTROL_BYTES))
    return controls / len(head) > 0.10


def _decode(raw: bytes, report: ReadReport) -> str:
    if b"\x00" in raw:
        report.nul_lines += 1
        raw = raw.replace(b"\x00", b"")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        report.recoded_lines += 1
        return raw.decode("latin-1")


def sniff(path: str | Path, *, decode: bool = True) -> tuple[str, ReadReport]:
    """The head of a file as text, for kind detection; refuses empty and binary files. With
    ``decode`` False only the refusals are checked (the head is "": the kind is known)."""
    report = ReadReport(path=str(path))
    try:
        report.size = Path(path).stat().st_size
    except OSError:
        pass
    head = head_bytes(path, report)
    if _looks_binary(head):
        raise InputError(f"{path}: binary data, not tool output (no parser reads it)")
    if not decode:
        return "", report
    text = "\n".join(_decode(line, report) for line in head.split(b"\n"))
    return text, report


def head_bytes(path: str | Path, report: ReadReport | None = None) -> bytes:
    """The raw head of a file (gzip undone), for detecting binary formats; InputError when
    it cannot be opened or is empty."""
    with open_binary(path) as handle:
        if report is not None:
            report.compressed = isinstance(handle, gzip.GzipFile)
        try:
            head = handle.read(HEAD_BYTES)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise InputError(f"{path}: unreadable ({exc})") from exc
    if not head:
        raise InputError(f"{path}: file is empty")
    return head


def read_bytes(path: str | Path, report: ReadReport | None = None, *, max_bytes: int) -> bytes:
    """A whole binary file, up to ``max_bytes`` (the cut is recorded in ``report``): for
    the formats that are not text (a flight recorder pickle)."""
    report = report if report is not None else ReadReport(path=str(path))
    with open_binary(path) as handle:
        report.compressed = isinstance(handle, gzip.GzipFile)
        try:
            data = handle.read(max_bytes + 1)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise InputError(f"{path}: unreadable ({exc})") from exc
    if len(data) > max_bytes:
        data = data[:max_bytes]
        report.truncated_at = max_bytes
    report.bytes_read = len(data)
    return data


def _read_chunks(handle: BinaryIO, report: ReadReport, max_bytes: int | None) -> Iterator[bytes]:
    """Raw blocks of the file, stopping (and recording it) at ``max_bytes``."""
    while True:
        size = CHUNK_BYTES
        if max_bytes is not None:
            size = min(size, max_bytes - report.bytes_read)
            if size <= 0:
                if handle.read(1):
                    report.truncated_at = report.bytes_read
                return
        try:
            chunk = handle.read(size)
        except (OSError, EOFError, gzip.BadGzipFile):
            report.unterminated_last_line = True  # a cut-off gzip stream: keep what came out
            return
        if not chunk:
            return
        report.bytes_read += len(chunk)
        yield chunk


def _raw_lines(handle: BinaryIO, report: ReadReport, max_bytes: int | None) -> Iterator[list[bytes]]:
    """Batches of complete raw lines (without the newline); overlong lines cut, once."""
    pending = b""
    skipping = False  # inside the rest of an overlong line
    for chunk in _read_chunks(handle, report, max_bytes):
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        if skipping and lines:
            lines = lines[1:]  # the remainder of the cut line ends here
            skipping = False
        if len(pending) > MAX_LINE_BYTES:
            if not skipping:
                report.long_lines += 1
                lines.append(pending[:MAX_LINE_BYTES])
            pending, skipping = b"", True
        if lines:
            yield lines
    if pending and not skipping and report.truncated_at is None:
        report.unterminated_last_line = True
        yield [pending]


def iter_lines(
    path: str | Path,
    report: ReadReport | None = None,
    *,
    max_bytes: int | None = None,
    progress: Callable[[ReadReport], None] | None = None,
) -> Iterator[str]:
    """Stream a file's lines as text, in bounded memory, recording repairs in ``report``.

    Reads in blocks and decodes a block at once when it is clean UTF-8 (the common case,
    several times faster than line by line), falling back to per-line repair otherwise.
    ``progress`` is called every ``PROGRESS_EVERY`` lines, so a terminal can show how far a
    multi-gigabyte log has got.
    """
    report = report if report is not None else ReadReport(path=str(path))
    with open_binary(path) as handle:
        report.compressed = isinstance(handle, gzip.GzipFile)
        for batch in _raw_lines(handle, report, max_bytes):
            block = b"\n".join(batch)
            texts: list[str] | None = None
            if b"\x00" not in block:
                try:
                    texts = block.decode("utf-8").split("\n")
                except UnicodeDecodeError:
                    texts = None
            if texts is None:
                texts = [_decode(raw, report) for raw in batch]
            for text in texts:
                report.lines += 1
                if progress is not None and report.lines % PROGRESS_EVERY == 0:
                    progress(report)
                yield text[:-1] if text.endswith("\r") else text


def read_text(
    path: str | Path,
    report: ReadReport | None = None,
    *,
    max_bytes: int = MAX_DOCUMENT_BYTES,
    progress: Callable[[ReadReport], None] | None = None,
) -> str:
    """A whole document as text, capped at ``max_bytes`` (the cap is reported, not silent)."""
    buffer = io.StringIO()
    for line in iter_lines(path, report, max_bytes=max_bytes, progress=progress):
        buffer.write(line)
        buffer.write("\n")
    return buffer.getvalue()
