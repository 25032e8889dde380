"""The engine: run the layers in the seed's order, weigh the findings, name the cause.

Weighing encodes the framework's judgments, not a tuning of scores:

- data before numeric: when the data layer holds a finding, numeric findings are capped
  below it (a bad sample makes the grad norm explode; the explosion is the symptom);
- a rank that departs because of a bad batch is explained by that batch; a rank whose node
  has hardware evidence departs because of its GPU, not its data;
- communication errors that come with a hardware fault in the window are its consequence
  (one dead GPU stalls every collective);
- a resumed-from checkpoint that does not verify explains the divergence after it.

Only findings that convict, with confidence >= 0.5, put nodes in ``culprit_nodes``;
thermal throttling convicts only when it is itself the primary cause.

A guess is a guess: a cause is named only by a rule that holds. When none does, the primary
is ``inconclusive`` (confidence 0.2, never a culprit): with the symptom ``unknown`` nothing
could be judged (no onset, no resume); with an anomaly, its summary gives the seed's most
likely direction for the symptom, labelled as a direction, and the actions protect the run
as the symptom requires and say what to collect to decide (grad norm, per-rank values, batch
descriptors, ``detect_anomaly``, the learning rate). A resume on an inconclusive diagnosis
is always a person's decision (``spikeops.response``).

Unread is not healthy, and quiet is not always healthy: ``false_alarm`` needs step metrics
that were read and show nothing, no slowdown and no crash; a job that slowed down with a
flat loss, or died, is ``inconclusive`` when no rule names the cause. Findings about a node
that say nothing of the cause (layer hardware, cause ``inconclusive``) are never the primary.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable
from typing import Any

from spikeops.diagnosis import checkpoint, collectives, communication, data, hardware, history, numeric, replay
from spikeops.diagnosis.actions import plan_actions
from spikeops.diagnosis.context import Context, build_context
from spikeops.diagnosis.evidence import BundleFacts, load_bundle, with_fresh_checkpoints
from spikeops.diagnosis.model import LAYERS, Diagnosis, EvidenceLine, Finding
from spikeops.diagnosis.symptom import WINDOW, StallRule, SymptomResult, classify, throughput_drop
from spikeops.thresholds import MIN_POINTS, SHORT_HISTORY

__all__ = ["diagnose", "diagnose_facts", "classify_bundle", "focus_step", "incident_time", "stall_rule", "ALL_RULES", "PRIMARY_THRESHOLD"]

ALL_RULES = (*data.RULES, *numeric.RULES, *communication.RULES, *collectives.RULES, *hardware.RULES, *checkpoint.RULES,
             replay.hardware_silent_data_corruption)
#: A finding must reach this confidence to be the primary cause or to convict nodes.
PRIMARY_THRESHOLD = 0.5
#: A finding between this and PRIMARY_THRESHOLD is a lead: said in an inconclusive summary,
#: never named as the cause.
TENTATIVE_THRESHOLD = 0.4
#: When nothing holds, the seed table's most likely direction for the symptom: said in the
#: inconclusive summary as a direction, never named as the cause.
DIRECTIONS = {
    "instant_nan": "the numeric layer (gradient overflow, a bad sample, optimizer state corruption)",
    "single_spike": "the data layer (an anomalous batch), or a transient retransmission in the communication layer",
    "spike_no_recovery": "the learning rate or a data distribution shift, or a resume from a corrupted checkpoint",
    "creeping_increase": "the data order (RNG not restored after a resume), precision, or the LR policy",
}
#: Confidence of an inconclusive primary (the spec: at most 0.3).
INCONCLUSIVE_CONFIDENCE = 0.2


def _run(rule: Any, ctx: Context) -> list[Finding]:
    try:
        return list(rule(ctx))
    except Exception as exc:  # one broken rule must not lose the diagnosis
        if os.environ.get("SPIKEOPS_DEBUG"):
            traceback.print_exc()
        ctx.missing.append(f"rule {rule.__name__} failed ({type(exc).__name__}: {exc}); its layer is partly unchecked")
        return []


def _cap(finding: Finding, ceiling: float, why: str) -> None:
    if finding.confidence > ceiling:
        finding.confidence = ceiling
        finding.summary += f" ({why})"


def _weigh(findings: list[Finding]) -> None:
    holds = [f for f in findings if f.confidence >= PRIMARY_THRESHOLD]
    sample_ranks = {r for f in holds if f.cause in ("overlong_sample", "corrupted_sample") for r in f.ranks}
    hw_nodes = {n for f in holds if f.layer == "hardware" and f.convicts and f.cause != "thermal_throttle" for n in f.nodes}
    for finding in findings:
        if finding.cause == "rank_data_misalignment":
            if set(finding.ranks) & sample_ranks:
                _cap(finding, 0.45, "explained by its batch")
            elif set(finding.nodes) & hw_nodes:
                _cap(finding, 0.3, "its node has hardware evidence: the GPU, not the data")
    # A resume from a checkpoint that fails its manifest explains what follows it; a checkpoint
    # the job printed it could not load or write (no onset) explains no divergence.
    checkpoint_top = max((f.confidence for f in findings if f.cause == "corrupted_checkpoint"
                          and f.onset_step is not None), default=0.0)
    data_top = max((f.confidence for f in findings if f.layer == "data"), default=0.0)
    explaining = max(data_top, checkpoint_top)
    for finding in findings:
        if finding.layer == "numeric" and explaining >= PRIMARY_THRESHOLD:
            _cap(finding, explaining - 0.15, "a consequence of the data or checkpoint finding, checked first")
        if finding.cause == "grad_explosion":
            for lr in findings:
                if lr.cause == "lr_too_high" and lr.confidence >= PRIMARY_THRESHOLD and lr.step is not None \
                        and finding.step is not None and lr.step <= finding.step:
                    lr.confidence = max(lr.confidence, 0.8)
                    _cap(finding, lr.confidence - 0.1, f"it follows the LR change at step {lr.step}")
        if finding.cause == "nccl_error" and hw_nodes:
            _cap(finding, 0.4, "downstream of the hardware fault")
        if finding.layer == "data" and finding.cause != "rng_not_restored" and checkpoint_top >= 0.8:
            _cap(finding, checkpoint_top - 0.1, "after a resume from a corrupted checkpoint")


def _order(finding: Finding) -> tuple[float, int]:
    return (-finding.confidence, LAYERS.index(finding.layer))


def _metrics_evidence(ctx: Context, steps: list[int | None], why: str) -> list[EvidenceLine]:
    return [line for line in (ctx.metric_line(step, why) for step in steps) if line is not None]


def _false_alarm(ctx: Context, weak: bool) -> Finding:
    frame = ctx.metrics.frame if ctx.metrics is not None else None
    evidence = []
    if frame is not None and len(frame):
        evidence = _metrics_evidence(ctx, [int(frame.index[0]), int(frame.index[-1])], "no anomaly in between")
    notes = f"; {ctx.symptom.notes[0]}" if ctx.symptom.notes else ""
    confidence = 0.6 if weak else 0.85
    if ctx.symptom.points < SHORT_HISTORY:
        confidence = 0.45  # a handful of logged points: nothing anomalous, but little to go on
        notes += f"; judged on {ctx.symptom.points} logged points only"
    return Finding(
        layer="none", cause="false_alarm", confidence=confidence,
        summary=("the metrics show nothing anomalous" if frame is not None else "no step metrics to judge") + notes,
        evidence=evidence,
    )


def _what_to_collect(ctx: Context) -> list[str]:
    """The evidence an inconclusive diagnosis needs next, from what was missing: unread
    metrics and nodes, and for an anomaly what each cause's rule needs and did not have."""
    wanted = []
    if ctx.symptom.symptom == "stalled":
        if not any(node.flight_recorder for node in ctx.reachable):
            wanted.append("the job's flight recorder dumps (TORCH_FR_BUFFER_SIZE in the job; [job] flight_recorder "
                          "in the inventory when they are not at $TORCH_FR_DUMP_TEMP_FILE)")
        if not any(node.stacks for node in ctx.reachable):
            wanted.append("py-spy dump of the job's processes while they are alive (py-spy on the nodes)")
        if not any(node.ncclras is not None for node in ctx.reachable):
            wanted.append("ncclras output (NCCL 2.24 or later) from a node of the job")
    frame = ctx.metrics.frame if ctx.metrics is not None else None
    if frame is None or not len(frame):
        wanted.append("the job's step metrics: metrics.jsonl, or its training log with the iteration/step lines")
    elif ctx.symptom.points < MIN_POINTS:
        wanted.append(f"more of the training log: the logged steps before the incident ({MIN_POINTS} or more)")
    if ctx.spike is not None and frame is not None:
        grads = int(frame["grad_norm"].notna().sum()) + (int(frame["grad_bad"].sum()) if "grad_bad" in frame else 0)
        if grads == 0:
            wanted.append("the grad norm of every step (clip_grad_norm_'s return value): did it climb before the spike")
        if frame["lr"].notna().sum() == 0:
            wanted.append("the learning rate of every step: does the spike follow a peak or a change of the schedule")
        if not ctx.ranks:
            wanted.append("per-rank loss and grad norm around the spike (ranks.jsonl): one rank or all of them")
        if not ctx.batches:
            wanted.append("the batch descriptors of the spike step (batches.jsonl: token counts, empty samples)")
        if ctx.symptom.symptom == "instant_nan":
            wanted.append("a torch.autograd.detect_anomaly() run of the steps before the NaN: the operator that made it")
    if not ctx.nodes:
        wanted.append("the nodes' evidence (spikeops collect): kernel log, nvidia-smi -q, NCCL log, IB counters")
    else:
        unreachable = [node.name for node in ctx.nodes if node.unreachable]
        if unreachable:
            wanted.append(f"the unreachable node(s) {', '.join(unreachable[:8])}: their kernel log and nvidia-smi -q "
                          "out of band (BMC, console)")
    return wanted or ["the job's full log and the nodes' evidence around the window"]


