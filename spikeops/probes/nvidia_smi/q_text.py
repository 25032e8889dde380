"""``nvidia-smi -q``: the indented text report, read into one tree per ``GPU <bus id>``
section and then into the shared GPU model."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from spikeops.probes.base import (
    Gap,
    LineSource,
    clip,
    numbered_lines,
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
    SmiMessage,
    _ELISION,
    _Gaps,
    _SMI_ERROR,
    _SRAM_SOURCE_ALIASES,
    _count,
    _finish_ecc,
    _flag,
    _measure,
    _norm,
    _reason_key,
    _set_bit_part,
    _set_bus,
    _set_ecc_field,
    _smi_time,
    _snake,
    _temp_key,
    _text,
)

__all__ = ["parse_q", "detect_q"]


# --------------------------------------------------------------------------- -q text


class _Node:
    """A line of ``-q`` text and the lines indented under it. A plain slotted class, not a
    dataclass: one is built per line of a 2,000-line report, on the diagnosis's hot path."""

    __slots__ = ("key", "value", "line", "indent", "children", "name")

    def __init__(self, key: str, value: str | None, line: int, indent: int, name: str | None = None) -> None:
        self.key, self.value, self.line, self.indent = key, value, line, indent
        self.children: list[_Node] = []
        #: The normalised key, computed once: lookups by name are the parser's hot loop.
        self.name = _norm(key) if name is None else name

    def child(self, *names: str) -> _Node | None:
        for node in self.children:
            if node.name in names:
                return node
        return None

    def all(self, *names: str) -> Iterator[_Node]:
        return (node for node in self.children if node.name in names)

    def get(self, *path: str) -> str | None:
        node: _Node | None = self
        for name in path:
            node = node.child(name) if node else None
        return node.value if node else None

    def walk(self) -> Iterator[_Node]:
        stack = list(reversed(self.children))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


