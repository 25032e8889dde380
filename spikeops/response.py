"""The seed's rapid-response matrix and the approval policy, as small pure decisions.

The incident flow asks these functions what to do at each fork and does the I/O itself, so
the rules that decide whether a job is stopped, a node drained or a job resumed can be read
in one place and tested without Prefect, a scheduler or a cluster:
- ``protective_move``: stop at once for a NaN or a spike that does not recover; observe a
  single spike; keep a stalled (hung) job alive until its stacks and flight recorder are
  collected, then stop it; leave anything else running (the matrix's "Protect" column);
- ``approval_gate``: whether a drain or a resume needs a person, the policy's own answer
  otherwise (``always`` asks for every action, ``auto-hardware`` lets a confident hardware
  conviction through, ``never`` never drains);
- ``must_stop_before_resume`` and ``resume_decision``: a job is resumed only when it was
  stopped, from a verified checkpoint, without every convicted node, and (where asked) with a
  person's yes. Silence is a no. An inconclusive diagnosis (the evidence could not be read)
  never resumes a stopped job on the policy's word alone, nor does a software fault (a
  collective mismatch: the same code would hang again).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from spikeops.inventory import fold_nodes

__all__ = ["STOP_AT_ONCE", "STOP_AFTER_COLLECTION", "SOFTWARE_FAULTS", "APPROVAL_POLICIES", "AUTO_APPROVE_CONFIDENCE", "Gate", "protective_move",
           "approval_gate", "must_stop_before_resume", "resume_decision", "describe_actions", "outcome_summary",
           "SUCCESS", "UNSURE", "REPLAY_BELOW", "replay_wanted"]

#: The symptoms for which the seed's matrix says "stop training, preserve state".
STOP_AT_ONCE = frozenset({"instant_nan", "spike_no_recovery"})
#: A hung job: its stacks and flight recorder need its live processes, so it is stopped only
#: once the evidence is collected (it trains nothing meanwhile).
STOP_AFTER_COLLECTION = frozenset({"stalled"})
#: Causes a resume cannot fix (the code is wrong): a person decides when to resume.
SOFTWARE_FAULTS = frozenset({"collective_mismatch"})
APPROVAL_POLICIES = ("always", "auto-hardware", "never")
#: ``auto-hardware`` drains without asking only at or above this confidence.
AUTO_APPROVE_CONFIDENCE = 0.8
#: Diagnoses that know nothing: a stopped job is never resumed on them without a person.
UNSURE = frozenset({"inconclusive"})
#: Action outcomes that leave the intended state in place (the idempotent repeat included).
SUCCESS = ("done", "nothing-to-do", "dry-run")

Move = Literal["stop", "observe", "stop_after_collection", "none"]


def protective_move(symptom: str | None, *, observe_steps: int = 50) -> Move:
    """The matrix's first column: what protects the run before anything is known."""
    if symptom in STOP_AT_ONCE:
        return "stop"
    if symptom in STOP_AFTER_COLLECTION:
        return "stop_after_collection"
    if symptom == "single_spike" and observe_steps > 0:
        return "observe"
    return "none"


@dataclass(frozen=True)
class Gate:
    """What one decision needs. ``action`` is what is decided (``None``: nothing to decide);
    ``ask`` means a person must answer ``question``; otherwise ``approved`` and ``why`` are the
    policy's answer."""

    action: Literal["isolate", "resume", "replay"] | None
    ask: bool = False
    approved: bool = False
    why: str = ""
    question: str = ""


def approval_gate(policy: str, diagnosis: Mapping[str, Any], *, stopped: bool, can_isolate: bool = True,
                  can_resume: bool = True, remediation: str = "a plain resume", replayed: str | None = None) -> Gate:
    """Whether the next action needs a person. A drain is decided when the diagnosis convicts
    nodes; with ``always``, a stopped job with no culprit is resumed only after a yes too.
    ``replayed`` is the replay gate's verdict when the spike window was replayed: a
    ``transient`` one (neither the original nodes nor others reproduce it with the same data)
    rules out a persistent fault, so an inconclusive diagnosis after it is not "nothing known"."""
    if policy not in APPROVAL_POLICIES:
        raise ValueError(f"approval policy must be one of {', '.join(APPROVAL_POLICIES)}")
    primary = diagnosis.get("primary") or {}
    culprits = list(diagnosis.get("culprit_nodes") or [])
    resume_from = diagnosis.get("resume_from")
    if culprits and can_isolate:
        if policy == "never":
            return Gate("isolate", approved=False, why="policy: never isolate")
        confidence = float(primary.get("confidence") or 0)
        if policy == "auto-hardware" and primary.get("layer") == "hardware" and confidence >= AUTO_APPROVE_CONFIDENCE:
            return Gate("isolate", approved=True,
                        why=f"policy: auto-approved ({primary.get('cause')}, confidence {primary.get('confidence')})")
        return Gate("isolate", ask=True, question=f"drain {fold_nodes(culprits)} and resume without them")
    if not culprits and stopped and resume_from and can_resume:
        if policy == "always":
            return Gate("resume", ask=True, question=f"resume from {resume_from.get('path')} ({remediation})")
        if primary.get("cause") in UNSURE and replayed != "transient":  # nothing known: a person decides
            return Gate("resume", ask=True, question=f"resume from {resume_from.get('path')} although the diagnosis "
                                                     f"is {primary.get('cause')} ({remediation})")
        if primary.get("cause") in SOFTWARE_FAULTS:  # the same code hangs again: only after a fix
            return Gate("resume", ask=True, question=f"resume from {resume_from.get('path')} once the parallel "
                                                     f"configuration is fixed ({primary.get('cause')}; {remediation})")
    return Gate(None)


