"""Training-side instrumentation: the evidence the diagnosis needs, and the seed's
prevention checklist, in a few lines of any training loop. Importable without torch; torch
is used when the job has imported it.

- ``MetricsLogger``: metrics.jsonl, ranks.jsonl, batches.jsonl in the bundle formats;
- ``PrometheusExporter``: the same step metrics on a ``/metrics`` endpoint, for the alerting
  rules in ``infra/monitoring/`` (docs/monitoring.md);
- ``GradGuard``, ``NanGuard``, ``filter_samples``: grad-norm clip and z-score alarm, the
  first NaN recorded and alerted, max-length/empty/duplicate filters;
- ``capture_state``/``restore_state``/``FingerprintCheck``: RNG and sampler state with the
  checkpoint, and the data-order check after a resume;
- ``AnomalyLocator``: the operator that produced the first NaN, after a resume;
- ``on_checkpoint_saved``: resume state and MANIFEST.json on every save;
- ``ResumeRequest``: what the incident flow asked a resumed run to do (skip batches, 0.3x LR,
  strict RNG restore, detect_anomaly, or a replay: ``request.replay``), read from the environment;
- ``ReplayRecorder``/``deterministic``/``grad_digest``: the replay gate's record of the spike
  window (replay.jsonl: loss, grad norm, local and reduced gradient digests per step and rank);
- ``FlightRecorderDump``: the flight recorder dumped where NCCL's watchdog would write it, when
  the loop stops advancing (gloo has no such watchdog): the dump that names a hang's rank.
"""

from __future__ import annotations

from spikeops.train.anomaly import AnomalyLocator
from spikeops.train.checkpointing import on_checkpoint_saved
from spikeops.train.exporter import PrometheusExporter
from spikeops.train.flight_recorder import FlightRecorderDump
from spikeops.train.guards import FilterStats, GradGuard, NanGuard, NonFiniteLoss, filter_samples
from spikeops.train.logger import MetricsLogger, batch_record, fingerprint
from spikeops.train.remedies import ReplayRequest, ResumeRequest
from spikeops.train.replay import ReplayRecorder, deterministic, grad_digest
from spikeops.train.resume import (
    DataOrderWarning,
    FingerprintCheck,
    capture_state,
    load_state,
    restore_state,
    save_state,
)

__all__ = [
    "MetricsLogger", "fingerprint", "batch_record", "PrometheusExporter",
    "GradGuard", "NanGuard", "NonFiniteLoss", "filter_samples", "FilterStats",
    "capture_state", "restore_state", "save_state", "load_state", "FingerprintCheck", "DataOrderWarning",
    "AnomalyLocator", "on_checkpoint_saved", "ResumeRequest", "ReplayRequest",
    "ReplayRecorder", "deterministic", "grad_digest", "FlightRecorderDump",
]
