"""The replay gate's verdict in the diagnosis (spec: ``silent_data_corruption``, ``replay/``).

A bundle that holds two replays of the spike window (``replay/same-nodes`` and
``replay/other-nodes``, written by the job in replay mode) is judged by
``spikeops.replay.bundle_verdict``, and the verdict weighs like this:

- ``sdc``: the replay on the original nodes reproduced the anomaly, the one elsewhere did not,
  and at the first step where they differ only some ranks' local gradients differ: a hardware
  finding that convicts those ranks' original nodes (the only cause a replay creates);
- ``reproduced``: both replays reproduce it bit for bit, wherever they ran: the hardware is
  acquitted, and the data or numeric finding that explains the spike is confirmed;
- ``transient``: neither replay meets it again: not the data (it would come back with the same
  data), not a persistent fault; said, nothing convicted;
- ``inconclusive``: a replay missing, cut short or contradictory: said in ``missing``, never judged.
"""

from __future__ import annotations

from typing import Any

from spikeops.diagnosis.context import Context
from spikeops.diagnosis.model import EvidenceLine, Finding, RuledOut

__all__ = ["replay_verdict", "hardware_silent_data_corruption", "apply_replay", "CONFIRMED"]

#: A data or numeric finding the replays reproduced on other nodes is held at least this sure.
CONFIRMED = 0.9


def replay_verdict(ctx: Context) -> Any | None:
    """The bundle's replay verdict (computed once per diagnosis), or None without replays."""
    from spikeops.replay import bundle_verdict, has_replays

    if not has_replays(ctx.facts.path):
        return None
    cached = getattr(ctx, "_replay_verdict", None)
    if cached is None:
        cached = bundle_verdict(ctx.facts.path, ctx.symptom.spike_step)
        object.__setattr__(ctx, "_replay_verdict", cached)
    return cached


def hardware_silent_data_corruption(ctx: Context) -> list[Finding]:
    verdict = replay_verdict(ctx)
    if verdict is None:
        return []
    if verdict.verdict == "inconclusive":
        ctx.missing.append(f"replay/: the replays settle nothing ({verdict.reason or verdict.summary})")
        return []
    if verdict.verdict != "sdc" or not verdict.culprit_nodes:
        return []
    return [Finding(
        "hardware", "silent_data_corruption", float(verdict.confidence), verdict.summary,
        nodes=sorted(set(verdict.culprit_nodes)), ranks=sorted(set(verdict.culprit_ranks)),
        step=verdict.first_divergence,
        evidence=[EvidenceLine(e.file, e.line, e.text) for e in verdict.evidence],
        convicts=True, onset_step=verdict.first_divergence)]


def apply_replay(findings: list[Finding], ctx: Context) -> None:
    """What ``reproduced`` and ``transient`` say about the other findings (after the rules)."""
    verdict = replay_verdict(ctx)
    if verdict is None or verdict.verdict in ("sdc", "inconclusive"):
        return
    if verdict.verdict == "reproduced":
        ctx.ruled_out.append(RuledOut("hardware", f"replays on the original and on other nodes reproduce the spike "
                                                  f"identically: not the GPUs ({verdict.summary})"))
        for finding in findings:
            if finding.layer in ("data", "numeric") and not finding.history and finding.confidence >= 0.3:
                finding.confidence = max(finding.confidence, CONFIRMED)
                finding.summary += " (confirmed: the replays reproduce it on other nodes)"
                break  # the strongest explanation, as the findings are ordered
        return
    ctx.ruled_out.append(RuledOut("hardware", f"the replays on the same and on other nodes do not reproduce the "
                                              f"spike: a transient, no persistent fault ({verdict.summary})"))
    for finding in findings:
        if finding.layer == "data" and not finding.history:
            finding.confidence = min(finding.confidence, 0.45)
            finding.summary += " (the replays with the same data do not reproduce the spike)"
