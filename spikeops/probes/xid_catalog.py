"""NVIDIA's Xid and NVSwitch SXid catalogs, as data.

An Xid is the NVIDIA driver's numbered error report (``NVRM: Xid (PCI:0000:9b:00): 79, ...``);
an SXid is the NVSwitch driver's (``nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, ...``).
The number alone decides what a diagnosis may conclude from the line, so it lives here in one
table per catalog, and every set the diagnosis asks about is derived from those tables rather
than written out a second time where it could drift.

The rows follow NVIDIA's "XID Errors" documentation and its Xid catalog for Ampere and newer
GPUs (mnemonics, descriptions, resolution buckets such as ``RESTART_APP`` / ``RESET_GPU`` /
``RESTART_BM``), and the Fabric Manager user guide's SXid tables. Codes the newer catalog
marks "Unused" keep the meaning the older documentation gave them, because older GPUs still
print them.

Three sets are fixed by the project's diagnosis spec and the table must agree with them:

- GPU-implicating (a node with one inside the incident window is a culprit):
  48, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140.
- Memory-class (with ECC growth on the same GPU the cause is ``gpu_ecc``):
  48, 63, 64, 92, 94, 95, 140. Exactly these rows have category ``"memory"``.
- Application-class (point at the job, never convict a node): 13, 31, 43. Exactly these rows
  have category ``"application"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

__all__ = [
    "XidInfo",
    "SXidInfo",
    "CATEGORIES",
    "XID_TABLE",
    "SXID_TABLE",
    "lookup",
    "lookup_sxid",
    "GPU_IMPLICATING",
    "MEMORY_CLASS",
    "APPLICATION_CLASS",
    "SXID_FATAL",
    "SXID_NON_FATAL",
]

#: What part of the system an Xid points at. ``unknown`` is only for codes not in the table.
CATEGORIES: Final = frozenset(
    {"hardware", "memory", "nvlink", "application", "driver", "thermal_power", "system", "unknown"}
)


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One Xid code: what it is called, what it means, and what it allows a diagnosis to say.

    ``implicates_gpu``: the GPU itself is suspect (isolate the node when it falls in the
    incident window). ``memory_related``: the error is about GPU memory (ECC, row
    remapping), so together with growing ECC counters it means ``gpu_ecc``. ``action`` is
    NVIDIA's immediate resolution bucket (``RESTART_APP``, ``RESET_GPU``, ``RESTART_BM`` =
    reboot the machine, ``IGNORE``, ``CONTACT_SUPPORT``, ``WORKFLOW_...``).
    """

    code: int
    name: str
    description: str
    category: str
    implicates_gpu: bool
    memory_related: bool
    action: str


@dataclass(frozen=True, slots=True)
class SXidInfo:
    """One NVSwitch SXid code. ``fatal``: the Fabric Manager guide lists it as fatal (the
    port, or with ``always_fatal`` the whole fabric, needs a reset); an SXid line also prints
    its own ``Fatal``/``Non-fatal`` word, which the parser keeps beside this."""

    code: int
    name: str
    description: str
    fatal: bool
    always_fatal: bool
    action: str


def _x(
    code: int, name: str, description: str, category: str, action: str,
    *, gpu: bool = False, memory: bool = False,
) -> XidInfo:
    return XidInfo(code, name, description, category, gpu, memory, action)


