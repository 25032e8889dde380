"""``ibswinfo``: an unmanaged switch's PSUs, fans and temperature."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from spikeops.probes.base import Gap, LineSource, clip, numbered_lines

__all__ = ["SwitchInfo", "parse_ibswinfo", "summarize_ibswinfo", "detect_ibswinfo"]


# --------------------------------------------------------------------------------------
# ibswinfo
# --------------------------------------------------------------------------------------


@dataclass
class SwitchInfo:
    """``ibswinfo -d lid-N``: an unmanaged switch's inventory and vitals.

    ``fields`` holds every top-level ``key | value`` as printed; ``psus`` one dict per power
    supply (``index``, ``status`` and its indented sub-fields as printed, plus ``power_w``).
    ``fans_rpm`` maps fan number to rpm. ``uptime_s`` is ``96d-01:55:47`` in seconds.
    """

    title: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    psus: list[dict[str, str | int | None]] = field(default_factory=list)
    temperature_c: int | None = None
    max_temperature_c: int | None = None
    module_temperatures_c: dict[int, int] = field(default_factory=dict)
    fans_rpm: dict[int, int] = field(default_factory=dict)
    fan_status: str | None = None
    uptime_s: int | None = None
    gaps: list[Gap] = field(default_factory=list)


_SW_KV = re.compile(r"^(?P<indent>\s*)(?P<key>\S.*?)\s+(?P<sep>\||:)\s+(?P<value>.*?)\s*$")
_SW_SEPARATOR = re.compile(r"^\s*(?:-{5,}|={5,})\s*$")
_SW_PSU = re.compile(r"^PSU(?P<index>\d+) status$|^psu(?P<index2>\d+)\.(?P<sub>.+)$", re.I)
_SW_FAN = re.compile(r"^fan#(?P<index>\d+)(?:\.speed)? \(rpm\)$")
_SW_QSFP = re.compile(r"^QSFP#(?P<index>\d+)(?:\.temp)? \(C\)$")
_SW_UPTIME = re.compile(r"^(?P<d>\d+)d-(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)$")


def _sw_int(value: str) -> int | None:
    return int(value) if re.fullmatch(r"-?\d+", value.strip()) else None


def _sw_uptime(key: str, value: str) -> int | None:
    match = _SW_UPTIME.match(value.strip())
    if match:
        return int(match["d"]) * 86400 + int(match["h"]) * 3600 + int(match["m"]) * 60 + int(match["s"])
    return _sw_int(value) if "sec" in key else None


def _psu(info: SwitchInfo, index: int) -> dict[str, str | int | None]:
    for psu in info.psus:
        if psu["index"] == index:
            return psu
    psu: dict[str, str | int | None] = {"index": index}
    info.psus.append(psu)
    return psu


def _sw_psu_field(psu: dict[str, str | int | None], key: str, value: str) -> None:
    psu[key] = value
    if "power" in key.lower() and "(w)" in key.lower():
        psu["power_w"] = _sw_int(value)


def _sw_top_field(info: SwitchInfo, key: str, value: str, number: int) -> None:
    """A top-level key: vitals get typed fields, everything stays in ``fields``."""
    info.fields[key] = value
    lowered = key.lower()
    fan = _SW_FAN.match(key)
    qsfp = _SW_QSFP.match(key)
    if fan:
        rpm = _sw_int(value)
        if rpm is None:
            info.gaps.append(Gap(f"fan #{fan['index']} rpm not a number: {clip(value, 40)!r}", number))
        else:
            info.fans_rpm[int(fan["index"])] = rpm
    elif qsfp:
        temperature = _sw_int(value)
        if temperature is not None:
            info.module_temperatures_c[int(qsfp["index"])] = temperature
    elif lowered in ("temperature (c)", "cur.temp (c)"):
        info.temperature_c = _sw_int(value)
    elif lowered in ("max temp (c)", "max.temp (c)"):
        info.max_temperature_c = _sw_int(value)
    elif lowered in ("fan status", "fans"):
        info.fan_status = value or None
    elif lowered.startswith("uptime"):
        info.uptime_s = _sw_uptime(lowered, value)


def parse_ibswinfo(source: LineSource) -> SwitchInfo:
    """Read ibswinfo's full report (``key | value``) and its ``-o`` forms (``key : value``).

    Indented lines after ``PSUn status`` belong to that power supply (their names, such as
    ``fan status``, repeat top-level names, so indentation is what tells them apart).
    """
    info = SwitchInfo()
    psu: dict[str, str | int | None] | None = None
    seen_title_rule = False
    for number, line in numbered_lines(source):
        if not line.strip():
            continue
        if _SW_SEPARATOR.match(line):
            seen_title_rule = seen_title_rule or line.strip().startswith("=")
            psu = None
            continue
        kv = _SW_KV.match(line)
        if not kv:
            if seen_title_rule and info.title is None and not info.fields:
                info.title = line.strip()
            else:
                info.gaps.append(Gap(f"not an ibswinfo line: {clip(line, 100)!r}", number))
            continue
        key, value = kv["key"], kv["value"]
        if kv["indent"] and psu is not None:
            _sw_psu_field(psu, key, value)
            continue
        psu_match = _SW_PSU.match(key)
        if psu_match and psu_match["index"] is not None:
            psu = _psu(info, int(psu_match["index"]))
            psu["status"] = value
            continue
        if psu_match and psu_match["index2"] is not None:  # ``-o`` form: psu0.status : OK
            _sw_psu_field(_psu(info, int(psu_match["index2"])), psu_match["sub"], value)
            continue
        psu = None
        _sw_top_field(info, key, value, number)
    if not info.fields and not info.psus:
        info.gaps.append(Gap("no ibswinfo fields found"))
    return info


def summarize_ibswinfo(info: SwitchInfo) -> list[str]:
    name = info.fields.get("part number") or info.fields.get("part_number") or "?"
    firmware = info.fields.get("firmware version") or info.fields.get("fw_version") or "?"
    lines = [
        f"switch {info.title or '?'} {name}, firmware {firmware}, uptime {info.uptime_s} s, "
        f"temperature {info.temperature_c} C (max {info.max_temperature_c} C), "
        f"{len(info.psus)} PSUs, {len(info.fans_rpm)} fans"
    ]
    for psu in info.psus:
        bad = {k: v for k, v in psu.items() if isinstance(v, str) and v.upper() == "ERROR"}
        if bad or str(psu.get("status", "OK")).upper() not in ("OK", ""):
            lines.append(f"  PSU{psu['index']}: {psu}")
    if info.fan_status and info.fan_status.upper() != "OK":
        lines.append(f"  fan status: {info.fan_status}")
    for fan, rpm in info.fans_rpm.items():
        if rpm == 0:
            lines.append(f"  fan #{fan} stopped (0 rpm)")
    return lines


def detect_ibswinfo(sample: str) -> float:
    if re.search(r"^PSU\d+ status\s+\|", sample, re.M) or re.search(r"^part number\s+\|", sample, re.M):
        return 0.9
    return 0.0
