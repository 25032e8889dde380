"""What every rule sees: the bundle's facts, the symptom, and the steps around the trouble.

Rules are small pure functions of a ``Context``; they return findings and may add a
"ruled out" line (what they checked and found clean) or a "missing" line (what they could
not check). The per-rank and batch windows are loaded once here, for the steps that matter.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from spikeops.diagnosis.evidence import (
    BundleFacts,
    first_step,
    JobOutput,
    MetricsTable,
    NodeFacts,
    batch_records,
    rank_records,
    read_jsonl_window,
)
from spikeops.diagnosis.model import EvidenceLine, RuledOut
from spikeops.diagnosis.symptom import SymptomResult
from spikeops.probes.base import clip
from spikeops.probes.bundle_files import BatchRecord, RankRecord

__all__ = ["Context", "build_context", "RANK_WINDOW_BEFORE", "RANK_WINDOW_AFTER"]

#: Steps of per-rank rows read before the onset (the peers' normal) and after the spike.
RANK_WINDOW_BEFORE = 40
RANK_WINDOW_AFTER = 10
#: Batches before the onset that give the population of normal token counts.
BATCH_WINDOW_BEFORE = 8
#: Without a spike (the global loss moved a few percent), the last logged steps whose per-rank
#: rows are still read: one rank can depart 6-20x from its peers while the mean hides it.
RANK_SCAN_STEPS = 50
#: Steps of reference batches compared after a resume: a lost RNG state changes every
#: batch, so a few steps of every rank tell it for sure.
REFERENCE_STEPS = 16


@dataclass
class Context:
    facts: BundleFacts
    symptom: SymptomResult
    ranks: list[RankRecord] = field(default_factory=list)
    batches: list[BatchRecord] = field(default_factory=list)
    reference: list[BatchRecord] = field(default_factory=list)
    reference_present: bool = False
    #: Steps of per-rank rows read without a spike (the last stretch of the run), or None.
    scanned: tuple[int, int] | None = None
    ruled_out: list[RuledOut] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    # -- job ---------------------------------------------------------------------------
    @property
    def job(self) -> Any:
        return self.facts.incident.job

    @property
    def metrics(self) -> MetricsTable | None:
        return self.facts.metrics

    @property
    def nodes(self) -> list[NodeFacts]:
        return self.facts.nodes

    @property
    def reachable(self) -> list[NodeFacts]:
        return [node for node in self.facts.nodes if not node.unreachable]

    def node_of_rank(self, rank: int | None) -> str | None:
        return None if rank is None else self.job.node_of_rank(rank)

    def node_named(self, host: str | None) -> str | None:
        """The job's node a host name in a log means (``gpu-003.cluster.local`` is
        ``gpu-003``); None when it names none of the job's nodes."""
        if not host:
            return None
        known = set(self.job.nodes) | {node.name for node in self.facts.nodes}
        if host in known:
            return host
        short = host.split(".", 1)[0]
        return short if short in known else None

    def output_node(self, output: JobOutput, *, host: str | None = None, rank: int | None = None,
                    device: int | None = None, local_rank: int | None = None, pci: str | None = None) -> str | None:
        """The node an error line of the job's output is about, when the line (or its file)
        says: a host it names, the node whose log it is, a global rank through the job's rank
        map; a device, local rank or PCI address only tells the node in a one-node job. None otherwise:
        an error that names no node convicts none."""
        named = self.node_named(host)
        if named is not None:
            return named
        if output.node is not None:
            return output.node
        if rank is not None:
            return self.node_of_rank(rank)
        if (device is not None or local_rank is not None or pci is not None) and len(self.job.nodes) == 1:
            return self.job.nodes[0]
        return None

    def outputs(self) -> list[JobOutput]:
        """The job's own output, read for errors (bundle train.log, nodes' train.log/nccl.log)."""
        return list(self.facts.output)

    # -- time ----------------------------------------------------------------------------
    def in_window(self, moment: datetime | None) -> bool | None:
        window = self.facts.incident.window
        if window is None:
            return None
        return window.contains(moment)

    def step_at(self, moment: datetime | None) -> int | None:
        return self.metrics.step_at_or_after(moment) if self.metrics is not None and moment else None

    # -- steps ---------------------------------------------------------------------------
    @property
    def spike(self) -> int | None:
        return self.symptom.spike_step

    @property
    def onset(self) -> int | None:
        return self.symptom.onset_step

    @cached_property
    def trouble(self) -> tuple[int, int] | None:
        """[onset, spike]: the steps whose batches and ranks can hold the cause (computed
        once: rules test every batch against it)."""
        if self.spike is None:
            return None
        return (min(self.onset or self.spike, self.spike), self.spike)

    def metric_line(self, step: int | None, why: str = "") -> EvidenceLine | None:
        if self.metrics is None or step is None or step not in self.metrics.frame.index:
            return None
        row = self.metrics.frame.loc[step]
        parts = [f"step {step}"]
        for column in ("loss", "grad_norm", "lr", "loss_scale", "throughput"):
            value = row.get(column)
            if column == "loss" and bool(row.get("loss_bad")):
                parts.append("loss non-finite")
            elif value is not None and pd.notna(value):
                parts.append(f"{column} {value:.6g}")
        text = ", ".join(parts) + (f" ({why})" if why else "")
        return EvidenceLine(self.metrics.file, int(row["line"]), clip(text))

    # -- ranks ---------------------------------------------------------------------------
    def ranks_by_step(self) -> dict[int, list[RankRecord]]:
        grouped: dict[int, list[RankRecord]] = defaultdict(list)
        for record in self.ranks:
            grouped[record.step].append(record)
        return grouped