# fmt: off
#: The Xid catalog: one row per code, in code order.
XID_TABLE: Final[tuple[XidInfo, ...]] = (
    _x(8, "GPU stopped processing",
       "A channel stopped making progress (idle timeout). Causes range from the driver or the "
       "application to system memory corruption, bus errors, thermal trouble or FB corruption.",
       "driver", "RESTART_APP"),
    _x(13, "Graphics Engine Exception",
       "An SM raised an exception (out-of-range address, illegal instruction, misaligned "
       "access) while running a kernel: almost always the job's own bug. Runs of Xid 13 lines "
       "(warp, global, ESR) belong to one fault.",
       "application", "RESTART_APP"),
    _x(31, "GPU memory page fault",
       "MMU fault: a kernel or copy touched an address it had not mapped (illegal memory "
       "access). Points at the application or a library; rarely at the driver or hardware.",
       "application", "RESTART_APP"),
    _x(32, "Invalid or corrupted push buffer stream",
       "The command stream the GPU fetched from host memory was corrupt: PCIe bus errors, "
       "system memory corruption, or the driver.",
       "system", "RESTART_APP"),
    _x(38, "Driver firmware error",
       "A watchdog timeout in the graphics engine's context-switch firmware (FECS).",
       "driver", "IGNORE"),
    _x(43, "GPU stopped processing",
       "The driver reset a channel after an application fault (often right after Xid 13/31): "
       "the job died; the GPU is fine.",
       "application", "IGNORE"),
    _x(44, "Graphics Engine fault during context switch",
       "A fault while switching contexts on the graphics engine.",
       "driver", "IGNORE"),
    _x(45, "Preemptive cleanup, due to previous errors",
       "The driver tore down channels because of an earlier error (often a DBE hitting several "
       "CUDA applications, or the job being killed). Follow the Xid that preceded it.",
       "driver", "WORKFLOW_XID_45"),
    _x(46, "GPU stopped processing",
       "A GPU-wide timeout: the GPU stopped responding to work.",
       "driver", "RESET_GPU"),
    _x(48, "Double Bit ECC Error",
       "An uncorrectable (double-bit) ECC error in GPU memory. Data in flight may be corrupt; "
       "the page or row is retired/remapped at the next reset.",
       "memory", "WORKFLOW_XID_48", gpu=True, memory=True),
    _x(54, "Auxiliary power is not connected to the GPU board",
       "The board is not getting its auxiliary power and runs at reduced clocks.",
       "thermal_power", "CHECK_MECHANICALS"),
    _x(56, "Display Engine error",
       "An error in the display engine; not expected on compute GPUs.",
       "driver", "CONTACT_SUPPORT"),
    _x(57, "Error programming video memory interface",
       "The driver failed to program the framebuffer memory interface.",
       "hardware", "CONTACT_SUPPORT"),
    _x(58, "Unstable video memory interface detected",
       "EDC errors on the framebuffer interface: unstable memory link.",
       "hardware", "CONTACT_SUPPORT"),
    _x(61, "Internal micro-controller breakpoint/warning",
       "The GPU's PMU micro-controller hit a breakpoint or warning (older drivers).",
       "hardware", "CONTACT_SUPPORT"),
    _x(62, "Internal micro-controller halt",
       "The GPU's internal micro-controller halted: the GPU cannot continue without a reset.",
       "hardware", "RESET_GPU", gpu=True),
    _x(63, "GPU memory remapping event",
       "ECC page retirement or row remapping recorded a bad memory row (A100 and newer print "
       "'Row Remapper: New row marked for remapping, reset gpu to activate'). The remap takes "
       "effect at the next GPU reset; repeated events on one GPU mean failing memory.",
       "memory", "RESET_GPU", memory=True),
    _x(64, "GPU memory remapping failure",
       "A bad memory row could not be retired or remapped (no spare rows, or the InfoROM "
       "write failed): the GPU keeps faulting on that memory.",
       "memory", "RESET_GPU", gpu=True, memory=True),
    _x(65, "Video processor exception",
       "An exception in a video processor engine.",
       "hardware", "RESTART_APP"),
    _x(68, "NVDEC0 Exception",
       "An exception in the video decoder engine.",
       "hardware", "RESTART_APP"),
    _x(69, "Graphics Engine class error",
       "The graphics engine rejected a method of an object class: driver or application.",
       "driver", "RESTART_APP"),
    _x(73, "NVENC2 Error",
       "An error in the third video encoder engine.",
       "hardware", "RESTART_APP"),
    _x(74, "NVLink Error",
       "An NVLink link reported an error (link down, replay or CRC trouble, or a fatal error "
       "propagated from an NVSwitch SXid). Collective traffic over the link may be corrupted "
       "or stalled.",
       "nvlink", "WORKFLOW_NVLINK_ERR", gpu=True),
    _x(79, "GPU has fallen off the bus",
       "The GPU stopped answering on PCIe: power, thermal, PCIe link or board failure. Nothing "
       "on it can be trusted until the machine is rebooted.",
       "hardware", "RESTART_BM", gpu=True),
    _x(80, "Corrupted data sent to GPU",
       "The push buffer's CRC did not match: data was corrupted between host memory and the "
       "GPU (PCIe or system memory).",
       "system", "RESTART_APP"),
    _x(81, "VGA Subsystem Error",
       "An error in the VGA subsystem.",
       "hardware", "CONTACT_SUPPORT"),
    _x(92, "High single-bit ECC error rate",
       "Correctable ECC errors are arriving faster than expected: memory is degrading.",
       "memory", "CONTACT_SUPPORT", gpu=True, memory=True),
    _x(94, "Contained memory error",
       "An uncorrectable memory error was contained to the application that touched it; "
       "other work on the GPU continues. The row is remapped at the next reset.",
       "memory", "RESTART_APP", gpu=True, memory=True),
    _x(95, "Uncontained memory error",
       "An uncorrectable memory error could not be contained: every application on the GPU "
       "is affected and the GPU must be reset.",
       "memory", "RESET_GPU", gpu=True, memory=True),
    _x(109, "Context Switch Timeout Error",
       "A context switch did not finish in time (errorString CTX SWITCH TIMEOUT).",
       "driver", "RESET_GPU"),
    _x(110, "Security Fault Error",
       "A security fault in the GPU's protected firmware.",
       "hardware", "RESET_GPU"),
    _x(119, "GSP RPC Timeout",
       "The GPU System Processor (the firmware running the GPU) stopped answering driver "
       "requests; the GPU is unusable until it is reset.",
       "hardware", "RESET_GPU", gpu=True),
    _x(120, "GSP Error",
       "The GPU System Processor reported an error; the GPU needs a reset.",
       "hardware", "RESET_GPU", gpu=True),
    _x(121, "C2C Error",
       "A corrected error on the NVLink-C2C chip-to-chip link (Grace Hopper / Grace Blackwell).",
       "nvlink", "IGNORE"),
    _x(122, "SPI PMU RPC read failure",
       "Reading the GPU's SPI flash through the PMU failed.",
       "hardware", "CONTACT_SUPPORT"),
    _x(123, "SPI PMU RPC write failure",
       "Writing the GPU's SPI flash through the PMU failed.",
       "hardware", "CONTACT_SUPPORT"),
    _x(136, "Link Training Failed",
       "NVLink training (ALI) failed: the link did not come up.",
       "nvlink", "RESET_GPU"),
    _x(137, "NVLink Privilege Error",
       "A privileged NVLink register access was refused.",
       "nvlink", "IGNORE"),
    _x(140, "ECC Unrecovered Error",
       "An ECC error the GPU could not recover from (escaped containment).",
       "memory", "RESET_GPU", gpu=True, memory=True),
    _x(143, "GPU Initialization Error",
       "The GPU failed to initialise.",
       "hardware", "RESET_GPU"),
    _x(144, "NVLink SAW Error",
       "NVLink5 (Blackwell) SAW unit error; severity depends on the decoded status.",
       "nvlink", "WORKFLOW_NVLINK5_ERR"),
    _x(145, "NVLink RLW Error",
       "NVLink5 RLW (remap/link-layer) unit error.",
       "nvlink", "WORKFLOW_NVLINK5_ERR"),
    _x(146, "NVLink TLW Error",
       "NVLink5 TLW (transaction layer) unit error.",
       "nvlink", "WORKFLOW_NVLINK5_ERR"),
    _x(147, "NVLink TREX Error",
       "NVLink5 TREX unit error.",
       "nvlink", "WORKFLOW_NVLINK5_ERR"),
    _x(148, "NVLink NVLPW_CTRL Error",
       "NVLink5 NVLPW control unit error.",
       "nvlink", "WORKFLOW_NVLINK5_ERR"),
    _x(149, "NVLink NETIR Error",
       "NVLink5 NETIR unit error (link/network interface).",
       "nvlink", "WORKFLOW_NVLINK5_ERR"),
    _x(150, "NVLink MSE Error",
       "NVLink5 MSE unit error.",
       "nvlink", "WORKFLOW_NVLINK5_ERR"),
    _x(154, "GPU Recovery Action Changed",
       "Informational: the driver changed the recovery action the GPU needs (none, GPU reset, "
       "node reboot, drain P2P) because of another Xid; follow that Xid.",
       "driver", "FOLLOW_RECOVERY_ACTION"),
    _x(155, "NVLink SW Defined Error",
       "An NVLink error defined by software (Blackwell).",
       "nvlink", "RESET_GPU"),
)

