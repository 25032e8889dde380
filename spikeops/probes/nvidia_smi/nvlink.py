"""``nvidia-smi nvlink -s``: per-GPU NVLink speeds and inactive links."""

from __future__ import annotations

import re

from spikeops.probes.base import (
    LineSource,
    clip,
    numbered_lines,
)
from spikeops.probes.nvidia_smi.model import (
    _MAX_ROW,
    _head,
    NvlinkGpu,
    NvlinkLink,
    NvlinkStatus,
    SmiMessage,
    _Gaps,
    _SMI_ERROR,
    _count,
    _snake,
    _text,
)

__all__ = ["parse_nvlink_status", "detect_nvlink"]


# --------------------------------------------------------------------------- nvlink -s



_NVLINK_GPU = re.compile(r"^GPU\s+(?P<index>\d{1,4}):\s*(?P<name>.*?)\s*(?:\(UUID:\s*(?P<uuid>[^)]*)\))?\s*$")
_NVLINK_LINK = re.compile(r"^\s*Link\s+(?P<link>\d{1,4})\s*:\s*(?P<rest>.*?)\s*$")
_LINK_SPEED = re.compile(r"^(?P<speed>\d{1,9}(?:\.\d{1,9})?)\s*GB/s$", re.I)
_LINK_COUNTER = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9 _-]*?)\s*:\s*(?P<value>\S+)$")


def parse_nvlink_status(source: LineSource) -> NvlinkStatus:
    """Read ``nvidia-smi nvlink -s``: per GPU, each link's speed or ``<inactive>``."""
    status = NvlinkStatus()
    gaps = _Gaps(status.gaps)
    current: NvlinkGpu | None = None
    for number, line in numbered_lines(source):
        stripped = line.strip()
        if not stripped:
            continue
        if len(stripped) > _MAX_ROW:
            gaps.add(f"line of {len(stripped)} characters is not an nvlink status line", number)
            continue
        header = _NVLINK_GPU.match(stripped)
        if header and not line[0].isspace():
            current = NvlinkGpu(
                index=int(header["index"]),
                name=_text(header["name"]),
                uuid=_text(header["uuid"]),
                line=number,
            )
            status.gpus.append(current)
            continue
        link = _NVLINK_LINK.match(line)
        if link and current is not None:
            _add_link(current, int(link["link"]), link["rest"], stripped, number, gaps)
            continue
        if _SMI_ERROR.match(stripped):
            status.errors.append(SmiMessage(clip(stripped), number))
        else:
            gaps.add(f"not an nvlink status line: {clip(stripped, 80)!r}", number)
    if not status.gpus and not status.errors:
        gaps.add("no nvidia-smi nvlink output found")
    gaps.close()
    return status


def _add_link(gpu: NvlinkGpu, index: int, rest: str, raw: str, number: int, gaps: _Gaps) -> None:
    speed = _LINK_SPEED.match(rest)
    if speed:
        gpu.links.append(NvlinkLink(index, float(speed["speed"]), True, raw=clip(raw), line=number))
        return
    if rest.strip("<> ").lower() == "inactive":
        gpu.links.append(NvlinkLink(index, None, False, raw=clip(raw), line=number))
        return
    counter = _LINK_COUNTER.match(rest)
    if counter:  # ``nvlink -e``: several counter lines per link
        existing = next((link for link in gpu.links if link.link == index), None)
        if existing is None:
            existing = NvlinkLink(index, raw=clip(raw), line=number)
            gpu.links.append(existing)
        existing.counters[_snake(counter["name"])] = _count(counter["value"])
        return
    gaps.add(f"link state not understood: {clip(raw, 80)!r}", number)


def detect_nvlink(sample: str) -> float:
    head = _head(sample)
    if re.search(r"^GPU \d{1,4}: [^\n]{0,200}\(UUID: [^)\n]{0,80}\)[ \t]*$", head, re.M) and re.search(
        r"^\s+Link \d+: ", head, re.M
    ):
        return 0.9
    return 0.0
