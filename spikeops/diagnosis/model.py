"""The diagnosis's vocabulary and output shape (shared/spec/diagnosis.md, format 1).

Findings carry two things the JSON does not: whether they convict their nodes (the nodes to
isolate) and the step at which they say the trouble began. The engine uses both to fill
``culprit_nodes`` and ``onset_step``; ``to_json`` writes exactly the spec's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spikeops.vocabulary import HISTORY_CAUSES, LAYER_OF, LAYERS
from spikeops.vocabulary import SYMPTOMS as _SYMPTOMS

__all__ = [
    "DIAGNOSIS_FORMAT",
    "LAYERS",
    "CAUSES",
    "SYMPTOMS",
    "INCONCLUSIVE_LAYERS",
    "EvidenceLine",
    "Finding",
    "RuledOut",
    "Diagnosis",
]

DIAGNOSIS_FORMAT = "spikeops-diagnosis/1"

#: The spec's cause table: cause -> layer (shared with the simulator: spikeops.vocabulary,
#: which generates incidents for the causes a generator can plant), plus ``inconclusive``
#: (the answer when no rule holds and the evidence to judge is missing),
#: ``silent_data_corruption`` (only replays of the spike window show it: spikeops.replay) and
#: the causes only the lineage's history shows (``poisoned_checkpoint``: history.json).
CAUSES: dict[str, str] = {**LAYER_OF, "inconclusive": "none", "silent_data_corruption": "hardware",
                          **HISTORY_CAUSES}
#: The spec's symptoms, ``unknown`` (no step metrics could be judged) included.
SYMPTOMS: tuple[str, ...] = (*_SYMPTOMS, *(() if "unknown" in _SYMPTOMS else ("unknown",)))
#: Layers whose evidence can be inconclusive about a node (it failed, or could not be read,
#: and nothing says which part): an extension, documented in docs/diagnosis.md. Such a
#: finding never convicts and is never the primary cause.
INCONCLUSIVE_LAYERS = ("none", "hardware")


@dataclass(frozen=True)
class EvidenceLine:
    """One line a finding rests on: bundle-relative file, 1-based line, the text itself."""

    file: str
    line: int | None
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "text": self.text}


@dataclass
class Finding:
    layer: str
    cause: str
    confidence: float
    summary: str
    nodes: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    step: int | None = None
    evidence: list[EvidenceLine] = field(default_factory=list)
    #: The evidence ties a fault to ``nodes``: isolate them (if the finding holds up).
    convicts: bool = False
    #: The first step this finding says the trouble touched (hardware event, resume...).
    onset_step: int | None = None
    #: Listed for completeness (old, unchanged, or everywhere): never the primary cause.
    history: bool = False

    def __post_init__(self) -> None:
        if self.cause == "inconclusive" and self.layer in INCONCLUSIVE_LAYERS:
            return
        if CAUSES.get(self.cause) != self.layer:
            raise ValueError(f"cause {self.cause!r} is not in layer {self.layer!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "cause": self.cause,
            "confidence": round(float(self.confidence), 3),
            "nodes": sorted(set(self.nodes)),
            "ranks": sorted(set(self.ranks)),
            "step": self.step,
            "evidence": [line.to_json() for line in self.evidence],
            "summary": self.summary,
        }


@dataclass(frozen=True)
class RuledOut:
    layer: str
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "why": self.why}


@dataclass
class Diagnosis:
    symptom: str
    spike_step: int | None
    onset_step: int | None
    primary: Finding
    culprit_nodes: list[str]
    culprit_ranks: list[int]
    findings: list[Finding]
    ruled_out: list[RuledOut]
    missing: list[str]
    actions: list[dict[str, Any]]
    resume_from: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": DIAGNOSIS_FORMAT,
            "symptom": self.symptom,
            "spike_step": self.spike_step,
            "onset_step": self.onset_step,
            "primary": {
                "layer": self.primary.layer,
                "cause": self.primary.cause,
                "confidence": round(float(self.primary.confidence), 3),
            },
            "culprit_nodes": list(self.culprit_nodes),
            "culprit_ranks": list(self.culprit_ranks),
            "findings": [finding.to_json() for finding in self.findings],
            "ruled_out": [item.to_json() for item in self.ruled_out],
            "missing": list(self.missing),
            "actions": list(self.actions),
            "resume_from": self.resume_from,
        }
