"""InfiniBand / RoCE probe outputs: ``ibstat``, ``ibstatus``, the sysfs counters,
``perfquery``, ``ibnetdiscover -p`` and ``ibswinfo``: one module per tool over the shared
vocabulary (``model``). This module registers their kinds and re-exports the API.

A flapping or slow IB link turns into NCCL retransmits, stalls and sometimes a corrupted
AllReduce, so the hardware layer needs three facts from these tools: is every port
Active/LinkUp, did a port negotiate a lower rate than its peers, and which error or
congestion counters moved. Each tool prints those facts its own way:

- ``ibstat`` (infiniband-diags): ``CA 'mlx5_0'`` blocks, ``Port N:`` sub-blocks, ``Rate: 400``
  in Gb/s. Version 47 indents with tabs, 39 with spaces, so fields are recognised by name,
  never by indentation. ``ibpanic:`` ends the output early (a device vanished between the
  directory listing and the stat); what was printed before it is kept.
- ``ibstatus`` (a shell script over sysfs): kernel spellings ``4: ACTIVE``, ``5: LinkUp``,
  ``200 Gb/sec (4X HDR)``, hexadecimal lids. States are normalised to ibstat's words
  (``Active``) so a rule written against one tool works on the other.
- ``grep -H . /sys/class/infiniband/*/ports/*/counters/*``: ``path:value`` lines; the same
  with ``hw_counters/`` (mlx5 RDMA counters such as ``out_of_buffer``), port attribute files
  (``state``, ``rate``...) and relative paths. Counters are exact ints (``port_rcv_data``
  passes 2**47).
- ``perfquery``: ``# Port extended counters: Lid 1719 port 1 (CapMask: ...)`` headers and
  dotted ``Name:......value`` lines. Decimal values are ints; hexadecimal values
  (``CounterSelect:...0x0000``, select masks rather than counters) are kept as the printed
  string.
- ``ibnetdiscover -p``: one row per port, ``CA 134 1 0x... 4x EDR - SW 1719 10 0x... ( 'a' - 'b' )``;
  a port with nothing on the other end has no ``- ...`` half.
- ``ibswinfo``: a ``key | value`` report for unmanaged Mellanox switches (PSUs, fans,
  temperature).

Counters are kept raw: whether one grew is a question for the diagnosis, which compares
against ``baseline/``.
"""

from __future__ import annotations

from spikeops.probes.base import Kind, RemoteProbe, register, register_remote
from spikeops.probes.infiniband.model import normalise_state, normalise_phys_state, parse_rate
from spikeops.probes.infiniband.ibstat import IbPort, IbCa, IbToolError, IbStat, ports_below_peers, parse_ibstat, parse_ibstatus, summarize_ibstat, detect_ibstat, detect_ibstatus
from spikeops.probes.infiniband.counters import ERROR_COUNTERS, HW_ERROR_COUNTERS, CONGESTION_COUNTERS, IbPortCounters, IbCounters, parse_counters, render_sysfs_tree, summarize_counters, detect_counters
from spikeops.probes.infiniband.perfquery import PerfQueryBlock, PerfQuery, parse_perfquery, summarize_perfquery, detect_perfquery
from spikeops.probes.infiniband.ibnetdiscover import IbLink, IbLinks, parse_ibnetdiscover_ports, summarize_ibnetdiscover, detect_ibnetdiscover
from spikeops.probes.infiniband.ibswinfo import SwitchInfo, parse_ibswinfo, summarize_ibswinfo, detect_ibswinfo

