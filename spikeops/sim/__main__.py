"""``python -m spikeops.sim CAUSE OUTDIR``: write one simulated bundle, print its answer."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from spikeops.sim.build import build_bundle
from spikeops.sim.model import CAUSES, DISTRACTORS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spikeops.sim",
        description="Write a synthetic incident bundle with one planted cause; print the expected diagnosis.",
    )
    parser.add_argument("cause", choices=CAUSES)
    parser.add_argument("outdir", type=Path, help="bundle directory to create (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rank-steps", type=int, default=None)
    parser.add_argument("--no-distractors", action="store_true")
    parser.add_argument("--distractor", action="append", choices=DISTRACTORS, default=None,
                        help="plant exactly this distractor (repeatable)")
    parser.add_argument("--write-expected", action="store_true",
                        help="also write diagnosis.expected.json into the bundle")
    parser.add_argument("--force", action="store_true", help="replace OUTDIR if it is an existing bundle")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 with the answer on stdout; 2 with a one-line reason for a bad request."""
    args = _parser().parse_args(argv)
    out: Path = args.outdir
    if args.force and (out / "incident.json").is_file():
        shutil.rmtree(out)
    distractors = False if args.no_distractors else (args.distractor if args.distractor else True)
    try:
        expected = build_bundle(out, args.cause, seed=args.seed, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                steps=args.steps, rank_steps=args.rank_steps, distractors=distractors,
                                write_diagnosis_expected=args.write_expected)
    except (ValueError, FileExistsError) as exc:
        sys.stderr.write(f"spikeops.sim: {exc}\n")
        return 2
    sys.stdout.write(json.dumps(expected.to_dict(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
