"""Asking a person: the approval gate of a drain or a resume, as a pause of the flow run.

Not a task: a pause belongs to the flow run itself (``pause_flow_run`` keeps the process and
waits for the typed ``Approval`` input from the UI or ``resume_flow_run``). The policy's part
of the decision is ``spikeops.response.approval_gate``; this module asks, waits as long as the
policy says (the incident gives its shared concurrency slot back meanwhile), and keeps the
answer: who, when, with which note, in ``actions.jsonl``, the report and the Slack thread.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from prefect.input import RunInput
from pydantic import Field

from spikeops.response import Gate
from spikeops.tasks.runinfo import current_run

__all__ = ["Approval", "ask_approval", "record_decision"]


class Approval(RunInput):
    """The answer on the approval page."""

    approve: bool = Field(False, description="true: do what the text above says; false: do nothing more")
    approver: str = Field("", description="who decided (kept in the incident's audit trail)")
    note: str = Field("", description="why (kept with the decision)")


def ask_approval(gate: Gate, *, timeout_s: int, description: str, bundle: str, job_id: str, incident: str,
                 notifier: Any, logger: Any, slots: Any = None, links: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """The policy's answer, or a person's within ``timeout_s``; silence is a no. Every
    decision is recorded, the policy's included."""
    from prefect.flow_runs import pause_flow_run

    if gate.action is None:
        return False, ""
    if not gate.ask:
        record_decision(bundle, job_id, incident, gate, gate.approved, gate.why, approver="policy")
        return gate.approved, gate.why
    if notifier is not None:
        notifier.stage("approval", f"Waiting for approval to {gate.question} (up to {_duration(timeout_s)}; "
                       "the flow run's Resume page)", links=links)
    logger.info("waiting up to %s s for approval to %s", timeout_s, gate.question)
    answer = None
    with slots.paused() if slots is not None else nullcontext(), _answer_silence_at(timeout_s, gate):
        try:
            # Prefect's own pause timeout lies beyond ours: when it expires the server fails the
            # run, so the answer "nobody came" is given by spikeops itself (see _answer_silence_at)
            answer = pause_flow_run(wait_for_input=Approval.with_initial_data(description=description),
                                    timeout=timeout_s + PAUSE_MARGIN_S, poll_interval=2)
        except Exception as exc:  # the run was not resumed even by spikeops: never act on silence
            why = f"no approval within {_duration(timeout_s)} ({type(exc).__name__})"
    if answer is not None and answer.approver == SILENCE:
        why, answer = f"no approval within {_duration(timeout_s)}", None
    if answer is None:
        record_decision(bundle, job_id, incident, gate, False, why, approver="")
        approved = False
    else:
        approved = bool(answer.approve)
        why = ("approved" if approved else "declined") + (f" by {answer.approver}" if answer.approver else "")
        record_decision(bundle, job_id, incident, gate, approved, why, approver=answer.approver, note=answer.note)
    if notifier is not None:
        note = f" (note: {answer.note[:300]})" if answer is not None and answer.note else ""
        notifier.stage("decision", f"{gate.question}: {why}{note}", links=links)
    logger.info("approval: %s", why)
    return approved, why


#: The approver spikeops names when nobody answered in time.
SILENCE = "spikeops: no answer"
#: Seconds Prefect's pause outlasts the approval window (then the server fails the run).
PAUSE_MARGIN_S = 600


@contextmanager
def _answer_silence_at(timeout_s: int, gate: Gate) -> Iterator[None]:
    """At the end of the approval window, answer the pause with a no on behalf of nobody, so
    the run resolves as "no approval" and goes on (tells, writes the report, releases its
    slots) instead of being failed by Prefect's pause expiry. A person who answered first wins:
    resuming a run that is no longer paused is refused, and that refusal is ignored."""
    from prefect.flow_runs import resume_flow_run

    run = current_run()

    def answer() -> None:
        try:
            resume_flow_run(run.id, run_input={"approve": False, "approver": SILENCE,
                                               "note": f"no answer to: {gate.question}"[:500]})
        except Exception:  # already resumed by a person, or the API blinked: the pause timeout remains
            pass

    # the Prefect settings (API URL) live in context variables, which a new thread does not inherit
    timer = threading.Timer(timeout_s, contextvars.copy_context().run, args=(answer,)) if run is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


def record_decision(bundle: str, job_id: str, incident: str, gate: Gate, approved: bool, why: str, *,
                    approver: str, note: str = "") -> None:
    """One ``approval`` record in the bundle's ``actions.jsonl`` (the audit trail the report
    and a post-mortem read)."""
    from spikeops.schedulers import ActionLog, ActionResult

    outcome = "approved" if approved else ("declined" if approver else "no-answer")
    ActionLog(Path(bundle) / "actions.jsonl").append(ActionResult(
        "approval", job_id, outcome, f"{gate.action}: {gate.question or why}; {why}"
        + (f"; note: {note[:300]}" if note else ""), incident=incident,
        extra={"gate": gate.action, "approver": approver[:200], "note": note[:2000], "asked": gate.ask}))


def _duration(seconds: int) -> str:
    return f"{seconds // 3600} h" if seconds >= 3600 and seconds % 3600 == 0 else (
        f"{seconds // 60} min" if seconds >= 120 else f"{seconds} s")