def _resumed(ctx: Context) -> bool:
    """The run resumed: the incident says so, or the log's step counter went back."""
    return ctx.job.resumed_from is not None or bool(ctx.metrics is not None and ctx.metrics.replays)


def _direction(ctx: Context) -> str:
    """The seed table's most likely direction for the symptom, said as a direction."""
    symptom = ctx.symptom.symptom
    direction = DIRECTIONS[symptom]
    if symptom == "creeping_increase" and not _resumed(ctx):
        direction = "precision or the LR policy (the run never resumed, so its data order cannot have changed)"
    text = f"the seed's most likely direction for a {symptom.replace('_', ' ')} is {direction}: a direction, not a finding"
    verdict = replay.replay_verdict(ctx)
    if verdict is not None and verdict.verdict == "transient":
        text = ("replays of the window with the same data on the same and on other nodes do not reproduce it: a "
                "transient fault; " + text)
    return text


def _quiet_but(ctx: Context) -> tuple[str, list[str], list[EvidenceLine]] | None:
    """Why a run whose loss shows nothing is still not a false alarm: it slowed down (one slow
    GPU or node shows as throughput, not loss), or it died. (what, to collect, evidence)."""
    frame = ctx.metrics.frame if ctx.metrics is not None else None
    if frame is not None and len(frame):
        slowed = throughput_drop(frame)
        if slowed is not None:
            line = ctx.metric_line(slowed[0], f"throughput {slowed[1]:.0%} lower from here")
            return (f"the loss is flat but the job's throughput fell {slowed[1]:.0%} from step {slowed[0]}: one slow "
                    "GPU or node slows every rank",
                    ["each GPU's clocks and throttle reasons (nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE) and "
                     "per-rank step times: which GPU or node is slow"], [line] if line else [])
    crash = _crash(ctx)
    if crash is not None:
        return (f"the loss was flat, then the job died ({crash.text[:160]})",
                ["the full traceback, and the kernel log and nvidia-smi -q of the nodes from when it died"], [crash])
    return None


