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

__all__ = ["RULES", "checkpoint_corrupted", "checkpoint_printed_errors", "printed_bad_paths", "same_checkpoint",
           "resumed_checkpoint"]


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


#: Confidence of a checkpoint the job printed it could not load (it named the fault) and of
#: one it could not finish writing (what is left on disk is cut short).
PRINTED_LOAD = 0.8
PRINTED_SAVE = 0.7


def _printed_checkpoint_errors(ctx: Context) -> list[tuple[object, object]]:
    """(output, event) for each checkpoint load or save error in the job's own output."""
    found = []
    for output in ctx.outputs():
        for event in getattr(output.errors, "events", None) or []:
            if event.kind in ("checkpoint_load", "checkpoint_save") and ctx.in_window(event.time) is not False:
                found.append((output, event))
    return found


def printed_bad_paths(ctx: Context) -> list[str]:
    """Checkpoint paths the job printed it could not load or write: never resumed from."""
    return sorted({event.details["path"] for _, event in _printed_checkpoint_errors(ctx) if event.details.get("path")})


def same_checkpoint(printed: str, path: str | None) -> bool:
    """A printed path names the checkpoint at ``path``: the same, a file inside it, or a
    relative path that ends it (``work_dirs/x/iter_90000.pth`` for ``/data/work_dirs/x/iter_90000.pth``)."""
    if not path:
        return False
    printed, path = printed.rstrip("/"), path.rstrip("/")
    return printed == path or printed.startswith(path + "/") or path.endswith("/" + printed.lstrip("./"))


def checkpoint_printed_errors(ctx: Context) -> list[Finding]:
    """The job printed that it could not load a checkpoint (a truncated archive, a state-dict
    that does not fit, a bad safetensors header) or could not write one (no space left while
    saving): ``corrupted_checkpoint`` evidence, naming the checkpoint when the job printed its
    path; the resume skips it (the engine) and it is quarantined."""
    errors = _printed_checkpoint_errors(ctx)
    if not errors:
        return []
    findings = []
    for kind, confidence, what in (("checkpoint_load", PRINTED_LOAD, "could not load a checkpoint"),
                                   ("checkpoint_save", PRINTED_SAVE, "could not finish writing a checkpoint")):
        items = [(output, event) for output, event in errors if event.kind == kind]
        if not items:
            continue
        paths = sorted({event.details["path"] for _, event in items if event.details.get("path")})
        message = items[-1][1].details.get("message", items[-1][1].text)
        named = f" ({', '.join(paths[:3])})" if paths else " (its path is not printed)"
        left = ("; what it left on disk is cut short: never resume from it" if kind == "checkpoint_save"
                else "; resume from another, verified one")
        findings.append(Finding(
            layer="checkpoint", cause="corrupted_checkpoint", confidence=confidence,
            summary=f"the job {what}{named}: {message[:200]}{left}",
            evidence=[EvidenceLine(output.file, event.line, event.text) for output, event in items[:4]],
        ))
    return findings


RULES: tuple[Callable[[Context], list[Finding]], ...] = (checkpoint_corrupted, checkpoint_printed_errors)
