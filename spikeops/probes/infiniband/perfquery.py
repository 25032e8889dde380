"""``perfquery``: a port's counters as the subnet manager's tools print them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from spikeops.probes.base import Gap, LineSource, clip, numbered_lines

__all__ = ["PerfQueryBlock", "PerfQuery", "parse_perfquery", "summarize_perfquery", "detect_perfquery"]


# --------------------------------------------------------------------------------------
# perfquery
# --------------------------------------------------------------------------------------


@dataclass
class PerfQueryBlock:
    """One ``# <title> counters: Lid N port M`` block.

    ``title`` is what precedes ``counters:`` (``Port extended``, ``Port``,
    ``PortRcvErrorDetails``). Counter values are ints when printed in decimal and the
    printed string when in hex (``CounterSelect: 0x0000`` is a select mask, not a count).
    ``port`` is None for "all ports" aggregates that do not print a number.
    """

    title: str
    lid: int | None
    port: int | None
    counters: dict[str, int | str] = field(default_factory=dict)
    cap_mask: str | None = None
    target: str = ""
    line: int = 0
    text: str = ""


@dataclass
class PerfQuery:
    blocks: list[PerfQueryBlock] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def block(self, title: str, port: int | None = None) -> PerfQueryBlock | None:
        return next(
            (b for b in self.blocks if b.title == title and (port is None or b.port == port)), None
        )


_PQ_HEADER = re.compile(
    r"^#\s*(?P<title>[^:#]*?)\s*counters:\s*(?P<target>.*?)"
    r"\s+(?:port\s+(?P<port>\d+)|all ports)\b(?P<rest>.*)$"
)
_PQ_COUNTER = re.compile(r"^\s*(?P<name>[A-Za-z][\w\[\]]*):\.*\s*(?P<value>\S.*?)\s*$")
_PQ_CAPMASK = re.compile(r"CapMask:\s*(?P<mask>0x[0-9a-fA-F]+)")
_PQ_LID = re.compile(r"\bLid\s+(?P<lid>\d+)")
#: perfquery's error/congestion counters (current and infiniband-diags 1.4 names).
_PQ_ERROR = re.compile(r"Error|Discard|Downed|Recover", re.I)
_PQ_CONGESTION = re.compile(r"XmitWait|XmtWait|Congestion", re.I)


def _perf_value(text: str) -> int | str | None:
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"0x[0-9a-fA-F]+", text):
        return text
    return None


def parse_perfquery(source: LineSource) -> PerfQuery:
    """Read ``perfquery``, ``perfquery -x`` and the other ``# ... counters:`` dumps
    (``-E`` PortRcvErrorDetails, ``-D`` ...). Several blocks may follow one another (one per
    port, or one per LID when a script loops); each keeps its own header line for citing."""
    result = PerfQuery()
    block: PerfQueryBlock | None = None
    for number, line in numbered_lines(source):
        stripped = line.strip()
        if not stripped:
            continue
        header = _PQ_HEADER.match(stripped)
        if header:
            lid = _PQ_LID.search(header["target"])
            cap = _PQ_CAPMASK.search(header["rest"])
            block = PerfQueryBlock(
                title=header["title"],
                lid=int(lid["lid"]) if lid else None,
                port=int(header["port"]) if header["port"] else None,
                cap_mask=cap["mask"] if cap else None,
                target=header["target"],
                line=number,
                text=clip(line),
            )
            result.blocks.append(block)
            continue
        counter = _PQ_COUNTER.match(line)
        value = _perf_value(counter["value"]) if counter else None
        if counter is None or value is None:
            result.gaps.append(Gap(f"not a perfquery line: {clip(stripped, 100)!r}", number))
            continue
        if block is None:
            result.gaps.append(Gap("counters before any '# ... counters:' header", number))
            block = PerfQueryBlock(title="", lid=None, port=None, line=number, text=clip(line))
            result.blocks.append(block)
        block.counters[counter["name"]] = value
    if not result.blocks:
        result.gaps.append(Gap("no perfquery counters found"))
    return result


def summarize_perfquery(result: PerfQuery) -> list[str]:
    lines = [f"{len(result.blocks)} perfquery blocks"]
    for block in result.blocks:
        errors = {
            k: v for k, v in block.counters.items()
            if isinstance(v, int) and v and _PQ_ERROR.search(k) and not k.startswith("CounterSelect")
        }
        waits = {
            k: v for k, v in block.counters.items() if isinstance(v, int) and v and _PQ_CONGESTION.search(k)
        }
        where = f"{block.title or '?'} lid {block.lid} port {block.port}"
        lines.append(f"  {where}: {len(block.counters)} counters")
        for name, value in {**errors, **waits}.items():
            kind = "congestion" if name in waits else "errors"
            lines.append(f"    {kind}: {name} = {value:,}")
    return lines


def detect_perfquery(sample: str) -> float:
    if re.search(r"^#\s*[^:#\n]*counters:\s*(?:Lid|DR path|GUID)\b.*?(?:port \d+|all ports)", sample, re.M):
        return 0.95
    return 0.0
