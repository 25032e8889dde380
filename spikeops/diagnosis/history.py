"""History: what the lineage's earlier incidents say about this one (diagnosis.md, "History").

``history.json`` lists the incidents of the job's lineage before this one, with how each was
resumed (checkpoint, excluded nodes, environment). The rules here read only that file, so the
diagnosis stays a function of its bundle:

- **recurrence**: the anomaly is back at the same point after a resume from checkpoint C (its
  spike step between C and the earlier spike, or within one checkpoint interval of the earlier
  spike): the resume did not remove the cause, and a finding names the earlier incident and
  what its resume changed;
- with no data cause to explain it, C is suspect (``poisoned_checkpoint``, Megatron-LM#5281: a
  checkpoint that verifies but holds state that NaNs a few steps after every load): the onset
  moves to C's step, so ``resume_from`` is the newest verified checkpoint before C, and C gets
  a quarantine marker (the action ``quarantine_checkpoint`` with ``reason: poisoned``);
- with a data cause (a data finding now, the earlier incident's cause, or a single spike, which
  the seed's matrix sends to the data layer on recurrence), the skip widens: every rank, the
  steps from the onset to the spike, and never the earlier skip again;
- when the earlier incident's culprits were excluded and the anomaly came back without them,
  their conviction is in doubt: a finding and a ``doubt_conviction`` action say so (the nodes
  stay drained: the diagnosis releases nothing);
- a node convicted before (this lineage's history.json, or any lineage's conviction of it in
  ``node_history.json``) is named as such in the findings that name it; history alone never
  convicts.

The same checkpoint is never proposed again with the same plan (``safe_resume``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spikeops.diagnosis.context import Context
from spikeops.diagnosis.model import CAUSES, EvidenceLine, Finding
from spikeops.history import HISTORY_FILE, PastIncident

__all__ = ["Recurrence", "HistoryVerdict", "checkpoint_interval", "find_recurrence", "same_point",
           "apply_history", "safe_resume", "revise_actions", "widened_skip", "MAX_SKIPPED_STEPS",
           "POISONED_CONFIDENCE"]

#: The confidence of ``poisoned_checkpoint`` when the anomaly recurred after a resume from a
#: checkpoint that verified and nothing else explains it; with a fresh conviction beside it,
#: lower (still above the primary threshold: going back one more checkpoint costs steps, a loop
#: costs the cluster).
POISONED_CONFIDENCE = 0.85
POISONED_BESIDE_CONVICTION = 0.55
#: A data recurrence names the earlier cause at this confidence when nothing in this bundle does.
DATA_RECURRENCE_CONFIDENCE = 0.6
#: The widest skip a recurrence asks for (the environment variable stays a few KiB).
MAX_SKIPPED_STEPS = 512
_DATA = {cause for cause, layer in CAUSES.items() if layer == "data"}


def checkpoint_interval(steps: Iterable[int | None]) -> int | None:
    """The typical distance between the job's checkpoints (the median gap), None with fewer
    than two."""
    known = sorted({step for step in steps if step is not None})
    gaps = [b - a for a, b in zip(known, known[1:]) if b > a]
    return int(statistics.median(gaps)) if gaps else None


def same_point(earlier: PastIncident, spike: int, interval: int | None) -> bool:
    """The spec's "same point": the spike lies between the earlier resume's checkpoint and the
    earlier spike, or within one checkpoint interval of the earlier spike."""
    if earlier.spike_step is None:
        return False
    if earlier.resumed_step is not None and earlier.resumed_step < spike <= earlier.spike_step:
        return True
    return abs(spike - earlier.spike_step) <= (interval or 0)


@dataclass(frozen=True)
class Recurrence:
    """This anomaly is ``earlier``'s again, after ``earlier``'s resume."""

    earlier: PastIncident
    spike_step: int

    def describe(self) -> str:
        return (f"{self.earlier.incident_id} (job {self.earlier.job_id}, {self.earlier.cause} at step "
                f"{self.earlier.spike_step}) resumed the job as {self.earlier.resumed_as or '?'} from step "
                f"{self.earlier.resumed_step} ({self.earlier.resumed_path}); its plan: {self.earlier.plan.describe()}")


def find_recurrence(history: Sequence[PastIncident], job_id: str | None, resumed_path: str | None,
                    spike: int | None, symptom: str | None, interval: int | None) -> Recurrence | None:
    """The earlier incident whose resume this anomaly repeats, or None. The resume that made
    this run is found by the job it resubmitted (``resumed_as``), else by the checkpoint the
    run says it resumed from."""
    if spike is None or symptom in (None, "none", "unknown"):
        return None
    resumed = [entry for entry in history if entry.resumed]
    made_this = [e for e in resumed if job_id is not None and e.resumed_as == job_id] or \
        [e for e in resumed if resumed_path and e.resumed_path == resumed_path]
    if not made_this:
        return None
    earlier = made_this[-1]
    return Recurrence(earlier, spike) if same_point(earlier, spike, interval) else None


@dataclass
class HistoryVerdict:
    """What the history rules concluded, for the engine's resume point and actions."""

    recurrence: Recurrence | None = None
    data: bool = False
    poisoned: dict[str, Any] | None = None
    skip: dict[str, Any] | None = None
    doubted: list[str] = field(default_factory=list)


