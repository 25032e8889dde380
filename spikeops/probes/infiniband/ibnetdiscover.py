"""``ibnetdiscover -p``: every link of the fabric, and the ones below their peers' rate."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from spikeops.probes.base import Gap, LineSource, clip, numbered_lines
from spikeops.probes.infiniband.model import (
    _nonblank,
    _usual_rate,
)

__all__ = ["IbLink", "IbLinks", "parse_ibnetdiscover_ports", "summarize_ibnetdiscover", "detect_ibnetdiscover"]


# --------------------------------------------------------------------------------------
# ibnetdiscover -p
# --------------------------------------------------------------------------------------

#: Per-lane data rate in Gb/s (ibnetdiscover's speed words).
_LANE_GBPS = {
    "SDR": 2.5, "DDR": 5.0, "QDR": 10.0, "FDR10": 10.0, "FDR": 14.0,
    "EDR": 25.0, "HDR": 50.0, "NDR": 100.0, "XDR": 200.0,
}
_NODE = r"(?:CA|SW|RT|\?\?)"
_END = r"(?P<{p}type>" + _NODE + r")\s+(?P<{p}lid>\d+)\s+(?P<{p}port>\d+)\s+(?P<{p}guid>0x[0-9a-fA-F]+)"
_LINK_ROW = re.compile(
    r"^\s*" + _END.format(p="f") + r"\s+(?P<width>\d+x|\?\?\?)\s+(?P<speed>[A-Z0-9]+|\?\?\?)"
    r"(?:\s+-\s+" + _END.format(p="t") + r"\s+\(\s*'(?P<fname>.*)'\s+-\s+'(?P<tname>.*)'\s*\)"
    r"|\s+'(?P<uname>.*)'|\s+(?P<bare>\S.*?))?\s*$"
)


@dataclass
class IbLink:
    """One row of ``ibnetdiscover -p``: a port, its negotiated width/speed, and its peer.

    Every cable appears twice (once from each end). ``width``/``speed`` are as printed
    (``4x``, ``EDR``), None for ``???``; ``rate_gbps`` is their product. ``unlinked``: no
    peer on the other end. ``degraded``: a linked port below the usual width/speed of its
    kind of link (CA-SW or SW-SW) in this fabric; an unlinked port's speed is whatever its
    PortInfo holds (``4x SDR`` on unused or split ports) and is never called degraded.
    """

    from_type: str
    from_lid: int
    from_port: int
    from_guid: str
    width: str | None
    speed: str | None
    to_type: str | None = None
    to_lid: int | None = None
    to_port: int | None = None
    to_guid: str | None = None
    from_name: str | None = None
    to_name: str | None = None
    rate_gbps: float | None = None
    unlinked: bool = False
    degraded: bool = False
    line: int = 0
    text: str = ""


@dataclass
class IbLinks:
    links: list[IbLink] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def degraded(self) -> list[IbLink]:
        return [link for link in self.links if link.degraded]

    def unlinked(self) -> list[IbLink]:
        return [link for link in self.links if link.unlinked]


def _link_rate(width: str | None, speed: str | None) -> float | None:
    if width is None or speed is None or speed not in _LANE_GBPS:
        return None
    return int(width[:-1]) * _LANE_GBPS[speed]


def _link_from_match(match: re.Match[str], number: int, line: str) -> IbLink:
    width = None if match["width"] == "???" else match["width"]
    speed = None if match["speed"] == "???" else match["speed"]
    linked = match["ttype"] is not None
    return IbLink(
        from_type=match["ftype"],
        from_lid=int(match["flid"]),
        from_port=int(match["fport"]),
        from_guid=match["fguid"],
        width=width,
        speed=speed,
        to_type=match["ttype"],
        to_lid=int(match["tlid"]) if linked else None,
        to_port=int(match["tport"]) if linked else None,
        to_guid=match["tguid"],
        from_name=match["fname"] if linked else (match["uname"] or match["bare"]),
        to_name=match["tname"],
        rate_gbps=_link_rate(width, speed),
        unlinked=not linked,
        line=number,
        text=clip(line),
    )


def _mark_degraded(links: list[IbLink]) -> None:
    """Flag linked ports below the usual rate of their link kind (CA-SW, SW-SW).

    Links are compared within their kind so HCAs cabled at HDR100 (``2x HDR``) are not
    called degraded next to ``4x HDR`` switch-to-switch links; a kind seen only once is
    compared with the whole fabric.
    """
    linked = [link for link in links if not link.unlinked and link.rate_gbps is not None]
    by_kind: dict[frozenset[str | None], list[float]] = {}
    for link in linked:
        by_kind.setdefault(frozenset((link.from_type, link.to_type)), []).append(link.rate_gbps or 0.0)
    fabric = _usual_rate([link.rate_gbps or 0.0 for link in linked])
    for link in linked:
        peers = by_kind[frozenset((link.from_type, link.to_type))]
        normal = _usual_rate(peers) if len(peers) >= 2 else fabric
        link.degraded = normal is not None and (link.rate_gbps or 0.0) < normal


def parse_ibnetdiscover_ports(source: LineSource) -> IbLinks:
    """Read ``ibnetdiscover -p`` (``--ports``) rows; other lines become gaps.

    Node names are quoted by current versions and bare in old ones (``Infiniscale-IV
    Mellanox Technologies``); both are read.
    """
    result = IbLinks()
    for number, line in numbered_lines(source):
        if not line.strip():
            continue
        match = _LINK_ROW.match(line)
        if not match or (match["bare"] or "").startswith("-"):  # a peer half we could not read
            result.gaps.append(Gap(f"not an ibnetdiscover -p row: {clip(line, 100)!r}", number))
            continue
        result.links.append(_link_from_match(match, number, line))
    _mark_degraded(result.links)
    if not result.links:
        result.gaps.append(Gap("no ibnetdiscover port rows found"))
    return result


def _usual_link(links: Sequence[IbLink]) -> str | None:
    counts = Counter(f"{x.width} {x.speed}" for x in links if not x.unlinked and x.rate_gbps is not None)
    return counts.most_common(1)[0][0] if counts else None


def summarize_ibnetdiscover(result: IbLinks) -> list[str]:
    links = result.links
    linked = [link for link in links if not link.unlinked]
    lines = [
        f"{len(links)} port rows: {len(linked)} linked ({len(linked) // 2} cables if every link "
        f"is listed from both ends), {len(result.unlinked())} unlinked; usual link {_usual_link(links)}"
    ]
    for link in result.degraded():
        lines.append(
            f"  DEGRADED {link.from_type} lid {link.from_lid} port {link.from_port} "
            f"({link.from_name}) -> {link.to_name}: {link.width} {link.speed} (line {link.line})"
        )
    for link in result.unlinked():
        lines.append(
            f"  unlinked {link.from_type} lid {link.from_lid} port {link.from_port} "
            f"({link.from_name}): {link.width or '???'} {link.speed or '???'}"
        )
    return lines


def detect_ibnetdiscover(sample: str) -> float:
    lines = _nonblank(sample)
    rows = sum(1 for line in lines if _LINK_ROW.match(line))
    if not rows:
        return 0.0
    linked = sum(1 for line in lines if " - " in line and _LINK_ROW.match(line))
    share = rows / len(lines)
    if share >= 0.8 and linked:
        return 0.9
    return 0.5 if share >= 0.5 else 0.2
