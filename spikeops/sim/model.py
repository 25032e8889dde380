"""The simulator's vocabulary and its ground truth (``Expected``).

The names here are the diagnosis spec's (shared/spec/diagnosis.md): one cause per row of
its table, ``false_alarm`` included, each in the layer the table puts it in. They are
written out once, here, and the scenario table is checked against them at import, so a
cause the spec adds cannot be forgotten silently.

Ground-truth conventions (the spec's definitions, applied to what the simulator planted):

- ``spike_step``: the first logged step far above the running level of the loss (a jump of
  at least +40 % on a curve whose step-to-step noise is at most 2 %); for a NaN incident,
  the first step whose loss (or grad norm) is non-finite. None when the symptom is ``none``.
- ``onset_step``: the first step touched by the trouble: the first step of a precursor (grad
  norm already climbing, loss scale already collapsing, one rank already departing, the
  LR already changed, throughput already dropping), the first step logged at or after a
  hardware event's wall-clock time (an Xid logged during step S's interval makes S the
  onset), or the resume step + 1 for causes that start at a resume. Equal to ``spike_step``
  when nothing precedes the jump. None only for ``false_alarm``.
- ``resume_from``: the newest checkpoint of ``checkpoints.json`` with ``verified: true``
  whose step is strictly below ``onset_step`` (``{"step", "path"}``); None when there is no
  onset or no such checkpoint.
- ``culprit_nodes``: exactly the nodes to isolate: the node whose hardware failed
  (``gpu_xid``, ``gpu_ecc``, ``ib_link_flap``, ``thermal_throttle``) or the minority nodes
  of an NCCL version mismatch; empty for every other cause.
- ``culprit_ranks``: the ranks the evidence names: the rank whose batch or values departed
  (data causes), the rank(s) driving the GPU(s) the hardware evidence names (``gpu_xid``,
  ``gpu_ecc``, ``thermal_throttle``); empty when the trouble is everyone's (numeric,
  communication, resume causes) or a NIC's (``ib_link_flap``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from spikeops.vocabulary import LAYER_OF, LAYERS, SYMPTOMS

__all__ = [
    "LAYER_OF",
    "CAUSES",
    "LAYERS",
    "SYMPTOMS",
    "DISTRACTORS",
    "RESUME_CAUSES",
    "NODE_CAUSES",
    "Expected",
]

CAUSES: tuple[str, ...] = tuple(LAYER_OF)

#: Evidence planted to tempt a diagnosis that is not careful; none changes the answer.
DISTRACTORS: tuple[str, ...] = (
    "old_xid",
    "app_xid",
    "steady_correctable_ecc",
    "steady_pause",
    "intact_resume",
    "missing_probe",
    "unreachable_node",
    "corrupt_old_checkpoint",
    "plain_dmesg",
)

#: Causes that begin at a resume: they own ``job.resumed_from`` (no ``intact_resume``).
RESUME_CAUSES: frozenset[str] = frozenset({"rng_not_restored", "corrupted_checkpoint"})
#: Causes whose answer names nodes to isolate.
NODE_CAUSES: frozenset[str] = frozenset(
    {"gpu_xid", "gpu_ecc", "ib_link_flap", "thermal_throttle", "nccl_version_mismatch"}
)


@dataclass
class Expected:
    """The answer a correct diagnosis gives for a simulated bundle (conventions: module doc)."""

    symptom: str
    layer: str
    cause: str
    culprit_nodes: list[str]
    culprit_ranks: list[int]
    spike_step: int | None
    onset_step: int | None
    resume_from: dict | None
    distractors: list[str]
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_diagnosis(self) -> dict[str, Any]:
        """The answer in the shape of ``diagnosis.json`` (the fields that are scored)."""
        return {
            "format": "spikeops-diagnosis/1",
            "symptom": self.symptom,
            "spike_step": self.spike_step,
            "onset_step": self.onset_step,
            "primary": {"layer": self.layer, "cause": self.cause},
            "culprit_nodes": list(self.culprit_nodes),
            "culprit_ranks": list(self.culprit_ranks),
            "resume_from": self.resume_from,
        }