#: The NVSwitch SXid catalog (Fabric Manager user guide), in code order.
SXID_TABLE: Final[tuple[SXidInfo, ...]] = (
    SXidInfo(10001, "Host_priv_error",
             "Not fatal by itself, but may be followed by fatal events.", False, False, "IGNORE"),
    SXidInfo(10004, "Host_thermal_event_start",
             "The switch is running hot; links may drop to single-lane mode and lose throughput.",
             False, False, "CHECK_COOLING"),
    SXidInfo(11001, "ingress invalid command",
             "Fatal on the port: GPU NVLink traffic through it stops.", True, False, "RESTART_BM"),
    SXidInfo(11004, "Ingress invalid ACL",
             "Incorrect fabric partition routing; GPU traffic stalls and CUDA jobs abort with Xid 45.",
             False, False, "RESTART_VM"),
    SXidInfo(11012, "Single bit ECC errors",
             "Corrected by the switch hardware; no impact.", False, False, "IGNORE"),
    SXidInfo(12020, "egress sequence ID error",
             "Always fatal to the whole fabric: reset every GPU and NVSwitch.", True, True, "RESTART_BM"),
    SXidInfo(12028, "egress non-posted PRIV error",
             "GPU NVLink traffic stalls and subsequent GPU access hangs; jobs abort with Xid 45.",
             False, False, "RESTART_VM"),
    SXidInfo(19084, "AN1 Heartbeat Timeout Error",
             "Usually accompanied by a fatal SXid affecting the GPU's NVLink traffic.",
             False, False, "RESET_FABRIC"),
    SXidInfo(20001, "TX Replay Error",
             "An NVLink packet had to be retransmitted; may cost throughput on the port.",
             False, False, "IGNORE"),
    SXidInfo(20012, "Broken/inconsistent connection",
             "A broken or inconsistent link connection, or an uncoordinated shutdown.",
             False, False, "CHECK_MECHANICALS"),
    SXidInfo(20034, "LTSSM Fault Up",
             "An NVLink link went down from active; usually comes with other NVLink errors and "
             "with Xid 74/79 on the GPU at the other end.", True, False, "RESET_GPU"),
    SXidInfo(22003, "Minion Halt",
             "Always fatal to the whole fabric.", True, True, "RESTART_BM"),
    SXidInfo(22012, "Minion Link NA interrupt",
             "Broken or inconsistent connection; potentially fatal on the port.", True, False, "CHECK_MECHANICALS"),
    SXidInfo(22013, "Minion Link DLREQ interrupt",
             "Can be safely ignored.", False, False, "IGNORE"),
    SXidInfo(24007, "sourcetrack timeout error",
             "Fatal on the port: requests through it timed out.", True, False, "RESTART_BM"),
)
# fmt: on

