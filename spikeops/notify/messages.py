"""Slack messages for an incident, as Block Kit: pure functions from facts to blocks.

The opening message must say at a glance what happened to which job; replies say what each
stage found; the final summary (edited into the opening message) says what spikeops believes,
why, and what it did or wants to do, with buttons to the flow run and the approval page.
Slack's limits are enforced here (50 blocks, 3,000 characters a section, 150 a header), so a
long diagnosis is cut with a pointer to the report instead of being refused by Slack.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from spikeops.inventory import fold_nodes

__all__ = [
    "approval_markdown",
    "MAX_BLOCKS",
    "MAX_SECTION",
    "MAX_HEADER",
    "opening",
    "stage",
    "diagnosis_message",
    "summary",
    "fit_blocks",
    "redact",
    "SYMPTOM_WORDS",
]

MAX_BLOCKS = 50
MAX_SECTION = 3000
MAX_HEADER = 150
MAX_FINDINGS = 5
MAX_EVIDENCE = 3
SYMPTOM_WORDS = {
    "instant_nan": "NaN loss", "single_spike": "loss spike", "spike_no_recovery": "loss spike, no recovery",
    "creeping_increase": "creeping loss", "none": "no anomaly in the metrics",
    "stalled": "stalled (no new step)",
}
_SECRETS = [
    re.compile(r"xox[abposr]-[A-Za-z0-9-]{6,}"),           # Slack tokens
    re.compile(r"xapp-[A-Za-z0-9-]{6,}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)(authorization:\s*bearer\s+)[^\s`'\"]+"),
    re.compile(r"(?i)\b((?:password|passwd|secret|token|api[_-]?key)=)[^\s`'\"]+"),
]


def redact(text: str) -> str:
    """Remove anything shaped like a secret before it reaches Slack, a file or a log."""
    for pattern in _SECRETS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() and m.group(1) else "") + "[redacted]", text)
    return text


def _clip(text: str, limit: int, more: str = "… (full text in report.md)") -> str:
    text = redact(text)
    return text if len(text) <= limit else text[: limit - len(more)] + more


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": _clip(text, MAX_SECTION)}}


def _header(text: str) -> dict[str, Any]:
    return {"type": "header", "text": {"type": "plain_text", "text": _clip(text, MAX_HEADER, "…"), "emoji": True}}


def _context(text: str) -> dict[str, Any]:
    return {"type": "context", "elements": [{"type": "mrkdwn", "text": _clip(text, MAX_SECTION)}]}


def _fields(pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    return {"type": "section", "fields": [{"type": "mrkdwn", "text": _clip(f"*{k}*\n{v}", 2000)}
                                          for k, v in pairs[:10]]}


def fit_blocks(blocks: list[dict[str, Any]], note: str = "More in report.md.") -> list[dict[str, Any]]:
    """At most ``MAX_BLOCKS`` blocks, the last one saying what was left out."""
    if len(blocks) <= MAX_BLOCKS:
        return blocks
    kept = blocks[: MAX_BLOCKS - 1]
    return kept + [_context(f"{len(blocks) - len(kept)} more blocks left out. {note}")]


def _job_line(incident: Mapping[str, Any]) -> str:
    job = incident.get("job") or {}
    name = f" ({job.get('name')})" if job.get("name") else ""
    return f"{job.get('id', '?')}{name}"


def opening(incident: Mapping[str, Any], *, symptom: str | None = None, spike_step: int | None = None,
            links: Mapping[str, str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The first message of the thread, on the alert."""
    job = incident.get("job") or {}
    alert = incident.get("alert") or {}
    what = SYMPTOM_WORDS.get(symptom or "", "training anomaly")
    text = f":rotating_light: {what} in job {_job_line(incident)}"
    pairs = [("Job", _job_line(incident)), ("Symptom", symptom or "classifying…"),
             ("Spike step", str(spike_step) if spike_step is not None else "—"),
             ("Nodes", f"{len(job.get('nodes') or [])}: {fold_nodes(job.get('nodes') or [])}" if job.get("nodes") else "—"),
             ("Alert", f"{alert.get('source', '—')} at {alert.get('received', incident.get('created', '—'))}"),
             ("Incident", str(incident.get("incident_id", "—")))]
    blocks = [_header(text.replace(":rotating_light: ", "🚨 ")), _fields(pairs)]
    blocks += _buttons(links)
    return text, fit_blocks(blocks)


