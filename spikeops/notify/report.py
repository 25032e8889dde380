"""The incident report: ``report.md`` and ``report.html`` in the bundle.

What Slack has no room for: the whole timeline (alert, collection, actions from
``actions.jsonl``), the symptom, every finding with all its evidence lines, what was ruled
out, what evidence was missing, the actions, and the plot. Markdown first (it is also the
Prefect artifact); the HTML is the same content, self-contained, for a browser.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spikeops.inventory import fold_nodes
from spikeops.notify.messages import SYMPTOM_WORDS, redact

__all__ = ["render_markdown", "render_html", "write_report", "read_actions"]


def read_actions(bundle: Path) -> list[dict[str, Any]]:
    path = Path(bundle) / "actions.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None


def _at(line: Any) -> str:
    """``:LINE`` for evidence with a line; nothing for files without lines (a flight recorder dump)."""
    return f":{line}" if line is not None else ""


def _md_escape(text: str) -> str:
    return redact(str(text)).replace("|", "\\|").replace("\n", " ")


def _lineage_lines(diagnosis: Mapping[str, Any], history: Sequence[Mapping[str, Any]],
                   ledger: Mapping[str, Any] | None) -> list[str]:
    """The lineage's earlier incidents, a conviction in doubt, and what this incident cost."""
    lines: list[str] = []
    entry = ((ledger or {}).get("entry") or {}).get("incident") or {}
    doubts = [a for a in diagnosis.get("actions") or [] if a.get("kind") == "doubt_conviction"]
    if history or doubts or entry.get("recurrence_of"):
        lineage = entry.get("lineage") or ((ledger or {}).get("context") or {}).get("lineage") or "?"
        lines += ["", "## Lineage", "", f"- **Lineage**: {lineage}, {len(history)} earlier incident(s)"]
        if entry.get("recurrence_of"):
            lines.append(f"- **Recurrence of**: {entry['recurrence_of']} (same point after its resume)")
        for doubt in doubts:
            lines.append(f"- **Conviction in doubt**: {fold_nodes(doubt.get('nodes') or [])} ({doubt.get('cause')} in "
                         f"{doubt.get('incident_id')}): the anomaly recurred without them; they stay drained")
        if history:
            lines += ["", "| opened | incident | job | cause | spike step | resumed as | from | plan |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for past in history:
                plan = past.get("plan") or {}
                what = "; ".join(filter(None, [f"excluded {fold_nodes(plan.get('excluded') or [])}"
                                               if plan.get("excluded") else "",
                                               " ".join(f"{k}={v}" for k, v in (plan.get("env") or {}).items())]))
                lines.append(f"| {past.get('opened')} | {past.get('incident_id')} | {past.get('job_id')} | "
                             f"{past.get('cause')} | {past.get('spike_step')} | {past.get('resumed_as') or '—'} | "
                             f"{(past.get('resumed_from') or {}).get('path') or '—'} | {_md_escape(what or '—')} |")
    if entry:
        from spikeops.ledger.lost import TIMES, lost_time

        lost = lost_time(entry)
        lines += ["", "## Cost", "",
                  f"- **GPU-hours lost**: {lost['gpu_hours'] if lost['gpu_hours'] is not None else 'unknown'}"
                  f" ({lost['gpus'] or '?'} GPUs)",
                  f"- **Steps rolled back**: {lost['steps_rolled_back'] if lost['steps_rolled_back'] is not None else '—'}"
                  f" at {lost['step_seconds'] or '?'} s/step",
                  f"- **Downtime**: {lost['downtime_s'] / 60:.1f} min (spike to the resumed job running"
                  + (", still counting)" if lost["still_down"] else ")"),
                  "- **Times**: " + "; ".join(f"{name.replace('_', ' ')} {entry.get('t_' + name) or '—'}"
                                             for name in TIMES)]
    return lines


def render_markdown(diagnosis: Mapping[str, Any], incident: Mapping[str, Any], *,
                    actions_log: Sequence[Mapping[str, Any]] = (), plot_name: str | None = None,
                    history: Sequence[Mapping[str, Any]] = (), ledger: Mapping[str, Any] | None = None) -> str:
    job = incident.get("job") or {}
    primary = diagnosis.get("primary") or {}
    lines = [f"# Incident {incident.get('incident_id', '')}: {primary.get('cause', 'undiagnosed')}", ""]
    lines += [f"- **Job**: {job.get('id')} {('(' + job['name'] + ')') if job.get('name') else ''}",
              f"- **Nodes**: {len(job.get('nodes') or [])} ({fold_nodes(job.get('nodes') or [])})",
              f"- **Symptom**: {diagnosis.get('symptom')} ({SYMPTOM_WORDS.get(diagnosis.get('symptom') or '', '')})",
              f"- **Spike step / onset step**: {diagnosis.get('spike_step')} / {diagnosis.get('onset_step')}",
              f"- **Primary cause**: {primary.get('cause')} ({primary.get('layer')}, confidence "
              f"{float(primary.get('confidence') or 0):.2f})",
              f"- **Culprit nodes**: {fold_nodes(diagnosis.get('culprit_nodes') or []) or 'none'}",
              f"- **Culprit ranks**: {', '.join(str(r) for r in diagnosis.get('culprit_ranks') or []) or 'none'}"]
    resume = diagnosis.get("resume_from")
    lines.append(f"- **Resume from**: {resume.get('path')} (step {resume.get('step')})" if resume
                 else "- **Resume from**: no verified checkpoint before the onset")
    lines += _lineage_lines(diagnosis, history, ledger)
    lines += ["", "## Timeline", "", "| time | what |", "| --- | --- |"]
    alert = incident.get("alert") or {}
    timeline = [(alert.get("received") or incident.get("created"), f"alert from {alert.get('source', '?')}")]
    window = incident.get("window") or {}
    if window.get("start"):
        timeline.append((window["start"], "start of the incident window"))
    for record in actions_log:
        timeline.append((record.get("time"), f"{record.get('action')} {record.get('target')}: "
                                             f"{record.get('outcome')} ({record.get('detail', '')})"))
    for when, what in sorted(timeline, key=lambda pair: str(pair[0] or "")):
        lines.append(f"| {when or '—'} | {_md_escape(what)} |")
    if plot_name:
        lines += ["", f"![training curves around the spike]({plot_name})"]
    lines += ["", "## Findings", ""]
    for index, finding in enumerate(diagnosis.get("findings") or [], start=1):
        lines.append(f"### {index}. {finding.get('cause')} ({finding.get('layer')}, confidence "
                     f"{float(finding.get('confidence') or 0):.2f})")
        lines.append("")
        lines.append(redact(str(finding.get("summary", ""))))
        where = []
        if finding.get("nodes"):
            where.append(f"nodes {fold_nodes(finding['nodes'])}")
        if finding.get("ranks"):
            where.append("ranks " + ", ".join(str(r) for r in finding["ranks"]))
        if finding.get("step") is not None:
            where.append(f"step {finding['step']}")
        if where:
            lines += ["", "_" + "; ".join(where) + "_"]
        evidence = finding.get("evidence") or []
        if evidence:
            lines += ["", "```"] + [redact(f"{e.get('file')}{_at(e.get('line'))}: {e.get('text', '')}").replace("```", "'''")
                                    for e in evidence] + ["```"]
        lines.append("")
    if not diagnosis.get("findings"):
        lines += ["No finding.", ""]
    lines += ["## Ruled out", ""]
    lines += [f"- {r.get('layer')}: {redact(str(r.get('why')))}" for r in diagnosis.get("ruled_out") or []] or ["- nothing"]
    lines += ["", "## Missing evidence", ""]
    lines += [f"- {redact(str(m))}" for m in diagnosis.get("missing") or []] or ["- none"]
    lines += ["", "## Actions", ""]
    lines += [f"- `{a.get('kind')}` " + ", ".join(f"{k}={v}" for k, v in a.items() if k != "kind")
              for a in diagnosis.get("actions") or []] or ["- none"]
    if actions_log:
        lines += ["", "### What was done", "", "| time | action | target | outcome | detail |", "| --- | --- | --- | --- | --- |"]
        for record in actions_log:
            lines.append(f"| {record.get('time')} | {record.get('action')} | {record.get('target')} | "
                         f"{record.get('outcome')} | {_md_escape(record.get('detail', ''))} |")
    return "\n".join(lines).rstrip() + "\n"


def render_html(markdown: str, *, plot_png: bytes | None = None, title: str = "spikeops incident") -> str:
    """A self-contained page: the markdown rendered plainly (headings, lists, tables, code),
    the plot inlined."""
    body: list[str] = []
    in_code = False
    table: list[list[str]] = []

    def flush_table() -> None:
        if not table:
            return
        head, *rows = table
        body.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in head) + "</tr>" +
                    "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows) + "</table>")
        table.clear()

    for line in markdown.splitlines():
        if line.startswith("```"):
            flush_table()
            body.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
            continue
        if in_code:
            body.append(html.escape(line))
            continue
        if line.startswith("|"):
            cells = [html.escape(c.strip().replace("\\|", "|")) for c in line.strip().strip("|").split(" | ")]
            if not all(set(c) <= {"-", " "} for c in cells):
                table.append(cells)
            continue
        flush_table()
        if line.startswith("!["):
            if plot_png:
                body.append('<img alt="training curves" src="data:image/png;base64,'
                            + base64.b64encode(plot_png).decode() + '">')
            continue
        level = len(line) - len(line.lstrip("#"))
        if level and line[level:level + 1] == " ":
            body.append(f"<h{level}>{html.escape(line[level + 1:])}</h{level}>")
        elif line.startswith("- "):
            body.append(f"<li>{html.escape(line[2:]).replace('**', '')}</li>")
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    flush_table()
    style = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
             "pre{background:#f4f4f4;padding:.6em;overflow-x:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .5em;font-size:90%}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(bundle: str | Path, diagnosis: Mapping[str, Any], incident: Mapping[str, Any],
                 *, plot_png: bytes | None = None) -> tuple[Path, Path]:
    """Write report.md, report.html (and plot.png) into the bundle; their paths."""
    from spikeops.bundle import atomic_write

    root = Path(bundle)
    plot_name = None
    if plot_png:
        atomic_write(root / "plot.png", plot_png)
        plot_name = "plot.png"
    history = _json_file(root / "history.json")
    ledger = _json_file(root / "ledger.json")
    markdown = render_markdown(diagnosis, incident, actions_log=read_actions(root), plot_name=plot_name,
                               history=[h for h in history if isinstance(h, dict)] if isinstance(history, list) else [],
                               ledger=ledger if isinstance(ledger, dict) else None)
    atomic_write(root / "report.md", markdown.encode())
    page = render_html(markdown, plot_png=plot_png, title=f"incident {incident.get('incident_id', '')}")
    atomic_write(root / "report.html", page.encode())
    return root / "report.md", root / "report.html"
