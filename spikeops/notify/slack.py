"""Posting an incident to Slack: one thread, kept current, never a lost message.

- One thread per incident: the opening message on the alert, replies as stages finish, the
  diagnosis, the plot (``files_upload_v2`` into the thread), and at the end the summary
  edited into the opening message (``chat.update``) so the channel shows the outcome.
- The thread is remembered in the bundle (``slack.json``), and each reply has a key: a
  re-run of the same incident continues the thread and does not post a stage twice.
- The token comes from ``SLACK_BOT_TOKEN`` (or the caller, e.g. a Prefect Secret block); the
  API base URL from ``SPIKEOPS_SLACK_API_URL`` when set. The token is never logged, never
  written; every text is passed through ``redact`` before it leaves.
- Without a token, every message goes to ``outbox.jsonl`` in the bundle: offline runs and the
  demo show what would have been posted. When Slack fails (down, token revoked, a refusal),
  the message goes to the outbox too, marked undelivered with the error, and the caller gets
  a result, never an exception: the incident goes on.
- Rate limits: slack-sdk's ``RateLimitErrorRetryHandler`` waits ``Retry-After`` and retries.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spikeops.bundle import atomic_write
from spikeops.notify import messages
from spikeops.timeparse import iso

__all__ = ["SlackNotifier", "Delivery", "OUTBOX", "STATE", "DEFAULT_CHANNEL"]

OUTBOX = "outbox.jsonl"
STATE = "slack.json"
DEFAULT_CHANNEL = "#incidents"
log = logging.getLogger("spikeops.notify")


@dataclass
class Delivery:
    """What happened to one message: posted (with its ts), written to the outbox, or failed."""

    key: str
    posted: bool
    ts: str | None = None
    error: str | None = None
    skipped: bool = False  # already posted earlier (idempotent re-run)


class SlackNotifier:
    def __init__(self, bundle: str | Path, *, channel: str | None = None, token: str | None = None,
                 api_url: str | None = None, client: Any = None, retries: int = 3) -> None:
        self.bundle = Path(bundle)
        self.channel = channel or os.environ.get("SPIKEOPS_SLACK_CHANNEL") or DEFAULT_CHANNEL
        self._lock = threading.Lock()
        token = token if token is not None else os.environ.get("SLACK_BOT_TOKEN")
        self.client = client
        if self.client is None and token:
            from slack_sdk import WebClient
            from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler

            base = api_url or os.environ.get("SPIKEOPS_SLACK_API_URL") or WebClient.BASE_URL
            self.client = WebClient(token=token, base_url=base if base.endswith("/") else base + "/", timeout=15)
            self.client.retry_handlers.append(RateLimitErrorRetryHandler(max_retry_count=retries))
        self.state = self._load_state()

    # ------------------------------------------------------------------ state and outbox
    @property
    def online(self) -> bool:
        return self.client is not None

    def _load_state(self) -> dict[str, Any]:
        try:
            state = json.loads((self.bundle / STATE).read_text())
            return state if isinstance(state, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        atomic_write(self.bundle / STATE, (json.dumps(self.state, indent=1) + "\n").encode())

    def _outbox(self, record: dict[str, Any]) -> None:
        record = {"time": iso(datetime.now(UTC)), **record}
        line = messages.redact(json.dumps(record, ensure_ascii=False)) + "\n"
        self.bundle.mkdir(parents=True, exist_ok=True)
        with open(self.bundle / OUTBOX, "a", encoding="utf-8") as handle:
            handle.write(line)

    def _done(self, key: str) -> bool:
        return key in self.state.get("posted", {})

    def _remember(self, key: str, ts: str | None) -> None:
        self.state.setdefault("posted", {})[key] = ts
        self._save_state()

    # ------------------------------------------------------------------ sending
    def _call(self, method: str, **params: Any) -> tuple[dict[str, Any] | None, str | None]:
        """Call the Web API; (response data, None) or (None, one-line error without secrets)."""
        try:
            response = getattr(self.client, method)(**params)
            return dict(response.data), None
        except Exception as exc:  # SlackApiError, connection errors, timeouts: all become data
            error = getattr(getattr(exc, "response", None), "data", None)
            reason = error.get("error") if isinstance(error, dict) else None
            text = messages.redact(f"{reason or type(exc).__name__}: {exc}" if not reason else reason)
            log.warning("slack %s failed: %s", method, text)
            return None, text.splitlines()[0][:300]

    def _refresh(self) -> None:
        """Another process (the receiver opening the thread) may have written the state."""
        fresh = self._load_state()
        if fresh:
            self.state = fresh

    def _post(self, key: str, text: str, blocks: list[dict[str, Any]], *, threaded: bool = True) -> Delivery:
        with self._lock:
            self._refresh()
            if self._done(key):
                return Delivery(key, True, self.state["posted"][key], skipped=True)
            text = messages.redact(text)
            parent = self.state.get("ts") if threaded else None
            record = {"method": "chat.postMessage", "key": key, "channel": self.state.get("channel", self.channel),
                      "thread_ts": parent, "text": text, "blocks": blocks}
            if not self.online:
                self._outbox({**record, "delivered": False, "error": "no token (SLACK_BOT_TOKEN unset)"})
                self._remember(key, None)
                return Delivery(key, False, error="no token: written to outbox.jsonl")
            data, error = self._call("chat_postMessage", channel=record["channel"], text=text, blocks=blocks,
                                     thread_ts=parent, unfurl_links=False)
            if error is not None:
                self._outbox({**record, "delivered": False, "error": error})
                return Delivery(key, False, error=error)
            if not threaded or not self.state.get("ts"):
                self.state["ts"] = data.get("ts")
                self.state["channel"] = data.get("channel")
            self._remember(key, data.get("ts"))
            return Delivery(key, True, data.get("ts"))

    # ------------------------------------------------------------------ the incident's messages
    def open(self, incident: Mapping[str, Any], *, symptom: str | None = None, spike_step: int | None = None,
             links: Mapping[str, str] | None = None) -> Delivery:
        """The opening message (once per incident; a re-run continues the same thread)."""
        text, blocks = messages.opening(incident, symptom=symptom, spike_step=spike_step, links=links)
        return self._post("open", text, blocks, threaded=False)

    def stage(self, key: str, text: str, links: Mapping[str, str] | None = None) -> Delivery:
        body, blocks = messages.stage(text, links)
        return self._post(f"stage:{key}", body, blocks)

    def diagnosis(self, diagnosis: Mapping[str, Any], incident: Mapping[str, Any], *,
                  actions: Sequence[Mapping[str, Any]] | None = None,
                  links: Mapping[str, str] | None = None) -> Delivery:
        text, blocks = messages.diagnosis_message(diagnosis, incident, actions=actions, links=links)
        return self._post("diagnosis", text, blocks)

    def upload(self, key: str, content: bytes, filename: str, title: str) -> Delivery:
        """A file (the plot) into the thread; offline, it is written into the bundle."""
        with self._lock:
            if self._done(f"file:{key}"):
                return Delivery(key, True, skipped=True)
            record = {"method": "files.upload_v2", "key": f"file:{key}", "filename": filename, "title": title,
                      "thread_ts": self.state.get("ts"), "bytes": len(content)}
            if not self.online:
                atomic_write(self.bundle / filename, content)
                self._outbox({**record, "delivered": False, "error": "no token (SLACK_BOT_TOKEN unset)",
                              "saved_as": filename})
                self._remember(f"file:{key}", None)
                return Delivery(key, False, error="no token: saved in the bundle")
            data, error = self._call("files_upload_v2", channel=self.state.get("channel"), content=content,
                                     filename=filename, title=title, thread_ts=self.state.get("ts"))
            if error is not None:
                self._outbox({**record, "delivered": False, "error": error})
                return Delivery(key, False, error=error)
            self._remember(f"file:{key}", None)
            return Delivery(key, True)

    def finish(self, diagnosis: Mapping[str, Any] | None, incident: Mapping[str, Any], *, outcome: str,
               links: Mapping[str, str] | None = None) -> Delivery:
        """Edit the final summary into the opening message (the channel's view of the incident)."""
        text, blocks = messages.summary(diagnosis, incident, outcome=outcome, links=links)
        text = messages.redact(text)
        with self._lock:
            self._refresh()
            record = {"method": "chat.update", "key": "summary", "channel": self.state.get("channel"),
                      "ts": self.state.get("ts"), "text": text, "blocks": blocks}
            if not self.online or not self.state.get("ts"):
                why = "no token (SLACK_BOT_TOKEN unset)" if not self.online else "no opening message to edit"
                self._outbox({**record, "delivered": False, "error": why})
                return Delivery("summary", False, error=why)
            data, error = self._call("chat_update", channel=self.state["channel"], ts=self.state["ts"], text=text,
                                     blocks=blocks)
            if error is not None:
                self._outbox({**record, "delivered": False, "error": error})
                return Delivery("summary", False, error=error)
            self.state["summary"] = outcome
            self._save_state()
            return Delivery("summary", True, self.state["ts"])