def stage(text: str, links: Mapping[str, str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A reply for a finished stage (collected 14/16 nodes, job stopped, …); a stage that asks
    for or reports a decision carries a button to the flow run."""
    return redact(text), fit_blocks([_section(text)] + _buttons(links))


def approval_markdown(question: str, diagnosis: Mapping[str, Any], *, remediation: str,
                      for_a_person: Sequence[str] = (), timeout_s: int | None = None) -> str:
    """What a person reads on the approval page (Markdown, rendered by the Prefect UI): what
    is asked, on what evidence, from which checkpoint, with which remediation."""
    primary = diagnosis.get("primary") or {}
    culprits = list(diagnosis.get("culprit_nodes") or [])
    resume = diagnosis.get("resume_from") or {}
    lines = [f"### Approve: {question}", "",
             f"- **Cause**: `{primary.get('cause')}` ({primary.get('layer')} layer, confidence "
             f"{float(primary.get('confidence') or 0):.2f})",
             f"- **Symptom**: {diagnosis.get('symptom')} (spike step {diagnosis.get('spike_step')}, "
             f"onset step {diagnosis.get('onset_step')})",
             f"- **Culprit nodes**: {fold_nodes(culprits) + f' ({len(culprits)})' if culprits else 'none'}",
             f"- **Resume from**: {resume.get('path')} (step {resume.get('step')})" if resume
             else "- **Resume from**: no verified checkpoint before the onset",
             f"- **Remediation for the resumed job**: {remediation}"]
    if for_a_person:
        lines.append(f"- **Left to a person**: {'; '.join(for_a_person)}")
    primary_finding = (diagnosis.get("findings") or [{}])[0]
    evidence = list(primary_finding.get("evidence") or [])[:MAX_EVIDENCE]
    if evidence:
        fence = "`" * 3
        lines += ["", f"**Evidence** ({primary_finding.get('cause')})", "", fence]
        lines += [(f"{e.get('file')}:{e.get('line')}: " if e.get("line") is not None else f"{e.get('file')}: ")
                  + str(e.get("text", ""))[:240].replace(fence, "'''") for e in evidence]
        lines.append(fence)
    summary = (diagnosis.get("findings") or [{}])[0].get("summary")
    if summary:
        lines += ["", f"_{str(summary)[:500]}_"]
    wait = f" within {timeout_s // 60} min" if timeout_s and timeout_s >= 120 else ""
    lines += ["", f"**approve = true** does exactly this; **false** (or no answer{wait}) does nothing more: "
              "a stopped job stays stopped. Say who you are and why: both are kept in the incident's audit trail."]
    return redact("\n".join(lines))


def _finding_text(finding: Mapping[str, Any]) -> str:
    head = (f"*{finding.get('cause')}* ({finding.get('layer')}, confidence {float(finding.get('confidence') or 0):.2f})"
            f" — {finding.get('summary', '')}")
    where = []
    if finding.get("nodes"):
        where.append(f"nodes {fold_nodes(finding['nodes'])}")
    if finding.get("ranks"):
        where.append("ranks " + ", ".join(str(r) for r in finding["ranks"][:12]))
    if finding.get("step") is not None:
        where.append(f"step {finding['step']}")
    lines = [head + (f"\n_{'; '.join(where)}_" if where else "")]
    evidence = finding.get("evidence") or []
    if evidence:
        cited = "\n".join(f"{e.get('file')}{'' if e.get('line') is None else ':' + str(e['line'])}: "
                          f"{str(e.get('text', ''))[:300]}" for e in evidence[:MAX_EVIDENCE])
        lines.append("```" + cited.replace("```", "'''") + "```")
        if len(evidence) > MAX_EVIDENCE:
            lines.append(f"_and {len(evidence) - MAX_EVIDENCE} more evidence lines in report.md_")
    return "\n".join(lines)


def _action_text(action: Mapping[str, Any]) -> str:
    rest = ", ".join(f"{k}={v}" for k, v in action.items() if k not in ("kind", "status"))
    status = action.get("status")
    return f"• `{action.get('kind')}`" + (f" {rest}" if rest else "") + (f" — *{status}*" if status else "")


def _buttons(links: Mapping[str, str] | None) -> list[dict[str, Any]]:
    if not links:
        return []
    labels = {"flow_run": "Open the flow run", "approval": "Review and approve", "report": "Incident report"}
    elements = [{"type": "button", "text": {"type": "plain_text", "text": labels.get(key, key)[:75]},
                 "url": url[:3000], **({"style": "primary"} if key == "approval" else {}), "action_id": f"open_{key}"}
                for key, url in links.items() if url and url.startswith(("http://", "https://"))]
    return [{"type": "actions", "elements": elements[:25]}] if elements else []


def diagnosis_message(diagnosis: Mapping[str, Any], incident: Mapping[str, Any], *,
                      actions: Sequence[Mapping[str, Any]] | None = None,
                      links: Mapping[str, str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The diagnosis as a reply: primary cause, top findings with evidence, culprits, actions."""
    primary = diagnosis.get("primary") or {}
    cause = primary.get("cause", "unknown")
    text = (f"Diagnosis for job {_job_line(incident)}: {cause} ({primary.get('layer')}, "
            f"confidence {float(primary.get('confidence') or 0):.2f})")
    culprits = diagnosis.get("culprit_nodes") or []
    ranks = diagnosis.get("culprit_ranks") or []
    resume = diagnosis.get("resume_from") or {}
    blocks: list[dict[str, Any]] = [
        _header(f"Diagnosis: {cause}"),
        _fields([("Layer", str(primary.get("layer"))), ("Confidence", f"{float(primary.get('confidence') or 0):.2f}"),
                 ("Symptom", str(diagnosis.get("symptom"))),
                 ("Spike / onset step", f"{diagnosis.get('spike_step')} / {diagnosis.get('onset_step')}"),
                 ("Culprit nodes", fold_nodes(culprits) if culprits else "none (no node convicted)"),
                 ("Resume from", f"{resume.get('path')} (step {resume.get('step')})" if resume else "no verified checkpoint")]),
    ]
    if ranks:
        blocks.append(_context("Culprit ranks: " + ", ".join(str(r) for r in ranks[:40])))
    findings = list(diagnosis.get("findings") or [])
    if findings:
        blocks.append({"type": "divider"})
        for finding in findings[:MAX_FINDINGS]:
            blocks.append(_section(_finding_text(finding)))
        if len(findings) > MAX_FINDINGS:
            blocks.append(_context(f"{len(findings) - MAX_FINDINGS} more findings in report.md"))
    ruled = diagnosis.get("ruled_out") or []
    if ruled:
        blocks.append(_context("Ruled out: " + "; ".join(f"{r.get('layer')}: {r.get('why')}" for r in ruled[:6])))
    missing = diagnosis.get("missing") or []
    if missing:
        blocks.append(_context(f"Missing evidence ({len(missing)}): " + "; ".join(str(m) for m in missing[:6])))
    listed = list(actions if actions is not None else diagnosis.get("actions") or [])
    if listed:
        blocks.append(_section("*Actions*\n" + "\n".join(_action_text(a) for a in listed[:15])))
    blocks += _buttons(links)
    return text, fit_blocks(blocks)


def summary(diagnosis: Mapping[str, Any] | None, incident: Mapping[str, Any], *, outcome: str,
            links: Mapping[str, str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The final state, edited into the opening message so the channel shows it at a glance."""
    primary = (diagnosis or {}).get("primary") or {}
    culprits = (diagnosis or {}).get("culprit_nodes") or []
    what = SYMPTOM_WORDS.get((diagnosis or {}).get("symptom") or "", "training anomaly")
    title = f"{what} in job {_job_line(incident)}: {primary.get('cause', 'undiagnosed')}"
    pairs = [("Cause", f"{primary.get('cause', '—')} ({primary.get('layer', '—')}, "
                       f"{float(primary.get('confidence') or 0):.2f})"),
             ("Culprit nodes", fold_nodes(culprits) if culprits else "none"),
             ("Outcome", outcome), ("Incident", str(incident.get("incident_id", "—")))]
    blocks = [_header(("✅ " if "resumed" in outcome else "🚨 ") + title), _fields(pairs)]
    blocks.append(_context("Details and evidence in this thread."))
    blocks += _buttons(links)
    return title, fit_blocks(blocks)
