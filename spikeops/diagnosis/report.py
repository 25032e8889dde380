"""The diagnosis for a person at a terminal: cause first, then why, then what to do.

Rendered with rich (colour and layout on a terminal, plain text when piped). Culprit nodes
are folded as node sets (``gpu-[003,017]``) the way Slurm and ClusterShell print them.
"""

from __future__ import annotations

from typing import Any, TextIO

from ClusterShell.NodeSet import NodeSet
from rich.console import Console
from rich.table import Table
from rich.text import Text

from spikeops.diagnosis.model import Diagnosis

__all__ = ["render", "fold_nodes", "describe_action"]


def fold_nodes(nodes: list[str]) -> str:
    return str(NodeSet.fromlist(nodes)) if nodes else "none"


def describe_action(action: dict[str, Any]) -> str:
    kind = action.get("kind", "?")
    details = {k: v for k, v in action.items() if k != "kind"}
    if kind == "isolate_nodes":
        return f"isolate {fold_nodes(action.get('nodes', []))} (drain, reason: {action.get('reason')})"
    if kind == "resume":
        exclude = f", excluding {fold_nodes(action['exclude'])}" if action.get("exclude") else ""
        return f"resume from step {action.get('step')} ({action.get('path')}){exclude}"
    if kind == "skip_batches":
        return f"skip the batches of step(s) {action.get('steps')} on rank(s) {action.get('ranks')}"
    if kind == "observe":
        return f"keep training and observe {action.get('steps')} more steps"
    if kind == "lr_test":
        return f"test {action.get('factor')}x LR"
    if kind == "collect_evidence":
        return "collect " + "; ".join(action.get("what") or ["more evidence"])
    text = kind.replace("_", " ")
    return f"{text} {details}" if details else text


def render(diagnosis: Diagnosis, stream: TextIO, *, width: int | None = None) -> None:
    console = Console(file=stream, width=width, highlight=False, soft_wrap=False)
    primary = diagnosis.primary
    steps = []
    if diagnosis.spike_step is not None:
        steps.append(f"spike at step {diagnosis.spike_step}")
    if diagnosis.onset_step is not None:
        steps.append(f"onset at step {diagnosis.onset_step}")
    console.print(Text.assemble(("symptom: ", "bold"), diagnosis.symptom.replace("_", " "),
                                (f" ({', '.join(steps)})" if steps else "")))
    colour = {"false_alarm": "bold green", "inconclusive": "bold yellow"}.get(primary.cause, "bold red")
    console.print(Text.assemble(("cause:   ", "bold"), (f"{primary.cause}", colour),
                                f" [{primary.layer} layer, confidence {primary.confidence:.2f}]"))
    console.print(Text.assemble(("         ", ""), primary.summary))
    console.print(Text.assemble(("culprits: ", "bold"), f"nodes {fold_nodes(diagnosis.culprit_nodes)}",
                                f", ranks {diagnosis.culprit_ranks or 'none'}"))
    if diagnosis.findings:
        table = Table(title="findings", title_justify="left", show_lines=False, expand=False)
        table.add_column("conf", justify="right")
        table.add_column("layer / cause")
        table.add_column("summary and evidence", overflow="fold")
        for finding in diagnosis.findings[:12]:
            body = Text(finding.summary)
            for line in finding.evidence[:3]:
                where = f"{line.file}:{line.line}" if line.line else line.file
                body.append(f"\n  {where}  ", style="dim")
                body.append(line.text[:200], style="italic")
            table.add_row(f"{finding.confidence:.2f}", f"{finding.layer}\n{finding.cause}", body)
        console.print(table)
    if diagnosis.ruled_out:
        console.print(Text("ruled out", style="bold"))
        for item in diagnosis.ruled_out:
            console.print(f"  - [{item.layer}] {item.why}", markup=False)
    if diagnosis.missing:
        console.print(Text("missing evidence", style="bold"))
        for item in diagnosis.missing:
            console.print(f"  - {item}", markup=False)
    console.print(Text("actions", style="bold"))
    for number, action in enumerate(diagnosis.actions, start=1):
        console.print(f"  {number}. {describe_action(action)}", markup=False)
    if diagnosis.resume_from:
        console.print(Text.assemble(("resume from: ", "bold"),
                                    f"step {diagnosis.resume_from['step']} ({diagnosis.resume_from['path']})"))
    else:
        console.print(Text.assemble(("resume from: ", "bold"), "none"))
