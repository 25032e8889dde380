"""Asking a person: the approval gate of a drain or a resume, as a pause of the flow run.

Not a task: a pause belongs to the flow run itself (``pause_flow_run`` suspends the run and
waits for the typed ``Approval`` input from the UI or ``resume_flow_run``). The policy's part
of the decision is ``spikeops.response.approval_gate``; this module only asks.
"""

from __future__ import annotations

from typing import Any

from prefect.input import RunInput
from pydantic import Field

from spikeops.response import Gate

__all__ = ["Approval", "ask_approval"]


class Approval(RunInput):
    """What the person answering the approval page types in."""

    approve: bool = Field(description="drain the culprit nodes and resume the job without them")
    approver: str = Field("", description="who decided (kept in actions.jsonl)")
    note: str = ""


def ask_approval(gate: Gate, timeout_s: int, notifier: Any, logger: Any) -> tuple[bool, str]:
    """The policy's answer, or a person's within ``timeout_s``; silence is a no."""
    from prefect.flow_runs import pause_flow_run

    if not gate.ask:
        return gate.approved, gate.why
    if notifier is not None:
        notifier.stage("approval", f"Waiting for approval to {gate.question} (see the flow run's resume page)")
    logger.info("waiting up to %s s for approval", timeout_s)
    try:
        answer = pause_flow_run(wait_for_input=Approval, timeout=timeout_s)
    except Exception as exc:  # a timeout: nobody answered; never act on silence
        return False, f"no approval within {timeout_s} s ({type(exc).__name__})"
    who = f" by {answer.approver}" if answer.approver else ""
    return bool(answer.approve), ("approved" if answer.approve else "declined") + who
