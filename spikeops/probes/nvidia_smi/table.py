"""``nvidia-smi`` without arguments: the default table (per-GPU cells, processes)."""

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
    GpuProcess,
    NvidiaSmiTable,
    SmiMessage,
    TableGpu,
    _Gaps,
    _SMI_ERROR,
    _count,
    _float,
    _measure,
    _smi_time,
    _text,
    normalise_bus_id,
)

__all__ = ["parse_table", "detect_table"]


# --------------------------------------------------------------------------- default table


_TABLE_VERSIONS = re.compile(
    r"NVIDIA-SMI\s+(?P<smi>\S+)|Driver Version:\s*(?P<driver>\S+)|CUDA Version:\s*(?P<cuda>\S+)"
)
_GPU_CELL = re.compile(r"^\s*(?P<index>\d{1,4})\s+(?P<name>.+?)\s+(?P<persistence>\S+)\s*$")
_BUS_CELL = re.compile(
    r"^\s*(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s+(?P<disp>\S+)\s*$"
)
#: Values are separated from the slash by spaces (``72W /  700W``); ``N/A`` has its own slash.
_STATS_CELL = re.compile(
    r"^\s*(?P<fan>\S+)\s+(?P<temp>\S+)\s+(?P<perf>\S+)\s+(?P<power>\S+)\s+/\s+(?P<cap>\S+)\s*$"
)
_PAIR_CELL = re.compile(r"^\s*(?P<left>\S+)\s+/\s+(?P<right>\S+)\s*$")
_PROCESS_ROW = re.compile(
    r"^\s*(?P<gpu>\d{1,4})\s+(?:(?P<gi>\S+)\s+(?P<ci>\S+)\s+)?(?P<pid>\d{1,10})\s+(?P<type>[A-Z+]+)\s+"
    r"(?P<name>.*?)\s+(?P<memory>\S+)\s*$"
)


#: Rows of the table and nvlink lines are under 100 characters; a longer "row" is garbage,
#: and refusing it keeps the row patterns linear-time on hostile input.


def _cells(line: str) -> list[str]:
    """The cells of a ``| a | b | c |`` row."""
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|"):
        body = body[:-1]
    return body.split("|")


