"""A local Slack Web API server, so the notifier's tests and the demo meet the real wire format.

A mock of ``WebClient`` would test our idea of Slack; this module is a real HTTP server on
127.0.0.1 that slack-sdk's unmodified ``WebClient(token=..., base_url=server.api_url)``
talks to exactly as it talks to slack.com: the same request encodings (JSON bodies for
``chat.*``, form bodies for ``files.*`` with ``files`` and ``blocks`` as JSON strings, query
strings, multipart), the same ``Authorization: Bearer`` header, the same answers (HTTP 200
and ``{"ok": false, "error": ...}`` for every refusal, HTTP 429 with ``Retry-After`` when
rate limited), so the SDK's own response validation and retry handlers run for real.

What it serves, with Slack's behaviour (sources in the method docstrings):

- ``auth.test``, ``api.test``;
- ``chat.postMessage`` and ``chat.update``, with Block Kit's limits checked the way Slack
  checks them (``invalid_blocks`` with ``response_metadata.messages`` naming the JSON
  pointer, ``invalid_blocks_format``, ``msg_too_long``, ``no_text``);
- the upload flow of ``files_upload_v2``: ``files.getUploadURLExternal``, a POST of the
  bytes to the upload URL it returned (on this server), ``files.completeUploadExternal``;
  a file shared to a channel appears there as a message, in its thread when given one;
- ``files.upload`` (the retired one-step upload) answers ``method_deprecated``; any other
  name ``unknown_method``.

Slack answers ``ok`` to a ``thread_ts`` that is well formed but names no parent message in
the channel, and the reply is then seen by nobody. The server does the same and marks such a
message ``orphaned``, so a test can catch a notifier that lost its thread.

Test hooks: ``calls`` (every request, the token never stored: ``Authorization`` becomes
``Bearer <len N>``), ``messages``, ``files``, ``thread(ts)``, ``fail_next`` (HTTP 429 and
``Retry-After``, or a 5xx), ``revoke_token``. Nothing here logs a request.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

__all__ = [
    "DEFAULT_TOKEN",
    "DEFAULT_CHANNELS",
    "MAX_BLOCKS",
    "MAX_TEXT",
    "Call",
    "Edit",
    "Message",
    "UploadedFile",
    "SlackServer",
    "UPLOAD_CALL",
    "validate_blocks",
]

DEFAULT_TOKEN = "xoxb-test-token"
DEFAULT_CHANNELS: Mapping[str, str] = {"C0INCIDENT": "incidents"}
#: Block Kit: at most 50 blocks in a message.
MAX_BLOCKS = 50
#: chat.postMessage's documented ceiling for ``text``.
MAX_TEXT = 40_000
_SECTION_TEXT = 3000
_SECTION_FIELDS = 10
_FIELD_TEXT = 2000
_HEADER_TEXT = 150
_BLOCK_ID = 255
_CONTEXT_ELEMENTS = 10
_ACTIONS_ELEMENTS = 25
_BLOCK_TYPES = frozenset({
    "actions", "context", "divider", "file", "header", "image", "input", "markdown", "rich_text",
    "section", "video", "table", "context_actions",
})
_TS = re.compile(r"\d{1,10}\.\d{1,6}")

_TEAM_ID = "T0SPIKEOPS"
_TEAM = "spikeops-sim"
_USER_ID = "U0SPIKEBOT"
_BOT_ID = "B0SPIKEBOT"
_APP_ID = "A0SPIKEOPS"
_API = "/api/"
_UPLOAD = "/upload/v1/"
#: The pseudo method name of a POST to an upload URL, in ``calls``.
UPLOAD_CALL = "upload"
_DEPRECATED = frozenset({"files.upload"})
_STATUS_ERRORS = {429: "ratelimited", 500: "internal_error", 503: "service_unavailable"}


@dataclass(frozen=True)
class Call:
    """One request as the server saw it; ``error`` is the code answered, None when ok.

    ``params`` are decoded (JSON values stay JSON values; ``blocks`` stays as sent) and
    ``headers`` are the request's, with the token replaced by its length only, so a test can
    check a token was sent without the token ever being stored.
    """

    method: str
    params: Mapping[str, Any]
    headers: Mapping[str, str]
    status: int
    error: str | None = None


@dataclass(frozen=True)
class Edit:
    """One ``chat.update`` of a message: what it replaced and what it wrote."""

    ts: str
    old_text: str
    old_blocks: list[Any] | None
    new_text: str
    new_blocks: list[Any] | None


@dataclass
class Message:
    """A message in a channel as Slack keeps it.

    ``thread_ts`` is None for a top-level message and the parent's ts for a reply.
    ``orphaned``: posted with a ``thread_ts`` that names no parent here; Slack answers ok
    and nobody sees it. ``files`` are the ids of files shared with this message.
    """

    channel: str
    ts: str
    thread_ts: str | None
    text: str
    blocks: list[Any] | None
    updated: bool = False
    edits: list[Edit] = field(default_factory=list)
    files: tuple[str, ...] = ()
    orphaned: bool = False


@dataclass(frozen=True)
class UploadedFile:
    """A file completed by ``files.completeUploadExternal``, with the bytes that were posted."""

    file_id: str
    filename: str
    title: str
    bytes: bytes
    channel: str | None
    thread_ts: str | None
    initial_comment: str | None


@dataclass
class _Pending:
    file_id: str
    filename: str
    length: int
    data: bytes | None = None


class _Refused(Exception):
    """An answer of ``{"ok": false}``: the error code and Slack's detail lines."""

    def __init__(self, error: str, messages: list[str] | None = None, status: int = 200) -> None:
        super().__init__(error)
        self.error = error
        self.messages = messages or []
        self.status = status