__all__ = [
    "REMOTE_IBSTAT", "REMOTE_IB_COUNTERS",
    # ibstat / ibstatus
    "IbPort",
    "IbCa",
    "IbToolError",
    "IbStat",
    "parse_ibstat",
    "parse_ibstatus",
    "ports_below_peers",
    "normalise_state",
    "normalise_phys_state",
    "parse_rate",
    # sysfs counters
    "IbPortCounters",
    "IbCounters",
    "parse_counters",
    "render_sysfs_tree",
    "ERROR_COUNTERS",
    "HW_ERROR_COUNTERS",
    "CONGESTION_COUNTERS",
    # perfquery
    "PerfQueryBlock",
    "PerfQuery",
    "parse_perfquery",
    # ibnetdiscover
    "IbLink",
    "IbLinks",
    "parse_ibnetdiscover_ports",
    # ibswinfo
    "SwitchInfo",
    "parse_ibswinfo",
    # detection, summaries and kinds
    "detect_ibstat",
    "detect_ibstatus",
    "detect_counters",
    "detect_perfquery",
    "detect_ibnetdiscover",
    "detect_ibswinfo",
    "summarize_ibstat",
    "summarize_counters",
    "summarize_perfquery",
    "summarize_ibnetdiscover",
    "summarize_ibswinfo",
    "KIND_IBSTAT",
    "KIND_IBSTATUS",
    "KIND_IB_COUNTERS",
    "KIND_PERFQUERY",
    "KIND_IBNETDISCOVER",
    "KIND_IBSWINFO",
    "KINDS",
]

KIND_IBSTAT = register(
    Kind(
        name="ibstat",
        description="ibstat: InfiniBand/RoCE adapters and port states, rates, lids (any infiniband-diags)",
        command="ibstat",
        parse=parse_ibstat,
        detect=detect_ibstat,
        summarize=summarize_ibstat,
    )
)
KIND_IBSTATUS = register(
    Kind(
        name="ibstatus",
        description="ibstatus: per-port state, physical state, rate (4X HDR) and lids from sysfs",
        command="ibstatus",
        parse=parse_ibstatus,
        detect=detect_ibstatus,
        summarize=summarize_ibstat,
    )
)
KIND_IB_COUNTERS = register(
    Kind(
        name="ib-counters",
        description="InfiniBand sysfs port counters, hw_counters, port attributes "
        "(grep -H . capture or a copied /sys/class/infiniband tree)",
        command="grep -H . /sys/class/infiniband/*/ports/*/counters/*",
        parse=parse_counters,
        detect=detect_counters,
        summarize=summarize_counters,
        streaming=True,
        from_directory=render_sysfs_tree,
    )
)
KIND_PERFQUERY = register(
    Kind(
        name="perfquery",
        description="perfquery: IB port counters per LID/port (plain, -x extended, -E/-D details)",
        command="perfquery -x",
        parse=parse_perfquery,
        detect=detect_perfquery,
        summarize=summarize_perfquery,
        streaming=True,
    )
)
KIND_IBNETDISCOVER = register(
    Kind(
        name="ibnetdiscover",
        description="ibnetdiscover -p: fabric port rows, negotiated width/speed, degraded/unlinked ports",
        command="ibnetdiscover -p",
        parse=parse_ibnetdiscover_ports,
        detect=detect_ibnetdiscover,
        summarize=summarize_ibnetdiscover,
        streaming=True,
    )
)
KIND_IBSWINFO = register(
    Kind(
        name="ibswinfo",
        description="ibswinfo: unmanaged Mellanox switch inventory, PSUs, temperature, fans, uptime",
        command="ibswinfo -d {lid}",
        parse=parse_ibswinfo,
        detect=detect_ibswinfo,
        summarize=summarize_ibswinfo,
    )
)
KINDS: tuple[Kind, ...] = (
    KIND_IBSTAT, KIND_IBSTATUS, KIND_IB_COUNTERS, KIND_PERFQUERY, KIND_IBNETDISCOVER, KIND_IBSWINFO,
)

REMOTE_IBSTAT = register_remote(RemoteProbe(
    name="ibstat", filename="ibstat.txt", command="ibstat", kind="ibstat", order=40, max_bytes=4 << 20,
))
#: The spec's ``grep -H . /sys/class/infiniband/*/ports/*/counters/*``, with the sysfs root
#: movable for nodes whose host /sys is mounted elsewhere.
REMOTE_IB_COUNTERS = register_remote(RemoteProbe(
    name="ib-counters", filename="ib-counters.txt",
    command='grep -H . "${SPIKEOPS_SYSFS:-/sys}"/class/infiniband/*/ports/*/counters/*',
    kind="ib-counters", order=50, max_bytes=8 << 20,
))