def _crash(ctx: Context) -> EvidenceLine | None:
    """The job's own log ends in an exception after its last step line: it died."""
    if ctx.metrics is None or not len(ctx.metrics.frame):
        return None
    last_step_line = int(ctx.metrics.frame["line"].max())
    for output in ctx.outputs():
        errors = output.errors
        if output.file != ctx.metrics.file or errors is None or errors.last_exception is None:
            continue
        if (errors.last_exception_line or 0) > last_step_line:
            return EvidenceLine(output.file, errors.last_exception_line, errors.last_exception)
    return None


def _inconclusive(ctx: Context, quiet: tuple[str, list[str], list[EvidenceLine]] | None = None,
                  lead: Finding | None = None) -> Finding:
    """No rule holds. With nothing judged, what could not be read; with an anomaly, the seed's
    direction for it (and the strongest lead below the bar, as a lead); with a flat loss that
    slowed or died, that. Then what to collect."""
    symptom = ctx.symptom.symptom
    collect = _what_to_collect(ctx)
    evidence: list[EvidenceLine] = []
    if quiet is not None:
        what, extra, evidence = quiet
        summary = f"{what}, and no rule names a cause"
        collect = extra + [item for item in collect if item not in extra]
    elif symptom in DIRECTIONS:
        summary = (f"{symptom.replace('_', ' ')} at step {ctx.spike}, and no rule holds on what was read; "
                   + _direction(ctx))
        if lead is not None:
            summary += (f"; the strongest lead, below the bar of a finding: {lead.cause.replace('_', ' ')} at "
                        f"{lead.confidence:.2f} ({lead.summary[:160]})")
        evidence = _metrics_evidence(ctx, [ctx.spike], "spike")
    elif symptom == "stalled":
        summary = (f"the job stopped advancing after step {ctx.symptom.spike_step} (a hang: the seed's communication "
                   "layer first), but nothing read says which rank it waits for, and no rule holds on what was read")
    else:
        summary = ("; ".join(ctx.symptom.unread) or "no step metrics could be judged") + ", and no rule holds on what was read"
    for output in ctx.outputs():
        for source in (output.errors, output.nccl):
            for event in (getattr(source, "events", None) or [])[:1]:
                evidence.append(EvidenceLine(output.file, event.line, event.text))
    return Finding(
        layer="none", cause="inconclusive", confidence=INCONCLUSIVE_CONFIDENCE,
        summary=f"{summary}: collect " + "; ".join(collect), step=ctx.spike, evidence=evidence[:4],
    )


