"""Node tool output, rendered byte-for-byte the way the real tools print it.

Each renderer is modelled on real captures in shared/fixtures/real/: ``nvidia-smi -q`` on
the R535 8x H100 page (key column padded to 42, four-space nesting, ``Clocks Event
Reasons``; R525 still says ``Clocks Throttle Reasons``), the kernel log in the four
timestamped forms the bundle spec lists plus plain ``dmesg``, mlx5 ``ethtool -S``,
infiniband-diags ``ibstat`` (tab-indented), the sysfs counters as ``grep -H .`` prints
them, and ``NCCL_DEBUG=INFO`` init lines with PyTorch's glog-prefixed watchdog lines.

A diagnosis should find the fault in these files the way a person would, from values and
messages, never from anything the simulator alone would write: there is no marker, no
ordering and no naming that differs between a culprit and a healthy node except the
evidence itself.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta, timezone

from spikeops.sim.plan import ECC_KEYS, GpuState, IbPort, KernelEvent, NodeState, Plan
from spikeops.sim.world import World, rand_hex

__all__ = [
    "KV_WIDTH",
    "ctime",
    "render_smi",
    "smi_lost_stderr",
    "KERNEL_COMMANDS",
    "kernel_noise",
    "render_kernel",
    "render_ethtool",
    "ethtool_counters",
    "render_ibstat",
    "ib_counter_defaults",
    "render_ib_counters",
    "render_nccl",
    "render_nccl_version",
    "NCCL_VERSION_COMMANDS",
    "glog_stamp",
    "nccl_warn_prefix",
    "busid_nccl",
    "xid_lines",
    "pci_of",
]

#: nvidia-smi -q (R535 and older) pads every ``key`` to this column before ``: value``.
KV_WIDTH = 42

_DOW = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MON = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def ctime(moment: float) -> str:
    """C's ctime layout (``Wed Jun  7 19:32:16 2023``), in UTC."""
    t = datetime.fromtimestamp(moment, UTC)
    return f"{_DOW[t.weekday()]} {_MON[t.month - 1]} {t.day:2d} {t:%H:%M:%S} {t.year}"


def pci_of(bus: str) -> str:
    """The kernel's name for a GPU in Xid lines: ``0000:5d:00``."""
    return f"0000:{bus.lower()}:00"


# ------------------------------------------------------------------------------ nvidia-smi


def _kv(indent: int, key: str, value: object) -> str:
    return f"{' ' * indent + key:<{KV_WIDTH}}: {value}"


def _section(indent: int, key: str) -> str:
    return " " * indent + key


def _active(flag: bool) -> str:
    return "Active" if flag else "Not Active"


def _ecc_lines(world: World, gpu: GpuState, baseline: bool) -> list[str]:
    now = gpu.ecc_base if baseline else gpu.ecc_now
    life = gpu.ecc_lifetime
    hopper = world.gpu.hopper
    out = [_section(4, "ECC Errors")]
    for title, values in (("Volatile", now), ("Aggregate", {k: now[k] + life[k] for k in ECC_KEYS})):
        out.append(_section(8, title))
        out.append(_kv(12, "SRAM Correctable", values["sram_corr"]))
        if hopper:
            out.append(_kv(12, "SRAM Uncorrectable Parity", values["sram_unc_parity"]))
            out.append(_kv(12, "SRAM Uncorrectable SEC-DED", values["sram_unc_secded"]))
        else:
            out.append(_kv(12, "SRAM Uncorrectable", values["sram_unc_parity"] + values["sram_unc_secded"]))
        out.append(_kv(12, "DRAM Correctable", values["dram_corr"]))
        out.append(_kv(12, "DRAM Uncorrectable", values["dram_unc"]))
        if hopper and title == "Aggregate":
            out.append(_kv(12, "SRAM Threshold Exceeded", "No"))
    if hopper:
        out.append(_section(8, "Aggregate Uncorrectable SRAM Sources"))
        for name in ("SRAM L2", "SRAM SM", "SRAM Microcontroller", "SRAM PCIE", "SRAM Other"):
            out.append(_kv(12, name, 0))
    return out


