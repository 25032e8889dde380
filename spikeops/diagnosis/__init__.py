"""The four-layer diagnosis (data, numeric, communication, hardware; then checkpoints).

``diagnose(BUNDLE)`` reads an incident bundle (shared/spec/bundle.md) and returns the
diagnosis of shared/spec/diagnosis.md: the symptom, the spike and onset steps, the primary
cause with its confidence, the culprit nodes and ranks, every finding with the evidence
lines it rests on, what was ruled out, what was missing, the actions, and where to resume.
One module per layer holds that layer's rules; ``engine`` weighs them.
"""

from spikeops.diagnosis.engine import diagnose, diagnose_facts
from spikeops.diagnosis.model import CAUSES, DIAGNOSIS_FORMAT, SYMPTOMS, Diagnosis, Finding

__all__ = ["diagnose", "diagnose_facts", "Diagnosis", "Finding", "CAUSES", "SYMPTOMS", "DIAGNOSIS_FORMAT"]
