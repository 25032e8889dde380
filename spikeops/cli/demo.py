"""``spikeops demo``: the whole pipeline on one machine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from spikeops.cli.common import EXIT_OK

from spikeops.errors import InputError, SpikeopsError

__all__ = ["add_demo"]


def _cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.demo import SCENARIOS, DemoOptions, run_demo, stop_demo

    if args.list:
        for name, what in SCENARIOS.items():
            out.write(f"{name:<24} {what}\n")
        return EXIT_OK
    if args.stop:
        out.write("stopped: " + ", ".join(stop_demo(args.stop)) + "\n")
        return EXIT_OK
    if args.scenario not in SCENARIOS:
        raise InputError(f"unknown scenario {args.scenario!r}; `spikeops demo --list` shows them")
    if not 2 <= args.nodes <= 64:
        raise InputError("--nodes: between 2 and 64")
    try:
        run_demo(DemoOptions(scenario=args.scenario, nodes=args.nodes, seed=args.seed, keep=args.keep,
                             directory=args.dir, scheduler=args.scheduler, monitoring=args.monitoring), out)
    except SpikeopsError:
        raise
    except Exception as exc:  # a daemon that would not start, a flow that failed: one line, what was built stays
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        err.write(f"spikeops demo: failed: {type(exc).__name__}: {first} (files kept in the demo directory)\n")
        return 1
    return EXIT_OK


def add_demo(commands: Any) -> None:
    demo = commands.add_parser(
        "demo", help="the whole pipeline on one machine: a cluster, a diverging job, the flow",
        description="Start a local cluster (one real sshd per node on loopback; the real Slurm when installed, "
        "else local processes), a training job that diverges as the scenario says, the watcher, and the incident "
        "flow on an ephemeral Prefect server. Prints each stage, the diagnosis, what was done and where the "
        "bundle, report, plot and Slack outbox are; then stops everything.")
    demo.add_argument("--scenario", default="gpu_xid", metavar="NAME",
                      help="the incident to stage (default gpu_xid: an Xid 79 on one node); see --list")
    demo.add_argument("--nodes", type=int, default=8, help="nodes in the job (2-64, default 8)")
    demo.add_argument("--seed", type=int, default=None, help="scenario seed (default: a fixed one)")
    demo.add_argument("--dir", type=Path, default=None, help="where the demo's files go (default: a new temp dir)")
    demo.add_argument("--scheduler", choices=("auto", "slurm", "local"), default="auto",
                      help="auto (default): the real Slurm when its daemons are installed and we are root")
    demo.add_argument("--monitoring", choices=("watcher", "prometheus"), default="watcher",
                      help="what notices the anomaly: spikeops' watcher (default), or the real Prometheus and "
                      "Alertmanager (Debian's packages, when installed) with the shipped rules, through the receiver")
    demo.add_argument("--keep", action="store_true", help="leave the cluster and jobs running (stop: --stop DIR)")
    demo.add_argument("--list", action="store_true", help="list the scenarios and exit")
    demo.add_argument("--stop", type=Path, metavar="DIR", help="stop what a --keep demo left running in DIR")
    demo.set_defaults(handler=_cmd_demo)