# ---------------------------------------------------------------------------------------------
# Block Kit


def _text_errors(obj: Any, pointer: str, limit: int, *, plain_only: bool = False) -> list[str]:
    if not isinstance(obj, Mapping):
        return [f"[ERROR] must provide an object [json-pointer:{pointer}]"]
    errors: list[str] = []
    kind = obj.get("type")
    allowed = ("plain_text",) if plain_only else ("plain_text", "mrkdwn")
    if kind not in allowed:
        errors.append(f"[ERROR] must be one of {', '.join(allowed)} [json-pointer:{pointer}/type]")
    text = obj.get("text")
    if not isinstance(text, str):
        errors.append(f"[ERROR] must provide a string [json-pointer:{pointer}/text]")
    elif not text:
        errors.append(f"[ERROR] must be more than 0 characters [json-pointer:{pointer}/text]")
    elif len(text) > limit:
        errors.append(f"[ERROR] must be less than {limit + 1} characters [json-pointer:{pointer}/text]")
    return errors


def _block_errors(block: Any, index: int) -> list[str]:
    pointer = f"/blocks/{index}"
    if not isinstance(block, Mapping):
        return [f"[ERROR] must provide an object [json-pointer:{pointer}]"]
    kind = block.get("type")
    if kind not in _BLOCK_TYPES:
        return [f"[ERROR] unsupported type: {kind} [json-pointer:{pointer}/type]"]
    errors: list[str] = []
    block_id = block.get("block_id")
    if block_id is not None and (not isinstance(block_id, str) or len(block_id) > _BLOCK_ID):
        errors.append(f"[ERROR] must be less than {_BLOCK_ID + 1} characters [json-pointer:{pointer}/block_id]")
    if kind == "header":
        errors += _text_errors(block.get("text"), f"{pointer}/text", _HEADER_TEXT, plain_only=True)
    elif kind == "section":
        if "text" not in block and "fields" not in block:
            errors.append(f"[ERROR] must provide either text or fields [json-pointer:{pointer}]")
        if "text" in block:
            errors += _text_errors(block["text"], f"{pointer}/text", _SECTION_TEXT)
        fields = block.get("fields")
        if fields is not None:
            if not isinstance(fields, list):
                errors.append(f"[ERROR] must provide an array [json-pointer:{pointer}/fields]")
            else:
                if len(fields) > _SECTION_FIELDS:
                    errors.append(f"[ERROR] no more than {_SECTION_FIELDS} items allowed "
                                  f"[json-pointer:{pointer}/fields]")
                for number, item in enumerate(fields):
                    errors += _text_errors(item, f"{pointer}/fields/{number}", _FIELD_TEXT)
    elif kind in ("context", "actions"):
        elements = block.get("elements")
        limit = _CONTEXT_ELEMENTS if kind == "context" else _ACTIONS_ELEMENTS
        if not isinstance(elements, list) or not elements:
            errors.append(f"[ERROR] must provide a non-empty array [json-pointer:{pointer}/elements]")
        elif len(elements) > limit:
            errors.append(f"[ERROR] no more than {limit} items allowed [json-pointer:{pointer}/elements]")
    return errors