def _evidence(entry: PastIncident) -> EvidenceLine:
    return EvidenceLine(HISTORY_FILE, None, entry.line())


def _holding_data(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.layer == "data" and not f.history and f.confidence >= 0.5]


def widened_skip(earlier: PastIncident, current: Iterable[int], *, onset: int | None, spike: int) -> dict[str, Any]:
    """A skip wider than the earlier resume's: every rank, the earlier steps, the steps this
    bundle names, and every step from the earliest onset to the latest spike (never before
    the checkpoint resumed from); when that is still the earlier skip, the window doubles."""
    before = set(earlier.plan.skip_steps)
    floor = (earlier.resumed_step + 1) if earlier.resumed_step is not None else None
    ends = [s for s in (onset, earlier.onset_step, spike, earlier.spike_step) if s is not None]
    low, high = min(ends), max(ends)
    if floor is not None:
        low = max(low, floor)
    steps = before | set(current) | set(range(low, high + 1))
    if steps == before and not earlier.plan.skip_ranks:
        width = high - low + 1
        steps |= set(range(max(low - width, floor or 0), high + width + 1))
    if len(steps) > MAX_SKIPPED_STEPS:  # the steps nearest the spike
        steps = set(sorted(steps, key=lambda s: (abs(s - spike), s))[:MAX_SKIPPED_STEPS])
    return {"kind": "skip_batches", "steps": sorted(steps), "ranks": [],
            "why": f"recurrence of {earlier.incident_id} (its resume's plan: {earlier.plan.describe()})"}


