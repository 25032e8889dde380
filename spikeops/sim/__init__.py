"""Synthetic incident bundles with known answers: the independent test bed of the diagnosis.

``build_bundle(path, cause, seed=...)`` writes a bundle (shared/spec/bundle.md) in which one
cause of the diagnosis spec (shared/spec/diagnosis.md) is planted, with realistic healthy
evidence around it and a seeded set of distractors, and returns the ``Expected`` answer.
The simulator encodes the spec and the domain, never the engine's rules, so a diagnosis
that passes it has learnt the evidence, not the generator. Ground-truth conventions are
documented in ``spikeops.sim.model``.

Command line: ``python -m spikeops.sim CAUSE OUTDIR [--seed N] [--nodes N] [--steps N]
[--no-distractors]`` writes the bundle and prints the answer as JSON.
"""

from __future__ import annotations

from spikeops.sim.build import build_bundle
from spikeops.sim.model import CAUSES, DISTRACTORS, Expected

__all__ = ["Expected", "CAUSES", "DISTRACTORS", "build_bundle"]
