"""``spikeops diagnose``: the four-layer diagnosis of a bundle."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TextIO

from spikeops.cli.common import EXIT_OK

__all__ = ["add_diagnose"]


def _cmd_diagnose(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.bundle import atomic_write
    from spikeops.diagnosis import diagnose
    from spikeops.diagnosis.report import render

    diagnosis = diagnose(args.bundle, workers=args.workers)
    document = diagnosis.to_json()
    text = json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False, default=str) + "\n"
    target = Path(args.bundle) / "diagnosis.json"
    if not args.no_write:
        try:
            atomic_write(target, text.encode())
        except OSError as exc:
            err.write(f"spikeops diagnose: could not write {target} ({exc.strerror or exc}); printing only\n")
    if args.json:
        out.write(text)
    else:
        render(diagnosis, out)
        if not args.no_write:
            out.write(f"\nwritten: {target}\n")
    return EXIT_OK


def add_diagnose(commands: Any) -> None:
    diag = commands.add_parser(
        "diagnose",
        help="name the cause of a loss spike or NaN from an incident bundle",
        description=(
            "Diagnose an incident bundle (shared/spec/bundle.md) with the four-layer framework: "
            "data, numeric, communication, hardware, then checkpoint integrity. Classifies the "
            "symptom from the step metrics, finds the spike and onset steps, names the primary "
            "cause with the evidence lines it rests on, the culprit nodes (the ones to isolate) "
            "and ranks, what was ruled out and what evidence was missing, the actions, and the "
            "newest verified checkpoint before the onset. Writes BUNDLE/diagnosis.json."
        ),
        epilog=(
            "Examples:\n"
            "  spikeops diagnose /incidents/inc-20261129T180312Z-4412\n"
            "  spikeops diagnose BUNDLE --json | jq .culprit_nodes\n"
            "Output format: shared/spec/diagnosis.md (format spikeops-diagnosis/1); action kinds in docs/diagnosis.md.\n"
            "Exit status: 0 a diagnosis was made (false_alarm included), 2 the bundle cannot be read."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diag.add_argument("bundle", metavar="BUNDLE", help="incident bundle directory (with incident.json)")
    diag.add_argument("--json", action="store_true", help="print only the diagnosis JSON on stdout")
    diag.add_argument("--no-write", action="store_true", help="do not write BUNDLE/diagnosis.json")
    diag.add_argument("--workers", type=int, default=None,
                      help="processes parsing node evidence (default: CPUs for 24+ nodes, else 1)")
    diag.set_defaults(handler=_cmd_diagnose)
