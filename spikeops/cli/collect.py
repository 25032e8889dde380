"""``spikeops collect``: a job's evidence from every node over SSH into a bundle."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from spikeops.cli.common import EXIT_NOTHING, EXIT_OK

__all__ = ["add_collect"]


def _collect_progress(stream: TextIO):
    """A one-line progress counter on a terminal; nothing when piped or in CI logs."""
    if not stream.isatty():
        return None
    failed = 0

    def show(done: int, total: int, result: Any) -> None:
        nonlocal failed
        failed += result.outcome != "ok"
        stream.write(f"\r  collecting: {done}/{total} nodes ({failed} not ok)")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show


def _cmd_collect(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.collect import collect
    from spikeops.inventory import expand_nodes, load_inventory

    inventory = load_inventory(args.inventory)
    nodes = expand_nodes(args.nodes) if args.nodes else None
    result = collect(inventory, args.job, args.out, nodes=nodes, baseline=args.baseline, replace=args.replace,
                     fanout=args.fanout, progress=None if args.json else _collect_progress(err))
    if args.json:
        out.write(json.dumps(result.to_json(), indent=2) + "\n")
    else:
        for line in result.summary_lines():
            out.write(line + "\n")
    return EXIT_OK if result.buckets()["ok"] or any(r.probes for r in result.nodes) else EXIT_NOTHING


def add_collect(commands: Any) -> None:
    coll = commands.add_parser(
        "collect",
        help="collect a job's evidence from every node over SSH into an incident bundle",
        description=(
            "Fan out over SSH to the job's nodes (one connection per node, at most [ssh] fanout at "
            "once) and run the bundle spec's probes on each: nvidia-smi -q, the kernel log with "
            "wall-clock times, ethtool -S for each interface, ibstat, the InfiniBand sysfs "
            "counters, the job's NCCL and training log lines, and nvml.json where spikeops is "
            "installed on the node. Host keys are checked strictly against known_hosts. Every "
            "probe has a timeout and an output cap; a node that is down, silent, refuses the key "
            "or hangs is recorded in its probes.json and in the summary, never fatal. Writes "
            "OUT/nodes/NODE/ (OUT/nodes/NODE/baseline/ with --baseline), and OUT/incident.json "
            "when OUT has none."
        ),
        epilog=(
            "The inventory (TOML: nodes, [ssh] user/port/identity_file/known_hosts/jump_host/"
            "timeouts/fanout, [hosts], [job] log paths, [probes.NAME] overrides) is described in "
            "docs/inventory.md; ~/.ssh/config fills in what it leaves unset.\n"
            "Examples:\n"
            "  spikeops collect --inventory cluster.toml --job 4412 --out /incidents/inc-4412\n"
            "  spikeops collect --inventory cluster.toml --job 4412 --nodes 'gpu-[001-064]' --out B\n"
            "  spikeops collect --inventory cluster.toml --job 4412 --baseline --out /baselines/4412\n"
            "Exit status: 0 the bundle was written (failed nodes are recorded in it), 1 no node "
            "could be reached, 2 bad input (inventory, job id, nodes, OUT already holding evidence)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    coll.add_argument("--inventory", "-i", required=True, metavar="FILE", help="cluster inventory (docs/inventory.md)")
    coll.add_argument("--job", "-j", required=True, metavar="JOB", help="job id (fills {job} in the [job] log paths)")
    coll.add_argument("--out", "-o", required=True, metavar="DIR", help="bundle directory to write into")
    coll.add_argument("--nodes", "-w", metavar="NODESET",
                      help="the job's nodes, as a node set (default: every node of the inventory)")
    coll.add_argument("--baseline", action="store_true", help="write into nodes/*/baseline/ (a healthy reference)")
    coll.add_argument("--replace", action="store_true", help="replace evidence already collected into DIR")
    coll.add_argument("--fanout", type=int, default=None, help="connections at once (default: [ssh] fanout)")
    coll.add_argument("--json", action="store_true", help="print the per-node results as JSON")
    coll.set_defaults(handler=_cmd_collect)
