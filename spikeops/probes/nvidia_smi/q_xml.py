"""``nvidia-smi -q -x``: the XML report (an internal DTD's entities refused unexpanded)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator

from spikeops.probes.base import (
    LineSource,
    clip,
    join_text,
)
from spikeops.probes.nvidia_smi.model import (
    _power_from_pairs,
    _head,
    EccCounts,
    GpuProcess,
    GpuStatus,
    MigDevice,
    NvidiaSmiReport,
    RemappedRows,
    RetiredPages,
    _Gaps,
    _SRAM_SOURCE_ALIASES,
    _count,
    _finish_ecc,
    _flag,
    _measure,
    _reason_key,
    _set_bit_part,
    _set_bus,
    _set_ecc_field,
    _smi_time,
    _text,
)

__all__ = ["parse_xml", "detect_xml"]


# --------------------------------------------------------------------------- -q -x XML


_DOCTYPE = re.compile(r"<!DOCTYPE\b")
_PLAIN_DOCTYPE = re.compile(
    r"<!DOCTYPE\s+[\w.:-]+(?:\s+(?:SYSTEM|PUBLIC)(?:\s+(?:\"[^\"]*\"|'[^']*'))+)?\s*>"
)


def _blank(text: str) -> str:
    """Keep the newlines of removed text so error positions still point at the right line."""
    return "\n" * text.count("\n")


def _neutralise_doctype(text: str, gaps: _Gaps) -> str:
    """Drop the DOCTYPE before parsing. nvidia-smi's own names an external DTD that is never
    fetched; one with an internal subset may declare entities, which are refused, not
    expanded (their references then fail to parse and become a gap)."""
    match = _DOCTYPE.search(text)
    if match is None:
        if "<!ENTITY" in text:
            line = text[: text.find("<!ENTITY")].count("\n") + 1
            gaps.add("ENTITY declaration outside a DOCTYPE: refused", line)
        return text
    start = match.start()
    line = text[:start].count("\n") + 1
    plain = _PLAIN_DOCTYPE.match(text, start)
    if plain:
        end = plain.end()
    else:
        gaps.add("DOCTYPE with an internal subset (entity declarations) refused, not expanded", line)
        closing = re.compile(r"\]\s*>").search(text, start)
        end = closing.end() if closing else len(text)
    return text[:start] + _blank(text[start:end]) + text[end:]


def _xml_root(text: str, gaps: _Gaps) -> ET.Element | None:
    """Parse as far as the text allows: a truncated or broken document keeps every element
    opened before the break (the partial tree), and the break becomes a gap."""
    parser = ET.XMLPullParser(events=("start",))
    root: ET.Element | None = None

    def drain() -> None:
        nonlocal root
        for _event, element in parser.read_events():
            if root is None:
                root = element

    try:
        parser.feed(text)
        drain()
        parser.close()
        drain()
    except ET.ParseError as exc:
        position = getattr(exc, "position", None)
        line = position[0] if position else None
        gaps.add(f"XML cut short or malformed: {clip(str(exc), 120)}", line)
    except (ValueError, UnicodeError) as exc:  # pragma: no cover - defensive
        gaps.add(f"XML could not be read: {clip(str(exc), 120)}")
    return root


def _tag_lines(text: str, tag: str) -> list[int]:
    """Line numbers of each ``<tag`` opening, in document order (ElementTree keeps none)."""
    lines: list[int] = []
    line, position = 1, 0
    for match in re.finditer(rf"<{tag}[\s>/]", text):
        line += text.count("\n", position, match.start())
        position = match.start()
        lines.append(line)
    return lines


def _x(element: ET.Element | None, *path: str) -> str | None:
    """Text of a descendant by tag path; None when missing (a truncated element counts)."""
    node = element
    for tag in path:
        node = node.find(tag) if node is not None else None
    if node is None or node.text is None:
        return None
    return node.text.strip()


def parse_xml(source: LineSource) -> NvidiaSmiReport:
    """Read ``nvidia-smi -q -x`` (nvsmi_device_v10+ DTDs; old and new ECC/throttle names)."""
    text = join_text(source)
    report = NvidiaSmiReport()
    gaps = _Gaps(report.gaps)
    safe = text.encode("utf-8", "replace").decode("utf-8")
    if safe != text:
        gaps.add("characters that are not valid Unicode were replaced")
    root = _xml_root(_neutralise_doctype(safe, gaps), gaps)
    if root is None:
        gaps.add("no XML document found")
        gaps.close()
        return report
    if root.tag != "nvidia_smi_log":
        gaps.add(f"not nvidia-smi XML: root element <{clip(str(root.tag), 60)}>")
        gaps.close()
        return report
    report.timestamp = _smi_time(_x(root, "timestamp"))
    report.driver_version = _text(_x(root, "driver_version"))
    report.cuda_version = _text(_x(root, "cuda_version"))
    report.attached_gpus = _count(_x(root, "attached_gpus"))
    gpu_lines = _tag_lines(text, "gpu")
    mig_lines = iter(_tag_lines(text, "mig_device"))
    process_lines = iter(_tag_lines(text, "process_info"))
    for index, element in enumerate(root.findall("gpu")):
        line = gpu_lines[index] if index < len(gpu_lines) else None
        report.gpus.append(_gpu_from_xml(element, index, line, mig_lines, process_lines))
    if report.attached_gpus is not None and len(report.gpus) < report.attached_gpus:
        gaps.add(f"{len(report.gpus)} of {report.attached_gpus} attached GPUs in the output")
    gaps.close()
    return report


def _gpu_from_xml(
    element: ET.Element,
    index: int,
    line: int | None,
    mig_lines: Iterator[int],
    process_lines: Iterator[int],
) -> GpuStatus:
    gpu = GpuStatus(index=index, line=line)
    _set_bus(gpu, element.get("id") or _x(element, "pci", "pci_bus_id"))
    gpu.product = _text(_x(element, "product_name"))
    gpu.uuid = _text(_x(element, "uuid"))
    gpu.serial = _text(_x(element, "serial"))
    gpu.minor_number = _count(_x(element, "minor_number"))
    gpu.performance_state = _text(_x(element, "performance_state"))
    gpu.fan_speed_pct = _measure(_x(element, "fan_speed"))
    gpu.ecc_mode = _text(_x(element, "ecc_mode", "current_ecc"))
    gpu.mig_mode = _text(_x(element, "mig_mode", "current_mig"))
    gpu.pcie_replays = _count(_x(element, "pci", "replay_counter"))
    gpu.memory_used_mib = _count(_x(element, "fb_memory_usage", "used"))
    gpu.memory_total_mib = _count(_x(element, "fb_memory_usage", "total"))
    gpu.utilization_gpu_pct = _measure(_x(element, "utilization", "gpu_util"))
    ecc = element.find("ecc_errors")
    if ecc is not None:
        _ecc_from_xml(gpu, ecc)
    retired = element.find("retired_pages")
    if retired is not None:
        gpu.retired_pages = RetiredPages(
            single_bit=_count(_x(retired, "multiple_single_bit_retirement", "retired_count")),
            double_bit=_count(_x(retired, "double_bit_retirement", "retired_count")),
            pending_blacklist=_flag(_x(retired, "pending_blacklist")),
            pending_retirement=_flag(_x(retired, "pending_retirement")),
            line=line,
        )
    remapped = element.find("remapped_rows")
    if remapped is not None and len(remapped):
        gpu.remapped_rows = RemappedRows(
            correctable=_count(_x(remapped, "remapped_row_corr")),
            uncorrectable=_count(_x(remapped, "remapped_row_unc")),
            pending=_flag(_x(remapped, "remapped_row_pending")),
            failure=_flag(_x(remapped, "remapped_row_failure")),
            histogram={
                re.sub(r"^row_remapper_histogram_", "", bank.tag): _count(bank.text)
                for bank in remapped.findall("row_remapper_histogram/*")
            },
            line=line,
        )
    for child in element:
        tag = str(child.tag)
        if re.fullmatch(r"clocks?_(?:event|throttle)_reasons?", tag):
            gpu.clock_event_reasons = {_reason_key(str(r.tag)): _flag(r.text) for r in child}
        elif re.fullmatch(r"clocks?_(?:event|throttle)_reasons?_counters?", tag):
            gpu.clock_event_counters_us = {_reason_key(str(r.tag)): _count(r.text) for r in child}
    temperature = element.find("temperature")
    if temperature is not None:
        for item in temperature:
            key = _XML_TEMPERATURE.get(str(item.tag), str(item.tag))
            if key == "current":
                gpu.temperature_c = _measure(item.text)
            elif key == "memory_current":
                gpu.memory_temperature_c = _measure(item.text)
            else:
                gpu.temperature_thresholds[key] = _measure(item.text)
    power = element.find("gpu_power_readings")
    if power is None:
        power = element.find("power_readings")
    if power is not None:
        _power_from_pairs(gpu, ((str(item.tag), item.text) for item in power))
    for mig in element.findall("mig_devices/mig_device"):
        gpu.mig_devices.append(_mig_from_xml(mig, next(mig_lines, None)))
    for info in element.findall("processes/process_info"):
        gpu.processes.append(
            GpuProcess(
                pid=_count(_x(info, "pid")),
                name=_text(_x(info, "process_name")),
                used_memory_mib=_count(_x(info, "used_memory")),
                type=_text(_x(info, "type")),
                gpu_instance_id=_count(_x(info, "gpu_instance_id")),
                compute_instance_id=_count(_x(info, "compute_instance_id")),
                line=next(process_lines, None),
            )
        )
    return gpu


_XML_TEMPERATURE = {
    "gpu_temp": "current",
    "memory_temp": "memory_current",
    "gpu_temp_tlimit": "tlimit",
    "gpu_temp_max_threshold": "shutdown",
    "gpu_temp_slow_threshold": "slowdown",
    "gpu_temp_max_gpu_threshold": "max_operating",
    "gpu_temp_max_mem_threshold": "memory_max_operating",
    "gpu_target_temperature": "target",
    "gpu_temp_max_tlimit_threshold": "shutdown_tlimit",
    "gpu_temp_slow_tlimit_threshold": "slowdown_tlimit",
    "gpu_temp_max_gpu_tlimit_threshold": "max_operating_tlimit",
    "gpu_temp_max_mem_tlimit_threshold": "memory_max_operating_tlimit",
}


def _ecc_from_xml(gpu: GpuStatus, element: ET.Element) -> None:
    for part in element:
        tag = str(part.tag)
        if tag in ("volatile", "aggregate"):
            ecc = EccCounts()
            for item in part:
                name = str(item.tag)
                if name in ("single_bit", "double_bit"):
                    for bit in item:
                        _set_bit_part(ecc, name == "single_bit", str(bit.tag), bit.text)
                else:
                    _set_ecc_field(ecc, name, item.text)
            _finish_ecc(ecc)
            if tag == "volatile":
                gpu.ecc_volatile = ecc
            else:
                gpu.ecc_aggregate = ecc
        elif tag == "aggregate_uncorrectable_sram_sources":
            target = gpu.ecc_aggregate or EccCounts()
            gpu.ecc_aggregate = target
            for source in part:
                key = re.sub(r"^sram_", "", str(source.tag))
                target.sram_uncorrectable_sources[_SRAM_SOURCE_ALIASES.get(key, key)] = _count(source.text)
        elif not len(part) and _flag(part.text) is not None:
            gpu.ecc_flags[tag] = _flag(part.text)


def _mig_from_xml(element: ET.Element, line: int | None) -> MigDevice:
    sram = next((item.text for item in element.iter("sram_uncorrectable")), None)
    memory = element.find("fb_memory_usage")
    if memory is None:
        memory = element.find("shared_fb_memory_usage")
    return MigDevice(
        index=_count(_x(element, "index")),
        gpu_instance_id=_count(_x(element, "gpu_instance_id")),
        compute_instance_id=_count(_x(element, "compute_instance_id")),
        sram_uncorrectable=_count(sram),
        memory_used_mib=_count(_x(memory, "used")) if memory is not None else None,
        memory_total_mib=_count(_x(memory, "total")) if memory is not None else None,
        line=line,
    )


def detect_xml(sample: str) -> float:
    head = _head(sample)
    if "<nvidia_smi_log" in head:
        return 0.95
    if "<?xml" in head and re.search(r"<gpu id=\"[0-9A-Fa-f:.]+\"", head):
        return 0.6
    return 0.0
