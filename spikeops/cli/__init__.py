"""The ``spikeops`` command line: one module per command group under ``spikeops.cli``.

Every failure a user can cause (a missing file, binary data, an unknown kind, a broken
bundle) ends in one line on stderr and exit status 2; a bug in spikeops ends in one line
and status 70, with the traceback only when ``SPIKEOPS_DEBUG=1``. Nobody debugging a loss
spike at 3 a.m. should have to read a Python traceback from their incident tool.

Only the command being run is built and imported in full: the others are listed for
``spikeops --help`` by name and one line. A command's start-up is then its own imports, not
every command's (``spikeops checkpoint verify`` of a warm checkpoint is a fraction of a
second, of which start-up was a third before). ``COMMANDS`` is the table: a new command is a
row here and an ``add_*`` function in its group's module.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from spikeops import __version__
from spikeops.cli.common import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE
from spikeops.errors import SpikeopsError

__all__ = ["main", "build_parser", "COMMANDS"]

#: (command, "module:function" that adds its full parser, the line ``spikeops --help`` shows).
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("parse", "spikeops.cli.parse:add_parse",
     "show what spikeops reads in a tool-output file, a captured sysfs tree, or a bundle"),
    ("diagnose", "spikeops.cli.diagnose:add_diagnose", "name the cause of a loss spike or NaN from an incident bundle"),
    ("collect", "spikeops.cli.collect:add_collect",
     "collect a job's evidence from every node over SSH into an incident bundle"),
    ("node-report", "spikeops.cli.parse:add_node_report",
     "print this node's NVML reading as nvml.json (run on a GPU node by the collector)"),
    ("checkpoint", "spikeops.cli.checkpoint:add_checkpoint",
     "write, verify and pick checkpoints by their MANIFEST.json (BLAKE3 or SHA-256)"),
    ("notify", "spikeops.cli.notify:add_notify",
     "post a bundle's diagnosis to Slack (thread, plot, summary) and write its report"),
    ("serve", "spikeops.cli.serve:add_serve", "serve the incident flow's deployment and the alert receiver"),
    ("worker", "spikeops.cli.serve:add_worker",
     "a work-pool worker that starts spikeops' flows warm (the scale-out layout)"),
    ("config", "spikeops.cli.serve:add_config", "check spikeops.toml"),
    ("baselines", "spikeops.baselines:add_baselines_parser",
     "refresh per-node baselines and run the healthy-run control"),
    ("watch", "spikeops.watch.cli:add_parser",
     "follow a job's metrics and start the incident flow on a NaN, spike, collapse, slowdown or stall"),
    ("incidents", "spikeops.ledger.cli:add_incidents_parser",
     "the incidents in the ledger: list, show one, report their cost"),
    ("ledger", "spikeops.ledger.cli:add_ledger_parser",
     "the ledger itself: import bundles, write spooled entries, migrate, show which"),
    ("demo", "spikeops.cli.demo:add_demo", "the whole pipeline on one machine: a cluster, a diverging job, the flow"),
    ("nodes", "spikeops.cli.scheduler:add_nodes",
     "drain, reboot, validate, release and list the nodes spikeops isolated"),
    ("job", "spikeops.cli.scheduler:add_job", "stop, preserve and resume a job"),
)


def _adder(target: str):
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def build_parser(command: str | None = None, *, full: bool = False) -> argparse.ArgumentParser:
    """The parser with ``command`` alone, in full, when it is one of ours (a parser per command
    costs a few milliseconds, and a command's start-up is what a user waits for); otherwise
    every command as a one-line entry, to list them and to refuse an unknown one. ``full``:
    every command in full."""
    parser = argparse.ArgumentParser(
        prog="spikeops",
        description=(
            "Incident pipeline for loss spikes and NaNs in large GPU training runs: reads the "
            "evidence real tools print on real nodes, diagnoses it layer by layer (data, numeric, "
            "communication, hardware), and acts on the scheduler."
        ),
        epilog="Exit status: 0 success, 2 bad input (one-line reason on stderr), 70 internal error. "
               "`spikeops COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"spikeops {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    known = any(name == command for name, _, _ in COMMANDS)
    for name, target, summary in COMMANDS:
        if full or name == command:
            _adder(target)(commands)
        elif not known:
            commands.add_parser(name, help=summary)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the top-level
    parser has options only, and none of them takes a value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(words))
    args = parser.parse_args(words)
    if getattr(args, "handler", None) is None:
        parser.print_help(out)
        return EXIT_USAGE
    try:
        return int(args.handler(args, out, err))
    except SpikeopsError as exc:
        err.write(f"spikeops {args.command}: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.write("\nspikeops: interrupted\n")
        return 130
    except BrokenPipeError:
        # `spikeops parse big.log --json | head`: the reader left; that is not an error.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return EXIT_OK
    except Exception as exc:  # the last line of defence: never a traceback by default
        if os.environ.get("SPIKEOPS_DEBUG"):
            import traceback

            traceback.print_exc(file=err)
        err.write(
            f"spikeops {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(set SPIKEOPS_DEBUG=1 for the traceback and report it)\n"
        )
        return EXIT_INTERNAL
