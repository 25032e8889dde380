"""``spikeops watch``: the online counterpart of the symptom classifier (docs/watch.md).

- ``detect``: ``WatchConfig`` (the ``[watch]`` thresholds), ``Detector.feed(record)`` and the
  ``Anomaly`` it returns when an incident starts; pure, no I/O;
- ``sources``: following a ``metrics.jsonl`` or a training log, polling Prometheus;
- ``fire``: the alert for the receiver, the firing targets, and the ``watch`` loop;
- ``cli``: the ``spikeops watch`` subcommand. The Prefect flow is ``flows/watch.py``.
"""

from spikeops.watch.detect import KINDS, Anomaly, Detector, WatchConfig
from spikeops.watch.fire import alert_payload, describe, post_to_receiver, print_target, receiver_target, watch
from spikeops.watch.sources import SourceStats, follow_log, follow_metrics, open_source, poll_prometheus

__all__ = [
    "KINDS", "Anomaly", "Detector", "WatchConfig",
    "alert_payload", "describe", "post_to_receiver", "print_target", "receiver_target", "watch",
    "SourceStats", "follow_log", "follow_metrics", "open_source", "poll_prometheus",
]
