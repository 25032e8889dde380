"""``nvidia-smi`` in its five printed forms: ``-q`` text, ``-q -x`` XML, ``--query-*`` CSV,
the default table, and ``nvlink -s``: one module per form (``q_text``, ``q_xml``,
``query_csv``, ``table``, ``nvlink``) over the shared GPU model (``model``); ``summary``
says what is alarming in each. This module registers the five kinds and re-exports the API.

A loss spike that a bad GPU caused leaves its trace here: uncorrectable ECC counts, a row
remap pending a reset, retired pages, a GPU slowed by heat or by the power brake, a fan
sensor reading ``ERR!``, an NVLink gone ``<inactive>``. Collectors capture whichever form
their node script ran, so all forms land in one vocabulary: ``parse_q``, ``parse_xml`` and
``parse_query_csv`` all give ``GpuStatus`` records with the same normalised field names, and
the diagnosis never needs to know which form a node produced.

Quirks handled on purpose (each seen in real output or in NVIDIA's own format history):

- ECC counters changed shape across generations. Pre-Ampere drivers print ``Single Bit`` /
  ``Double Bit`` sections split by memory (``Device Memory``, ``Register File``, ...,
  ``Total``); Ampere prints ``SRAM``/``DRAM`` ``Correctable``/``Uncorrectable``; Hopper
  drivers split ``SRAM Uncorrectable`` into ``Parity`` and ``SEC-DED``. ``EccCounts`` keeps
  every part and answers ``uncorrectable_total()`` the same way for all of them.
- ``Clocks Throttle Reasons`` was renamed ``Clocks Event Reasons`` (R535); ``Idle`` in the
  text is ``gpu_idle`` in the CSV. Reason names are normalised to the CSV's snake_case keys.
- ``T.Limit`` temperatures are margins to a limit, so ``-8 C`` is a real, signed value.
- On MIG, ``Remapped Rows`` prints ``N/A`` (None, not zero) and each ``MIG Device`` carries
  its own ``SRAM Uncorrectable``.
- The bus id is printed ``00000000:19:00.0`` by nvidia-smi but the kernel names the same GPU
  ``PCI:0000:19:00`` in Xid lines; ``normalise_bus_id`` gives both forms.
- People paste excerpts with ``[...]`` elisions, and files get cut: what is missing becomes
  a gap, never the GPU around it.
- XML may carry a DOCTYPE. nvidia-smi's own (an external DTD name) is harmless and ignored;
  an internal subset with ENTITY declarations is refused unexpanded (a billion-laughs file
  must not cost a node's memory).
"""

from __future__ import annotations

from spikeops.probes.base import Kind, RemoteProbe, register, register_remote
from spikeops.probes.nvidia_smi.model import (
    CLOCK_REASON_BITS,
    MAX_GAPS,
    CsvRow,
    EccCounts,
    GpuProcess,
    GpuStatus,
    MigDevice,
    NvidiaSmiReport,
    NvidiaSmiTable,
    NvlinkGpu,
    NvlinkLink,
    NvlinkStatus,
    QueryCsv,
    RemappedRows,
    RetiredPages,
    SmiMessage,
    TableGpu,
    normalise_bus_id,
)
from spikeops.probes.nvidia_smi.nvlink import detect_nvlink, parse_nvlink_status
from spikeops.probes.nvidia_smi.q_text import detect_q, parse_q
from spikeops.probes.nvidia_smi.q_xml import detect_xml, parse_xml
from spikeops.probes.nvidia_smi.query_csv import detect_csv, parse_query_csv
from spikeops.probes.nvidia_smi.summary import summarize_csv, summarize_nvlink, summarize_report, summarize_table
from spikeops.probes.nvidia_smi.table import detect_table, parse_table

__all__ = [
    "REMOTE",
    "CLOCK_REASON_BITS",
    "EccCounts",
    "RetiredPages",
    "RemappedRows",
    "MigDevice",
    "GpuProcess",
    "SmiMessage",
    "GpuStatus",
    "NvidiaSmiReport",
    "CsvRow",
    "QueryCsv",
    "TableGpu",
    "NvidiaSmiTable",
    "NvlinkLink",
    "NvlinkGpu",
    "NvlinkStatus",
    "normalise_bus_id",
    "parse_q",
    "parse_xml",
    "parse_query_csv",
    "parse_table",
    "parse_nvlink_status",
    "detect_q",
    "detect_xml",
    "detect_csv",
    "detect_table",
    "detect_nvlink",
    "summarize_report",
    "summarize_csv",
    "summarize_table",
    "summarize_nvlink",
    "MAX_GAPS",
    "KIND_Q",
    "KIND_XML",
    "KIND_CSV",
    "KIND_TABLE",
    "KIND_NVLINK",
]

# --------------------------------------------------------------------------- registration


KIND_Q = register(
    Kind(
        name="nvidia-smi-q",
        description="nvidia-smi -q: per-GPU ECC, retired pages, remapped rows, clock event reasons, "
        "temperatures, power",
        command="nvidia-smi -q",
        parse=parse_q,
        detect=detect_q,
        summarize=summarize_report,
    )
)
KIND_XML = register(
    Kind(
        name="nvidia-smi-xml",
        description="nvidia-smi -q -x: the -q report as XML (entity declarations refused)",
        command="nvidia-smi -q -x",
        parse=parse_xml,
        detect=detect_xml,
        summarize=summarize_report,
    )
)
KIND_CSV = register(
    Kind(
        name="nvidia-smi-csv",
        description="nvidia-smi --query-{gpu,retired-pages,remapped-rows,compute-apps}=... --format=csv",
        command="nvidia-smi --query-gpu=index,pci.bus_id,uuid,name,temperature.gpu,power.draw,"
        "ecc.errors.uncorrected.volatile.total,ecc.errors.uncorrected.aggregate.total,"
        "retired_pages.pending,remapped_rows.pending,clocks_throttle_reasons.active --format=csv",
        parse=parse_query_csv,
        detect=detect_csv,
        summarize=summarize_csv,
    )
)
KIND_TABLE = register(
    Kind(
        name="nvidia-smi-table",
        description="nvidia-smi (default table): per-GPU temp, power, memory, util, volatile ECC, fan ERR!",
        command="nvidia-smi",
        parse=parse_table,
        detect=detect_table,
        summarize=summarize_table,
    )
)
KIND_NVLINK = register(
    Kind(
        name="nvidia-smi-nvlink",
        description="nvidia-smi nvlink -s: per-GPU NVLink speeds, inactive links",
        command="nvidia-smi nvlink -s",
        parse=parse_nvlink_status,
        detect=detect_nvlink,
        summarize=summarize_nvlink,
    )
)

#: Collected on every node. ``-q`` rather than ``-q -x``: the text form is what people read
#: in the post-mortem, and the parser reads it as fully as the XML.
REMOTE = register_remote(RemoteProbe(
    name="nvidia-smi-q", filename="nvidia-smi-q.txt", command="nvidia-smi -q",
    kind="nvidia-smi-q", order=10,
))
