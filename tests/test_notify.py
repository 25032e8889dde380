"""Slack notifications against a local Slack-compatible server (spikeops.sim.slack) that
slack-sdk talks to over HTTP: thread, blocks, upload, limits, retries, failures, secrets."""

from __future__ import annotations

import io
import json
import logging
import shutil
from pathlib import Path

import pytest

from spikeops.cli import main
from spikeops.diagnosis import diagnose
from spikeops.notify import SlackNotifier, notify_bundle
from spikeops.notify.messages import MAX_BLOCKS, MAX_SECTION
from spikeops.sim.slack import SlackServer

TOKEN = "xoxb-1111-2222-notarealtokenbutlong"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "bundle-xid79"


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    target = tmp_path / "bundle"
    shutil.copytree(EXAMPLE, target)
    return target


@pytest.fixture
def slack():
    with SlackServer(token=TOKEN) as server:
        yield server


def _notifier(bundle: Path, slack: SlackServer, **kwargs) -> SlackNotifier:
    return SlackNotifier(bundle, channel="#incidents", token=TOKEN, api_url=slack.api_url, **kwargs)


def _everything_posted(slack: SlackServer) -> str:
    parts = [json.dumps({"text": m.text, "blocks": m.blocks}) for m in slack.messages]
    parts += [json.dumps({"text": e.new_text, "blocks": e.new_blocks}) for m in slack.messages for e in m.edits]
    parts += [f.bytes.decode("latin-1") for f in slack.files]
    parts += [json.dumps(c.params, default=str) + json.dumps(c.headers) for c in slack.calls]
    return "\n".join(parts)


def test_one_thread_with_diagnosis_plot_and_summary(bundle: Path, slack: SlackServer) -> None:
    links = {"flow_run": "http://127.0.0.1:4200/runs/flow-run/abc", "approval": "http://127.0.0.1:4200/runs/abc/resume"}
    result = notify_bundle(bundle, links=links, notifier=_notifier(bundle, slack))
    assert result.delivered and [d.key for d in result.deliveries] == ["open", "diagnosis", "plot", "summary"]
    parent = next(m for m in slack.messages if m.thread_ts is None)
    thread = slack.thread(parent.ts)
    assert thread[0].ts == parent.ts and all(m.thread_ts == parent.ts for m in thread[1:]) and len(thread) >= 3
    assert not any(getattr(m, "orphaned", False) for m in slack.messages)
    # the diagnosis reply: cause, layer, confidence, culprit as a node set, evidence lines, buttons
    reply = thread[1]
    text = json.dumps(reply.blocks)
    assert "Diagnosis: gpu_xid" in text and "hardware" in text and "gpu-003" in text
    assert "kernel.log" in text  # an evidence line, cited by file and line
    buttons = [e for b in reply.blocks if b["type"] == "actions" for e in b["elements"]]
    assert {b["url"] for b in buttons} == set(links.values())
    # the plot went into the thread
    assert len(slack.files) == 1 and slack.files[0].thread_ts == parent.ts
    assert slack.files[0].bytes.startswith(b"\x89PNG\r\n\x1a\n")
    # the summary was edited into the opening message
    assert parent.updated and "gpu_xid" in parent.text
    assert (bundle / "report.md").read_text().startswith("# Incident")
    assert "data:image/png;base64," in (bundle / "report.html").read_text()


def test_rerun_continues_the_thread_without_duplicates(bundle: Path, slack: SlackServer) -> None:
    notify_bundle(bundle, notifier=_notifier(bundle, slack))
    before = len(slack.messages)
    again = notify_bundle(bundle, notifier=_notifier(bundle, slack))
    assert len(slack.messages) == before and len(slack.files) == 1
    assert [d.skipped for d in again.deliveries] == [True, True, True, False]  # only the summary is refreshed


def test_rate_limit_is_waited_out(bundle: Path, slack: SlackServer) -> None:
    slack.fail_next("chat.postMessage", status=429, retry_after=1, count=1)
    delivery = _notifier(bundle, slack).open(json.loads((bundle / "incident.json").read_text()))
    assert delivery.posted
    assert [c.status for c in slack.calls if c.method == "chat.postMessage"] == [429, 200]


