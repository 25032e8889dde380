"""NCCL versions: every form they are printed in, and ``nccl-version.txt``."""

from __future__ import annotations

import re
from spikeops.probes.base import Gap, LineSource, clip, numbered_lines
from spikeops.probes.nccl_log.model import (
    NcclVersion,
)

__all__ = ["normalise_version", "parse_version", "detect_version", "summarize_version"]


# --------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------

_TUPLE_VERSION = re.compile(r"\(\s*(\d{1,2})\s*,\s*(\d{1,3})\s*,\s*(\d{1,3})\s*\)")
_DOTTED_VERSION = re.compile(r"(?<![\d.])v?(\d{1,2})\.(\d{1,3})\.(\d{1,3})(?!\.?\d)")
_DOTTED_IN_NAME = re.compile(r"(?<!\d)(\d{1,2})\.(\d{1,3})\.(\d{1,3})(?!\.?\d)")
_INT_CODE = re.compile(r"\s*(\d{4,5})\s*")


def _from_code(code: int) -> str | None:
    """``NCCL_VERSION_CODE`` as old torch returns it: ``X*1000+Y*100+Z`` before 2.9
    (2708 → 2.7.8), ``X*10000+Y*100+Z`` from 2.9 on (21805 → 2.18.5)."""
    if 2000 <= code <= 2899:
        return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"
    if 20900 <= code <= 39999:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return None


def normalise_version(text: str) -> str | None:
    """``"2.18.5"`` from any way a node states its NCCL version, None when it states none.

    Accepts ``2.18.5``, ``2.18.5+cuda12.2``, ``(2, 18, 5)``, ``NCCL version 2.18.5+cuda12.2``,
    ``libnccl.so.2.18.5`` and the integer code old torch returns (``21805``, ``2708``). The
    CUDA suffix is dropped so a log line and the version file compare equal.
    """
    if not isinstance(text, str):
        return None
    text = text[:4096]
    match = _TUPLE_VERSION.search(text)
    if match is None:
        match = _DOTTED_VERSION.search(text)
    if match is None and "libnccl" in text:
        match = _DOTTED_IN_NAME.search(text.split("libnccl", 1)[1])
    if match is not None:
        major, minor, patch = (int(part) for part in match.groups())
        if 1 <= major <= 9:
            return f"{major}.{minor}.{patch}"
        return None
    code = _INT_CODE.fullmatch(text)
    if code is not None:
        return _from_code(int(code[1]))
    return None


# --------------------------------------------------------------------------------------
# nccl-version.txt
# --------------------------------------------------------------------------------------

_STRICT_VERSION_FORMS = re.compile(
    r"v?[1-3]\.\d{1,2}\.\d{1,2}(?:[+-][\w.+-]*)?"
    r"|\(\s*[1-3]\s*,\s*\d{1,2}\s*,\s*\d{1,2}\s*\)"
    r"|NCCL version:?\s*v?[1-3]\.\d{1,2}\.\d{1,2}\S*"
    r"|.*\blibnccl\.so\.[1-3]\.\d{1,2}\.\d{1,2}\b.*"
)
_MAX_VERSION_LINES = 1000


def parse_version(source: LineSource) -> NcclVersion:
    """Read ``nccl-version.txt``: the first line stating a version in one of the known forms
    wins; a second, different version or a file stating none becomes a gap."""
    best: tuple[int, int, str, str] | None = None  # (priority, line, raw, version)
    versions: dict[str, int] = {}
    last_text = ""
    gaps: list[Gap] = []
    try:
        for number, line in numbered_lines(source):
            if number > _MAX_VERSION_LINES:
                gaps.append(Gap(f"only the first {_MAX_VERSION_LINES} lines read", number))
                break
            text = line.strip()
            if not text:
                continue
            last_text = text
            version = normalise_version(text)
            if version is None:
                continue
            if _STRICT_VERSION_FORMS.fullmatch(text) or _INT_CODE.fullmatch(text):
                priority = 0
            elif "nccl" in text.lower():
                priority = 1
            else:
                priority = 2
            versions.setdefault(version, number)
            if best is None or priority < best[0]:
                best = (priority, number, text, version)
    except Exception as exc:
        gaps.append(Gap(f"input ended early ({type(exc).__name__})"))
    if best is None:
        gaps.append(Gap(f"no NCCL version found: {last_text[:120]!r}" if last_text else "empty file"))
        return NcclVersion(version=None, raw=clip(last_text), line=None, gaps=gaps)
    for version, number in versions.items():
        if version != best[3]:
            gaps.append(Gap(f"another NCCL version {version} ignored", number))
    return NcclVersion(version=best[3], raw=clip(best[2]), line=best[1], gaps=gaps)


def detect_version(sample: str) -> float:
    """Only a tiny file that is nothing but a version in a known form; a bare integer code
    is a weak guess (many one-number files exist)."""
    if len(sample) > 1024:
        return 0.0
    lines = [line.strip() for line in sample.splitlines() if line.strip()]
    if not lines or len(lines) > 5:
        return 0.0
    score = 0.0
    for line in lines:
        if _STRICT_VERSION_FORMS.fullmatch(line) and normalise_version(line):
            score = max(score, 0.9)
        elif _INT_CODE.fullmatch(line) and normalise_version(line):
            score = max(score, 0.45)
    return score


def summarize_version(result: NcclVersion) -> list[str]:
    if result.version is None:
        return [f"no NCCL version read ({result.gaps[0].reason if result.gaps else 'empty'})"]
    return [f"NCCL {result.version} (line {result.line}: {result.raw})"]
