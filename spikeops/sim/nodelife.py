"""A simulated node's validation tools and its reboot, for the node lifecycle's tests and demo.

The nodes of ``spikeops.sim.cluster`` answer from files; this module changes those files the
way the node itself would change:

- ``set_tool(D, NODE, TOOL, MODE)`` installs a validation tool on one node (or removes it:
  ``MODE=None``, the tool is then not installed and not on the node's PATH):
  ``dcgmi`` prints a real ``dcgmi diag -r 2`` capture from ``shared/fixtures/real/dcgm``
  (``pass``: every test passed on 8 A100s; ``fail``: GPU Memory failed on GPU 0);
  ``all_reduce_perf`` (with ``mpirun``) prints nccl-tests' format, rendered here with its own
  ``PRINT`` formats (``pass``; ``wrong``: wrong elements, ``Out of bounds values : N FAILED``,
  exit 1; ``slow``: a tenth of the bandwidth; ``error``: ``Test NCCL failure ...``, exit 1);
  ``healthy-run``, the site's control, passes or fails (``fail``: a CUDA error, exit 1).
- ``reboot_node(D, NODE)`` is what a reboot does to the node's answers: its kernel log starts
  again (a new boot, dmesg's ISO form, now), optionally with Xids the fault prints again after
  the boot (a fault a reset does not clear), and its nvidia-smi page can be replaced by a
  healthy node's (the GPU is back). Slurm's RebootProgram (``slurmcluster``'s reboot hook) and
  the local scheduler's ``reboot-program`` call it through the command line below.

Command line: ``python -m spikeops.sim.nodelife tool --dir D NODE TOOL MODE|none`` and
``python -m spikeops.sim.nodelife reboot --dir D NODE [--smi-from NODE] [--xid PCI:CODE]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from spikeops.sim.nodetools import install_tool
from spikeops.sim.processes import ClusterError

__all__ = ["TOOL_MODES", "DCGM_FIXTURES", "set_tool", "reboot_node", "all_reduce_rows", "main"]

TOOL_MODES = {"dcgmi": ("pass", "fail"), "all_reduce_perf": ("pass", "wrong", "slow", "error"),
              "healthy-run": ("pass", "fail")}
#: Real ``dcgmi diag -r 2`` captures (shared/fixtures/real/dcgm) a node prints, by mode.
DCGM_FIXTURES = {"pass": "dcgm/dcgmi-diag-r2-p4de-a100-all-pass_awsome-distributed-training.txt",
                 "fail": "dcgm/dcgmi-diag-r2-gpu-memory-fail-thermal_ml-engineering.txt"}
_SIZES = [8 << 20 << k for k in range(8)]  # 8 MiB .. 1 GiB, factor 2 (``-b 8M -e 1G -f 2``)


def _node_dir(directory: str | Path, node: str) -> tuple[Path, Path]:
    root = Path(directory).resolve()
    folder = root / "nodes" / node
    if "/" in node or node.startswith(".") or not folder.is_dir():
        raise ClusterError(f"{node!r} is not a node of the simulated cluster in {root}")
    return root, folder


def _fmt(value: float, width: int) -> str:
    """nccl-tests' ``getFloatStr``: the most decimals that fit the column."""
    for text in (f"{value:{width}.2f}", f"{value:{width}.1f}", f"{value:{width}.0f}"):
        if len(text) <= width:
            return text
    return f"{value:{width}.1e}"


def all_reduce_rows(node: str, mode: str, ranks: int = 16) -> tuple[str, int]:
    """The table and footer ``all_reduce_perf`` prints after its rank lines (nccl-tests'
    formats), and its exit status, for one of ``TOOL_MODES['all_reduce_perf']``."""
    if mode == "error":
        return (f"{node}: Test NCCL failure common.cu:958 'unhandled system error (run with NCCL_DEBUG=INFO for "
                f"details) / '\n .. {node} pid 4100: Test failure common.cu:872\n"), 1
    lines = ["#", f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}           out-of-place                       "
                  "in-place          ",
             f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'time':>7}  {'algbw':>6}  "
             f"{'busbw':>6}  {'#wrong':>6}  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}",
             f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  {'(GB/s)':>6}  "
             f"{'(GB/s)':>6}  {'':>6}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}"]
    peak = 180.0 if mode != "slow" else 18.0
    total, wrong_total = 0.0, 0
    for index, size in enumerate(_SIZES):
        algbw = peak * (index + 1) / len(_SIZES)
        busbw = algbw * 2 * (ranks - 1) / ranks
        time_us = size / (algbw * 1e3)
        wrong = 3 if mode == "wrong" and index == 5 else 0
        wrong_total += wrong
        total += busbw
        half = f"  {_fmt(time_us, 7)}  {_fmt(algbw, 6)}  {_fmt(busbw, 6)}  {wrong:6g}"
        lines.append(f"{size:12d}  {size // 4:12d}  {'float':>8}  {'sum':>6}  {-1:6d}" + half + half)
    lines.append(f"# {'Out of bounds values':<20} : {wrong_total} {'FAILED' if wrong_total else 'OK'}")
    lines.append(f"# {'Avg bus bandwidth':<20} : {total / len(_SIZES):g} ")
    lines += ["#", "# Collective test concluded: all_reduce_perf", ""]
    return "\n".join(lines), 1 if wrong_total else 0