def _resume_point(facts: BundleFacts, onset: int | None, bad: list[str] = ()) -> dict[str, Any] | None:
    """The newest verified checkpoint strictly before ``onset``, skipping those the job
    printed it could not load or write (``bad`` paths)."""
    if onset is None or not facts.checkpoints:
        return None
    good = [c for c in facts.checkpoints if c.verified is True and c.step is not None and c.step < onset
            and not any(checkpoint.same_checkpoint(path, c.path) for path in bad)]
    if not good:
        return None
    best = max(good, key=lambda c: c.step)
    return {"step": best.step, "path": best.path}


def _dedupe(items: list[Any]) -> list[Any]:
    seen, out = set(), []
    for item in items:
        key = repr(item)
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def _focus(facts: BundleFacts) -> int | None:
    return focus_step(facts.incident.window, facts.metrics)


def focus_step(window: Any, metrics: Any) -> int | None:
    """The first step that may be the spike: the window's start, moved back by the window's
    length (at least 10 minutes), because metrics lag and a job that died stops logging
    before the alert fires. None (the whole run) when steps carry no times."""
    if metrics is None or window is None or window.start is None:
        return None
    frame = metrics.frame
    if not frame["time"].notna().any():
        return None
    span = (window.end - window.start) if window.end is not None else timedelta(0)
    start = window.start - max(span, timedelta(minutes=10))
    focus = metrics.step_at_or_after(start)
    if focus is None:  # every logged step is older than the window: judge the last stretch
        focus = int(frame.index[max(0, len(frame) - WINDOW)])
    return focus