def _poisoned_finding(ctx: Context, recurrence: Recurrence, findings: Sequence[Finding]) -> Finding | None:
    earlier = recurrence.earlier
    entry = None
    if ctx.facts.checkpoints:
        entry = next((c for c in ctx.facts.checkpoints if earlier.resumed_path and c.path == earlier.resumed_path),
                     None) or next((c for c in ctx.facts.checkpoints if earlier.resumed_step is not None
                                    and c.step == earlier.resumed_step), None)
    if entry is not None and entry.verified is False:
        return None  # it does not verify: corrupted_checkpoint's rule, not this one
    suspects = set(earlier.culprit_nodes) | set(earlier.plan.excluded)
    fresh = sorted({n for f in findings if f.convicts and f.confidence >= 0.5 and not f.history
                    for n in f.nodes} - suspects)
    confidence = POISONED_BESIDE_CONVICTION if fresh else POISONED_CONFIDENCE
    step = earlier.resumed_step if earlier.resumed_step is not None else (entry.step if entry else None)
    evidence = [_evidence(earlier)]
    line = ctx.metric_line(recurrence.spike_step, "the anomaly again")
    if line is not None:
        evidence.append(line)
    if entry is not None:
        evidence.append(EvidenceLine("checkpoints.json", None, f"step {entry.step}, path {entry.path}, verified "
                                     f"{entry.verified}"))
    summary = (f"the {ctx.symptom.symptom.replace('_', ' ')} recurred at step {recurrence.spike_step}, the same "
               f"point as before, after {recurrence.describe()}: that resume did not remove the cause, and no data "
               f"cause explains it, so the checkpoint at step {step} is suspect (it verifies; its state may not): "
               f"resume from an older verified one and quarantine it")
    if fresh:
        summary += f"; {', '.join(fresh)} newly convicted beside it"
    return Finding(layer="checkpoint", cause="poisoned_checkpoint", confidence=confidence, summary=summary,
                   step=recurrence.spike_step, evidence=evidence, onset_step=step)


def _data_finding(ctx: Context, recurrence: Recurrence, holding: Sequence[Finding], skip: dict[str, Any]) -> Finding:
    earlier = recurrence.earlier
    cause = holding[0].cause if holding else (earlier.cause if earlier.cause in _DATA else "corrupted_sample")
    ranks = sorted({r for f in holding for r in f.ranks})
    summary = (f"the {ctx.symptom.symptom.replace('_', ' ')} recurred at step {recurrence.spike_step}, the same point "
               f"as before, after {recurrence.describe()}: the data cause was not removed; skip wider: every rank's "
               f"batches of {len(skip['steps'])} step(s) from {skip['steps'][0]} to {skip['steps'][-1]}")
    evidence = [_evidence(earlier)]
    line = ctx.metric_line(recurrence.spike_step, "the anomaly again")
    if line is not None:
        evidence.append(line)
    return Finding(layer="data", cause=cause, confidence=DATA_RECURRENCE_CONFIDENCE if not holding else 0.5,
                   summary=summary, ranks=ranks, step=recurrence.spike_step, evidence=evidence,
                   onset_step=min(s for s in (ctx.onset, earlier.onset_step, recurrence.spike_step) if s is not None),
                   history=bool(holding))


def _doubt(ctx: Context, recurrence: Recurrence) -> tuple[Finding | None, list[str]]:
    earlier = recurrence.earlier
    gone = sorted(n for n in earlier.culprit_nodes if n in earlier.plan.excluded and n not in set(ctx.job.nodes))
    if not gone:
        return None, []
    finding = Finding(
        layer="hardware", cause="inconclusive", confidence=0.2, nodes=gone, history=True,
        summary=f"the conviction of {', '.join(gone)} in {earlier.incident_id} ({earlier.cause}) is in doubt: the "
                f"{ctx.symptom.symptom.replace('_', ' ')} recurred at step {recurrence.spike_step} without "
                f"{'it' if len(gone) == 1 else 'them'}; {'it stays' if len(gone) == 1 else 'they stay'} drained until "
                f"a person decides (the diagnosis releases nothing)",
        step=recurrence.spike_step, evidence=[_evidence(earlier)])
    return finding, gone


def _name_convictions(findings: Sequence[Finding], history: Sequence[PastIncident],
                      node_history: Sequence[Any] = ()) -> None:
    """A node convicted before (in this lineage's ``history.json``, or in any lineage's
    ``node_history.json``) is named so in the findings that name it; never convicted by it."""
    before: dict[str, dict[str, str]] = {}
    for entry in history:
        for node in entry.culprit_nodes:
            before.setdefault(node, {})[entry.incident_id] = f"{entry.incident_id} ({entry.cause})"
    for conviction in node_history:
        before.setdefault(conviction.node, {}).setdefault(conviction.incident_id, conviction.describe())
    for finding in findings:
        named = [f"{node} in {', '.join(before[node].values())}" for node in sorted(set(finding.nodes))
                 if node in before]
        if named:
            finding.summary += f"; convicted before: {'; '.join(named)}"