def _gpu_lines(world: World, node: NodeState, gpu: GpuState, baseline: bool, flush: float) -> list[str]:
    model = world.gpu
    idle = baseline
    r535 = not world.driver.startswith("525")
    corr, unc, pending, failure = gpu.remap_base if baseline else gpu.remap_now
    thermal = gpu.thermal and not baseline
    temp = (27 + gpu.index % 5) if idle else gpu.temp_c
    mem_temp = (36 + gpu.index % 4) if idle else gpu.mem_temp_c
    power = 68.0 + gpu.index * 0.53 if idle else gpu.power_w
    sm_clock = 345 if idle else gpu.sm_clock_mhz
    used = 0 if idle else gpu.mem_used_mib
    util = 0 if idle else gpu.util_pct
    bus = gpu.bus
    lines = [
        f"GPU 00000000:{bus}:00.0",
        _kv(4, "Product Name", model.product),
        _kv(4, "Product Brand", "NVIDIA"),
        _kv(4, "Product Architecture", model.architecture),
        _kv(4, "Display Mode", "Enabled" if model.hopper else "Disabled"),
        _kv(4, "Display Active", "Disabled"),
        _kv(4, "Persistence Mode", "Enabled"),
    ]
    if r535:
        lines.append(_kv(4, "Addressing Mode", "None"))
    lines += [
        _section(4, "MIG Mode"), _kv(8, "Current", "Disabled"), _kv(8, "Pending", "Disabled"),
        _kv(4, "Accounting Mode", "Disabled"),
        _kv(4, "Accounting Mode Buffer Size", 4000),
        _section(4, "Driver Model"), _kv(8, "Current", "N/A"), _kv(8, "Pending", "N/A"),
        _kv(4, "Serial Number", gpu.serial),
        _kv(4, "GPU UUID", gpu.uuid),
        _kv(4, "Minor Number", gpu.index),
        _kv(4, "VBIOS Version", model.vbios),
        _kv(4, "MultiGPU Board", "No"),
        _kv(4, "Board ID", f"0x{int(bus, 16):x}00"),
        _kv(4, "Board Part Number", model.board_part),
        _kv(4, "GPU Part Number", model.gpu_part),
        _kv(4, "FRU Part Number", "N/A"),
        _kv(4, "Module ID", gpu.module_id),
        _section(4, "Inforom Version"),
        _kv(8, "Image Version", model.inforom),
        _kv(8, "OEM Object", "2.1"),
        _kv(8, "ECC Object", "7.16" if model.hopper else "6.16"),
        _kv(8, "Power Management Object", "N/A"),
        _section(4, "Inforom BBX Object Flush"),
        _kv(8, "Latest Timestamp", datetime.fromtimestamp(flush, UTC).strftime("%Y/%m/%d %H:%M:%S.")
            + f"{int(flush * 1000) % 1000:03d}"),
        _kv(8, "Latest Duration", f"{87000 + gpu.index * 613} us"),
        _section(4, "GPU Operation Mode"), _kv(8, "Current", "N/A"), _kv(8, "Pending", "N/A"),
        _kv(4, "GSP Firmware Version", world.driver if model.hopper else "N/A"),
        _section(4, "GPU Virtualization Mode"),
        _kv(8, "Virtualization Mode", "None"),
        _kv(8, "Host VGPU Mode", "N/A"),
    ]
    if r535:
        lines += [
            _section(4, "GPU Reset Status"),
            _kv(8, "Reset Required", "Yes" if gpu.reset_required and not baseline else "No"),
            _kv(8, "Drain and Reset Recommended", "No"),
        ]
    lines += [
        _section(4, "IBMNPU"), _kv(8, "Relaxed Ordering Mode", "N/A"),
        _section(4, "PCI"),
        _kv(8, "Bus", f"0x{bus}"),
        _kv(8, "Device", "0x00"),
        _kv(8, "Domain", "0x0000"),
        _kv(8, "Device Id", model.device_id),
        _kv(8, "Bus Id", f"00000000:{bus}:00.0"),
        _kv(8, "Sub System Id", model.subsystem_id),
        _section(8, "GPU Link Info"),
        _section(12, "PCIe Generation"),
        _kv(16, "Max", model.pcie_gen),
        _kv(16, "Current", model.pcie_gen if not idle else 1),
        _kv(16, "Device Current", model.pcie_gen if not idle else 1),
        _kv(16, "Device Max", model.pcie_gen),
        _kv(16, "Host Max", model.pcie_gen),
        _section(12, "Link Width"),
        _kv(16, "Max", "16x"),
        _kv(16, "Current", "16x"),
        _section(8, "Bridge Chip"), _kv(12, "Type", "N/A"), _kv(12, "Firmware", "N/A"),
        _kv(8, "Replays Since Reset", gpu.pcie_replays),
        _kv(8, "Replay Number Rollovers", 0),
        _kv(8, "Tx Throughput", f"{(3875 if idle else 412000) + gpu.index * 97} KB/s"),
        _kv(8, "Rx Throughput", f"{(574 if idle else 398000) + gpu.index * 61} KB/s"),
        _kv(8, "Atomic Caps Inbound", "N/A"),
        _kv(8, "Atomic Caps Outbound", "FETCHADD_32 FETCHADD_64 SWAP_32 SWAP_64 CAS_32 CAS_64"),
        _kv(4, "Fan Speed", "N/A"),
        _kv(4, "Performance State", "P0"),
        _section(4, "Clocks Event Reasons" if r535 else "Clocks Throttle Reasons"),
        _kv(8, "Idle", _active(idle)),
        _kv(8, "Applications Clocks Setting", "Not Active"),
        _kv(8, "SW Power Cap", "Not Active"),
        _kv(8, "HW Slowdown", _active(thermal)),
        _kv(12, "HW Thermal Slowdown", _active(thermal)),
        _kv(12, "HW Power Brake Slowdown", "Not Active"),
        _kv(8, "Sync Boost", "Not Active"),
        _kv(8, "SW Thermal Slowdown", _active(thermal)),
        _kv(8, "Display Clock Setting", "Not Active"),
    ]
    if r535:
        lines.append(_kv(4, "Sparse Operation Mode", "Disabled"))
    lines += [
        _section(4, "FB Memory Usage"),
        _kv(8, "Total", f"{model.fb_total_mib} MiB"),
        _kv(8, "Reserved", f"{model.fb_reserved_mib} MiB"),
        _kv(8, "Used", f"{used} MiB"),
        _kv(8, "Free", f"{model.fb_total_mib - model.fb_reserved_mib - used} MiB"),
        _section(4, "BAR1 Memory Usage"),
        _kv(8, "Total", f"{model.bar1_mib} MiB"),
        _kv(8, "Used", f"{1 if idle else 37} MiB"),
        _kv(8, "Free", f"{model.bar1_mib - (1 if idle else 37)} MiB"),
    ]
    if r535:
        lines += [
            _section(4, "Conf Compute Protected Memory Usage"),
            _kv(8, "Total", "0 MiB"), _kv(8, "Used", "0 MiB"), _kv(8, "Free", "0 MiB"),
        ]
    lines += [
        _kv(4, "Compute Mode", "Default"),
        _section(4, "Utilization"),
        _kv(8, "Gpu", f"{util} %"),
        _kv(8, "Memory", f"{0 if idle else max(0, util - 38)} %"),
        _kv(8, "Encoder", "0 %"),
        _kv(8, "Decoder", "0 %"),
    ]
    if r535:
        lines += [_kv(8, "JPEG", "0 %"), _kv(8, "OFA", "0 %")]
    lines += [
        _section(4, "Encoder Stats"),
        _kv(8, "Active Sessions", 0), _kv(8, "Average FPS", 0), _kv(8, "Average Latency", 0),
        _section(4, "FBC Stats"),
        _kv(8, "Active Sessions", 0), _kv(8, "Average FPS", 0), _kv(8, "Average Latency", 0),
        _section(4, "ECC Mode"), _kv(8, "Current", "Enabled"), _kv(8, "Pending", "Enabled"),
    ]
    lines += _ecc_lines(world, gpu, baseline)
    lines += [
        _section(4, "Retired Pages"),
        _kv(8, "Single Bit ECC", "N/A"),
        _kv(8, "Double Bit ECC", "N/A"),
        _kv(8, "Pending Page Blacklist", "N/A"),
        _section(4, "Remapped Rows"),
        _kv(8, "Correctable Error", corr),
        _kv(8, "Uncorrectable Error", unc),
        _kv(8, "Pending", "Yes" if pending else "No"),
        _kv(8, "Remapping Failure Occurred", "Yes" if failure else "No"),
        _section(8, "Bank Remap Availability Histogram"),
        _kv(12, "Max", f"{model.remap_banks - min(corr + unc, 1)} bank(s)"),
        _kv(12, "High", f"{min(corr + unc, 1)} bank(s)"),
        _kv(12, "Partial", "0 bank(s)"),
        _kv(12, "Low", "0 bank(s)"),
        _kv(12, "None", "0 bank(s)"),
        _section(4, "Temperature"),
        _kv(8, "GPU Current Temp", f"{temp} C"),
    ]
    if model.hopper:
        lines += [
            _kv(8, "GPU T.Limit Temp", f"{85 - temp} C"),
            _kv(8, "GPU Shutdown T.Limit Temp", "-8 C"),
            _kv(8, "GPU Slowdown T.Limit Temp", "-2 C"),
            _kv(8, "GPU Max Operating T.Limit Temp", "0 C"),
            _kv(8, "GPU Target Temperature", "N/A"),
            _kv(8, "Memory Current Temp", f"{mem_temp} C"),
            _kv(8, "Memory Max Operating T.Limit Temp", "0 C"),
        ]
    else:
        lines += [
            _kv(8, "GPU Shutdown Temp", "92 C"),
            _kv(8, "GPU Slowdown Temp", "89 C"),
            _kv(8, "GPU Max Operating Temp", "85 C"),
            _kv(8, "GPU Target Temperature", "N/A"),
            _kv(8, "Memory Current Temp", f"{mem_temp} C"),
            _kv(8, "Memory Max Operating Temp", "95 C"),
        ]
    limit = f"{model.power_limit_w:.2f} W"
    if r535:
        lines += [
            _section(4, "GPU Power Readings"),
            _kv(8, "Power Draw", f"{power:.2f} W"),
            _kv(8, "Current Power Limit", limit),
            _kv(8, "Requested Power Limit", limit),
            _kv(8, "Default Power Limit", limit),
            _kv(8, "Min Power Limit", f"{model.min_power_w:.2f} W"),
            _kv(8, "Max Power Limit", limit),
            _section(4, "Module Power Readings"),
        ] + [_kv(8, k, "N/A") for k in ("Power Draw", "Current Power Limit", "Requested Power Limit",
                                         "Default Power Limit", "Min Power Limit", "Max Power Limit")]
    else:
        lines += [
            _section(4, "Power Readings"),
            _kv(8, "Power Management", "Supported"),
            _kv(8, "Power Draw", f"{power:.2f} W"),
            _kv(8, "Power Limit", limit),
            _kv(8, "Default Power Limit", limit),
            _kv(8, "Enforced Power Limit", limit),
            _kv(8, "Min Power Limit", f"{model.min_power_w:.2f} W"),
            _kv(8, "Max Power Limit", limit),
        ]
    mem_clock = model.max_memory_mhz
    lines += [
        _section(4, "Clocks"),
        _kv(8, "Graphics", f"{sm_clock} MHz"),
        _kv(8, "SM", f"{sm_clock} MHz"),
        _kv(8, "Memory", f"{mem_clock} MHz"),
        _kv(8, "Video", f"{765 if idle else 1080} MHz"),
        _section(4, "Applications Clocks"),
        _kv(8, "Graphics", f"{model.max_graphics_mhz} MHz"),
        _kv(8, "Memory", f"{mem_clock} MHz"),
        _section(4, "Default Applications Clocks"),
        _kv(8, "Graphics", f"{model.max_graphics_mhz} MHz"),
        _kv(8, "Memory", f"{mem_clock} MHz"),
        _section(4, "Deferred Clocks"),
        _kv(8, "Memory", "N/A"),
        _section(4, "Max Clocks"),
        _kv(8, "Graphics", f"{model.max_graphics_mhz} MHz"),
        _kv(8, "SM", f"{model.max_graphics_mhz} MHz"),
        _kv(8, "Memory", f"{mem_clock} MHz"),
        _kv(8, "Video", f"{model.max_video_mhz} MHz"),
        _section(4, "Max Customer Boost Clocks"),
        _kv(8, "Graphics", f"{model.max_graphics_mhz} MHz"),
        _section(4, "Clock Policy"),
        _kv(8, "Auto Boost", "N/A"),
        _kv(8, "Auto Boost Default", "N/A"),
        _section(4, "Voltage"),
        _kv(8, "Graphics", f"{(670.0 if idle else 885.0) + gpu.index * 5:.3f} mV"),
    ]
    if model.hopper:
        lines += [_section(4, "Fabric"), _kv(8, "State", "Completed"), _kv(8, "Status", "Success")]
    if idle:
        lines.append(_kv(4, "Processes", "None"))
    else:
        lines += [
            _section(4, "Processes"),
            _kv(8, "GPU instance ID", "N/A"),
            _kv(8, "Compute instance ID", "N/A"),
            _kv(8, "Process ID", node.pid_base + gpu.index),
            _kv(12, "Type", "C"),
            _kv(12, "Name", "/usr/bin/python3"),
            _kv(12, "Used GPU Memory", f"{used - 530} MiB"),
        ]
    return lines