def classify_bundle(path: str | Path) -> Any:
    """The symptom from the metrics alone, as the diagnosis will judge it (seconds, without
    reading any node's evidence): what the incident flow protects on first."""
    from spikeops.bundle import open_bundle
    from spikeops.diagnosis.evidence import load_metrics

    bundle = open_bundle(path)
    metrics, _ = load_metrics(bundle)
    frame = metrics.frame if metrics is not None else None
    since, now = incident_time(bundle.incident)
    return classify(frame, focus_step(bundle.incident.window, metrics), now=now, since=since,
                    stall_rule=stall_rule(bundle.incident))


def incident_time(incident: Any) -> tuple[Any, Any]:
    """(start, end) of the incident's window: a stall is judged at its end, and must have
    begun inside it (the spec's window is the span around the anomaly; a bundle put together
    long after a run, or without a window, says nothing about whether its job hung)."""
    window = incident.window
    if window is None or window.end is None:
        return None, None
    return window.start, window.end


def stall_rule(incident: Any) -> StallRule:
    """The stall rule: the watcher that raised the alert may have its own ([watch]
    stall_factor, stall_min_s, sent in the alert), else the defaults."""
    payload = (incident.alert or {}).get("payload") if isinstance(incident.alert, dict) else None
    values = {}
    for place in (payload, (payload or {}).get("labels") if isinstance(payload, dict) else None):
        if not isinstance(place, dict):
            continue
        for key, name in (("stall_factor", "factor"), ("stall_min_s", "minimum")):
            try:
                value = float(place[key]) if key in place else None
            except (TypeError, ValueError):
                value = None
            if value is not None and 0 < value < 1e7:
                values[name] = value
    return StallRule(**values)


def _classify(facts: BundleFacts) -> SymptomResult:
    frame = facts.metrics.frame if facts.metrics is not None else None
    since, now = incident_time(facts.incident)
    return classify(frame, _focus(facts), now=now, since=since, stall_rule=stall_rule(facts.incident))


def _early_windows(bundle: Any, metrics: Any) -> dict[Any, Any]:
    """The per-rank and batch windows around the trouble, read while the nodes are parsed in
    worker processes: they depend only on the metrics and the incident (``build_context``
    finds them in the memo). Nothing at all when something here fails: read again later."""
    facts = BundleFacts(bundle, bundle.incident, metrics, [], None, [])
    try:
        build_context(facts, _classify(facts))
    except Exception:  # noqa: BLE001 - a head start only; the diagnosis reads them itself
        return {}
    return facts.memo