def validate_blocks(blocks: Any) -> list[str]:
    """Slack's detail lines for what is wrong with a parsed ``blocks`` value, [] when valid.

    The limits of Slack's Block Kit reference (50 blocks, a section's text 3000 characters
    and at most 10 fields of 2000, a header's plain text 150, a block_id 255, no empty text)
    in the form Slack answers them, e.g. ``[ERROR] must be less than 3001 characters
    [json-pointer:/blocks/0/text/text]``. Interactive elements are not checked in depth.
    """
    if not isinstance(blocks, list):
        return ["[ERROR] must provide an array [json-pointer:/blocks]"]
    if len(blocks) > MAX_BLOCKS:
        return [f"[ERROR] no more than {MAX_BLOCKS} items allowed [json-pointer:/blocks]"]
    errors: list[str] = []
    for index, block in enumerate(blocks):
        errors += _block_errors(block, index)
    return errors


def _parse_blocks(raw: Any) -> list[Any] | None:
    """``blocks`` as sent (a JSON string in a form body, an array in a JSON body), checked."""
    if raw is None:
        return None
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except ValueError:
            raise _Refused("invalid_blocks_format") from None
    if not isinstance(raw, list):
        raise _Refused("invalid_blocks_format")
    errors = validate_blocks(raw)
    if errors:
        raise _Refused("invalid_blocks", errors)
    return raw


# ---------------------------------------------------------------------------------------------
# Requests


def _decode_body(content_type: str, body: bytes) -> dict[str, Any]:
    """The parameters of a request body, by content type, as Slack reads them."""
    kind = content_type.split(";")[0].strip().lower()
    if not body:
        return {}
    if kind == "application/json":
        try:
            value = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise _Refused("invalid_json") from None
        if not isinstance(value, dict):
            raise _Refused("invalid_json")
        return value
    if kind == "multipart/form-data":
        head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1")
        parsed = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
        params: dict[str, Any] = {}
        for part in parsed.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            if not isinstance(payload, bytes):
                payload = b""
            if name:
                params[str(name)] = payload if part.get_filename() else payload.decode("utf-8", "replace")
        return params
    if kind in ("application/x-www-form-urlencoded", "text/plain", ""):
        try:
            return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
        except UnicodeDecodeError:
            raise _Refused("invalid_form_data") from None
    raise _Refused("invalid_post_type")


def _redacted(value: Any, secrets_: tuple[str, ...]) -> Any:
    """``value`` with every occurrence of a token replaced, for the call log."""
    if isinstance(value, str):
        for secret in secrets_:
            if secret:
                value = value.replace(secret, f"<token len {len(secret)}>")
        return value
    if isinstance(value, Mapping):
        return {key: _redacted(item, secrets_) for key, item in value.items()}
    if isinstance(value, list):
        return [_redacted(item, secrets_) for item in value]
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