def _window(facts: BundleFacts, path: Path, low: int, high: int, reader: Callable[[list[Any]], list[Any]]
            ) -> tuple[list[Any], list[str]]:
    """``reader`` over the rows of ``path`` in [low, high], read once per loaded bundle: the
    flow diagnoses twice (before and after verifying the checkpoints), and these windows of
    the per-rank and batch files are megabytes of JSON. Each caller gets its own list."""
    key = (str(path), low, high, reader.__name__)
    if key not in facts.memo:
        rows, notes = read_jsonl_window(path, low, high)
        facts.memo[key] = (reader(rows), notes)
    records, notes = facts.memo[key]
    return list(records), list(notes)


def build_context(facts: BundleFacts, symptom: SymptomResult) -> Context:
    """Load the per-rank, batch and reference windows the rules need, once."""
    context = Context(facts, symptom)
    root = facts.path
    trouble = context.trouble
    if trouble is None and facts.metrics is not None and len(facts.metrics.frame) and (root / "ranks.jsonl").is_file():
        # No spike to look around: scan the last stretch of the run for a departing rank.
        steps = facts.metrics.frame.index
        low, high = int(steps[max(0, len(steps) - RANK_SCAN_STEPS)]), int(steps[-1])
        try:
            records, notes = _window(facts, root / "ranks.jsonl", low, high, rank_records)
        except (OSError, ValueError) as exc:
            context.missing.append(f"ranks.jsonl: unreadable ({exc})")
        else:
            context.missing.extend(notes)
            context.ranks = records
            context.scanned = (low, high)
    if trouble is not None:
        for name, target, reader, before in (("ranks.jsonl", "ranks", rank_records, RANK_WINDOW_BEFORE),
                                             ("batches.jsonl", "batches", batch_records, BATCH_WINDOW_BEFORE)):
            low, high = trouble[0] - before, trouble[1] + RANK_WINDOW_AFTER
            path = root / name
            if not path.is_file():
                context.missing.append(f"{name}: absent ({'per-rank' if name.startswith('ranks') else 'batch'} checks skipped)")
                continue
            try:
                records, notes = _window(facts, path, low, high, reader)
            except (OSError, ValueError) as exc:
                context.missing.append(f"{name}: unreadable ({exc})")
                continue
            context.missing.extend(notes)
            setattr(context, target, records)
            if not records:
                context.missing.append(f"{name}: no rows for steps {low}..{high}")
    resumed = facts.incident.job.resumed_from
    reference = root / "reference" / "batches.jsonl"
    current_path = root / "batches.jsonl"
    if resumed is not None and resumed.step is not None and reference.is_file():
        context.reference_present = True
        # Compare where both files have steps after the resume: the current file may hold
        # only a window around the incident, the reference only the steps after S.
        low = max(resumed.step + 1, first_step(reference) or 0, first_step(current_path) or 0)
        context.reference, notes = _window(facts, reference, low, low + REFERENCE_STEPS, batch_records)
        context.missing.extend(notes)
        if context.reference and current_path.is_file():
            steps = {record.step for record in context.reference}
            current, _ = _window(facts, current_path, min(steps), max(steps), batch_records)
            known = {(record.step, record.rank) for record in context.batches}
            context.batches.extend(record for record in current if (record.step, record.rank) not in known)
    return context