def apply_history(findings: list[Finding], ctx: Context) -> HistoryVerdict:
    """Add what the lineage's history says to ``findings`` (in place); the verdict tells the
    engine where (not) to resume and what to do."""
    history = list(getattr(ctx.facts, "history", None) or [])
    verdict = HistoryVerdict()
    _name_convictions(findings, history, list(getattr(ctx.facts, "node_history", None) or []))
    if not history:
        return verdict
    resumed = ctx.job.resumed_from
    interval = checkpoint_interval(c.step for c in ctx.facts.checkpoints or [])
    recurrence = find_recurrence(history, ctx.job.id, resumed.path if resumed is not None else None,
                                 ctx.spike, ctx.symptom.symptom, interval)
    if recurrence is None:
        return verdict
    verdict.recurrence = recurrence
    earlier = recurrence.earlier
    holding = _holding_data(findings)
    verdict.data = bool(holding) or earlier.cause in _DATA or ctx.symptom.symptom == "single_spike"
    if verdict.data:
        current = [f.step for f in holding if f.step is not None and f.cause in ("overlong_sample", "corrupted_sample")]
        verdict.skip = widened_skip(earlier, current, onset=ctx.onset, spike=recurrence.spike_step)
        findings.append(_data_finding(ctx, recurrence, holding, verdict.skip))
    else:
        poisoned = _poisoned_finding(ctx, recurrence, findings)
        if poisoned is not None:
            findings.append(poisoned)
            verdict.poisoned = {"step": poisoned.onset_step, "path": earlier.resumed_path,
                                "confidence": poisoned.confidence}
    doubt, gone = _doubt(ctx, recurrence)
    if doubt is not None:
        findings.append(doubt)
        verdict.doubted = gone
    return verdict


def safe_resume(resume_from: dict[str, Any] | None, verdict: HistoryVerdict,
                checkpoints: Sequence[Any] | None) -> dict[str, Any] | None:
    """Never the suspect checkpoint again: with a poisoned checkpoint, a resume point at or
    after it moves to the newest verified one strictly before it (None when there is none, or
    when the suspect's step is unknown)."""
    poisoned = verdict.poisoned
    if resume_from is None or poisoned is None:
        return resume_from
    step = poisoned.get("step")
    same = resume_from.get("path") == poisoned.get("path") or (step is not None and resume_from.get("step") == step)
    later = step is not None and resume_from.get("step") is not None and resume_from["step"] >= step
    if not same and not later:
        return resume_from
    if step is None:
        return None
    older = [c for c in checkpoints or [] if c.verified is True and c.step is not None and c.step < step
             and c.path != poisoned.get("path")]
    if not older:
        return None
    best = max(older, key=lambda c: c.step)
    return {"step": best.step, "path": best.path}


def revise_actions(actions: list[dict[str, Any]], verdict: HistoryVerdict) -> list[dict[str, Any]]:
    """The actions with what the history changes: the widened skip instead of the narrow one,
    and the conviction in doubt said (``doubt_conviction``: nodes, the incident, its cause)."""
    if verdict.recurrence is None:
        return actions
    out = list(actions)
    if verdict.skip is not None:
        out = [a for a in out if a.get("kind") != "skip_batches"]
        at = next((i for i, a in enumerate(out) if a.get("kind") in ("resume", "notify")), len(out))
        out.insert(at, dict(verdict.skip))
    if verdict.doubted:
        earlier = verdict.recurrence.earlier
        out.append({"kind": "doubt_conviction", "nodes": list(verdict.doubted), "incident_id": earlier.incident_id,
                    "cause": earlier.cause})
    return out
