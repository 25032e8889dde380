"""The diagnosis spec's vocabulary (shared/spec/diagnosis.md), written out once.

The engine (``spikeops.diagnosis``) and the incident simulator (``spikeops.sim``) both speak
it; keeping it here means a cause the spec adds is added for both, and neither can drift.
"""

from __future__ import annotations

__all__ = ["LAYER_OF", "HISTORY_CAUSES", "LAYERS", "SYMPTOMS"]

#: Every cause of the spec's table, in the table's order, with its layer.
LAYER_OF: dict[str, str] = {
    "overlong_sample": "data",
    "corrupted_sample": "data",
    "rng_not_restored": "data",
    "rank_data_misalignment": "data",
    "grad_explosion": "numeric",
    "lr_too_high": "numeric",
    "loss_scale_collapse": "numeric",
    "nccl_error": "communication",
    "network_congestion": "communication",
    "nccl_version_mismatch": "communication",
    "collective_hang": "communication",
    "collective_mismatch": "communication",
    "gpu_xid": "hardware",
    "gpu_ecc": "hardware",
    "ib_link_flap": "hardware",
    "thermal_throttle": "hardware",
    "corrupted_checkpoint": "checkpoint",
    "false_alarm": "none",
}
#: Causes that only a lineage's earlier incidents show (``history.json``): a single incident,
#: which is all the simulator plants, cannot hold them, so they stand apart from ``LAYER_OF``.
HISTORY_CAUSES: dict[str, str] = {
    "poisoned_checkpoint": "checkpoint",
}
#: Investigation order (the seed's framework), then checkpoint integrity and "none".
LAYERS: tuple[str, ...] = ("data", "numeric", "communication", "hardware", "checkpoint", "none")
SYMPTOMS: tuple[str, ...] = ("instant_nan", "single_spike", "spike_no_recovery", "creeping_increase", "none",
                             "stalled")
