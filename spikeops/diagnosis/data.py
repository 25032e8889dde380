"""Layer 1, data: is the input broken?

Checked first because data problems masquerade as numeric ones (the seed's production case:
an overlong sample made an attention matmul overflow, and the grad norm exploded). Each rule
looks at the batches of the steps the trouble touched (onset to spike), or at the data order
after a resume, or at one rank departing from its peers.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from spikeops.diagnosis.context import Context
from spikeops.diagnosis.model import EvidenceLine, Finding, RuledOut
from spikeops.probes.bundle_files import BatchRecord

__all__ = [
    "RULES",
    "data_overlong_sample",
    "data_corrupted_sample",
    "data_rng_not_restored",
    "data_rank_data_misalignment",
    "departing_ranks",
]

#: Token count before truncation this many times ``max_length`` is an overlong sample; long
#: documents are normal (they get truncated), a 100x one is a broken record.
OVERLONG_VS_LIMIT = 4.0
#: ...and this many times the longest normal batches (99th percentile) around it.
OVERLONG_VS_POPULATION = 3.0
#: Without ``max_length``, only the population says what "long" is: be stricter.
OVERLONG_VS_POPULATION_ONLY = 8.0


def _in_trouble(ctx: Context, record: BatchRecord) -> bool:
    steps = ctx.trouble
    return steps is not None and steps[0] <= record.step <= steps[1]


def _percentile(values: list[int], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(share * len(ordered)))])


def _line(record: BatchRecord) -> EvidenceLine:
    return EvidenceLine("batches.jsonl", record.line, record.text)


def _confidence_by_step(ctx: Context, step: int, at_spike: float, before: float) -> float:
    return at_spike if step == ctx.spike else before


def data_overlong_sample(ctx: Context) -> list[Finding]:
    if ctx.spike is None or not ctx.batches:
        return []
    population = [r.max_tokens for r in ctx.batches if r.max_tokens is not None and not _in_trouble(ctx, r)]
    p99 = _percentile(population, 0.99) if len(population) >= 10 else None
    limit = ctx.job.max_length
    hits = []
    for record in ctx.batches:
        if record.max_tokens is None or not _in_trouble(ctx, record):
            continue
        vs_limit = record.max_tokens / limit if limit else None
        vs_population = record.max_tokens / p99 if p99 else None
        if vs_limit is not None:
            overlong = vs_limit >= OVERLONG_VS_LIMIT and (vs_population is None or vs_population >= OVERLONG_VS_POPULATION)
        else:
            overlong = vs_population is not None and vs_population >= OVERLONG_VS_POPULATION_ONLY
        if overlong:
            hits.append((record, vs_limit, vs_population))
    findings = []
    for record, vs_limit, vs_population in hits:
        against = f"max_length {limit:,}" if limit else f"{vs_population:.0f}x the longest normal batches"
        node = ctx.node_of_rank(record.rank)
        findings.append(Finding(
            layer="data", cause="overlong_sample",
            confidence=_confidence_by_step(ctx, record.step, 0.92, 0.82),
            summary=f"rank {record.rank}'s batch at step {record.step} holds a {record.max_tokens:,}-token sample ({against})",
            nodes=[node] if node else [], ranks=[record.rank] if record.rank is not None else [],
            step=record.step, evidence=[_line(record)],
        ))
    if not findings and ctx.batches:
        ctx.ruled_out.append(RuledOut("data", "no overlong sample in the batches of the trouble steps"))
    return findings


def data_corrupted_sample(ctx: Context) -> list[Finding]:
    if ctx.spike is None or not ctx.batches:
        return []

    def broken(record: BatchRecord) -> bool:
        return bool(record.num_empty) or record.min_tokens == 0

    others = [r for r in ctx.batches if not _in_trouble(ctx, r)]
    common = others and sum(map(broken, others)) / len(others) > 0.05
    findings = []
    for record in ctx.batches:
        if not _in_trouble(ctx, record) or not broken(record):
            continue
        what = f"{record.num_empty} empty sample(s)" if record.num_empty else "a zero-token sample"
        node = ctx.node_of_rank(record.rank)
        confidence = _confidence_by_step(ctx, record.step, 0.85, 0.75)
        if common:
            confidence = 0.3  # empty samples everywhere, spikes only here: not the cause
        findings.append(Finding(
            layer="data", cause="corrupted_sample", confidence=confidence,
            summary=f"rank {record.rank}'s batch at step {record.step} holds {what}"
            + (" (but such batches are common in this run)" if common else ""),
            nodes=[node] if node else [], ranks=[record.rank] if record.rank is not None else [],
            step=record.step, evidence=[_line(record)], history=bool(common),
        ))
    if not findings and ctx.batches:
        ctx.ruled_out.append(RuledOut("data", "no empty or zero-token samples in the batches of the trouble steps"))
    return findings


#: Replayed steps needed to compare a resume's losses with the first run's.
MIN_REPLAYS = 5
#: Same data, same weights: the replay's losses differ from the first run's by far less than
#: one step's loss differs from the next (kernel nondeterminism only). Different data: by as
#: much. Between the two, the comparison says nothing.
SAME_DATA_RATIO = 0.3
OTHER_DATA_RATIO = 0.6


def _replayed_steps(ctx: Context) -> list[Finding]:
    """Without batch fingerprints, the log's own replay: after the step counter went back,
    the steps logged again are compared with the first run's for the same steps (the seed's
    "compare with the uninterrupted loss curve"). Weaker than fingerprints, so lower."""
    replays = list(getattr(ctx.metrics, "replays", []) or []) if ctx.metrics is not None else []
    if len(replays) < MIN_REPLAYS:
        return []
    replays.sort(key=lambda r: r.step)
    gaps = [abs(r.again - r.first) for r in replays]
    firsts = [r.first for r in replays]
    noise = statistics.median(abs(b - a) for a, b in zip(firsts, firsts[1:])) if len(firsts) > 2 else 0.0
    difference = statistics.median(gaps)
    first = replays[0]
    if noise <= 0:
        return []
    ratio = difference / noise
    if ratio <= SAME_DATA_RATIO:
        ctx.ruled_out.append(RuledOut(
            "data", f"the {len(replays)} steps logged again after the restart (from step {first.step}) reproduce the first "
                    f"run's losses (median difference {difference:.3g}, step-to-step noise {noise:.3g}): the data order survived"))
        return []
    if ratio < OTHER_DATA_RATIO:
        return []
    higher = statistics.mean(r.again for r in replays) > statistics.mean(firsts)
    confidence = 0.62 if ctx.symptom.symptom == "creeping_increase" else (0.55 if higher else 0.4)
    file = ctx.metrics.file
    return [Finding(
        layer="data", cause="rng_not_restored", confidence=confidence,
        summary=f"the run went back to step {first.step} and logged {len(replays)} steps again with other losses than the "
                f"first time (median difference {difference:.3g} vs step-to-step noise {noise:.3g}"
                + (", higher" if higher else "") + "): the data order (RNG/sampler state) was not restored; "
                "no batch fingerprints to confirm it",
        step=first.step,
        evidence=[EvidenceLine(file, first.first_line, f"step {first.step}: loss {first.first:.6g} (first run)"),
                  EvidenceLine(file, first.again_line, f"step {first.step}: loss {first.again:.6g} (after the restart)")],
        onset_step=first.step,
    )]


def data_rng_not_restored(ctx: Context) -> list[Finding]:
    resumed = ctx.job.resumed_from
    if resumed is None or resumed.step is None:
        return _replayed_steps(ctx)
    if not ctx.reference_present:
        ctx.missing.append("reference/batches.jsonl: absent (data order after the resume not checked)")
        return _replayed_steps(ctx)
    current = {(r.step, r.rank): r for r in ctx.batches if r.step > resumed.step and r.fingerprint}
    pairs = [(ref, current[(ref.step, ref.rank)]) for ref in ctx.reference
             if ref.fingerprint and (ref.step, ref.rank) in current]
    if not pairs:
        ctx.missing.append("batches.jsonl / reference/batches.jsonl: no common steps after the resume to compare")
        return []
    differing = [(ref, cur) for ref, cur in pairs if ref.fingerprint != cur.fingerprint]
    share = len(differing) / len(pairs)
    if share < 0.5:
        ctx.ruled_out.append(RuledOut(
            "data", f"data order after the resume from step {resumed.step} matches the run before it "
                    f"({len(pairs) - len(differing)}/{len(pairs)} batch fingerprints equal)"))
        return []
    first_ref, first_cur = min(differing, key=lambda pair: (pair[0].step, pair[0].rank or 0))
    confidence = 0.88 if ctx.symptom.symptom == "creeping_increase" else 0.65
    return [Finding(
        layer="data", cause="rng_not_restored", confidence=confidence,
        summary=f"after the resume from step {resumed.step}, {len(differing)}/{len(pairs)} batches differ from "
                f"the run before it for the same steps: data order (RNG/sampler state) was not restored",
        step=first_cur.step,
        evidence=[_line(first_cur), EvidenceLine("reference/batches.jsonl", first_ref.line, first_ref.text)],
        onset_step=resumed.step + 1,
    )]


#: Below this many ranks at a step, a departure must be large on its own to count.
MIN_PEERS = 8
SMALL_WORLD_RELATIVE = {"loss": 0.5, "grad_norm": 0.5, "mem_allocated_gb": 0.1}


def departing_ranks(ctx: Context, steps: range | list[int]) -> dict[int, list[tuple[int, str, float, float]]]:
    """Ranks whose loss, grad norm or memory departs from their peers at ``steps``.

    Per step and value, the peers' median and MAD; a rank departs when it is > 6 MADs and
    > 20 % (memory: 5 %) away from the median while most ranks are not. With fewer than
    ``MIN_PEERS`` ranks the MAD of a handful of values says little about their noise, so a
    departure must also be large on its own (50 %; memory 10 %). Returns rank ->
    [(step, value name, value, peers' median)].
    """
    by_step = ctx.ranks_by_step()
    out: dict[int, list[tuple[int, str, float, float]]] = {}
    for step in steps:
        records = by_step.get(step, [])
        if len(records) < 4:
            continue
        for name, relative in (("loss", 0.2), ("grad_norm", 0.2), ("mem_allocated_gb", 0.05)):
            values = [(r.rank, getattr(r, name)) for r in records if getattr(r, name) is not None]
            finite = [v for _, v in values if v == v and abs(v) != float("inf")]
            if len(finite) < 4:
                continue
            median = statistics.median(finite)
            mad = statistics.median(abs(v - median) for v in finite) * 1.4826
            if len(finite) < MIN_PEERS:
                relative = max(relative, SMALL_WORLD_RELATIVE[name])
            threshold = max(6 * mad, relative * abs(median), 1e-9)
            outliers = [(rank, v) for rank, v in values if not (abs(v - median) <= threshold)]
            if 0 < len(outliers) <= max(1, len(values) // 8):
                for rank, value in outliers:
                    out.setdefault(rank, []).append((step, name, value, median))
    return out


#: How far before the onset a rank's departure may start (it often precedes the global spike).
MISALIGNMENT_LOOKBACK = 30


def _runs_into_trouble(departing: dict[int, list[tuple[int, str, float, float]]], steps: list[int],
                       last: int) -> dict[int, list[tuple[int, str, float, float]]]:
    """Keep, per rank, only the unbroken run of departing steps that reaches the trouble (one
    missed step tolerated): an unrelated wobble 30 steps earlier is not this incident."""
    kept = {}
    order = {step: index for index, step in enumerate(steps)}
    for rank, hits in departing.items():
        hit_positions = sorted({order[step] for step, *_ in hits if step in order})
        if not hit_positions:
            continue
        end = hit_positions[-1]
        if steps[end] < last - 1 and order.get(last, end) - end > 2:
            continue
        start = end
        for position in reversed(hit_positions[:-1]):
            if start - position > 2:
                break
            start = position
        kept[rank] = [hit for hit in hits if hit[0] in order and start <= order[hit[0]] <= end]
    return kept


#: Without a spike, a rank must depart on this many logged steps of the scanned stretch, up
#: to its end, before it is a finding of its own (one odd step is noise).
QUIET_MIN_STEPS = 3


def data_rank_data_misalignment(ctx: Context) -> list[Finding]:
    trouble = ctx.trouble
    quiet = trouble is None
    if quiet and ctx.scanned is not None:
        # The global loss moved too little to be a spike; one rank may still be far off.
        trouble = ctx.scanned
    if trouble is None:
        return []
    if not ctx.ranks:
        return []
    low = trouble[0] if quiet else trouble[0] - MISALIGNMENT_LOOKBACK
    steps = sorted({r.step for r in ctx.ranks if low <= r.step <= trouble[1]})
    departing = _runs_into_trouble(departing_ranks(ctx, steps), steps, trouble[1])
    if quiet:
        departing = {rank: hits for rank, hits in departing.items()
                     if len({step for step, *_ in hits}) >= QUIET_MIN_STEPS}
    if not departing:
        ctx.ruled_out.append(RuledOut("data", f"no rank departs from its peers between steps {steps[0] if steps else trouble[0]} and {trouble[1]}"))
        return []
    findings = []
    records = {(r.step, r.rank): r for r in ctx.ranks}
    for rank, hits in sorted(departing.items()):
        node = ctx.node_of_rank(rank)
        hit_steps = sorted({step for step, *_ in hits})
        first_step, name, value, median = min(hits)
        confidence = 0.78 if len(hit_steps) >= 2 else 0.62
        evidence = []
        for step in hit_steps[:3]:
            record = records.get((step, rank))
            if record is not None:
                evidence.append(EvidenceLine("ranks.jsonl", record.line,
                                             f"step {step} rank {rank}: loss {record.loss}, grad_norm {record.grad_norm}, "
                                             f"mem_allocated_gb {record.mem_allocated_gb}"))
        findings.append(Finding(
            layer="data", cause="rank_data_misalignment", confidence=confidence,
            summary=f"rank {rank} departs from its peers at {len(hit_steps)} step(s) from {first_step} "
                    f"({name} {value:.4g} vs peers' median {median:.4g}) while the other ranks stay normal",
            nodes=[node] if node else [], ranks=[rank], step=first_step, evidence=evidence,
            onset_step=first_step,
        ))
    return findings


RULES: tuple[Callable[[Context], list[Finding]], ...] = (
    data_overlong_sample,
    data_corrupted_sample,
    data_rng_not_restored,
    data_rank_data_misalignment,
)