def render_smi(world: World, node: NodeState, moment: float, *, baseline: bool) -> str:
    """``nvidia-smi -q`` of a node at ``moment``: the current page (under load) or the
    baseline taken when the job started (idle, before the job's processes)."""
    lines = [
        "",
        "==============NVSMI LOG==============",
        "",
        _kv(0, "Timestamp", ctime(moment)),
        _kv(0, "Driver Version", world.driver),
        _kv(0, "CUDA Version", world.cuda),
        "",
        _kv(0, "Attached GPUs", len(node.gpus)),
    ]
    flush = node.boot + 37.0
    for position, gpu in enumerate(node.gpus):
        if position:
            lines.append("")
        lines += _gpu_lines(world, node, gpu, baseline, flush + gpu.index * 60.2)
    return "\n".join(lines) + "\n"


def smi_lost_stderr(bus: str) -> str:
    """What nvidia-smi prints when a GPU fell off the bus: it cannot get the device handle."""
    return f"Unable to determine the device handle for GPU0000:{bus}:00.0: Unknown Error\n"


# ------------------------------------------------------------------------------ kernel log

#: The command each kernel-log form comes from (probes.json).
KERNEL_COMMANDS = {
    "iso": "dmesg --time-format iso",
    "iso-x": "dmesg -x --time-format iso",
    "ctime": "dmesg -T",
    "journal": "journalctl -k -o short-iso-precise --no-pager",
    "plain": "dmesg",
}
_LEVEL_PAD = {"emerg": "emerg ", "alert": "alert ", "crit": "crit  ", "err": "err   ", "warn": "warn  ",
              "notice": "notice", "info": "info  ", "debug": "debug "}


