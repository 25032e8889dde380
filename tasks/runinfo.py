"""The flow run as people find it: its name and tags (search the runs list by job or cluster)
and its address in the Prefect UI (every Slack message that asks for or reports a decision
links to it)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

__all__ = ["current_run", "run_url", "incident_id_for", "label_run"]


def current_run() -> Any | None:
    """The running flow run, or None outside one."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context.flow_run if context is not None else None


def run_url(flow_run: Any | None = None) -> str | None:
    """The flow run's page in the Prefect UI: ``PREFECT_UI_URL`` when set, else derived from
    the API URL as Prefect itself does."""
    from prefect.utilities.urls import url_for

    run = flow_run or current_run()
    return url_for("flow-run", obj_id=run.id) if run is not None else None


def incident_id_for(job_id: str, flow_run: Any | None) -> str:
    """A run with no incident id (a manual run) gets one from its own creation time, so the
    failure hook, which sees only the flow run, finds the same bundle and thread."""
    created = getattr(flow_run, "created", None) or datetime.now(UTC)
    return f"inc-{created.astimezone(UTC):%Y%m%dT%H%M%SZ}-{job_id}"


def label_run(job_id: str, what: str | None = None, *, cluster: str | None = None) -> None:
    """Name the run ``job-<id>-<cause or symptom>`` and tag it ``job:<id>`` and
    ``cluster:<name>``. A label is a courtesy: failing to set one never fails the incident."""
    from prefect import get_client

    run = current_run()
    if run is None:
        return
    name = f"job-{job_id}" + (f"-{what}" if what else "")
    tags = set(run.tags or []) | {f"job:{job_id}"} | ({f"cluster:{cluster}"} if cluster else set())
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(run.id, name=name, tags=sorted(tags))
        run.tags = sorted(tags)
    except Exception:
        pass
