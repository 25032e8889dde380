"""``spikeops parse`` (what spikeops reads in a file, a sysfs tree or a bundle) and
``spikeops node-report`` (a node's NVML reading)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TextIO

from spikeops.cli.common import EXIT_OK, EXIT_USAGE

from spikeops.jsonable import to_jsonable
from spikeops.probes.base import clip
from spikeops.textio import ReadReport

__all__ = ["add_parse", "add_node_report"]


def _progress_printer(stream: TextIO):
    """A progress line for long reads, only on an interactive terminal."""
    if not stream.isatty():
        return None

    def show(report: ReadReport) -> None:
        if report.size and not report.compressed:
            share = min(100.0, 100.0 * report.bytes_read / report.size)
            stream.write(f"\r  reading {report.path}: {share:5.1f}% ({report.lines:,} lines)")
        else:
            stream.write(f"\r  reading {report.path}: {report.lines:,} lines")
        stream.flush()

    return show


def _print_reading(reading: Any, out: TextIO) -> None:
    how = f"detected, confidence {reading.confidence:.2f}" if reading.detected else "as requested"
    command = f" (`{clip(reading.kind.command, 60)}`)" if reading.kind.command else ""
    out.write(f"{reading.path}: {reading.kind.name}{command} [{how}]\n")
    try:
        summary = reading.kind.summarize(reading.result)
    except Exception as exc:  # a summary bug must not hide the parse
        summary = [f"(summary unavailable: {exc})"]
    for line in summary:
        out.write(f"  {line}\n")
    if reading.gaps:
        out.write(f"  not read ({len(reading.gaps)}):\n")
        for gap in reading.gaps[:20]:
            where = f"line {gap.line}: " if gap.line else ""
            out.write(f"    - {where}{gap.reason}\n")
        if len(reading.gaps) > 20:
            out.write(f"    - ... and {len(reading.gaps) - 20} more (see --json)\n")


def _reading_json(reading: Any) -> dict[str, Any]:
    return {
        "path": reading.path,
        "kind": reading.kind.name,
        "command": reading.kind.command,
        "detected": reading.detected,
        "confidence": reading.confidence,
        "result": to_jsonable(reading.result),
        "gaps": [{"line": gap.line, "reason": gap.reason} for gap in reading.gaps],
        "read": {
            "lines": reading.report.lines,
            "bytes": reading.report.bytes_read,
            "compressed": reading.report.compressed,
        },
    }


def _cmd_parse(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.probes import kind_names, registry

    if args.list_kinds:
        kinds = {kind.name: kind for kind in registry().values()}
        for name in sorted(kinds):
            kind = kinds[name]
            out.write(f"{name:22} {kind.description}\n")
        return EXIT_OK
    if not args.file:
        err.write("spikeops parse: a FILE is required (or --list-kinds)\n")
        return EXIT_USAGE
    target = Path(args.file)
    if target.is_dir() and (target / "incident.json").exists() and args.kind is None:
        from spikeops.bundle_view import describe_bundle, print_bundle

        description = describe_bundle(target)
        if args.json:
            out.write(json.dumps(to_jsonable(description), indent=2, allow_nan=True) + "\n")
        else:
            print_bundle(description, out)
        return EXIT_OK
    from spikeops.reading import read_evidence

    if args.kind is not None and args.kind not in kind_names():
        err.write(f"spikeops parse: unknown kind {args.kind!r}; known: {', '.join(kind_names())}\n")
        return EXIT_USAGE
    progress = None if args.json else _progress_printer(err)
    reading = read_evidence(target, args.kind, progress=progress)
    if progress is not None and reading.report.lines >= 200_000:
        err.write("\n")
    if args.json:
        out.write(json.dumps(_reading_json(reading), indent=2, ensure_ascii=False, allow_nan=True) + "\n")
    else:
        _print_reading(reading, out)
    return EXIT_OK


def _cmd_node_report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.probes.nvml import collect as read_nvml

    document = read_nvml(xid_wait=args.xid_wait)
    out.write(json.dumps(document, indent=2, allow_nan=False, default=str) + "\n")
    return EXIT_OK


def add_parse(commands: Any) -> None:
    parse = commands.add_parser(
        "parse",
        help="show what spikeops reads in a tool-output file, a captured sysfs tree, or a bundle",
        description=(
            "Read FILE the way the diagnosis will, and show what was read: the detected kind of "
            "tool output (nvidia-smi, kernel log with Xid events, ethtool -S, InfiniBand, NCCL, "
            "training logs, DCGM, Slurm, bundle files), a summary of its values, and every part "
            "that could not be read. FILE may be gzip-compressed. A directory is read as a "
            "captured /sys/class/infiniband tree, or as an incident bundle (incident.json inside)."
        ),
        epilog=(
            "Examples:\n"
            "  spikeops parse nodes/gpu-003/kernel.log\n"
            "  spikeops parse --kind ethtool ethtool-ib0.txt --json | jq .result.counters\n"
            "  spikeops parse examples/bundle-xid79\n"
            "Exit status: 0 read (possibly with gaps), 2 unreadable or unrecognised input."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parse.add_argument("file", nargs="?", metavar="FILE", help="file, sysfs tree or bundle directory")
    parse.add_argument("--kind", help="parse as this kind instead of detecting it (see --list-kinds)")
    parse.add_argument("--json", action="store_true", help="print the full parse as JSON on stdout")
    parse.add_argument("--list-kinds", action="store_true", help="list the kinds of evidence spikeops reads")
    parse.set_defaults(handler=_cmd_parse)


def add_node_report(commands: Any) -> None:
    report = commands.add_parser(
        "node-report",
        help="print this node's NVML reading as nvml.json (run on a GPU node by the collector)",
        description=(
            "Read every GPU on this node through NVML (nvidia-ml-py): ECC counters, remapped rows, "
            "retired pages, clock event reasons, temperatures, power, and the Xid events NVML "
            "delivers while listening. Prints the nvml.json document (format spikeops-nvml/1, "
            "docs/bundle.md). A node without a driver prints a document whose error says so."
        ),
    )
    report.add_argument("--xid-wait", type=float, default=0.0, metavar="SECONDS",
                        help="listen this long for Xid events (NVML keeps no history; default 0: do not listen)")
    report.set_defaults(handler=_cmd_node_report)
