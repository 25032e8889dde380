"""What every InfiniBand tool is read into: port states and physical states in ibstat's words,
rates, and the peer comparison that finds a port below its peers."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

__all__ = ["normalise_state", "normalise_phys_state", "parse_rate"]

T = TypeVar("T")


# --------------------------------------------------------------------------------------
# Shared vocabulary
# --------------------------------------------------------------------------------------

#: Kernel port states (drivers/infiniband/core/sysfs.c) in ibstat's words.
_STATE_WORDS = {
    "NOP": "Nop",
    "DOWN": "Down",
    "INIT": "Initializing",
    "INITIALIZING": "Initializing",
    "ARMED": "Armed",
    "ACTIVE": "Active",
    "ACTIVE_DEFER": "ActiveDefer",
    "ACTIVEDEFER": "ActiveDefer",
}
_STATE_CODES = {0: "Nop", 1: "Down", 2: "Initializing", 3: "Armed", 4: "Active", 5: "ActiveDefer"}
#: Physical states as both ibstat and the kernel spell them (``Phy Test`` in some kernels).
_PHYS_WORDS = {
    "sleep": "Sleep",
    "polling": "Polling",
    "disabled": "Disabled",
    "portconfigurationtraining": "PortConfigurationTraining",
    "linkup": "LinkUp",
    "linkerrorrecovery": "LinkErrorRecovery",
    "phytest": "PhyTest",
}
_PHYS_CODES = {
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "PhyTest",
}
_UNKNOWN_WORDS = {"", "???", "<unknown>", "unknown", "n/a", "na"}

_CODE_WORD = re.compile(r"^\s*(?:(?P<code>\d+)\s*:\s*)?(?P<word>.*?)\s*$")


def _normalise(text: str | None, codes: dict[int, str], by_word: Callable[[str], str]) -> str | None:
    """``4: ACTIVE`` / ``ACTIVE`` / ``4`` -> the canonical word; an unknown word stays as printed."""
    if text is None:
        return None
    match = _CODE_WORD.match(text)
    if not match:
        return None
    word = match["word"]
    if word.isdigit():
        return codes.get(int(word), word)
    if word.lower() in _UNKNOWN_WORDS:
        return codes.get(int(match["code"])) if match["code"] else None
    return by_word(word)


def normalise_state(text: str | None) -> str | None:
    """``4: ACTIVE`` (sysfs, ibstatus), ``ACTIVE`` or ``Active`` (ibstat) -> ``Active``.

    One vocabulary across tools lets the diagnosis ask "is it Active" once; an unknown word
    is kept as printed so nothing new is silently mapped to a wrong state.
    """
    return _normalise(text, _STATE_CODES, lambda word: _STATE_WORDS.get(word.upper().replace(" ", "_"), word))


def normalise_phys_state(text: str | None) -> str | None:
    """``5: LinkUp`` / ``LinkUp`` -> ``LinkUp``; ``Phy Test`` -> ``PhyTest``."""
    return _normalise(text, _PHYS_CODES, lambda word: _PHYS_WORDS.get(word.replace(" ", "").lower(), word))


_RATE = re.compile(r"^\s*(?P<gbps>\d+(?:\.\d+)?)\s*(?:Gb/sec)?\s*(?:\((?P<text>[^)]*)\))?\s*$")


def parse_rate(text: str | None) -> tuple[float | None, str | None]:
    """``200`` (ibstat), ``200 Gb/sec (4X HDR)`` (sysfs) -> ``(200.0, "4X HDR")``.

    The kernel prints SDR links without a speed word (``10 Gb/sec (4X)``) and half rates as
    ``2.5``, so the number is a float and the parenthesis is optional.
    """
    if text is None:
        return None, None
    match = _RATE.match(text)
    if not match:
        return None, None
    inner = match["text"]
    return float(match["gbps"]), (inner.strip() or None) if inner is not None else None


def _int_auto(text: str) -> int | None:
    """Lids are decimal in ibstat and ``0x33bf`` in sysfs/ibstatus."""
    value = text.strip()
    try:
        if value.lower().startswith("0x"):
            return int(value, 16)
        if re.fullmatch(r"\d+", value):
            return int(value)
    except ValueError:
        return None
    return None


def _below_peers(
    items: Sequence[T], group: Callable[[T], Hashable], rate: Callable[[T], float | None]
) -> list[T]:
    """Items whose rate is below the most common rate of their group.

    A link that trained at a lower rate (a bad cable renegotiating to a slower speed or fewer
    lanes) still says Active/LinkUp; only the comparison with its siblings shows it. Groups
    of one say nothing. On a tie the higher rate counts as "normal".
    """
    groups: dict[Hashable, list[tuple[T, float]]] = {}
    for item in items:
        value = rate(item)
        if value is not None:
            groups.setdefault(group(item), []).append((item, value))
    slow: list[T] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        normal = _usual_rate([value for _, value in members])
        slow.extend(item for item, value in members if normal is not None and value < normal)
    return slow


def _usual_rate(rates: Sequence[float]) -> float | None:
    """The most common rate; on a tie the higher one, so a 50/50 split flags the slow half."""
    counts = Counter(rates)
    if not counts:
        return None
    return max(counts, key=lambda value: (counts[value], value))


def _nonblank(sample: str, limit: int = 400) -> list[str]:
    return [line for line in sample.splitlines()[:limit] if line.strip()]


def _rate_label(rate: float | None) -> str:
    if rate is None:
        return "?"
    return f"{rate:g}"