_XID_BY_CODE: Final = MappingProxyType({row.code: row for row in XID_TABLE})
_SXID_BY_CODE: Final = MappingProxyType({row.code: row for row in SXID_TABLE})

#: Xids that convict the GPU (and so its node) when one falls inside the incident window.
GPU_IMPLICATING: Final[frozenset[int]] = frozenset(r.code for r in XID_TABLE if r.implicates_gpu)
#: Xids about GPU memory: with ECC counter growth on the same GPU the cause is ``gpu_ecc``.
MEMORY_CLASS: Final[frozenset[int]] = frozenset(r.code for r in XID_TABLE if r.memory_related)
#: Xids that point at the job, never at the node.
APPLICATION_CLASS: Final[frozenset[int]] = frozenset(
    r.code for r in XID_TABLE if r.category == "application"
)
#: SXids the Fabric Manager guide calls fatal (port or fabric needs a reset).
SXID_FATAL: Final[frozenset[int]] = frozenset(r.code for r in SXID_TABLE if r.fatal)
#: SXids documented as non-fatal.
SXID_NON_FATAL: Final[frozenset[int]] = frozenset(r.code for r in SXID_TABLE if not r.fatal)


def lookup(code: int) -> XidInfo:
    """The catalog row for an Xid; an unknown code gets a neutral row (category ``unknown``,
    implicating nothing) so a new driver's new Xid is reported without convicting anyone."""
    row = _XID_BY_CODE.get(code)
    if row is not None:
        return row
    return XidInfo(code, f"Xid {code}", "Not in spikeops' Xid catalog.", "unknown", False, False, "CONTACT_SUPPORT")


def lookup_sxid(code: int) -> SXidInfo:
    """The catalog row for an NVSwitch SXid; unknown codes are neither fatal nor ignorable
    by the catalog's word (the line's own ``Fatal``/``Non-fatal`` still tells)."""
    row = _SXID_BY_CODE.get(code)
    if row is not None:
        return row
    return SXidInfo(code, f"SXid {code}", "Not in spikeops' SXid catalog.", False, False, "CONTACT_SUPPORT")