#: Below this confidence a data or numeric diagnosis is replayed (when the policy allows):
#: the replay confirms it, or finds the GPU that computed wrong numbers.
REPLAY_BELOW = 0.95
ANOMALOUS = frozenset({"instant_nan", "single_spike", "spike_no_recovery"})


def replay_wanted(diagnosis: Mapping[str, Any], *, stopped: bool, max_steps: int) -> tuple[bool, str]:
    """Whether the spike window is worth replaying before the resume, and why (not). Only a
    stopped job's nodes are free to replay on; a conclusive hardware or communication
    conviction needs no replay; there must be a spike to reach and a verified checkpoint before
    it, within the step budget."""
    primary = diagnosis.get("primary") or {}
    resume = diagnosis.get("resume_from") or {}
    spike = diagnosis.get("spike_step")
    if not stopped:
        return False, "the job is still running on its nodes"
    if diagnosis.get("culprit_nodes") and primary.get("layer") in ("hardware", "communication"):
        return False, f"{primary.get('cause')} already convicts {fold_nodes(diagnosis['culprit_nodes'])}"
    if diagnosis.get("symptom") not in ANOMALOUS and primary.get("cause") not in UNSURE:
        return False, f"no spike to replay ({diagnosis.get('symptom')})"
    if spike is None or resume.get("step") is None or not resume.get("path"):
        return False, "no spike step or no verified checkpoint before it to replay from"
    steps = int(spike) - int(resume["step"])
    if steps > max_steps:
        return False, f"the window is {steps} steps, beyond the replay budget of {max_steps}"
    if primary.get("layer") in ("data", "numeric") and float(primary.get("confidence") or 0) >= REPLAY_BELOW:
        return False, f"{primary.get('cause')} at confidence {primary.get('confidence')}"
    return True, f"replay steps {int(resume['step']) + 1}-{spike} ({steps} steps) from {resume['path']}"


def must_stop_before_resume(excluded: Iterable[str], *, stopped: bool, can_resume: bool,
                            resume_from: Mapping[str, Any] | None) -> bool:
    """A convicted node was drained under a job that kept running (a single spike): the job
    must leave that node, so it is stopped (signal first) before it is resumed elsewhere."""
    return bool(list(excluded)) and not stopped and can_resume and bool(resume_from)


def resume_decision(gate: Gate, approved: bool, why: str, *, stopped: bool, can_resume: bool,
                    resume_from: Mapping[str, Any] | None, culprits: Iterable[str],
                    excluded: Iterable[str]) -> tuple[bool, str | None] | None:
    """``(True, None)``: resume now; ``(False, reason)``: the job stays stopped, and why;
    ``None``: there is nothing to resume (the job still runs, or resuming is skipped)."""
    if not can_resume or not stopped:
        return None
    if gate.action == "resume" and not approved:
        return False, f"resume not approved: {why}"
    if resume_from and resume_from.get("path") and (not list(culprits) or list(excluded)):
        return True, None
    return False, "no verified checkpoint before the onset" if not resume_from else "culprit nodes not isolated"


def describe_actions(actions: Iterable[Mapping[str, Any]], verb: str | None = None) -> str:
    """``stop 4412: done; drain gpu-002: done`` for a Slack line."""
    return "; ".join(f"{verb or a['action']} {a['target']}: {a['outcome']}" for a in actions)


def outcome_summary(resumed: Mapping[str, Any] | None, *, stopped: bool) -> str:
    """One line for the end of the thread: what state the job was left in."""
    resumed = resumed or {}
    if resumed.get("outcome") == "done":
        return f"resumed: {resumed.get('detail')}"
    return str(resumed.get("detail") or ("kept running, observed" if not stopped else "stopped"))