_GPU_HEADER = re.compile(r"^GPU\s+(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_BANNER = re.compile(r"^=+\s*NVSMI LOG\s*=+\s*$")
_KEY_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._\-/()+#,&'%]*$")
_HEADER_KEYS = {"timestamp", "driver version", "cuda version", "attached gpus"}


#: A GPU's sections that nothing of the GPU model reads (clocks, voltages, encoder and FBC
#: statistics, firmware versions...): a quarter of an H100's lines. Their header is kept and
#: their lines are not placed; a malformed line inside one is not reported either.
_UNREAD_SECTIONS = frozenset({
    "clocks", "max clocks", "applications clocks", "default applications clocks", "deferred clocks",
    "max customer boost clocks", "clock policy", "voltage", "inforom version", "fabric", "encoder stats",
    "fbc stats", "gpu virtualization mode", "gpu operation mode", "bar1 memory usage",
    "conf compute protected memory usage", "module power readings", "ibmnpu", "driver model",
    "inforom bbx object flush", "gpu reset status",
})

#: Keys seen in ``-q`` lines that passed ``_KEY_OK``, to their normal form (a few hundred in
#: practice; bounded so that a file of random keys cannot grow it without limit).
_KEY_NAMES: dict[str, str] = {}
_KEY_NAMES_MAX = 4096


def _split_line(line: str) -> tuple[int, str, str | None]:
    """(indent, key, value or None) of one ``-q`` line; keys never contain a colon."""
    expanded = line.expandtabs(8) if "\t" in line else line
    body = expanded.lstrip(" ")
    indent = len(expanded) - len(body)
    key, sep, value = body.partition(":")
    return indent, key.strip(), (value.strip() if sep else None)


class _QReader:
    """Builds one indentation tree per ``GPU <bus id>`` section, line by line.

    Top-level lines never own indented lines: an author's ``[...]`` or a stray line at
    column 0 in the middle of a GPU section becomes a gap, and the section goes on.
    """

    def __init__(self) -> None:
        self.report = NvidiaSmiReport()
        self.gaps = _Gaps(self.report.gaps)
        self.sections: list[_Node] = []
        self.stack: list[_Node] = []
        self.snapshot_start = 1
        self.last: _Node | None = None

    def new_snapshot(self, number: int) -> None:
        """``nvidia-smi -q -l N`` repeats the whole log; the latest snapshot is the state."""
        kept_errors = self.report.errors
        self.report.gaps.append(
            Gap(
                f"earlier snapshot (lines {self.snapshot_start}-{number - 1}) replaced by a later one",
                number,
            )
        )
        gaps = self.report.gaps
        self.report = NvidiaSmiReport(gaps=gaps, errors=kept_errors)
        self.gaps.into = gaps
        self.sections, self.stack, self.snapshot_start = [], [], number

    def top_level(self, number: int, line: str) -> None:
        stripped = line.strip()
        if _BANNER.match(stripped):
            if self.sections:
                self.new_snapshot(number)
            return
        header = _GPU_HEADER.match(stripped)
        if header:
            node = _Node(header["bus"], None, number, 0)
            self.sections.append(node)
            self.stack = [node]
            self.last = node
            return
        if _SMI_ERROR.match(stripped):
            self.report.errors.append(SmiMessage(clip(stripped), number))
            return
        _indent, key, value = _split_line(line)
        name = _norm(key)
        if value is not None and name in _HEADER_KEYS:
            if name == "timestamp" and self.sections:
                self.new_snapshot(number)
            self.header(name, value, number)
            return
        if _ELISION.match(stripped):
            self.gaps.add("elided in the source ([...]): the lines left out are not known", number)
            return
        if self.sections:
            self.gaps.add(f"unexpected line outside the GPU's fields: {clip(stripped, 80)!r}", number)
        # Before the first GPU: top-level keys and sections we do not model (vGPU
        # capability, HIC info) are skipped together with their indented lines.

    def header(self, name: str, value: str, number: int) -> None:
        if name == "timestamp":
            self.report.timestamp = _smi_time(value)
            if self.report.timestamp is None and _text(value):
                self.gaps.add(f"timestamp not understood: {clip(value, 60)!r}", number)
        elif name == "driver version":
            self.report.driver_version = _text(value)
        elif name == "cuda version":
            self.report.cuda_version = _text(value)
        elif name == "attached gpus":
            self.report.attached_gpus = _count(value)

    def indented(self, number: int, line: str) -> None:
        if not self.stack:
            return  # part of a top-level section before the first GPU
        stripped = line.strip()
        if stripped[0] in "[.…" and _ELISION.match(stripped):
            self.gaps.add("elided in the source ([...]): the lines left out are not known", number)
            return
        indent, key, value = _split_line(line)
        if not _KEY_OK.match(key):
            if _SMI_ERROR.match(stripped):
                self.report.errors.append(SmiMessage(clip(stripped), number))
            else:
                self.gaps.add(f"not an nvidia-smi -q line: {clip(stripped, 80)!r}", number)
            return
        if value is None and indent % 2:
            # A section header at an odd indent cannot be placed; adopting the lines
            # under it would hide them from the section they belong to.
            self.gaps.add(f"misindented section header: {clip(stripped, 80)!r}", number)
            return
        while len(self.stack) > 1 and self.stack[-1].indent >= indent:
            self.stack.pop()
        node = _Node(key, value, number, indent)
        self.stack[-1].children.append(node)
        self.stack.append(node)
        self.last = node

    def feed(self, lines: Iterable[tuple[int, str]]) -> None:
        # The common line (spaces, no tab, a key that reads, a value or an even-indented
        # header) is placed here with what ``indented`` would do, inline: 256 nodes of 8 GPUs
        # are 430,000 such lines in a diagnosis. Keys repeat across GPUs and nodes, so their
        # check and normal form are looked up, not recomputed. Everything else goes the long way.
        names = _KEY_NAMES
        skip_over = -1  # lines indented deeper than this belong to a section nothing reads
        for number, line in lines:
            first = line[:1]
            if first == " " and "\t" not in line:
                stack = self.stack
                body = line.lstrip(" ")
                if skip_over >= 0:
                    if len(line) - len(body) > skip_over and body:
                        self.last = None  # a line was there: the section did not end at its header
                        continue
                    skip_over = -1
                if not stack or not body or body[0] in "[.…":
                    self._slow(number, line)
                    continue
                key, sep, value = body.partition(":")
                key = key.strip()
                name = names.get(key)
                if name is None:
                    if not _KEY_OK.match(key):
                        self._slow(number, line)
                        continue
                    name = _norm(key)
                    if len(names) < _KEY_NAMES_MAX:
                        names[key] = name
                indent = len(line) - len(body)
                if sep:
                    value = value.strip()
                elif indent % 2:
                    self._slow(number, line)
                    continue
                else:
                    value = None
                while stack[-1].indent >= indent:  # never the section: it is at 0, a line at 1 or more
                    stack.pop()
                node = _Node(key, value, number, indent, name)
                stack[-1].children.append(node)
                stack.append(node)
                self.last = node
                if value is None and name in _UNREAD_SECTIONS and len(stack) == 2:
                    skip_over = indent
            elif not line.strip():
                continue
            elif first in " \t":
                self.indented(number, line)
            else:
                self.top_level(number, line)

    def _slow(self, number: int, line: str) -> None:
        """A space-indented line the fast path in ``feed`` does not place: ``indented`` decides."""
        if line.strip():
            self.indented(number, line)

    def finish(self) -> NvidiaSmiReport:
        report = self.report
        for index, section in enumerate(self.sections):
            report.gpus.append(_gpu_from_node(section, index, self.gaps))
        last = self.last
        if last is not None and last.value is None and not last.children and last.indent > 0:
            self.gaps.add(f"output ends at a section header {last.key!r} (cut short?)", last.line)
        if report.attached_gpus is not None and report.gpus and len(report.gpus) < report.attached_gpus:
            self.gaps.add(
                f"{len(report.gpus)} of {report.attached_gpus} attached GPUs in the output "
                "(cut short, elided, or queried with -i)"
            )
        if not report.gpus and report.driver_version is None and not report.errors:
            self.gaps.add("no nvidia-smi -q content found")
        self.gaps.close()
        return report


def parse_q(source: LineSource) -> NvidiaSmiReport:
    """Read ``nvidia-smi -q`` (any ``-d`` selection, any driver since the R4xx era)."""
    reader = _QReader()
    reader.feed(numbered_lines(source))
    return reader.finish()


def _gpu_from_node(section: _Node, index: int, gaps: _Gaps) -> GpuStatus:
    gpu = GpuStatus(index=index, line=section.line)
    _set_bus(gpu, section.key)
    gpu.product = _text(section.get("product name"))
    gpu.uuid = _text(section.get("gpu uuid"))
    gpu.serial = _text(section.get("serial number"))
    gpu.minor_number = _count(section.get("minor number"))
    gpu.performance_state = _text(section.get("performance state"))
    gpu.fan_speed_pct = _measure(section.get("fan speed"))
    gpu.ecc_mode = _text(section.get("ecc mode", "current"))
    gpu.mig_mode = _text(section.get("mig mode", "current"))
    gpu.pcie_replays = _count(section.get("pci", "replays since reset"))
    gpu.memory_used_mib = _count(section.get("fb memory usage", "used"))
    gpu.memory_total_mib = _count(section.get("fb memory usage", "total"))
    gpu.utilization_gpu_pct = _measure(section.get("utilization", "gpu"))
    ecc = section.child("ecc errors")
    if ecc is not None:
        _ecc_from_node(gpu, ecc)
    retired = section.child("retired pages")
    if retired is not None:
        gpu.retired_pages = _retired_from_node(retired)
    remapped = section.child("remapped rows")
    if remapped is not None:
        gpu.remapped_rows = _remapped_from_node(remapped)
    reasons = section.child("clocks event reasons", "clocks throttle reasons")
    if reasons is not None:
        gpu.clock_event_reasons = {
            _reason_key(node.key): _flag(node.value) for node in reasons.walk() if node.value is not None
        }
    counters = section.child("clocks event reasons counters", "clocks throttle reasons counters")
    if counters is not None:
        gpu.clock_event_counters_us = {
            _reason_key(node.key): _count(node.value) for node in counters.walk() if node.value is not None
        }
    temperature = section.child("temperature")
    if temperature is not None:
        _temperature_from_node(gpu, temperature)
    power = section.child("gpu power readings", "power readings")
    if power is not None:
        _power_from_pairs(gpu, ((node.name, node.value) for node in power.children))
    gpu.mig_devices = [_mig_from_node(node) for node in _mig_nodes(section)]
    processes = section.child("processes")
    if processes is not None:
        gpu.processes = _processes_from_node(processes, gaps)
    return gpu


def _ecc_from_node(gpu: GpuStatus, node: _Node) -> None:
    for part in node.children:
        if part.name in ("volatile", "aggregate"):
            counts = _ecc_counts_from_node(part)
            if part.name == "volatile":
                gpu.ecc_volatile = counts
            else:
                gpu.ecc_aggregate = counts
        elif part.name == "aggregate uncorrectable sram sources":
            target = gpu.ecc_aggregate or EccCounts()
            gpu.ecc_aggregate = target
            for source in part.children:
                key = _snake(re.sub(r"(?i)^sram\s+", "", source.key))
                target.sram_uncorrectable_sources[_SRAM_SOURCE_ALIASES.get(key, key)] = _count(source.value)
        elif part.value is not None and _flag(part.value) is not None:
            gpu.ecc_flags[_snake(part.key)] = _flag(part.value)


_ECC_TEXT_KEYS = {
    "sram correctable": "sram_correctable",
    "sram uncorrectable": "sram_uncorrectable",
    "sram uncorrectable parity": "sram_uncorrectable_parity",
    "sram uncorrectable sec-ded": "sram_uncorrectable_secded",
    "dram correctable": "dram_correctable",
    "dram uncorrectable": "dram_uncorrectable",
    "sram threshold exceeded": "sram_threshold_exceeded",
}


def _ecc_counts_from_node(node: _Node) -> EccCounts:
    ecc = EccCounts()
    for item in node.children:
        if item.name in ("single bit", "double bit"):
            for part in item.children:
                _set_bit_part(ecc, item.name == "single bit", _snake(part.key), part.value)
        elif item.name in _ECC_TEXT_KEYS:
            _set_ecc_field(ecc, _ECC_TEXT_KEYS[item.name], item.value)
    return _finish_ecc(ecc)


def _retired_from_node(node: _Node) -> RetiredPages:
    pages = RetiredPages(line=node.line)
    for item in node.children:
        if item.name.startswith("single bit"):
            pages.single_bit = _count(item.value)
        elif item.name.startswith("double bit"):
            pages.double_bit = _count(item.value)
        elif item.name.startswith("pending"):
            if "retirement" in item.name:
                pages.pending_retirement = _flag(item.value)
            else:
                pages.pending_blacklist = _flag(item.value)
    return pages


def _remapped_from_node(node: _Node) -> RemappedRows | None:
    if node.value is not None and not node.children:
        return None  # ``Remapped Rows : N/A`` (MIG, pre-Ampere)
    rows = RemappedRows(line=node.line)
    for item in node.children:
        if item.name.startswith("correctable"):
            rows.correctable = _count(item.value)
        elif item.name.startswith("uncorrectable"):
            rows.uncorrectable = _count(item.value)
        elif item.name == "pending":
            rows.pending = _flag(item.value)
        elif item.name.startswith("remapping failure"):
            rows.failure = _flag(item.value)
        elif item.name.startswith("bank remap availability"):
            rows.histogram = {_snake(bank.key): _count(bank.value) for bank in item.children}
    return rows


def _temperature_from_node(gpu: GpuStatus, node: _Node) -> None:
    for item in node.children:
        if item.value is None:
            continue
        key = _temp_key(item.key)
        if key == "current":
            gpu.temperature_c = _measure(item.value)
        elif key == "memory_current":
            gpu.memory_temperature_c = _measure(item.value)
        else:
            gpu.temperature_thresholds[key] = _measure(item.value)


def _mig_nodes(section: _Node) -> Iterator[_Node]:
    for node in section.children:
        if node.name == "mig device":
            yield node
        elif node.name == "mig devices":
            yield from node.all("mig device")


def _mig_from_node(node: _Node) -> MigDevice:
    memory = node.child("shared fb memory usage", "fb memory usage")
    return MigDevice(
        index=_count(node.get("index")),
        gpu_instance_id=_count(node.get("gpu instance id")),
        compute_instance_id=_count(node.get("compute instance id")),
        sram_uncorrectable=_count(node.get("ecc errors", "volatile", "sram uncorrectable")),
        memory_used_mib=_count(memory.get("used")) if memory else None,
        memory_total_mib=_count(memory.get("total")) if memory else None,
        line=node.line,
    )


def _processes_from_node(node: _Node, gaps: _Gaps) -> list[GpuProcess]:
    """R510+ prints ``GPU instance ID`` and ``Compute instance ID`` as siblings *before*
    each ``Process ID`` (whose own fields are indented under it); older drivers print
    ``Process ID`` alone. Both come out as one GpuProcess per ``Process ID``."""
    processes: list[GpuProcess] = []
    pending: dict[str, int | None] = {}
    for item in node.children:
        if item.name == "gpu instance id":
            pending["gi"] = _count(item.value)
        elif item.name == "compute instance id":
            pending["ci"] = _count(item.value)
        elif item.name == "process id":
            process = GpuProcess(
                pid=_count(item.value),
                gpu_instance_id=pending.get("gi"),
                compute_instance_id=pending.get("ci"),
                line=item.line,
            )
            process.type = _text(item.get("type"))
            process.name = _text(item.get("name"))
            process.used_memory_mib = _count(item.get("used gpu memory"))
            if process.pid is None:
                gaps.add(f"process without a readable pid: {item.value!r}", item.line)
            processes.append(process)
            pending = {}
    return processes


def detect_q(sample: str) -> float:
    """The ``NVSMI LOG`` banner; without it (an excerpt) a ``GPU 00000000:..`` section line
    together with ``Driver Version`` or indented ``Product Name``."""
    head = _head(sample)
    if re.search(r"^=+NVSMI LOG=+\s*$", head, re.M):
        return 0.95
    section = re.search(r"^GPU [0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\s*$", head, re.M)
    driver = re.search(r"^Driver Version\s+: \S", head, re.M)
    fields = re.search(
        r"^ {4}(?:Product Name|ECC Errors|Retired Pages|Remapped Rows|Temperature)\b", head, re.M
    )
    if section and (driver or fields):
        return 0.9
    if driver and re.search(r"^Attached GPUs\s+: \d", head, re.M):
        return 0.7
    return 0.0
