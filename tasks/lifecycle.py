"""The node lifecycle's tasks: thin over ``spikeops.lifecycle.service``, one per step, plus the
question a person answers (a pause of the flow run, as the incident's approval gate) and the
per-node slots that keep two runs from working on one node.

Each task opens the cluster's lifecycle from the configuration itself (a value Prefect can
record, never a live object); the decisions stay in the core (``spikeops.lifecycle.plan``).
Only the survey retries: a controller restarting is a few seconds; a reboot, a validation or a
release repeated at once would act twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

from prefect import task
from prefect.input import RunInput
from pydantic import Field

__all__ = ["LifecycleApproval", "lifecycle_survey", "lifecycle_reboot", "lifecycle_validate", "lifecycle_release",
           "lifecycle_decline",
           "lifecycle_replace", "lifecycle_tell", "ask_lifecycle", "node_slots", "node_limit_name", "BY"]

#: Who the lifecycle's own actions are recorded as.
BY = "spikeops node-lifecycle"


def _life(config: str | None, cluster: str) -> Any:
    from spikeops.lifecycle.service import ClusterLife

    return ClusterLife.open(config, cluster, by=BY)


@task(name="lifecycle-survey", task_run_name="nodes of {cluster}", retries=2, retry_delay_seconds=5)
def lifecycle_survey(config: str | None, cluster: str, nodes: list[str] | None) -> dict[str, Any]:
    """The record brought up to date (drains seen, reboots ended), then each node's next step."""
    with _life(config, cluster) as life:
        views = life.survey(nodes)
        changes = life.observe(views)
        if changes:
            views = life.survey(nodes)
        return {"changes": changes, "nodes": [view.to_json() for view in views]}


@task(name="lifecycle-reboot", task_run_name="reboot {nodes}")
def lifecycle_reboot(config: str | None, cluster: str, nodes: list[str], approved_by: str | None = None
                     ) -> list[dict[str, Any]]:
    with _life(config, cluster) as life:
        return [o.to_json() for o in life.reboot(nodes, approved_by=approved_by)]


@task(name="lifecycle-validate", task_run_name="validate {node}")
def lifecycle_validate(config: str | None, cluster: str, node: str) -> dict[str, Any]:
    with _life(config, cluster) as life:
        return life.validate([node], notify=True)[0].to_json()


@task(name="lifecycle-release", task_run_name="release {nodes}")
def lifecycle_release(config: str | None, cluster: str, nodes: list[str], approved_by: str | None = None
                      ) -> list[dict[str, Any]]:
    with _life(config, cluster) as life:
        return [o.to_json() for o in life.release(nodes, approved_by=approved_by, notify=True)]


@task(name="lifecycle-decline", task_run_name="{action} of {node} declined")
def lifecycle_decline(config: str | None, cluster: str, node: str, action: str, by: str, why: str) -> None:
    with _life(config, cluster) as life:
        life.decline(node, action, by, why)


@task(name="lifecycle-replace", task_run_name="mark {node} for replacement")
def lifecycle_replace(config: str | None, cluster: str, node: str, why: str) -> dict[str, Any]:
    with _life(config, cluster) as life:
        return life.mark_replace(node, why).to_json()


@task(name="lifecycle-tell", task_run_name="tell {key} about {node}")
def lifecycle_tell(config: str | None, cluster: str, node: str, key: str, text: str) -> dict[str, Any]:
    with _life(config, cluster) as life:
        return life.tell(node, key, text)


class LifecycleApproval(RunInput):
    """The answer on the lifecycle's approval page."""

    approve: bool = Field(False, description="true: do what the text above says for the nodes below; false: nothing")
    nodes: str = Field("", description="only these nodes (a node set such as gpu-[001-003]); empty: every node asked")
    approver: str = Field("", description="who decided (recorded in the ledger with the reboot or release)")
    note: str = Field("", description="why (kept with the decision)")


class _Question:
    def __init__(self, question: str) -> None:
        self.question = question


def ask_lifecycle(asks: Mapping[str, str], *, timeout_s: int, description: str, logger: Any
                  ) -> tuple[list[str], str | None, str]:
    """One question for every node that waits for a person (``asks``: node -> what would be
    done). Silence is a no. Returns the approved nodes, who answered (None: nobody did) and
    why; a person's answer covers every node asked (those not approved were declined)."""
    from prefect.flow_runs import pause_flow_run

    from spikeops.inventory import expand_nodes, fold_nodes
    from spikeops.tasks.approve import PAUSE_MARGIN_S, SILENCE, _answer_silence_at

    question = "; ".join(f"{what} {node}" for node, what in asks.items())
    logger.info("waiting up to %s s for approval to %s", timeout_s, question)
    with _answer_silence_at(timeout_s, _Question(question)):
        try:
            answer = pause_flow_run(wait_for_input=LifecycleApproval.with_initial_data(description=description),
                                    timeout=timeout_s + PAUSE_MARGIN_S, poll_interval=2)
        except Exception as exc:  # noqa: BLE001 - never act on a pause that went wrong
            return [], None, f"no approval ({type(exc).__name__})"
    if answer is None or answer.approver == SILENCE:
        return [], None, f"no approval within {timeout_s} s"
    if not answer.approve:
        return [], answer.approver or None, "declined" + (f" by {answer.approver}" if answer.approver else "")
    try:
        chosen = set(expand_nodes(answer.nodes)) if answer.nodes.strip() else set(asks)
    except Exception:  # noqa: BLE001 - a node set that does not read approves nothing
        return [], answer.approver or None, f"approved nodes {answer.nodes!r} do not read as a node set: nothing done"
    approved = [node for node in asks if node in chosen]
    why = f"approved by {answer.approver or 'someone'} for {fold_nodes(approved) or 'no node asked'}" + (
        f" (note: {answer.note[:300]})" if answer.note else "")
    return approved, answer.approver or "someone", why


def node_limit_name(cluster: str, node: str) -> str:
    """The global concurrency limit one node's lifecycle holds (a run at a time per node)."""
    return f"spikeops-node-{cluster}-{node}"


@contextmanager
def node_slots(cluster: str, nodes: list[str], timeout_s: float = 10.0) -> Iterator[tuple[list[str], list[str]]]:
    """Each node's slot, held to the end (the approval pause included); ``(held, busy)``: the
    nodes another run is working on are left to it. The limits are removed once idle."""
    from prefect.concurrency.sync import concurrency

    from spikeops.tasks.concurrency import _lease_s, ensure_limit, remove_idle_limit

    held: list[str] = []
    busy: list[str] = []
    with ExitStack() as stack:
        for node in nodes:
            name = node_limit_name(cluster, node)
            ensure_limit(name, 1)
            manager = concurrency(name, occupy=1, timeout_seconds=timeout_s, lease_duration=_lease_s(), strict=True,
                                  raise_on_lease_renewal_failure=False)
            try:
                manager.__enter__()
            except Exception:  # noqa: BLE001 - TimeoutError: another run holds it
                busy.append(node)
                continue
            stack.callback(manager.__exit__, None, None, None)
            held.append(node)
        try:
            yield held, busy
        finally:
            stack.close()
            for node in held:
                try:
                    remove_idle_limit(node_limit_name(cluster, node))
                except Exception:  # noqa: BLE001 - tidying
                    pass
