#!/usr/bin/env python3
"""Accuracy of `spikeops diagnose` on generated incidents it has never seen. Run by hand.

Draws N incidents at random (cause, seed, node count, GPUs per node, run length) from
spikeops.sim, each with its distractors, diagnoses each one, and counts:
- cause + culprits: the primary cause and the exact culprit node set are right;
- healthy drained: incidents where a node not at fault was put in ``culprit_nodes``;
- symptom, resume_from: each right.
The generator encodes the spec and the seed's domain, not the engine's rules; still, it is
our own generator: treat the figure as an upper bound on what truly unseen incidents give.

Usage: python bench/eval_diagnosis.py [--incidents 300] [--seed 7]
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spikeops.diagnosis import diagnose  # noqa: E402
from spikeops.sim import CAUSES, build_bundle  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--incidents", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    scratch = Path(tempfile.mkdtemp(prefix="spikeops-eval-"))
    totals = collections.Counter()
    misses = collections.Counter()
    try:
        for index in range(args.incidents):
            cause = rng.choice(CAUSES)
            shape = dict(nodes=rng.choice([3, 4, 6, 8, 12, 16, 24]), gpus_per_node=rng.choice([4, 8]),
                         steps=rng.choice([300, 600, 1500, 4000]))
            bundle = scratch / f"{index:04d}"
            expected = build_bundle(bundle, cause, seed=rng.randrange(10**6), **shape)
            got = diagnose(bundle).to_json()
            right = got["primary"]["cause"] == expected.cause and got["culprit_nodes"] == sorted(expected.culprit_nodes)
            totals["incidents"] += 1
            totals["cause+culprits"] += right
            totals["symptom"] += got["symptom"] == expected.symptom
            totals["resume_from"] += got["resume_from"] == expected.resume_from
            totals["healthy drained"] += bool(set(got["culprit_nodes"]) - set(expected.culprit_nodes))
            if not right:
                misses[cause] += 1
                print(f"miss: {cause} {shape} -> {got['primary']['cause']} {got['culprit_nodes']}", file=sys.stderr)
            shutil.rmtree(bundle)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    n = totals["incidents"]
    print(f"{n} incidents (seed {args.seed})")
    for key in ("cause+culprits", "symptom", "resume_from"):
        print(f"  {key}: {totals[key]}/{n} ({100 * totals[key] / n:.1f} %)")
    print(f"  healthy node drained: {totals['healthy drained']} incident(s)")
    if misses:
        print(f"  misses by cause: {dict(misses)}")


if __name__ == "__main__":
    main()