def test_limits_long_diagnoses_are_cut_not_refused(bundle: Path, slack: SlackServer) -> None:
    diagnosis = diagnose(bundle).to_json()
    finding = dict(diagnosis["findings"][0])
    finding["summary"] = "x" * 9000
    finding["evidence"] = [{"file": "kernel.log", "line": i, "text": "NVRM: Xid " + "y" * 2000} for i in range(40)]
    diagnosis["findings"] = [finding] * 80
    diagnosis["actions"] = [{"kind": "drain_node", "node": f"gpu-{i:03d}"} for i in range(70)]
    delivery = _notifier(bundle, slack).diagnosis(diagnosis, json.loads((bundle / "incident.json").read_text()))
    assert delivery.posted, delivery.error
    blocks = slack.messages[-1].blocks
    assert len(blocks) <= MAX_BLOCKS
    assert all(len(b.get("text", {}).get("text", "")) <= MAX_SECTION for b in blocks)
    assert "report.md" in json.dumps(blocks)


def test_no_secret_reaches_slack_files_or_logs(bundle: Path, slack: SlackServer, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    diagnosis = diagnose(bundle).to_json()
    diagnosis["findings"][0]["evidence"].append(
        {"file": "nccl.log", "line": 7, "text": f"export SLACK_BOT_TOKEN={TOKEN} password=hunter2"})
    (bundle / "diagnosis.json").write_text(json.dumps(diagnosis))
    notify_bundle(bundle, notifier=_notifier(bundle, slack))
    slack.revoke_token()
    failed = _notifier(bundle, slack).stage("late", f"token is {TOKEN}")
    assert not failed.posted and failed.error == "token_revoked"
    places = [_everything_posted(slack), caplog.text]
    places += [p.read_text(errors="replace") for p in bundle.rglob("*") if p.is_file() and p.suffix in
               (".md", ".html", ".jsonl", ".json") and p.name != "diagnosis.json"]  # the test's own input
    for text in places:
        assert TOKEN not in text and "hunter2" not in text
    assert "password=[redacted]" in (bundle / "report.md").read_text()
    posted = json.dumps(slack.messages[1].blocks)
    assert "SLACK_BOT_TOKEN=[redacted]" in posted and posted.count("```") % 2 == 0  # fences survive redaction


def test_without_a_token_the_outbox_shows_what_would_be_posted(bundle: Path, monkeypatch) -> None:
    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)
    out, err = io.StringIO(), io.StringIO()
    assert main(["notify", str(bundle)], out=out, err=err) == 0
    assert "outbox.jsonl" in out.getvalue()
    records = [json.loads(line) for line in (bundle / "outbox.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["chat.postMessage", "chat.postMessage", "files.upload_v2", "chat.update"]
    assert all(r["delivered"] is False for r in records)
    assert (bundle / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_slack_down_loses_nothing_and_raises_nothing(bundle: Path) -> None:
    server = SlackServer(token=TOKEN).start()
    url = server.api_url
    server.stop()
    notifier = SlackNotifier(bundle, token=TOKEN, api_url=url, retries=0)
    result = notify_bundle(bundle, notifier=notifier)
    assert not result.delivered and all(d.error for d in result.deliveries)
    records = [json.loads(line) for line in (bundle / "outbox.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["delivered"] is False and r["error"] for r in records)
    assert (bundle / "report.md").is_file()
    err = io.StringIO()
    assert main(["notify", str(bundle / "missing")], out=io.StringIO(), err=err) == 2


def test_prefect_tasks_post_and_attach_the_report(bundle: Path, slack: SlackServer, prefect_server: None) -> None:
    from prefect import flow

    from spikeops.tasks.notify import notify_diagnosis, notify_stage, report_artifact

    @flow
    def tell() -> tuple[dict, dict, str | None]:
        notifier = _notifier(bundle, slack)
        notifier.open(json.loads((bundle / "incident.json").read_text()))
        stage = notify_stage(notifier, "collected", "collected 3/4 nodes (gpu-004 unreachable)")
        told = notify_diagnosis(str(bundle), notifier)
        return stage, told, report_artifact(str(bundle), key="incident-report-test")

    stage, told, artifact = tell()
    assert stage["posted"] and told["delivered"] and artifact
    assert any("collected 3/4 nodes" in m.text for m in slack.messages)