def set_tool(directory: str | Path, node: str, tool: str, mode: str | None, *, fixtures: str | Path | None = None
             ) -> None:
    """Install ``tool`` on ``node`` in ``mode`` (module docstring); ``mode=None`` removes it."""
    from spikeops.sim.cluster import default_fixtures

    if tool not in TOOL_MODES or (mode is not None and mode not in TOOL_MODES[tool]):
        raise ValueError(f"tool {tool!r} mode {mode!r}: known " + "; ".join(
            f"{t}: {', '.join(m)}" for t, m in TOOL_MODES.items()))
    root, folder = _node_dir(directory, node)
    umask = os.umask(0o022)
    try:
        if tool == "dcgmi":
            install_tool(root, folder, "dcgmi", mode is not None)
            if mode is None:
                (folder / "dcgmi-diag.txt").unlink(missing_ok=True)
                return
            source = Path(fixtures or default_fixtures()) / DCGM_FIXTURES[mode]
            if not source.is_file():
                raise ClusterError(f"{source}: the real dcgmi capture is missing (SPIKEOPS_REAL_FIXTURES)")
            _replace(folder / "dcgmi-diag.txt", source.read_bytes())
        elif tool == "all_reduce_perf":
            for name in ("all_reduce_perf", "mpirun"):
                install_tool(root, folder, name, mode is not None)
            if mode is None:
                (folder / "all_reduce_perf.rows").unlink(missing_ok=True)
                return
            rows, code = all_reduce_rows(node, mode)
            _replace(folder / "all_reduce_perf.exit", f"{code}\n".encode())
            _replace(folder / "all_reduce_perf.rows", rows.encode())
        else:
            _replace(folder / "healthy-run.mode", f"{mode or 'pass'}\n".encode())
    finally:
        os.umask(umask)


def _replace(path: Path, data: bytes) -> None:
    """Whole or not at all: a session reading meanwhile sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def reboot_node(directory: str | Path, node: str, *, smi_from: str | None = None,
                xids: Sequence[tuple[str, int]] = (), now: datetime | None = None) -> None:
    """A reboot of ``node`` as its answers show it (module docstring). ``xids``: ``(pci, code)``
    the fault prints again a few seconds after the boot; ``smi_from``: a node whose nvidia-smi
    page this one prints from now on (its GPUs back)."""
    from spikeops.probes.xid_catalog import lookup

    root, folder = _node_dir(directory, node)
    moment = (now or datetime.now(UTC)).astimezone(UTC)

    def stamp(seconds: float) -> str:
        return (moment + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S,%f+00:00")

    lines = [f"{stamp(0)} Linux version 6.1.0-spikeops-sim (spikeops sim) #1 SMP PREEMPT_DYNAMIC",
             f"{stamp(0.5)} Command line: BOOT_IMAGE=/boot/vmlinuz root=/dev/nvme0n1p2 ro",
             f"{stamp(4.2)} nvidia: module license 'NVIDIA' taints kernel.",
             f"{stamp(4.9)} NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.161.08"]
    for offset, (pci, code) in enumerate(xids):
        info = lookup(code)
        lines.append(f"{stamp(6 + offset)} NVRM: Xid (PCI:{pci}): {code}, pid=0, name=nvidia-persiste, "
                     f"{getattr(info, 'name', 'error')}")
    umask = os.umask(0o022)
    try:
        _replace(folder / "kernel.log", ("\n".join(lines) + "\n").encode())
        if smi_from is not None:
            _, other = _node_dir(root, smi_from)
            for name in ("nvidia-smi-q.txt", "nvidia-smi-q.xml"):
                if (other / name).is_file():
                    _replace(folder / name, (other / name).read_bytes())
    finally:
        os.umask(umask)


def _xid(text: str) -> tuple[str, int]:
    pci, sep, code = text.rpartition(":")
    if not sep or not pci or not code.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected PCI:CODE, e.g. 0000:4e:00:79")
    return pci, int(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spikeops.sim.nodelife",
                                     description="Change a simulated node's validation tools, or reboot it.")
    sub = parser.add_subparsers(dest="command", required=True)
    tool = sub.add_parser("tool", help="install a validation tool on a node in a mode, or remove it ('none')")
    tool.add_argument("--dir", required=True, type=Path)
    tool.add_argument("node")
    tool.add_argument("tool", choices=tuple(TOOL_MODES))
    tool.add_argument("mode")
    boot = sub.add_parser("reboot", help="what a reboot does to a node's answers")
    boot.add_argument("--dir", required=True, type=Path)
    boot.add_argument("node")
    boot.add_argument("--smi-from", help="a healthy node whose nvidia-smi page this node prints from now on")
    boot.add_argument("--xid", action="append", type=_xid, default=[], metavar="PCI:CODE",
                      help="an Xid the fault prints again after the boot (repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.command == "tool":
            set_tool(args.dir, args.node, args.tool, None if args.mode == "none" else args.mode)
        else:
            reboot_node(args.dir, args.node, smi_from=args.smi_from, xids=args.xid)
    except (ValueError, ClusterError, OSError) as exc:
        print(f"spikeops.sim.nodelife: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