def _text_param(params: Mapping[str, Any], name: str) -> str | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class _Handler(BaseHTTPRequestHandler):
    """Routes ``/api/<method>`` and ``/upload/v1/<key>`` to the owning ``SlackServer``."""

    server: _HTTPServer
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        """Silent: a request line must never reach a log (the token is not in it, but nothing is)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._dispatch()

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch()

    def _dispatch(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        body = self.rfile.read(length) if length > 0 else b""
        url = urlsplit(self.path)
        owner = self.server.owner
        if length < 0:
            status, headers, payload = 400, {"Content-Type": "text/plain"}, b"Bad Content-Length"
        elif url.path.startswith(_API):
            status, headers, payload = owner._api(url.path[len(_API):], url.query, dict(self.headers.items()), body)
        elif url.path.startswith(_UPLOAD):
            status, headers, payload = owner._upload(url.path[len(_UPLOAD):], dict(self.headers.items()), body)
        else:
            status, headers, payload = 404, {"Content-Type": "text/plain"}, b"Not Found"
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, owner: SlackServer) -> None:
        self.owner = owner
        super().__init__(("127.0.0.1", 0), _Handler)


# ---------------------------------------------------------------------------------------------
# The server


class SlackServer:
    """A Slack workspace with one bot token, served over HTTP on 127.0.0.1 and a free port.

    ``channels`` maps channel ids to names (default ``{"C0INCIDENT": "incidents"}``); a
    message may name a channel by id, ``#name`` or ``name``. ``text_limit`` is the length
    past which ``text`` is ``msg_too_long`` (Slack documents 40,000; Slack's staff have
    reported refusals from about 4,000, so a test may tighten it).

    Use as a context manager, or ``start()`` / ``stop()``; ``api_url`` is what ``WebClient``
    takes as ``base_url``. Every read accessor returns a snapshot taken under the lock.
    """

    def __init__(self, *, token: str = DEFAULT_TOKEN, channels: Mapping[str, str] | None = None,
                 text_limit: int = MAX_TEXT) -> None:
        self._token = token
        self._channels = dict(DEFAULT_CHANNELS if channels is None else channels)
        self._text_limit = text_limit
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self._messages: list[Message] = []
        self._files: list[UploadedFile] = []
        self._pending: dict[str, _Pending] = {}
        self._upload_keys: dict[str, str] = {}
        self._failures: dict[str, deque[tuple[int, int]]] = {}
        self._revoked = False
        self._last_ts = 0
        self._file_count = 0
        self._http: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> SlackServer:
        """Bind 127.0.0.1 on a port the kernel picks and serve in a daemon thread."""
        if self._http is not None:
            return self
        self._http = _HTTPServer(self)
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"slack-sim:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; the recorded state stays readable."""
        http, thread = self._http, self._thread
        self._http, self._thread = None, None
        if http is None:
            return
        http.shutdown()
        http.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> SlackServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The port served on (the server must be started)."""
        if self._http is None:
            raise RuntimeError("SlackServer is not started")
        return int(self._http.server_address[1])

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``, the host part of every URL this server hands out."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        """``http://127.0.0.1:PORT/api/`` (with the trailing slash ``WebClient`` joins methods to)."""
        return f"{self.base_url}{_API}"

    # -- what happened --------------------------------------------------------------------------

    @property
    def calls(self) -> list[Call]:
        """Every request, in arrival order (the token redacted)."""
        with self._lock:
            return list(self._calls)

    @property
    def messages(self) -> list[Message]:
        """Every message posted, in ts order, edits applied (copies)."""
        with self._lock:
            return [replace(message, edits=list(message.edits)) for message in self._messages]

    @property
    def files(self) -> list[UploadedFile]:
        """Every file completed, in order."""
        with self._lock:
            return list(self._files)

    def thread(self, ts: str) -> list[Message]:
        """The parent whose ts is ``ts`` (or the parent of the reply ``ts``) and its replies, in order.

        Orphaned messages belong to no thread; a ``ts`` that names no visible message is a KeyError.
        """
        with self._lock:
            found = next((m for m in self._messages if m.ts == ts and not m.orphaned), None)
            if found is None:
                raise KeyError(f"no message with ts {ts}")
            root = found.thread_ts or found.ts
            return [replace(m, edits=list(m.edits)) for m in self._messages
                    if not m.orphaned and (m.ts == root or m.thread_ts == root)]

    # -- faults ---------------------------------------------------------------------------------

    def fail_next(self, method: str, *, status: int = 429, retry_after: int = 1, count: int = 1) -> None:
        """Answer the next ``count`` calls of ``method`` with HTTP ``status`` before serving it again.

        429 is Slack's rate limit: a ``Retry-After: <retry_after>`` header and
        ``{"ok": false, "error": "ratelimited"}``; 500 and 503 answer ``internal_error`` and
        ``service_unavailable``. ``method`` may be ``"upload"`` for the upload URL POST.
        """
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._lock:
            queue = self._failures.setdefault(method, deque())
            queue.extend([(status, retry_after)] * count)

    def revoke_token(self) -> None:
        """From now on the token is answered ``token_revoked``, as after the app is uninstalled."""
        with self._lock:
            self._revoked = True

    # -- internals: shared ----------------------------------------------------------------------

    def _next_ts(self) -> str:
        """A message ts like Slack's ("1732900000.000100"): wall-clock microseconds, strictly increasing."""
        now = int(time.time() * 1_000_000)
        self._last_ts = max(now, self._last_ts + 1)
        return f"{self._last_ts // 1_000_000}.{self._last_ts % 1_000_000:06d}"

    def _take_failure(self, method: str) -> tuple[int, int] | None:
        queue = self._failures.get(method)
        return queue.popleft() if queue else None

    def _record(self, method: str, params: Mapping[str, Any], headers: Mapping[str, str], status: int,
                error: str | None, presented: str | None) -> None:
        hidden = tuple(sorted({self._token, presented or ""} - {""}, key=len, reverse=True))
        clean_headers: dict[str, str] = {}
        for name, value in headers.items():
            if name.lower() == "authorization":
                scheme, _, credential = value.partition(" ")
                value = f"{scheme} <len {len(credential)}>" if credential else f"<len {len(value)}>"
            clean_headers[name] = _redacted(value, hidden)
        clean_params = dict(_redacted(dict(params), hidden))
        if "token" in clean_params:
            clean_params["token"] = f"<len {len(str(params['token']))}>"
        self._calls.append(Call(method, clean_params, clean_headers, status, error))

    def _failure_answer(self, failure: tuple[int, int]) -> tuple[int, dict[str, str], bytes, str]:
        status, retry_after = failure
        error = _STATUS_ERRORS.get(status, "fatal_error")
        headers = {"Content-Type": "application/json; charset=utf-8"}
        if status == 429:
            headers["Retry-After"] = str(retry_after)
        return status, headers, json.dumps({"ok": False, "error": error}).encode(), error

    def _channel_id(self, value: Any, *, names: bool = True) -> str | None:
        """The id of a channel given as id (or, where Slack allows, ``#name`` or ``name``)."""
        if not isinstance(value, str) or not value:
            return None
        if value in self._channels:
            return value
        if names:
            name = value[1:] if value.startswith("#") else value
            for channel_id, channel_name in self._channels.items():
                if channel_name == name:
                    return channel_id
        return None

    def _thread_parent(self, channel: str, thread_ts: Any) -> tuple[str | None, bool]:
        """(thread_ts, orphaned) for a reply: Slack answers a malformed ts ``invalid_thread_ts``
        and an unknown one (or a reply's) ok, posting where nobody will see it."""
        if thread_ts is None or thread_ts == "":
            return None, False
        text = str(thread_ts)
        if not _TS.fullmatch(text):
            raise _Refused("invalid_thread_ts", [f"[ERROR] {text} is not a valid thread_ts"])
        parent = next((m for m in self._messages if m.channel == channel and m.ts == text), None)
        return text, parent is None or parent.thread_ts is not None or parent.orphaned

    def _json(self, data: Mapping[str, Any]) -> bytes:
        return json.dumps(data).encode("utf-8")

    def _message_json(self, message: Message) -> dict[str, Any]:
        data: dict[str, Any] = {
            "user": _USER_ID, "type": "message", "ts": message.ts, "bot_id": _BOT_ID, "app_id": _APP_ID,
            "text": message.text, "team": _TEAM_ID,
            "bot_profile": {"id": _BOT_ID, "app_id": _APP_ID, "name": "spikeops", "team_id": _TEAM_ID},
        }
        if message.blocks is not None:
            data["blocks"] = message.blocks
        if message.thread_ts is not None:
            data["thread_ts"] = message.thread_ts
            data["parent_user_id"] = _USER_ID
        if message.edits:
            data["edited"] = {"user": _USER_ID, "ts": message.edits[-1].ts}
        if message.files:
            data["files"] = [{"id": file_id} for file_id in message.files]
            data["upload"] = True
        return data

    # -- internals: /api/ -----------------------------------------------------------------------

    def _api(self, method: str, query: str, headers: dict[str, str],
             body: bytes) -> tuple[int, dict[str, str], bytes]:
        params: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True))
        content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        authorization = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        presented: str | None = None
        error: str | None
        with self._lock:
            try:
                if authorization.startswith("Bearer "):
                    presented = authorization[len("Bearer "):].strip()
                elif "token" in params:
                    presented = str(params["token"])
                decoded = _decode_body(content_type, body)
                if presented is None and "token" in decoded and not content_type.lower().startswith(
                        "application/json"):
                    presented = str(decoded["token"])  # a form's token counts; a JSON body's never does
                params.update(decoded)
                handler = getattr(self, "_m_" + method.replace(".", "_"), None) if re.fullmatch(
                    r"[A-Za-z]+(\.[A-Za-z]+)+", method) else None
                if handler is None:
                    if method in _DEPRECATED:
                        raise _Refused("method_deprecated")
                    raise _Refused("unknown_method")
                failure = self._take_failure(method)
                if failure is not None:
                    status, out_headers, payload, failed = self._failure_answer(failure)
                    self._record(method, params, headers, status, failed, presented)
                    return status, out_headers, payload
                if method != "api.test":
                    self._authenticate(presented)
                data = {"ok": True, **handler(params)}
                status, error = 200, None
            except _Refused as refused:
                status, error = refused.status, refused.error
                data = {"ok": False, "error": refused.error}
                if refused.error == "unknown_method":
                    data["req_method"] = method
                if refused.messages:
                    data["response_metadata"] = {"messages": refused.messages}
            self._record(method, params, headers, status, error, presented)
        out = {
            "Content-Type": "application/json; charset=utf-8",
            "X-Slack-Req-Id": secrets.token_hex(16),
            "X-OAuth-Scopes": "chat:write,files:write",
        }
        return status, out, self._json(data)

    def _authenticate(self, presented: str | None) -> None:
        if not presented:
            raise _Refused("not_authed")
        if not secrets.compare_digest(presented.encode(), self._token.encode()):
            raise _Refused("invalid_auth")
        if self._revoked:
            raise _Refused("token_revoked")

    def _m_api_test(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``api.test``: echoes its arguments, needs no token."""
        return {"args": {k: v for k, v in params.items() if k != "token"}}

    def _m_auth_test(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``auth.test`` for a bot token: who the token is (docs.slack.dev/reference/methods/auth.test)."""
        return {
            "url": f"https://{_TEAM}.slack.com/", "team": _TEAM, "user": "spikeops", "team_id": _TEAM_ID,
            "user_id": _USER_ID, "bot_id": _BOT_ID, "is_enterprise_install": False,
        }

    def _content(self, params: Mapping[str, Any]) -> tuple[str, list[Any] | None, bool]:
        """(text, blocks, has_attachments) of a chat.* call, refused the way Slack refuses them."""
        text = _text_param(params, "text") or ""
        blocks = _parse_blocks(params.get("blocks"))
        attachments = params.get("attachments")
        has_attachments = bool(attachments) and attachments not in ("[]", [])
        if len(text) > self._text_limit:
            raise _Refused("msg_too_long")
        return text, blocks, has_attachments

    def _m_chat_postMessage(self, params: Mapping[str, Any]) -> dict[str, Any]:  # noqa: N802
        """``chat.postMessage`` (docs.slack.dev/reference/methods/chat.postMessage).

        ``channel`` by id or name (``channel_not_found``); ``text`` and/or ``blocks``
        (``no_text`` with neither); a well-formed ``thread_ts`` that names no parent is
        answered ok and the message is orphaned, as Slack does (python-slack-sdk#840,
        node-slack-sdk#780: "succeed in posting ... but the message won't thread and won't
        be visible"); a malformed one is ``invalid_thread_ts``.
        """
        channel = self._channel_id(params.get("channel"))
        if channel is None:
            raise _Refused("channel_not_found")
        text, blocks, has_attachments = self._content(params)
        if not text and not blocks and not has_attachments:
            raise _Refused("no_text")
        thread_ts, orphaned = self._thread_parent(channel, params.get("thread_ts"))
        message = Message(channel, self._next_ts(), thread_ts, text, blocks, orphaned=orphaned)
        self._messages.append(message)
        return {"channel": channel, "ts": message.ts, "message": self._message_json(message)}

    def _m_chat_update(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``chat.update`` (docs.slack.dev/reference/methods/chat.update).

        ``channel`` must be the id (``channel_not_found``) and ``ts`` a message in it
        (``message_not_found``); the new ``text`` replaces the old, and so does ``blocks``
        (an empty array clears them; omitted, the message becomes its text alone).
        """
        channel = self._channel_id(params.get("channel"), names=False)
        if channel is None:
            raise _Refused("channel_not_found")
        ts = _text_param(params, "ts")
        message = next((m for m in self._messages if m.channel == channel and m.ts == ts), None)
        if message is None:
            raise _Refused("message_not_found")
        text, blocks, has_attachments = self._content(params)
        if not text and not blocks and not has_attachments:
            raise _Refused("no_text")
        new_blocks = blocks if blocks else None
        edit = Edit(self._next_ts(), message.text, message.blocks, text, new_blocks)
        message.text, message.blocks, message.updated = text, new_blocks, True
        message.edits.append(edit)
        return {"channel": channel, "ts": message.ts, "text": text, "message": self._message_json(message)}

    def _m_files_getUploadURLExternal(self, params: Mapping[str, Any]) -> dict[str, Any]:  # noqa: N802
        """Step 1 of an upload (docs.slack.dev/reference/methods/files.getUploadURLExternal):
        ``filename`` and ``length`` (bytes) required; a length of 0 is ``missing_argument``."""
        filename = _text_param(params, "filename")
        raw_length = _text_param(params, "length")
        missing = [name for name, value in (("filename", filename), ("length", raw_length)) if not value]
        if missing:
            raise _Refused("invalid_arguments", [f"[ERROR] missing required field: {name}" for name in missing])
        assert filename is not None and raw_length is not None
        try:
            length = int(raw_length)
        except ValueError:
            raise _Refused("invalid_arguments", ["[ERROR] must be an integer [json-pointer:/length]"]) from None
        if length <= 0:
            raise _Refused("missing_argument")
        self._file_count += 1
        file_id = f"F0SIM{self._file_count:06d}"
        key = secrets.token_urlsafe(24)
        self._pending[file_id] = _Pending(file_id, filename, length)
        self._upload_keys[key] = file_id
        return {"upload_url": f"{self.base_url}{_UPLOAD}{key}", "file_id": file_id}

    def _m_files_completeUploadExternal(self, params: Mapping[str, Any]) -> dict[str, Any]:  # noqa: N802
        """Step 3 (docs.slack.dev/reference/methods/files.completeUploadExternal): ``files`` a JSON
        array of ``{"id", "title"}``; an id not uploaded (or already completed) is
        ``file_not_found``; ``channel_id`` (or ``channels``) an id, else ``invalid_channel``.
        A file shared to a channel is posted there as a message (in ``thread_ts`` when given)
        whose text is ``initial_comment``."""
        raw = params.get("files")
        try:
            entries = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise _Refused("invalid_arguments", ["[ERROR] invalid json [json-pointer:/files]"]) from None
        if not isinstance(entries, list) or not entries or not all(isinstance(e, Mapping) for e in entries):
            raise _Refused("invalid_arguments", ["[ERROR] must provide a non-empty array [json-pointer:/files]"])
        pending: list[tuple[_Pending, str]] = []
        for entry in entries:
            upload = self._pending.get(str(entry.get("id")))
            if upload is None or upload.data is None:
                raise _Refused("file_not_found")
            pending.append((upload, str(entry.get("title") or upload.filename)))
        requested = _text_param(params, "channel_id") or (_text_param(params, "channels") or "").split(",")[0]
        channel = None
        if requested:
            channel = self._channel_id(requested, names=False)
            if channel is None:
                raise _Refused("invalid_channel")
        comment = _text_param(params, "initial_comment")
        thread_ts, orphaned = self._thread_parent(channel, params.get("thread_ts")) if channel else (None, False)
        answered = []
        for upload, title in pending:
            assert upload.data is not None
            del self._pending[upload.file_id]
            self._files.append(UploadedFile(upload.file_id, upload.filename, title, upload.data, channel,
                                            thread_ts, comment))
            answered.append({"id": upload.file_id, "title": title, "name": upload.filename,
                             "size": len(upload.data)})
        if channel is not None:
            self._messages.append(Message(channel, self._next_ts(), thread_ts, comment or "", None,
                                          files=tuple(u.file_id for u, _ in pending), orphaned=orphaned))
        return {"files": answered}

    # -- internals: /upload/v1/ -----------------------------------------------------------------

    def _upload(self, key: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        """Step 2: the bytes POSTed to an upload URL. Slack's upload host answers
        ``OK - <length>`` as text; a URL it never issued is 404, and bytes that do not
        match the length promised in step 1 are refused (400) here so the mismatch is loud."""
        plain = {"Content-Type": "text/plain; charset=utf-8"}
        with self._lock:
            file_id = self._upload_keys.get(key)
            params: dict[str, Any] = {"file_id": file_id, "length": len(body)}
            failure = self._take_failure(UPLOAD_CALL)
            if failure is not None:
                status, out, payload, error = self._failure_answer(failure)
                self._record(UPLOAD_CALL, params, headers, status, error, None)
                return status, out, payload
            upload = self._pending.get(file_id or "")
            if upload is None:
                self._record(UPLOAD_CALL, params, headers, 404, "not_found", None)
                return 404, plain, b"Not Found"
            if len(body) != upload.length:
                self._record(UPLOAD_CALL, params, headers, 400, "length_mismatch", None)
                return 400, plain, f"length {len(body)} does not match {upload.length}".encode()
            upload.data = body
            self._record(UPLOAD_CALL, params, headers, 200, None, None)
            return 200, plain, f"OK - {len(body)}".encode()

