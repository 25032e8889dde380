"""Prefect tasks for telling people: Slack messages at each stage, and the report artifact.

The token comes from the environment or a Prefect Secret block (``slack_token_block``);
it is handed to slack-sdk and never returned, logged or stored in a result. A Slack failure
is returned as data (``Delivery.error``): a notification never fails the incident flow.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from spikeops.notify import SlackNotifier, notify_bundle

__all__ = ["slack_notifier", "notify_stage", "notify_diagnosis", "report_artifact", "artifact_markdown",
           "write_report_artifact", "tell_outcome", "tell_failure", "job_state"]


def slack_notifier(bundle: str | Path, channel: str | None = None, slack_token_block: str | None = None,
                   api_url: str | None = None) -> SlackNotifier:
    """A notifier for the incident's bundle; the token from a Prefect Secret block when named,
    else from SLACK_BOT_TOKEN (absent: the outbox)."""
    token = None
    if slack_token_block:
        from prefect.blocks.system import Secret

        token = Secret.load(slack_token_block).get()
    return SlackNotifier(bundle, channel=channel, token=token, api_url=api_url)


@task(name="notify-stage", task_run_name="notify {key}", retries=0)
def notify_stage(notifier: SlackNotifier, key: str, text: str) -> dict[str, Any]:
    delivery = notifier.stage(key, text)
    return {"key": delivery.key, "posted": delivery.posted, "error": delivery.error}


@task(name="notify-diagnosis")
def notify_diagnosis(bundle: str, notifier: SlackNotifier, links: Mapping[str, str] | None = None,
                     outcome: str | None = None) -> dict[str, Any]:
    result = notify_bundle(bundle, links=links, outcome=outcome, notifier=notifier)
    return {"delivered": result.delivered, "report": str(result.report),
            "deliveries": [{"key": d.key, "posted": d.posted, "error": d.error} for d in result.deliveries]}


@task(name="report-artifact")
def report_artifact(bundle: str, key: str | None = None) -> str | None:
    """Attach the bundle's report.md to the flow run as a markdown artifact. The plot is
    inlined (a data URI): the UI cannot reach a file beside the report."""
    path = Path(bundle) / "report.md"
    if not path.is_file():
        return None
    markdown = artifact_markdown(path.read_text(), Path(bundle) / "plot.png")
    artifact = create_markdown_artifact(markdown=markdown, key=key, description="incident report")
    return str(artifact)


def artifact_markdown(report: str, plot: Path, limit: int = 2 << 20) -> str:
    """``report.md`` with its relative image link replaced by the image itself (or by a line
    saying where it is, when it is too large to inline)."""
    import base64
    import re

    def inline(match: re.Match[str]) -> str:
        try:
            data = plot.read_bytes()
        except OSError:
            return f"_(plot not available: {plot})_"
        if len(data) > limit:
            return f"_(plot: {plot}, {len(data) >> 10} KiB, too large to show here)_"
        return f"![{match.group(1)}](data:image/png;base64,{base64.b64encode(data).decode()})"

    return re.sub(r"!\[([^\]]*)\]\(plot\.png\)", inline, report)


def write_report_artifact(bundle: str, diagnosis: Mapping[str, Any], incident: Mapping[str, Any], *,
                          key: str) -> None:
    """The report as it stands (before a pause: the approver reads it while the run waits)."""
    from spikeops.notify.plot import metrics_frame, plot_incident
    from spikeops.notify.report import write_report
    from spikeops.bundle import open_bundle

    frame = metrics_frame(open_bundle(bundle))
    png = plot_incident(frame, diagnosis) if frame is not None and len(frame) else None
    write_report(bundle, diagnosis, incident, plot_png=png)
    report_artifact(bundle, key=key)


def tell_outcome(bundle: str, notifier: SlackNotifier | None, diagnosis: Mapping[str, Any],
                 incident: Mapping[str, Any], *, summary: str, resumed: bool, recommended: list[str],
                 artifact_key: str, links: Mapping[str, str] | None = None) -> None:
    """The end of the thread: what is recommended when nothing was resumed, the diagnosis with
    its plot, the summary edited into the opening message; the report as an artifact."""
    if notifier is not None:
        if not resumed and recommended:
            notifier.stage("remediation", "Not resumed automatically. Recommended for the next run: "
                           + "; ".join(recommended), links=links)
        notify_bundle(bundle, notifier=notifier, diagnosis=diagnosis, outcome=summary, links=links)
    else:
        from spikeops.notify.report import write_report

        write_report(bundle, diagnosis, incident)
    report_artifact(bundle, key=artifact_key)


def job_state(bundle: Path) -> str:
    """What the incident did to the job so far, from its audit trail, for a failure message."""
    from spikeops.notify.report import read_actions

    actions = read_actions(bundle)
    if any(a.get("action") == "resume" and a.get("outcome") in ("done", "nothing-to-do") for a in actions):
        return "the job was resumed"
    if any(a.get("action") == "stop" and a.get("outcome") in ("done", "nothing-to-do") for a in actions):
        return "the job is STOPPED and was not resumed"
    return "the job was not touched"


def tell_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """on_failure / on_crashed: a broken flow is never silent. Posts into the incident's own
    thread (the bundle's slack.json; a manual run's incident id is derived from the run's
    creation time, as the flow derives it) and says the state the job was left in."""
    from spikeops.notify import SlackNotifier
    from spikeops.tasks.runinfo import incident_id_for, run_url

    raw = flow_run.parameters or {}
    overrides = raw.get("overrides") or {}
    job = str(raw.get("job_id") or "?")
    try:
        from spikeops.config import load_config, resolve_incident

        settings = resolve_incident(load_config(), job, raw.get("cluster"), overrides)
        incidents, channel = settings.incidents_dir, settings.slack_channel
    except Exception:  # the configuration itself may be what failed
        incidents, channel = overrides.get("incidents_dir") or "~/.local/state/spikeops/incidents", \
            overrides.get("slack_channel")
    bundle = Path(str(incidents)).expanduser() / (overrides.get("incident_id") or incident_id_for(job, flow_run))
    try:
        bundle.mkdir(parents=True, exist_ok=True)
        message = str(getattr(state, "message", "") or state.name)[:500]
        url = run_url(flow_run)
        SlackNotifier(bundle, channel=channel).stage(
            f"failed-{flow_run.id}", f"incident flow {state.name.lower()} for job {job}: {message}. "
            f"{job_state(bundle).capitalize()}; nothing further will happen automatically.",
            links={"flow_run": url} if url else None)
    except Exception:  # the hook must not fail the failure
        pass
