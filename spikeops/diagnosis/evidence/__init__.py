"""Loading a bundle into what the rules judge: the step table, per-rank windows, node facts.

This is the diagnosis's only I/O. It is also where the time goes on a 256-node incident, so:
step metrics are read with orjson into columns (not one object per step); per-rank and batch
files are read only for the steps around the trouble (binary search by byte offset when the
file is in step order, as the spec writes it); nodes are parsed in parallel worker processes;
and a baseline byte-identical to the current capture is not parsed twice (no growth).

Everything unreadable becomes a line in ``missing`` in the spec's wording; nothing raises
past ``load_bundle`` except BundleError for a bundle that cannot be opened at all.

One module per concern: ``metrics``, ``windows``, ``job_output``, ``nodes``, ``loading``;
this package re-exports what the rules use.
"""

from __future__ import annotations

from spikeops.diagnosis.evidence.metrics import MetricsTable, Replay, load_metrics
from spikeops.diagnosis.evidence.windows import first_step, read_jsonl_window, rank_records, batch_records
from spikeops.diagnosis.evidence.job_output import JobOutput, read_job_output
from spikeops.diagnosis.evidence.nodes import NodeFacts, load_node, incident_time
from spikeops.diagnosis.evidence.loading import BundleFacts, read_checkpoints, with_fresh_checkpoints, load_bundle, read_node_history, read_history

__all__ = [
    "read_checkpoints",
    "read_history",
    "read_node_history",
    "with_fresh_checkpoints",
    "MetricsTable",
    "Replay",
    "JobOutput",
    "read_job_output",
    "NodeFacts",
    "BundleFacts",
    "load_bundle",
    "load_metrics",
    "load_node",
    "incident_time",
    "read_jsonl_window",
    "first_step",
    "rank_records",
    "batch_records",
]
