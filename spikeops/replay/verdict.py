"""The replay gate's verdict: what two replays of the spike window say about the hardware.

Two replays run the steps from a checkpoint before the onset through the spike step, with
the same data order and RNG, deterministically: one on the original nodes, one on other
nodes (``spikeops.replay.plan``). A bad batch or an unstable optimizer reproduces wherever it
runs; a GPU that computes wrong numbers reproduces only where it is. The rule is the spec's
``silent_data_corruption`` (shared/spec/diagnosis.md):

- both replays reproduce the anomaly, bit-identically: data or numerics, confirmed
  (``reproduced``); no node is named;
- the replay on the original nodes reproduces and the other does not, and at the first step
  where they differ only some ranks' local gradient digests differ (same rank, same data):
  those ranks' ORIGINAL nodes are the culprits (``sdc``);
- neither reproduces: ``transient`` (a one-off upset, or something outside the replayed
  computation);
- anything incomplete, unreadable, partial or contradictory: ``inconclusive`` with the
  reason. It never convicts.

One extension, for the case the spec's rule would get wrong: when no spare node exists the
"other nodes" are the job's own nodes permuted, so a faulty node hosts another rank in the
second replay and the anomaly reproduces in both. Both reproduce, but not bit-identically:
the ranks that differ are each far off (non-finite or a much larger gradient norm) in one
replay only, and the node they ran on when they were off is the same node in both. That
node follows the anomaly across placements, and it alone is convicted (lower confidence).
Anything else that differs between two reproducing replays is inconclusive, never
"reproduced": a data cause replays bit-identically.

Pure: no torch, no Prefect, no files (``spikeops.replay.records`` reads them).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spikeops.diagnosis.model import EvidenceLine as Evidence  # the diagnosis's evidence line, one shape
from spikeops.probes.bundle_files import read_float
from spikeops.replay.records import ReplayRecord, ReplayRun

__all__ = ["ReplayVerdict", "Reproduction", "Evidence", "compare_replays", "sdc_finding", "VERDICTS",
           "CAUSE", "LAYER"]

VERDICTS = ("reproduced", "sdc", "transient", "inconclusive")
CAUSE = "silent_data_corruption"
LAYER = "hardware"

#: Loss points before the spike step that make its baseline.
BASELINE_POINTS = 20
#: A replay reproduces the anomaly when its excursion above the baseline is at least this
#: share of the original's (a non-finite loss reproduces a non-finite one).
REPRODUCE_SHARE = 0.5
#: When the original went non-finite, a finite replay reproduces it only this far above
#: the anomaly threshold.
NONFINITE_FACTOR = 10.0
#: A rank is "far off" in one replay when its gradient norm is this many times the other's.
FAR_OFF = 4.0
MAX_EVIDENCE = 10


@dataclass
class Reproduction:
    """Whether one replay reproduced the anomaly: True, False, or None (partial/unknown)."""

    run: str
    reproduces: bool | None
    step: int | None = None
    loss: float | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "reproduces": self.reproduces, "step": self.step, "loss": _json_float(self.loss),
                "detail": self.detail}


@dataclass
class ReplayVerdict:
    verdict: str
    summary: str
    confidence: float = 0.0
    spike_step: int | None = None
    culprit_nodes: list[str] = field(default_factory=list)
    culprit_ranks: list[int] = field(default_factory=list)
    #: The first step at which the two replays' digests differ (None: identical or unknown).
    first_divergence: int | None = None
    same_nodes: Reproduction | None = None
    other_nodes: Reproduction | None = None
    evidence: list[Evidence] = field(default_factory=list)
    #: For ``inconclusive``: what is missing or contradictory, in one line.
    reason: str | None = None
    notes: list[str] = field(default_factory=list)
    #: The replayed steps (first, last) both replays cover.
    steps: tuple[int, int] | None = None

    @property
    def convicts(self) -> bool:
        return self.verdict == "sdc" and bool(self.culprit_nodes)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict, "summary": self.summary, "confidence": round(self.confidence, 3),
            "spike_step": self.spike_step, "culprit_nodes": list(self.culprit_nodes),
            "culprit_ranks": list(self.culprit_ranks), "first_divergence": self.first_divergence,
            "steps": list(self.steps) if self.steps else None,
            "same_nodes": self.same_nodes.to_json() if self.same_nodes else None,
            "other_nodes": self.other_nodes.to_json() if self.other_nodes else None,
            "evidence": [e.to_json() for e in self.evidence], "reason": self.reason, "notes": list(self.notes),
        }


def _json_float(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return str(value)


def _fmt(value: float | None) -> str:
    if value is None:
        return "?"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


# ---------------------------------------------------------------------------- inputs
def _losses(original_metrics: Any) -> dict[int, float | None]:
    """Step -> loss from a mapping, a ``TrainingLog`` (``.records``), or records/dicts with
    ``step`` and ``loss``. The last value of a step wins (a restart re-logs steps)."""
    if isinstance(original_metrics, Mapping):
        out: dict[int, float | None] = {}
        for step, loss in original_metrics.items():
            try:
                out[int(step)] = read_float(loss)
            except (TypeError, ValueError):
                continue
        return out
    records: Iterable[Any] = getattr(original_metrics, "records", original_metrics) or ()
    out = {}
    for record in records:
        step = record.get("step") if isinstance(record, Mapping) else getattr(record, "step", None)
        loss = record.get("loss") if isinstance(record, Mapping) else getattr(record, "loss", None)
        try:
            out[int(step)] = read_float(loss)
        except (TypeError, ValueError):
            continue
    return out


def _ranks(original_ranks: Mapping[Any, str] | None) -> dict[int, str]:
    out = {}
    for rank, node in (original_ranks or {}).items():
        try:
            out[int(rank)] = str(node)
        except (TypeError, ValueError):
            continue
    return out


@dataclass
class _Level:
    """The loss level before the spike and how far above it counts as an anomaly."""

    median: float
    threshold: float
    points: int


def _level(values: list[float]) -> _Level | None:
    if not values:
        return None
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values) if len(values) > 1 else 0.0
    threshold = max(6 * 1.4826 * mad, 0.25 * abs(median), 1e-6)
    return _Level(median, threshold, len(values))


def _step_loss(run: ReplayRun, step: int, ranks: Iterable[int]) -> float | None:
    """The step's loss as the mean over ranks (non-finite if any rank's is)."""
    values = []
    for rank in ranks:
        record = run.records.get((step, rank))
        if record is None or record.loss is None:
            return None
        values.append(record.loss)
    if not values:
        return None
    if not all(math.isfinite(v) for v in values):
        return math.nan
    return sum(values) / len(values)


# ---------------------------------------------------------------------------- checks
def _coverage(run: ReplayRun, ranks: list[int], spike_step: int) -> tuple[int | None, str | None]:
    """The last step judged (the spike step, or an earlier one where the replay went
    non-finite and stopped) or the reason the replay does not cover the window."""
    if run.problem:
        return None, run.problem
    steps = run.steps
    first = steps[0]
    if first > spike_step:
        return None, f"{run.file}: starts at step {first}, after the spike step {spike_step}"
    for step in range(first, spike_step + 1):
        missing = [r for r in ranks if (step, r) not in run.records]
        if not missing:
            continue
        previous = _step_loss(run, step - 1, ranks) if step > first else None
        if step > first and previous is not None and not math.isfinite(previous) and step - 1 == max(steps):
            return step - 1, None  # it went non-finite and stopped there: a job that stops on NaN
        conflicted = [r for r in missing if (step, r) in run.conflicts]
        what = "written twice with different values" if conflicted else "missing"
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        return None, (f"{run.file}: step {step} rank(s) {', '.join(map(str, missing[:5]))}{more} {what}"
                      + (f"; {run.describe_gaps()}" if run.gaps else ""))
    return spike_step, None


def _reproduces(run: ReplayRun, ranks: list[int], last: int, spike_step: int, level: _Level,
                excursion: float) -> Reproduction:
    loss = _step_loss(run, last, ranks)
    where = f"step {last}" + ("" if last == spike_step else f" (it stopped there, before the spike step {spike_step})")
    if loss is None:
        return Reproduction(run.name, None, last, None, f"no loss at {where}")
    if not math.isfinite(loss):
        return Reproduction(run.name, True, last, loss, f"loss {_fmt(loss)} at {where}")
    above = loss - level.median
    if math.isfinite(excursion):
        needed = max(level.threshold, REPRODUCE_SHARE * excursion)
    else:
        needed = NONFINITE_FACTOR * level.threshold
    if above >= needed:
        return Reproduction(run.name, True, last, loss, f"loss {_fmt(loss)} at {where} (level {_fmt(level.median)})")
    if above <= level.threshold:
        return Reproduction(run.name, False, last, loss,
                            f"loss {_fmt(loss)} at {where}, within the normal level {_fmt(level.median)}")
    return Reproduction(run.name, None, last, loss,
                        f"loss {_fmt(loss)} at {where}: above the level {_fmt(level.median)} but well short of "
                        f"the original's excursion (a partial reproduction)")


def _differs(a: str | None, b: str | None) -> bool | None:
    if a is None or b is None:
        return None
    return a != b


@dataclass
class _Divergence:
    step: int
    local: list[int]
    reduced: list[int]


def _first_divergence(same: ReplayRun, other: ReplayRun, ranks: list[int], first: int,
                      last: int) -> tuple[_Divergence | None, str | None]:
    """The first step at which any rank's digests differ between the replays, or why the
    digests cannot be compared (one missing, or the two replays fed a rank different data)."""
    for step in range(first, last + 1):
        local, reduced = [], []
        for rank in ranks:
            a, b = same.records.get((step, rank)), other.records.get((step, rank))
            if a is None or b is None:
                return None, None  # past the end of the shorter replay (a replay that stopped on NaN)
            if _differs(a.fingerprint, b.fingerprint):
                return None, (f"step {step} rank {rank} was fed different data in the two replays "
                              f"(batch {a.fingerprint[:12]} vs {b.fingerprint[:12]}): not a replay of the same steps")
            changed = _differs(a.local_grad_digest, b.local_grad_digest)
            if changed is None:
                return None, (f"step {step} rank {rank}: no local_grad_digest in "
                              f"{same.file if a.local_grad_digest is None else other.file}")
            if changed:
                local.append(rank)
            if _differs(a.reduced_grad_digest, b.reduced_grad_digest):
                reduced.append(rank)
        if local or reduced:
            return _Divergence(step, local, reduced), None
    return None, None


def _far_off(mine: ReplayRecord, theirs: ReplayRecord) -> bool:
    """This rank's result is far off the same rank's in the other replay."""
    a, b = mine.grad_norm, theirs.grad_norm
    if not _finite(mine.loss) and _finite(theirs.loss):
        return True
    if a is None or b is None:
        return False
    if not math.isfinite(a):
        return math.isfinite(b)
    return math.isfinite(b) and a >= FAR_OFF * max(b, 1e-30)


def _evidence_for(runs: Iterable[ReplayRun], keys: Iterable[tuple[int, int]]) -> list[Evidence]:
    out: list[Evidence] = []
    for key in keys:
        for run in runs:
            record = run.records.get(key)
            if record is not None:
                item = Evidence(run.file, record.line, record.text)
                if item not in out:
                    out.append(item)
    return out[:MAX_EVIDENCE]


def _worst_rank(run: ReplayRun, step: int) -> int | None:
    """The rank with the highest (or a non-finite) loss at a step, for the evidence."""
    best, worst = None, -math.inf
    for rank, record in sorted(run.at(step).items()):
        loss = record.loss if record.loss is not None else -math.inf
        value = math.inf if math.isnan(loss) else loss
        if value > worst:
            best, worst = rank, value
    return best


def _inconclusive(reason: str, **kwargs: Any) -> ReplayVerdict:
    return ReplayVerdict("inconclusive", f"replay inconclusive: {reason}", 0.0, reason=reason, **kwargs)


# ---------------------------------------------------------------------------- the verdict
def compare_replays(original_metrics: Any, original_ranks: Mapping[Any, str] | None, same_nodes_replay: ReplayRun,
                    other_nodes_replay: ReplayRun, spike_step: int | None) -> ReplayVerdict:
    """The verdict of the replay gate (module docstring). ``original_metrics``: the original
    run's step losses (mapping step -> loss, a ``TrainingLog``, or records); ``original_ranks``:
    rank -> node in the original run (the culprits are named from it; when empty, from the
    same-nodes replay's own records)."""
    same, other = same_nodes_replay, other_nodes_replay
    if spike_step is None:
        return _inconclusive("no spike step to replay through")
    for run in (same, other):
        if run.problem or not run.records:
            return _inconclusive(run.problem or f"{run.file}: no replay record in it", spike_step=spike_step)
    original = _ranks(original_ranks)
    ranks = sorted(original) if original else sorted(set(same.ranks) | set(other.ranks))
    base = {"spike_step": spike_step}
    notes = [f"{run.file}: {len(run.gaps)} line(s) not read ({run.describe_gaps()})" for run in (same, other)
             if run.gaps]
    firsts = {run.steps[0] for run in (same, other)}
    if len(firsts) > 1:
        return _inconclusive(f"the replays start at different steps ({same.steps[0]} and {other.steps[0]}): "
                             f"not from the same checkpoint", notes=notes, **base)
    first = firsts.pop()
    ends = {}
    for run in (same, other):
        last, problem = _coverage(run, ranks, spike_step)
        if problem:
            return _inconclusive(f"incomplete replay: {problem}", notes=notes, **base)
        ends[run.name] = last

    # the placements: the same-nodes replay must have run where the original did
    same_place, other_place = same.placement(), other.placement()
    if original:
        moved = [r for r in ranks if r in same_place and same_place[r] != original[r]]
        if moved:
            r = moved[0]
            return _inconclusive(f"the same-nodes replay ran rank {r} on {same_place[r]}, the original run on "
                                 f"{original[r]}: not a replay on the original nodes", notes=notes, **base)
    else:
        original = {r: same_place[r] for r in ranks if r in same_place}
        notes.append("no rank map of the original run: the same-nodes replay's placement is taken as the original")

    # the anomaly to reproduce
    losses = _losses(original_metrics)
    original_loss = losses.get(spike_step)
    before = [v for s, v in sorted(losses.items()) if s < spike_step and _finite(v)][-BASELINE_POINTS:]
    if not before:  # the replays' own steps before the spike (they replay the original's)
        before = [v for s in range(first, spike_step) if _finite(v := _step_loss(same, s, ranks))]
        before = before[-BASELINE_POINTS:]
    level = _level([float(v) for v in before if v is not None])
    if original_loss is None:
        return _inconclusive(f"the original run's loss at step {spike_step} is not in its metrics", notes=notes, **base)
    if level is None:
        return _inconclusive(f"no loss before step {spike_step} to judge the spike against", notes=notes, **base)
    excursion = original_loss - level.median if math.isfinite(original_loss) else math.inf
    if excursion <= level.threshold:
        return _inconclusive(f"the original run's loss at step {spike_step} ({_fmt(original_loss)}) is not anomalous "
                             f"against its level {_fmt(level.median)}", notes=notes, **base)

    r_same = _reproduces(same, ranks, ends[same.name], spike_step, level, excursion)
    r_other = _reproduces(other, ranks, ends[other.name], spike_step, level, excursion)
    last = min(ends.values())
    divergence, problem = _first_divergence(same, other, ranks, first, last)
    base.update(same_nodes=r_same, other_nodes=r_other, notes=notes, steps=(first, spike_step))
    if problem:
        return _inconclusive(problem, **base)
    if divergence is not None:
        base["first_divergence"] = divergence.step
    for run, outcome in ((same, r_same), (other, r_other)):
        if outcome.reproduces is None:
            return _inconclusive(f"{run.name}: {outcome.detail}", **base)

    spike_keys = [(ends[run.name], rank) for run in (same, other)
                  if (rank := _worst_rank(run, ends[run.name])) is not None]
    window = f"steps {first}-{spike_step}"
    original_text = f"original {_fmt(original_loss)}"

    if r_same.reproduces and r_other.reproduces:
        if divergence is None:
            return ReplayVerdict(
                "reproduced", f"both replays of {window} reproduce the anomaly bit-identically on different nodes "
                f"({same.name}: {r_same.detail}; {other.name}: {r_other.detail}; {original_text}): the cause is in "
                f"the data or the numerics, not the hardware", 0.9,
                evidence=_evidence_for((same, other), spike_keys), **base)
        return _both_reproduce_but_differ(same, other, divergence, original, same_place, other_place, ranks, base)

    if not r_same.reproduces and not r_other.reproduces:
        if divergence is not None:
            notes.append(f"the replays differ from step {divergence.step} (ranks {divergence.local or divergence.reduced})"
                         f" without reproducing the anomaly")
        return ReplayVerdict(
            "transient", f"neither replay of {window} reproduces the anomaly ({same.name}: {r_same.detail}; "
            f"{other.name}: {r_other.detail}; {original_text}): a transient fault", 0.6,
            evidence=_evidence_for((same, other), spike_keys), **base)

    if not r_same.reproduces:
        return _inconclusive(f"only the replay on other nodes reproduces the anomaly ({r_other.detail}): a fault on "
                             f"the nodes it ran on? ({', '.join(sorted(set(other_place.values())))})", **base)

    # the original nodes reproduce, the others do not: the spec's rule
    if divergence is None:
        return _inconclusive(f"the replays disagree on the loss but no gradient digest differs through step {last}",
                             **base)
    if not divergence.local:
        return _inconclusive(f"at step {divergence.step} only the reduced gradients differ (ranks "
                             f"{divergence.reduced}), no rank's own: the reduction, not a GPU's compute", **base)
    culprit_ranks = divergence.local
    not_moved = [r for r in culprit_ranks if other_place.get(r) is not None and other_place.get(r) == original.get(r)]
    if not_moved:
        return _inconclusive(f"rank {not_moved[0]} ran on {original.get(not_moved[0])} in both replays: the "
                             f"difference cannot be the node's", **base)
    unknown = [r for r in culprit_ranks if r not in original]
    if unknown:
        return _inconclusive(f"the original node of rank {unknown[0]} is unknown", **base)
    confidence = 0.9
    if len(culprit_ranks) == len(ranks):
        far = [r for r in culprit_ranks
               if _far_off(same.records[(divergence.step, r)], other.records[(divergence.step, r)])]
        if len(far) != len(ranks):
            return _inconclusive(f"at step {divergence.step} every rank's local gradients differ between the "
                                 f"placements, with no rank far off: the nodes do not compute identically "
                                 f"(nondeterminism), no node can be singled out", **base)
        confidence = 0.7
        notes.append("no rank computed identically on both placements, so the replays' determinism across nodes is "
                     "not shown; every rank is far off on the original nodes only")
    nodes = sorted({original[r] for r in culprit_ranks})
    keys = [(divergence.step, r) for r in culprit_ranks] + [(ends[same.name], r) for r in culprit_ranks]
    moved_to = ", ".join(f"rank {r}: {original[r]} -> {other_place.get(r, '?')}" for r in culprit_ranks)
    summary = (f"the replay of {window} on the original nodes reproduces the anomaly ({r_same.detail}; "
               f"{original_text}), the replay on other nodes does not ({r_other.detail}); at step "
               f"{divergence.step}, the first where they differ, only rank(s) {', '.join(map(str, culprit_ranks))} "
               f"of {len(ranks)} computed different local gradients from the same data ({moved_to}): "
               f"{', '.join(nodes)} computes wrong numbers (silent data corruption)")
    return ReplayVerdict("sdc", summary, confidence, culprit_nodes=nodes, culprit_ranks=list(culprit_ranks),
                         evidence=_evidence_for((same, other), keys), **base)


def _both_reproduce_but_differ(same: ReplayRun, other: ReplayRun, divergence: _Divergence,
                               original: Mapping[int, str], same_place: Mapping[int, str],
                               other_place: Mapping[int, str], ranks: list[int],
                               base: dict[str, Any]) -> ReplayVerdict:
    """Both reproduce, not bit-identically: a node that follows the anomaly, or nothing."""
    step = divergence.step
    if not divergence.local:
        return _inconclusive(f"both replays reproduce the anomaly, but at step {step} their reduced gradients differ "
                             f"(ranks {divergence.reduced}) while no rank's own do: the reduction differs", **base)
    bad_same, bad_other, unexplained = [], [], []
    for rank in divergence.local:
        a, b = same.records[(step, rank)], other.records[(step, rank)]
        if _far_off(a, b):
            bad_same.append(rank)
        elif _far_off(b, a):
            bad_other.append(rank)
        else:
            unexplained.append(rank)
    nodes_same = {same_place.get(r, original.get(r)) for r in bad_same}
    nodes_other = {other_place.get(r) for r in bad_other}
    common = sorted(n for n in nodes_same & nodes_other if n is not None)
    if unexplained or not common or not bad_same or not bad_other:
        return _inconclusive(
            f"both replays reproduce the anomaly but not bit-identically: at step {step} rank(s) "
            f"{divergence.local} compute differently on the two placements"
            + (" with no node in common to both replays' far-off ranks" if not unexplained else
               " by small amounts (nondeterminism?)") + "; replay on spare nodes to tell data from hardware",
            **base)
    explained = all(same_place.get(r, original.get(r)) in common for r in bad_same) and \
        all(other_place.get(r) in common for r in bad_other)
    if not explained:
        return _inconclusive(f"both replays reproduce the anomaly; at step {step} far-off ranks ran on nodes "
                             f"{sorted(n for n in nodes_same | nodes_other if n)}, not one node in both", **base)
    culprit_ranks = sorted(r for r in bad_same if original.get(r) in common)
    keys = [(step, r) for r in divergence.local]
    where = "; ".join(f"{run}: rank(s) {', '.join(map(str, rs))}" for run, rs in
                      ((same.name, bad_same), (other.name, bad_other)))
    summary = (f"both replays reproduce the anomaly, but the faulty rank moves with the node: at step {step}, "
               f"the first where they differ, the far-off ranks ({where}) ran on {', '.join(common)} in both "
               f"placements, every other rank computed identically: {', '.join(common)} computes wrong numbers "
               f"(silent data corruption)")
    return ReplayVerdict("sdc", summary, 0.8, culprit_nodes=common, culprit_ranks=culprit_ranks,
                         evidence=_evidence_for((same, other), keys), **base)


def sdc_finding(verdict: ReplayVerdict) -> dict[str, Any] | None:
    """The spec-shaped finding (diagnosis.md) of an ``sdc`` verdict; None for any other:
    only ``sdc`` is a cause of its own (``reproduced`` raises the confidence of the data or
    numeric finding it confirms; ``transient`` and ``inconclusive`` convict nothing)."""
    if not verdict.convicts:
        return None
    return {
        "layer": LAYER, "cause": CAUSE, "confidence": round(verdict.confidence, 3),
        "nodes": sorted(set(verdict.culprit_nodes)), "ranks": sorted(set(verdict.culprit_ranks)),
        "step": verdict.first_divergence, "evidence": [e.to_json() for e in verdict.evidence],
        "summary": verdict.summary,
    }