class _TableReader:
    """Walks the table's sections: the GPU grid (two or three rows per GPU, closed by a
    ``+---`` rule), the MIG devices grid (skipped), and the processes grid."""

    def __init__(self) -> None:
        self.table = NvidiaSmiTable()
        self.gaps = _Gaps(self.table.gaps)
        self.section = "preamble"
        self.header_seen = False
        self.current: TableGpu | None = None
        self.row_in_block = 0
        self.processes_have_gi = False

    def feed(self, number: int, line: str) -> None:
        stripped = line.strip()
        if not stripped:
            return
        if len(stripped) > _MAX_ROW:
            self.gaps.add(f"line of {len(stripped)} characters is not an nvidia-smi table row", number)
            return
        if stripped.startswith("+") and set(stripped) <= set("+-= "):
            self.close_block()
            return
        if not stripped.startswith("|"):
            self.outside(number, stripped)
            return
        if "=" in stripped and set(stripped) <= set("|=+ "):
            self.section = {"gpu-header": "gpus", "process-header": "processes", "mig-header": "mig"}.get(
                self.section, self.section
            )
            self.close_block()
            return
        if "-" in stripped and set(stripped) <= set("|-+ "):
            self.close_block()
            return
        self.row(number, stripped)

    def outside(self, number: int, stripped: str) -> None:
        moment = _smi_time(stripped)
        if moment is not None:
            self.table.timestamp = moment
        elif _SMI_ERROR.match(stripped):
            self.table.errors.append(SmiMessage(clip(stripped), number))
        else:
            self.gaps.add(f"not part of the nvidia-smi table: {clip(stripped, 80)!r}", number)

    def close_block(self) -> None:
        self.current = None
        self.row_in_block = 0

    def row(self, number: int, stripped: str) -> None:
        if "NVIDIA-SMI" in stripped or "Driver Version:" in stripped:
            for match in _TABLE_VERSIONS.finditer(stripped):
                if match["smi"]:
                    self.table.smi_version = match["smi"]
                if match["driver"]:
                    self.table.driver_version = _text(match["driver"])
                if match["cuda"]:
                    self.table.cuda_version = _text(match["cuda"])
            return
        if "Bus-Id" in stripped or "Persistence-M" in stripped:
            self.section = "gpu-header"
            return
        if "Processes:" in stripped:
            self.section = "process-header"
            return
        if "MIG devices:" in stripped:
            self.section = "mig-header"
            return
        if self.section == "process-header":
            if re.search(r"\bGI\b", stripped):
                self.processes_have_gi = True
            return
        if self.section in ("gpu-header", "mig-header", "mig", "preamble"):
            return  # column titles, MIG grid rows: not modelled
        if self.section == "gpus":
            self.gpu_row(number, _cells(stripped))
        elif self.section == "processes":
            self.process_row(number, stripped)

    def gpu_row(self, number: int, cells: list[str]) -> None:
        if len(cells) < 3:
            self.gaps.add(f"GPU row with {len(cells)} cells", number)
            return
        first = _GPU_CELL.match(cells[0])
        if self.current is None or (first and self.row_in_block != 1):
            if not first:
                self.gaps.add(f"GPU row not understood: {clip('|'.join(cells), 80)!r}", number)
                return
            name = first["name"].strip()
            gpu = TableGpu(
                index=int(first["index"]),
                name=name,
                name_truncated=name.endswith("..."),
                persistence=_text(first["persistence"]),
                line=number,
            )
            bus = _BUS_CELL.match(cells[1])
            if bus:
                ids = normalise_bus_id(bus["bus"])
                if ids:
                    gpu.bus_id, gpu.pci = ids
                gpu.display_active = _text(bus["disp"])
            else:
                self.gaps.add(f"bus id cell not understood: {clip(cells[1], 60)!r}", number)
            gpu.volatile_uncorrected_ecc = _count(cells[2])
            self.table.gpus.append(gpu)
            self.current, self.row_in_block = gpu, 1
            return
        current = self.current
        if self.row_in_block == 1:
            self.stats_row(number, current, cells)
        elif self.row_in_block == 2:
            current.mig_mode = _text(cells[2])
        self.row_in_block += 1

    def stats_row(self, number: int, gpu: TableGpu, cells: list[str]) -> None:
        """``| N/A   27C    P0   72W / 700W |  1MiB / 81559MiB |  0%  Default |``."""
        match = _STATS_CELL.match(cells[0])
        if not match:
            self.gaps.add(f"GPU stats row not understood: {clip(cells[0], 60)!r}", number)
            return
        fan, temp, perf, power, cap = match.group("fan", "temp", "perf", "power", "cap")
        for column, value in (("fan", fan), ("temperature", temp), ("performance_state", perf),
                              ("power", power), ("power_cap", cap)):
            if value.upper() == "ERR!":
                gpu.err_columns.append(column)
        gpu.fan_error = "fan" in gpu.err_columns
        gpu.fan_pct = _measure(fan)
        gpu.temperature_c = _measure(temp)
        gpu.performance_state = _text(perf) if perf.upper() != "ERR!" else None
        gpu.power_draw_w = _float(power)
        gpu.power_cap_w = _float(cap)
        memory = _PAIR_CELL.match(cells[1])
        if memory:
            gpu.memory_used_mib = _count(memory["left"])
            gpu.memory_total_mib = _count(memory["right"])
        util = re.match(r"^\s*(?P<util>\S+)\s+(?P<mode>.+?)\s*$", cells[2])
        if util:
            gpu.utilization_gpu_pct = _measure(util["util"])
            gpu.compute_mode = _text(util["mode"])
            if util["util"].upper() == "ERR!":
                gpu.err_columns.append("utilization")

    def process_row(self, number: int, stripped: str) -> None:
        body = "|".join(_cells(stripped))
        if "No running processes found" in body:
            return
        match = _PROCESS_ROW.match(body)
        if not match or (self.processes_have_gi and match["gi"] is None):
            self.gaps.add(f"process row not understood: {clip(body, 80)!r}", number)
            return
        self.table.processes.append(
            GpuProcess(
                pid=int(match["pid"]),
                name=_text(match["name"]),
                used_memory_mib=_count(match["memory"]),
                type=match["type"],
                gpu_instance_id=_count(match["gi"]),
                compute_instance_id=_count(match["ci"]),
                gpu_index=int(match["gpu"]),
                line=number,
            )
        )


def parse_table(source: LineSource) -> NvidiaSmiTable:
    """Read the default ``nvidia-smi`` table: per-GPU rows and the processes grid."""
    reader = _TableReader()
    for number, line in numbered_lines(source):
        reader.feed(number, line)
    if not reader.table.gpus and reader.table.driver_version is None and not reader.table.errors:
        reader.gaps.add("no nvidia-smi table found")
    reader.gaps.close()
    return reader.table


def detect_table(sample: str) -> float:
    head = _head(sample)
    if re.search(r"^\|\s*NVIDIA-SMI \S+\s+Driver Version:", head, re.M):
        return 0.95
    if re.search(r"^\|\s*GPU\s+Name\s+.*Persistence-M", head, re.M):
        return 0.9
    if re.search(r"^\|\s*Processes:", head, re.M) and re.search(r"^\|=+\|", head, re.M):
        return 0.6
    return 0.0
