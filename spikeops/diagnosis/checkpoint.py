"""Checkpoint integrity: did the run resume from a checkpoint that does not verify?

A checkpoint written by a failing GPU or truncated by a crash looks like any other until its
checksums are compared; resuming from it poisons the run from its first step. The trouble
then starts at the resume (step S+1 for a checkpoint at step S), and the recovery must skip
that checkpoint (and quarantine it), which ``resume_from`` does by taking only verified ones.
"""

from __future__ import annotations

from collections.abc import Callable

from spikeops.diagnosis.context import Context
from spikeops.diagnosis.model import EvidenceLine, Finding, RuledOut

__all__ = ["RULES", "checkpoint_corrupted", "resumed_checkpoint"]


def resumed_checkpoint(ctx: Context):
    """The checkpoints.json entry the run resumed from (by path, else by step), or None."""
    resumed = ctx.job.resumed_from
    if resumed is None or ctx.facts.checkpoints is None:
        return None
    by_path = [c for c in ctx.facts.checkpoints if resumed.path and c.path == resumed.path]
    by_step = [c for c in ctx.facts.checkpoints if resumed.step is not None and c.step == resumed.step]
    return (by_path or by_step or [None])[0]


def checkpoint_corrupted(ctx: Context) -> list[Finding]:
    resumed = ctx.job.resumed_from
    if resumed is None:
        return []
    entry = resumed_checkpoint(ctx)
    if entry is None:
        if ctx.facts.checkpoints is not None:
            ctx.missing.append(f"checkpoints.json: no entry for the checkpoint resumed from (step {resumed.step})")
        return []
    if entry.verified is None:
        ctx.missing.append(f"checkpoint at step {entry.step} ({entry.path}): never verified against its manifest")
        return []
    if entry.verified:
        ctx.ruled_out.append(RuledOut("checkpoint", f"the run resumed from step {entry.step}, whose checkpoint verifies"))
        return []
    diverged = ctx.symptom.symptom != "none"
    index = ctx.facts.checkpoints.index(entry)
    step = resumed.step if resumed.step is not None else entry.step
    return [Finding(
        layer="checkpoint", cause="corrupted_checkpoint", confidence=0.92 if diverged else 0.5,
        summary=f"the run resumed from the checkpoint at step {entry.step} ({entry.path}), which does not match "
                f"its manifest: {entry.problem or 'checksum mismatch'}" + ("; the run diverged after" if diverged else ""),
        step=(step + 1) if step is not None else None,
        evidence=[EvidenceLine("checkpoints.json", None,
                               f"checkpoint #{index}: step {entry.step}, path {entry.path}, verified false, problem {entry.problem!r}"),
                  EvidenceLine("incident.json", None, f"job.resumed_from: step {resumed.step}, path {resumed.path}")],
        onset_step=(step + 1) if step is not None else None,
    )]


RULES: tuple[Callable[[Context], list[Finding]], ...] = (checkpoint_corrupted,)
