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

__all__ = ["slack_notifier", "notify_stage", "notify_diagnosis", "report_artifact", "tell_outcome", "tell_failure"]


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
    """Attach the bundle's report.md to the flow run as a markdown artifact."""
    path = Path(bundle) / "report.md"
    if not path.is_file():
        return None
    artifact = create_markdown_artifact(markdown=path.read_text(), key=key, description="incident report")
    return str(artifact)


def tell_outcome(bundle: str, notifier: SlackNotifier | None, diagnosis: Mapping[str, Any],
                 incident: Mapping[str, Any], *, summary: str, resumed: bool, recommended: list[str],
                 artifact_key: str) -> None:
    """The end of the thread: what is recommended when nothing was resumed, the diagnosis with
    its plot, the summary edited into the opening message; the report as an artifact."""
    if notifier is not None:
        if not resumed and recommended:
            notifier.stage("remediation", "Not resumed automatically. Recommended for the next run: "
                           + "; ".join(recommended))
        notify_bundle(bundle, notifier=notifier, diagnosis=diagnosis, outcome=summary)
    else:
        from spikeops.notify.report import write_report

        write_report(bundle, diagnosis, incident)
    report_artifact(bundle, key=artifact_key)


def tell_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """on_failure / on_crashed: a broken flow is never silent. Posts into the incident's
    thread (the bundle's slack.json) when the incident is known, else a new message."""
    from spikeops.notify import SlackNotifier

    raw = (flow_run.parameters or {}).get("params") or {}
    incidents = Path(str(raw.get("incidents_dir") or "~/.local/state/spikeops/incidents")).expanduser()
    bundle = incidents / (raw.get("incident_id") or f"failed-{flow_run.id}")
    try:
        bundle.mkdir(parents=True, exist_ok=True)
        message = str(getattr(state, "message", "") or state.name)[:500]
        SlackNotifier(bundle, channel=raw.get("slack_channel")).stage(
            f"failed-{flow_run.id}", f"incident flow {state.name.lower()} for job {raw.get('job_id')}: {message}. "
            "Nothing further will happen automatically; see the flow run.")
    except Exception:  # the hook must not fail the failure
        pass