def diagnose_facts(facts: BundleFacts) -> Diagnosis:
    """The diagnosis of an already-loaded bundle (pure over ``facts``)."""
    symptom = _classify(facts)
    ctx = build_context(facts, symptom)
    findings = [finding for rule in ALL_RULES for finding in _run(rule, ctx)]
    collectives.join_hardware(findings)
    _weigh(findings)
    findings.sort(key=_order)
    replay.apply_replay(findings, ctx)  # what re-executing the spike window said
    past = history.apply_history(findings, ctx)  # what the lineage's earlier incidents say
    findings.sort(key=_order)

    causal = [f for f in findings if not f.history and f.cause != "inconclusive"]
    holding = [f for f in causal if f.confidence >= PRIMARY_THRESHOLD]
    tentative = [f for f in causal if f.confidence >= TENTATIVE_THRESHOLD]
    quiet = _quiet_but(ctx) if symptom.symptom == "none" and not holding else None
    if symptom.symptom in ("unknown", "stalled") and not holding:
        # Unread is not healthy: nothing says what happened, and nothing says all is well.
        # A hang with nothing that names its rank is the same: say what to collect.
        primary = _inconclusive(ctx)
        findings.insert(0, primary)
    elif symptom.symptom == "none" and not holding and quiet is None:
        primary = _false_alarm(ctx, weak=bool(findings))
        findings.insert(0, primary)
    elif holding:
        primary = holding[0]
    else:
        # A guess is a guess: no rule holds, so no cause is named (quiet: slowed or died); a
        # weaker lead (a rule that fired below the bar) is said as one, not as the cause.
        primary = _inconclusive(ctx, quiet, tentative[0] if tentative else None)
        findings.insert(0, primary)
    if primary is not findings[0]:
        findings.remove(primary)
        findings.insert(0, primary)

    convicting = [f for f in findings if f.convicts and f.confidence >= PRIMARY_THRESHOLD
                  and (f.cause != "thermal_throttle" or primary.cause == "thermal_throttle")]
    culprit_nodes = sorted({node for f in convicting for node in f.nodes})
    if primary.layer == "data":
        culprit_ranks = sorted(set(primary.ranks))
    else:
        culprit_ranks = sorted({rank for f in convicting for rank in f.ranks} | set(primary.ranks))

    if primary.cause == "inconclusive" and symptom.symptom == "stalled":
        onset = symptom.onset_step  # the last step logged: a resume starts before it
    elif primary.cause == "false_alarm" or (primary.cause == "inconclusive" and symptom.symptom not in DIRECTIONS):
        onset = None
    elif primary.cause in ("rng_not_restored", "corrupted_checkpoint", "poisoned_checkpoint") \
            and primary.onset_step is not None:
        onset = primary.onset_step
    else:
        candidates = [symptom.onset_step, primary.onset_step] + [f.onset_step for f in convicting]
        if past.poisoned is not None:  # a suspect checkpoint beside another cause: resume before it too
            candidates.append(past.poisoned["step"])
        known = [step for step in candidates if step is not None]
        onset = min(known) if known else None
    unusable = checkpoint.printed_bad_paths(ctx)
    resume_from = history.safe_resume(_resume_point(facts, onset, unusable), past, facts.checkpoints)
    corrupt = None
    if primary.cause == "corrupted_checkpoint":
        entry = checkpoint.resumed_checkpoint(ctx)
        if entry is not None:
            corrupt = {"step": entry.step, "path": entry.path}
        elif unusable:
            corrupt = {"step": None, "path": unusable[0]}
    elif past.poisoned is not None and past.poisoned.get("path"):
        corrupt = {"step": past.poisoned["step"], "path": past.poisoned["path"], "reason": "poisoned"}
    actions = plan_actions(symptom.symptom, primary, findings, culprit_nodes, resume_from, corrupt,
                           collect=_what_to_collect(ctx) if primary.cause == "inconclusive" else None)
    actions = history.revise_actions(actions, past)

    ruled_out = _dedupe(ctx.ruled_out)
    missing = _dedupe(facts.missing + [f"step metrics: {why}" for why in symptom.unread] + ctx.missing)
    if resume_from is None and onset is not None and facts.checkpoints:
        missing.append(f"checkpoints.json: no verified checkpoint before the onset step {onset}")
    return Diagnosis(
        symptom=symptom.symptom,
        spike_step=symptom.spike_step,
        onset_step=onset,
        primary=primary,
        culprit_nodes=culprit_nodes,
        culprit_ranks=culprit_ranks,
        findings=findings,
        ruled_out=ruled_out,
        missing=missing,
        actions=actions,
        resume_from=resume_from,
    )


def diagnose(path: str | Path, *, workers: int | None = None,
             verify_before: Callable[[int], object] | None = None) -> Diagnosis:
    """Read a bundle and diagnose it (BundleError, one line, when it cannot be read at all).

    ``verify_before(onset)``, when given, is called once the onset is known to verify the
    checkpoints before it into the bundle's ``checkpoints.json``; the diagnosis is then made
    again with them, from the evidence already read (reading the nodes is most of the cost)."""
    facts = load_bundle(path, workers=workers, early=_early_windows)
    diagnosis = diagnose_facts(facts)
    if verify_before is not None and diagnosis.onset_step is not None:
        verify_before(int(diagnosis.onset_step))
        diagnosis = diagnose_facts(with_fresh_checkpoints(facts))
    return diagnosis