_KERNELS = (
    ("5.15.0-112-generic", "(buildd@lcy02-amd64-051) (gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0, GNU ld (GNU "
                           "Binutils for Ubuntu) 2.38) #122-Ubuntu SMP Thu May 23 07:48:21 UTC 2024"),
    ("5.15.0-119-generic", "(buildd@lcy02-amd64-082) (gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0, GNU ld (GNU "
                           "Binutils for Ubuntu) 2.38) #129-Ubuntu SMP Fri Aug 2 19:25:20 UTC 2024"),
    ("6.5.0-1024-nvidia", "(buildd@lcy02-amd64-045) (x86_64-linux-gnu-gcc-12 (Ubuntu 12.3.0-1ubuntu1~22.04) "
                          "12.3.0, GNU ld (GNU Binutils for Ubuntu) 2.38) #25-Ubuntu SMP PREEMPT_DYNAMIC"),
    ("5.14.0-427.42.1.el9_4.x86_64", "(mockbuild@iad1-prod-build001.bld.equ.rockylinux.org) (gcc (GCC) 11.4.1 "
                                     "20231218 (Red Hat 11.4.1-3), GNU ld version 2.35.2-43.el9) #1 SMP PREEMPT_DYNAMIC"),
)


def _boot_messages(world: World, node: NodeState, rng: random.Random) -> list[tuple[float, str, str]]:
    kernel, banner = random.Random(world.job_id).choice(_KERNELS)  # one image per cluster
    driver = world.driver
    out = [
        (0.0, "notice", f"Linux version {kernel} {banner}"),
        (0.0, "info", f"Command line: BOOT_IMAGE=/boot/vmlinuz-{kernel} root=UUID={rand_hex(rng, 8)}-"
                      f"{rand_hex(rng, 4)}-{rand_hex(rng, 4)}-{rand_hex(rng, 4)}-{rand_hex(rng, 12)} ro iommu=pt "
                      "pci=realloc=off"),
        (0.0, "info", "x86/fpu: Supporting XSAVE feature 0x001: 'x87 floating point registers'"),
        (0.004, "info", "BIOS-provided physical RAM map:"),
        (1.208, "info", "ACPI: Added _OSI(Module Device)"),
        (3.911, "info", "EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode. Opts: (null). "
                        "Quota mode: none."),
        (12.44, "warn", "nvidia: loading out-of-tree module taints kernel."),
        (12.45, "warn", "nvidia: module license 'NVIDIA' taints kernel."),
        (12.71, "info", "nvidia-nvlink: Nvlink Core is being initialized, major device number 235"),
        (12.94, "info", f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {driver}  Thu Feb 22 23:51:52 UTC 2024"),
        (13.02, "info", f"nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver for UNIX platforms  {driver}  "
                        "Thu Feb 22 23:38:04 UTC 2024"),
        (13.40, "info", "nvidia_uvm: module uses symbols nvUvmInterfaceDisableAccessCntr from proprietary module "
                        "nvidia, inheriting taint."),
        (14.05, "info", "nvidia-peermem nv_mem_init:525 nvidia_peermem: initialized"),
    ]
    for i, hca in enumerate(world.hcas + world.eth_hcas):
        slot = 0x0C + 0x10 * i
        out.append((9.2 + i * 0.21, "info", f"mlx5_core 0000:{slot:02x}:00.0: firmware version: {world.gpu.hca_fw}"))
        out.append((9.3 + i * 0.21, "info", f"mlx5_core 0000:{slot:02x}:00.0: 252.048 Gb/s available PCIe bandwidth "
                                            "(16.0 GT/s PCIe x16 link)"))
    for i, iface in enumerate(world.ifaces):
        out.append((21.7 + i, "info", f"IPv6: ADDRCONF(NETDEV_CHANGE): {iface}: link becomes ready"))
    return out


_RUNTIME_NOISE = (
    ("warn", "perf: interrupt took too long ({a} > {b}), lowering kernel.perf_event_max_sample_rate to {c}"),
    ("info", "hrtimer: interrupt took {a} ns"),
    ("warn", "TCP: request_sock_TCP: Possible SYN flooding on port {port}. Sending cookies.  Check SNMP counters."),
    ("info", "docker0: port 1(veth{h}) entered forwarding state"),
    ("notice", "audit: type=1400 audit({a}.{b}:{c}): apparmor=\"STATUS\" operation=\"profile_replace\" "
               "profile=\"unconfined\" name=\"docker-default\" pid={c} comm=\"apparmor_parser\""),
    ("info", "IPVS: rr: TCP 10.96.0.1:443 - no destination available"),
    ("info", "nvidia-nvswitch{d}: open (major=508)"),
    ("warn", "nfs: server storage{d} not responding, still trying"),
    ("info", "nfs: server storage{d} OK"),
    ("info", "Process accounting resumed"),
    ("info", "EXT4-fs (nvme1n1): re-mounted. Opts: (null). Quota mode: none."),
)


def kernel_noise(world: World, node: NodeState, rng: random.Random, end: float) -> list[KernelEvent]:
    """The boring bulk of a node's kernel log: boot messages, then sparse runtime noise."""
    events = [KernelEvent(node.boot + offset, level, [message]) for offset, level, message in
              _boot_messages(world, node, rng)]
    for _ in range(rng.randrange(4, 28)):
        level, template = rng.choice(_RUNTIME_NOISE)
        moment = rng.uniform(node.boot + 60.0, end)
        text = template.format(a=rng.randrange(2501, 30000), b=2500, c=rng.randrange(10000, 99999),
                               port=rng.choice((29500, 29400, 6379)), h=rand_hex(rng, 7), d=rng.randrange(0, 4))
        events.append(KernelEvent(moment, level, [text]))
    return events


def _iso(moment: float, tz_minutes: int, sep: str, colon: bool) -> str:
    zone = timezone(timedelta(minutes=tz_minutes))
    t = datetime.fromtimestamp(moment, zone)
    sign = "+" if tz_minutes >= 0 else "-"
    hours, minutes = divmod(abs(tz_minutes), 60)
    offset = f"{sign}{hours:02d}:{minutes:02d}" if colon else f"{sign}{hours:02d}{minutes:02d}"
    return f"{t:%Y-%m-%dT%H:%M:%S}{sep}{t.microsecond:06d}{offset}"


def render_kernel(node: NodeState, events: Iterable[KernelEvent], *, fmt: str, tz_minutes: int) -> str:
    """A kernel log in one of the forms the spec lists. Continuation lines of a multi-line
    message (the crash-dump notice) are indented under it, as dmesg and journalctl print
    them."""
    lines: list[str] = []
    ordered = sorted(events, key=lambda e: e.time)
    if fmt == "journal" and ordered:
        first = datetime.fromtimestamp(ordered[0].time, UTC)
        lines.append(f"-- Logs begin at {_DOW[first.weekday()]} {first:%Y-%m-%d %H:%M:%S} UTC. --")
    for event in ordered:
        for k, message in enumerate(event.messages):
            if k and message.startswith(" "):
                lines.append(message)
                continue
            moment = event.time + k * 0.000011
            if fmt == "iso":
                lines.append(f"{_iso(moment, tz_minutes, ',', True)} {message}")
            elif fmt == "iso-x":
                lines.append(f"kern  :{_LEVEL_PAD[event.level]}: {_iso(moment, tz_minutes, ',', True)} {message}")
            elif fmt == "ctime":
                lines.append(f"[{ctime(moment)}] {message}")
            elif fmt == "journal":
                lines.append(f"{_iso(moment, tz_minutes, '.', False)} {node.name} kernel: {message}")
            else:
                uptime = event.uptime if event.uptime is not None else moment - node.boot
                uptime += k * 0.000011
                seconds = int(uptime)
                lines.append(f"[{seconds:5d}.{int(round((uptime - seconds) * 1e6)) % 1000000:06d}] {message}")
    return "\n".join(lines) + "\n"


_XID_TEXT = {
    13: ("'<unknown>'", "<unknown>", "Graphics SM Warp Exception on (GPC {a}, TPC {b}, SM 0): Out Of Range Address"),
    31: ("{pid}", "python3", "Ch 0000001{b}, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_{b} faulted @ "
                            "0x{h}_4a000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"),
    43: ("{pid}", "pt_main_thread", "Ch 00000008"),
    48: ("{pid}", "pt_main_thread", "An uncorrectable double bit error (DBE) has been detected on GPU in the "
                                   "framebuffer at partition {a}, subpartition 0."),
    62: ("{pid}", "pt_main_thread", "{h}({hh}) 00000000 00000000"),
    63: ("'<unknown>'", "<unknown>", "Row Remapper: New row marked for remapping, reset gpu to activate."),
    64: ("'<unknown>'", "<unknown>", "Row Remapper: Failed to record row remapping, reset gpu to activate."),
    74: ("{pid}", "pt_main_thread", "NVLink: fatal error detected on link {a}(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"),
    79: ("'<unknown>'", "<unknown>", "GPU has fallen off the bus."),
    94: ("{pid}", "pt_main_thread", "Contained: SM (0x1). RST: No, D-RST: No"),
    95: ("'<unknown>'", "<unknown>", "Uncontained: FBHUB. RST: Yes, D-RST: No"),
    119: ("{pid}", "pt_main_thread", "Timeout after 6s of waiting for RPC response from GPU{g} GSP! Expected function "
                                    "76 (GSP_RM_CONTROL) (0x20800a4c 0x4)."),
    120: ("{pid}", "pt_main_thread", "GSP task exception: load access fault"),
}


def xid_lines(code: int, gpu: GpuState, pid: int, rng: random.Random) -> list[str]:
    """The kernel messages an Xid comes with, the way the driver prints them."""
    pci = pci_of(gpu.bus)
    pid_text, name, template = _XID_TEXT[code]
    fill = {"a": rng.randrange(0, 12), "b": rng.randrange(0, 8), "h": rand_hex(rng, 4), "hh": rand_hex(rng, 4),
            "g": gpu.index, "pid": pid}
    message = template.format(**fill)
    xid = f"NVRM: Xid (PCI:{pci}): {code}, pid={pid_text.format(**fill)}, name={name}, {message}"
    if code == 79:
        return [
            f"NVRM: GPU at PCI:{pci}: {gpu.uuid}",
            f"NVRM: GPU Board Serial Number: {gpu.serial}",
            xid,
            f"NVRM: GPU {pci}.0: GPU has fallen off the bus.",
            "NVRM: A GPU crash dump has been created. If possible, please run",
            "              NVRM: nvidia-bug-report.sh as root to collect this data before",
            "              NVRM: the NVIDIA kernel module is unloaded.",
        ]
    if code in (48, 62, 74, 94, 95, 119, 120):
        return [f"NVRM: GPU at PCI:{pci}: {gpu.uuid}", f"NVRM: GPU Board Serial Number: {gpu.serial}", xid]
    return [xid]


# ---------------------------------------------------------------------------------- ethtool

_ETH_GLOBAL = (
    "rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "tx_tso_packets", "tx_tso_bytes", "tx_tso_inner_packets",
    "tx_tso_inner_bytes", "tx_added_vlan_packets", "tx_nop", "rx_lro_packets", "rx_lro_bytes", "rx_ecn_mark",
    "rx_removed_vlan_packets", "rx_csum_unnecessary", "rx_csum_none", "rx_csum_complete", "rx_csum_complete_tail",
    "rx_csum_complete_tail_slow", "rx_csum_unnecessary_inner", "rx_xdp_drop", "rx_xdp_redirect", "tx_csum_partial",
    "tx_csum_partial_inner", "tx_queue_stopped", "tx_queue_dropped", "tx_xmit_more", "tx_recover", "tx_cqes",
    "tx_queue_wake", "tx_cqe_err", "rx_wqe_err", "rx_mpwqe_filler_cqes", "rx_mpwqe_filler_strides",
    "rx_oversize_pkts_sw_drop", "rx_buff_alloc_err", "rx_cqe_compress_blks", "rx_cqe_compress_pkts",
    "rx_cache_reuse", "rx_cache_full", "rx_cache_empty", "rx_cache_busy", "rx_cache_waive", "rx_congst_umr",
    "rx_arfs_err", "rx_recover", "ch_events", "ch_poll", "ch_arm", "ch_aff_change", "ch_force_irq", "ch_eq_rearm",
    "rx_out_of_buffer", "rx_if_down_packets", "rx_steer_missed_packets",
    "rx_vport_unicast_packets", "rx_vport_unicast_bytes", "tx_vport_unicast_packets", "tx_vport_unicast_bytes",
    "rx_vport_multicast_packets", "rx_vport_multicast_bytes", "tx_vport_multicast_packets",
    "tx_vport_multicast_bytes", "rx_vport_broadcast_packets", "rx_vport_broadcast_bytes",
    "tx_vport_broadcast_packets", "tx_vport_broadcast_bytes", "rx_vport_rdma_unicast_packets",
    "rx_vport_rdma_unicast_bytes", "tx_vport_rdma_unicast_packets", "tx_vport_rdma_unicast_bytes",
    "rx_vport_rdma_multicast_packets", "rx_vport_rdma_multicast_bytes", "tx_vport_rdma_multicast_packets",
    "tx_vport_rdma_multicast_bytes", "tx_packets_phy", "rx_packets_phy", "rx_crc_errors_phy", "tx_bytes_phy",
    "rx_bytes_phy", "tx_multicast_phy", "tx_broadcast_phy", "rx_multicast_phy", "rx_broadcast_phy",
    "rx_in_range_len_errors_phy", "rx_out_of_range_len_phy", "rx_oversize_pkts_phy", "rx_symbol_err_phy",
    "tx_mac_control_phy", "rx_mac_control_phy", "rx_unsupported_op_phy", "rx_pause_ctrl_phy", "tx_pause_ctrl_phy",
    "rx_discards_phy", "tx_discards_phy", "tx_errors_phy", "rx_undersize_pkts_phy", "rx_fragments_phy",
    "rx_jabbers_phy", "rx_64_bytes_phy", "rx_65_to_127_bytes_phy", "rx_128_to_255_bytes_phy",
    "rx_256_to_511_bytes_phy", "rx_512_to_1023_bytes_phy", "rx_1024_to_1518_bytes_phy",
    "rx_1519_to_2047_bytes_phy", "rx_2048_to_4095_bytes_phy", "rx_4096_to_8191_bytes_phy",
    "rx_8192_to_10239_bytes_phy", "link_down_events_phy", "rx_pcs_symbol_err_phy", "rx_corrected_bits_phy",
    "rx_err_lane_0_phy", "rx_err_lane_1_phy", "rx_err_lane_2_phy", "rx_err_lane_3_phy",
    "rx_buffer_passed_thres_phy", "rx_pci_signal_integrity", "tx_pci_signal_integrity",
    "outbound_pci_buffer_overflow", "outbound_pci_stalled_rd", "outbound_pci_stalled_wr",
    "outbound_pci_stalled_rd_events", "outbound_pci_stalled_wr_events",
)
_TRAFFIC = {"rx_packets", "tx_packets", "rx_vport_unicast_packets", "tx_vport_unicast_packets",
            "rx_vport_rdma_unicast_packets", "tx_vport_rdma_unicast_packets", "tx_packets_phy", "rx_packets_phy",
            "rx_csum_unnecessary", "tx_csum_partial", "tx_cqes", "ch_events", "ch_poll", "ch_arm",
            "rx_cache_reuse", "rx_1519_to_2047_bytes_phy", "rx_4096_to_8191_bytes_phy", "tx_tso_packets",
            "rx_65_to_127_bytes_phy", "rx_vport_multicast_packets", "rx_multicast_phy", "tx_xmit_more"}
_BYTES = {"rx_bytes", "tx_bytes", "rx_vport_unicast_bytes", "tx_vport_unicast_bytes", "rx_vport_rdma_unicast_bytes",
          "tx_vport_rdma_unicast_bytes", "tx_bytes_phy", "rx_bytes_phy", "tx_tso_bytes",
          "rx_vport_multicast_bytes"}


def ethtool_counters(rng: random.Random, hours: float, scale: float) -> dict[str, int]:
    """A healthy mlx5 port's ``ethtool -S`` counters after ``hours`` of traffic (priority 3
    carries RoCE; its counters are the ones congestion moves)."""
    out: dict[str, int] = {}
    packets = int(hours * 3600 * 1.9e6 * scale * rng.uniform(0.8, 1.2))
    for name in _ETH_GLOBAL:
        if name in _BYTES:
            out[name] = packets * rng.randrange(3800, 4200)
        elif name in _TRAFFIC:
            out[name] = int(packets * rng.uniform(0.05, 1.0))
        elif name in ("rx_csum_none", "rx_cache_full", "rx_cache_busy", "rx_cache_empty", "rx_cache_waive"):
            out[name] = rng.randrange(0, 500)
        elif name == "rx_corrected_bits_phy":
            out[name] = rng.randrange(0, 40)
        elif name == "link_down_events_phy":
            out[name] = rng.choice((0, 1, 1, 2))
        else:
            out[name] = 0
    for prio in range(8):
        share = 0.93 if prio == 3 else (0.06 if prio == 0 else 0.0)
        out[f"rx_prio{prio}_bytes"] = int(out["rx_bytes_phy"] * share)
        out[f"rx_prio{prio}_packets"] = int(out["rx_packets_phy"] * share)
        out[f"rx_prio{prio}_discards"] = 0
        out[f"tx_prio{prio}_bytes"] = int(out["tx_bytes_phy"] * share)
        out[f"tx_prio{prio}_packets"] = int(out["tx_packets_phy"] * share)
    for name in ("rx_prio3_pause", "rx_prio3_pause_duration", "tx_prio3_pause", "tx_prio3_pause_duration",
                 "rx_prio3_pause_transition", "tx_pause_storm_warning_events", "tx_pause_storm_error_events",
                 "rx_global_pause", "tx_global_pause", "tx_global_pause_duration", "module_unplug",
                 "module_bus_stuck", "module_high_temp", "module_bad_shorted"):
        out[name] = 0
    for channel in range(4):
        share = packets // 4
        out[f"ch{channel}_events"] = int(share * 0.02)
        out[f"ch{channel}_poll"] = int(share * 0.021)
        out[f"ch{channel}_arm"] = int(share * 0.019)
        out[f"ch{channel}_aff_change"] = rng.randrange(0, 9)
        out[f"ch{channel}_eq_rearm"] = 0
        out[f"rx{channel}_packets"] = share
        out[f"rx{channel}_bytes"] = share * 4096
        out[f"rx{channel}_csum_complete"] = 0
        out[f"rx{channel}_csum_unnecessary"] = share
        out[f"rx{channel}_csum_none"] = 0
        out[f"rx{channel}_buff_alloc_err"] = 0
        out[f"rx{channel}_cache_reuse"] = share // 2
        out[f"rx{channel}_recover"] = 0
        out[f"tx{channel}_packets"] = int(share * 0.97)
        out[f"tx{channel}_bytes"] = int(share * 0.97) * 4096
        out[f"tx{channel}_nop"] = rng.randrange(0, 200)
        out[f"tx{channel}_stopped"] = 0
        out[f"tx{channel}_dropped"] = 0
        out[f"tx{channel}_cqe_err"] = 0
    return out


def render_ethtool(values: dict[str, int]) -> str:
    """``ethtool -S``: a header, then ``     name: value`` in the driver's order."""
    return "NIC statistics:\n" + "".join(f"     {name}: {value}\n" for name, value in values.items())


# --------------------------------------------------------------------------------- ibstat


def render_ibstat(ports: list[IbPort]) -> str:
    """infiniband-diags 47 ``ibstat``: one CA block per HCA, tab-indented, sorted by name."""
    blocks = []
    for port in sorted(ports, key=lambda p: p.hca):
        infiniband = port.link_layer == "InfiniBand" and port.state != "Down"
        rate = port.now_rate if port.now_rate is not None else port.rate
        blocks.append(
            f"CA '{port.hca}'\n\tCA type: {port.ca_type}\n\tNumber of ports: 1\n\tFirmware version: {port.fw}\n"
            f"\tHardware version: 0\n\tNode GUID: {port.guid}\n\tSystem image GUID: {port.guid}\n"
            f"\tPort {port.port}:\n\t\tState: {port.state}\n\t\tPhysical state: {port.phys}\n\t\tRate: {rate}\n"
            f"\t\tBase lid: {port.base_lid if infiniband else 0}\n\t\tLMC: 0\n"
            f"\t\tSM lid: {port.sm_lid if infiniband else 0}\n"
            f"\t\tCapability mask: {'0xa751e848' if port.link_layer == 'InfiniBand' else '0x00010000'}\n"
            f"\t\tPort GUID: {port.guid if port.link_layer == 'InfiniBand' else '0x' + port.guid[2:8] + 'fffe' + port.guid[12:]}\n"
            f"\t\tLink layer: {port.link_layer}\n"
        )
    return "".join(blocks)


def ib_counter_defaults(rng: random.Random, hours: float, busy: bool) -> dict[str, int]:
    """A healthy port's ``counters/`` after ``hours`` (data counters in 4-byte words)."""
    words = int(hours * 3600 * (2.2e9 if busy else 3.0e5) * rng.uniform(0.8, 1.2))
    packets = words // 1024 + rng.randrange(1000)
    return {
        "VL15_dropped": 0,
        "excessive_buffer_overrun_errors": 0,
        "link_downed": rng.choice((0, 0, 0, 1)),
        "link_error_recovery": rng.choice((0, 0, 0, 1, 2)),
        "local_link_integrity_errors": 0,
        "multicast_rcv_packets": rng.randrange(0, 3000),
        "multicast_xmit_packets": rng.randrange(0, 300),
        "port_rcv_constraint_errors": 0,
        "port_rcv_data": words,
        "port_rcv_errors": 0,
        "port_rcv_packets": packets,
        "port_rcv_remote_physical_errors": 0,
        "port_rcv_switch_relay_errors": 0,
        "port_xmit_constraint_errors": 0,
        "port_xmit_data": int(words * rng.uniform(0.97, 1.03)),
        "port_xmit_discards": 0,
        "port_xmit_packets": int(packets * rng.uniform(0.97, 1.03)),
        "port_xmit_wait": int(hours * 3600 * rng.uniform(20.0, 4000.0 if busy else 5.0)),
        "symbol_error": 0,
        "unicast_rcv_packets": packets,
        "unicast_xmit_packets": int(packets * rng.uniform(0.97, 1.03)),
    }


def render_ib_counters(ports: list[IbPort], *, baseline: bool) -> str:
    """``grep -H . /sys/class/infiniband/*/ports/*/counters/*``: the glob sorts devices and
    counter names in byte order, so ``VL15_dropped`` comes first."""
    lines = []
    for port in sorted(ports, key=lambda p: p.hca):
        if not port.in_counters:
            continue
        values = port.base if baseline else port.now
        prefix = f"/sys/class/infiniband/{port.hca}/ports/{port.port}/counters/"
        lines.extend(f"{prefix}{name}:{values[name]}" for name in sorted(values))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ NCCL

#: The command each nccl-version.txt form comes from (probes.json).
NCCL_VERSION_COMMANDS = {
    "tuple": "python3 -c 'import torch; print(torch.cuda.nccl.version())'",
    "dotted": "python3 -c 'import torch; print(\".\".join(map(str, torch.cuda.nccl.version())))'",
    "banner": "NCCL_DEBUG=VERSION python3 -c 'import torch, torch.distributed'",
    "library": "readlink -f /usr/lib/x86_64-linux-gnu/libnccl.so.2",
}


def render_nccl_version(version: str, form: str) -> str:
    """``nccl-version.txt`` in the form its probe command prints (see NCCL_VERSION_COMMANDS)."""
    plain = version.split("+")[0]
    major, minor, patch = plain.split(".")
    if form == "tuple":
        return f"({major}, {minor}, {patch})\n"
    if form == "dotted":
        return f"{plain}\n"
    if form == "banner":
        return f"NCCL version {version}\n"
    return f"/usr/lib/x86_64-linux-gnu/libnccl.so.{plain}\n"


def busid_nccl(bus: str) -> str:
    """NCCL prints the PCI bus id as a bare hex number: 0x0b → ``b000``, 0x5d → ``5d000``."""
    return f"{int(bus, 16):x}000"


def glog_stamp(moment: float) -> str:
    """The c10/glog prefix stamp ``E1129 18:01:02.123456`` (no year)."""
    t = datetime.fromtimestamp(moment, UTC)
    return f"{t:%m%d %H:%M:%S}.{t.microsecond:06d}"


def nccl_warn_prefix(world: World, moment: float) -> str:
    """NCCL 2.23+ stamps its WARN lines (``NCCL_DEBUG_TIMESTAMP_FORMAT`` ``[%F %T] ``)."""
    major, minor = (int(x) for x in world.nccl.split("+")[0].split(".")[:2])
    if (major, minor) >= (2, 23):
        return datetime.fromtimestamp(moment, UTC).strftime("[%Y-%m-%d %H:%M:%S] ")
    return ""


def render_nccl(plan: Plan, node: NodeState, rng: random.Random) -> str:
    """The NCCL_DEBUG=INFO init lines each local rank printed, and any warnings after."""
    world = plan.world
    version = node.nccl_version
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    nranks = world.ranks
    ranks = world.ranks_of_node(node.index)
    hca_list = " ".join(f"[{i}]{h}:1/{'IB' if world.fabric == 'ib' else 'RoCE'}" for i, h in enumerate(world.hcas))
    bootstrap_ip = node.ip
    init: list[tuple[float, str]] = []
    for local, rank in enumerate(ranks):
        pid = node.pid_base + local
        tid = pid + rng.randrange(60, 240)
        host = f"{node.name}:{pid}"
        dev = f"[{local}]"
        t0 = local * 0.013 + rng.random() * 0.01
        init.append((t0, f"{host}:{pid} {dev} NCCL INFO Bootstrap : Using {world.bootstrap_if}:{bootstrap_ip}<0>"))
        init.append((t0 + 0.001, f"{host}:{pid} {dev} NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), "
                                 "using internal implementation"))
        if rank == 0 or (local == 0 and world.node_version_lines):
            init.append((t0 + 0.002, f"{host}:{pid} {dev} NCCL INFO NCCL version {version}"))
        init.append((t0 + 0.21, f"{host}:{tid} {dev} NCCL INFO NET/IB : Using {hca_list} ; OOB "
                                f"{world.bootstrap_if}:{bootstrap_ip}<0>"))
        init.append((t0 + 0.22, f"{host}:{tid} {dev} NCCL INFO Using network IB"))
        comm = f"0x{rng.randrange(0x550000000000, 0x560000000000) & ~0xF:x}"
        busid = busid_nccl(node.gpus[local].bus) if local < len(node.gpus) else "0"
        if (major, minor) >= (2, 19):
            tail = f"cudaDev {local} nvmlDev {local} busId {busid} commId 0x{world.extra['comm_id']} - Init COMPLETE"
        else:
            tail = f"cudaDev {local} busId {busid} - Init COMPLETE"
        init.append((t0 + 1.7 + rng.random() * 0.2, f"{host}:{tid} {dev} NCCL INFO comm {comm} rank {rank} "
                                                    f"nranks {nranks} {tail}"))
    lines = [text for _, text in sorted(init)]
    timed = sorted((line for line in node.nccl_lines if line.time is not None), key=lambda line: line.time or 0.0)
    lines.extend(line.text for line in timed)
    lines.extend(line.text for line in node.nccl_lines if line.time is None)
    return "\n".join(lines) + "\n"
