"""The alert receiver: monitoring alerts in, one incident flow run per incident out.

Prefect's webhooks are Cloud-only, so spikeops ships its own small FastAPI app:
- ``POST /alerts/alertmanager``: Alertmanager webhook v4;
- ``POST /alerts/grafana``: Grafana alerting webhook (the same alert list, plus its fields);
- ``POST /alerts/generic``: ``{"job": "4412", "cluster": "...", "alertname": "...",
  "status": "firing", "fingerprint": "...", "startsAt": "..."}``.

Authentication is required to listen anywhere but loopback: ``Authorization: Bearer`` with
``SPIKEOPS_RECEIVER_TOKEN``, or an HMAC-SHA256 of the body in ``X-Spikeops-Signature`` with
``SPIKEOPS_RECEIVER_HMAC_KEY``. Alerts are validated, resolved ones ignored, labels mapped to
flow parameters (``spikeops.alerts``: only the job id and cluster name, both checked against
strict patterns), and each firing alert starts the flow through a ``starter`` with the alert's
idempotency key, so a storm of repeats starts one run. The answer comes at once; the flow runs on
its own.

A storm costs one Prefect call (``SingleFlight``). Alertmanager resends a firing alert every
group and repeat interval, from every replica, and retries what failed: a thousand copies of one
alert is an ordinary night. Prefect would deduplicate them by the key too, but each copy would
cost an API round trip, and a SQLite-backed server serialises those writes (100 concurrent
copies took a median 2.5 s to answer, some over 10 s). So the receiver answers duplicates
itself:
- the first copy of a key starts the flow (in a small thread pool, off the event loop) and is
  answered with the run id once Prefect has it;
- a copy that arrives while that start is in flight is answered at once (202, ``"start":
  "in-flight"``, no run id yet);
- a copy of a key started in the last ``remember_s`` seconds is answered at once with the
  remembered run id (``"start": "remembered"``); the memory holds at most ``remember_max`` keys,
  oldest dropped first, and a key that fell out of it is simply asked of Prefect again (which
  still returns the same run for it);
- a start that fails is not remembered: its own request gets the 503 (Alertmanager retries it)
  and the next copy of the key tries again.
Only a request that starts the flow, or a resolved alert, is emitted as a Prefect event.

A copy of a body already parsed is answered without parsing it again (``_FastPath``: its
credentials, a lookup of the body, an answer rendered once), in raw ASGI in front of FastAPI, and in
``spikeops serve`` before uvicorn ever sees it (``spikeops.deployments.receiver_http``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# Module level, not inside create_app: FastAPI resolves the handlers' (string) annotations
# in this module's globals, and an unresolved ``Request`` silently becomes a query parameter.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from spikeops.alerts import MAX_BODY, SOURCES, Alert, AlertError, idempotency_key, parse_alerts
from spikeops.errors import InputError

__all__ = ["ReceiverConfig", "SingleFlight", "create_app", "check_bind"]

Starter = Callable[[Alert, str], "str | None"]


@dataclass(frozen=True)
class ReceiverConfig:
    token: str | None = None
    hmac_key: str | None = None
    default_cluster: str | None = None
    #: how long a started key's run id is remembered, and how many keys at most
    remember_s: float = 600.0
    remember_max: int = 10_000

    @classmethod
    def from_env(cls) -> ReceiverConfig:
        return cls(os.environ.get("SPIKEOPS_RECEIVER_TOKEN") or None,
                   os.environ.get("SPIKEOPS_RECEIVER_HMAC_KEY") or None,
                   os.environ.get("SPIKEOPS_DEFAULT_CLUSTER") or None)

    @property
    def authenticated(self) -> bool:
        return bool(self.token or self.hmac_key)


def check_bind(host: str, config: ReceiverConfig) -> None:
    """Refuse to listen beyond loopback without authentication."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not config.authenticated:
        raise ValueError(f"refusing to listen on {host} without SPIKEOPS_RECEIVER_TOKEN or SPIKEOPS_RECEIVER_HMAC_KEY")


def _authorised(config: ReceiverConfig, headers: Mapping[str, str], body: bytes) -> bool:
    if not config.authenticated:
        return True
    if config.token:
        given = headers.get("authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip(), config.token):
            return True
    if config.hmac_key:
        signature = headers.get("x-spikeops-signature", "").removeprefix("sha256=")
        expected = hmac.new(config.hmac_key.encode(), body, hashlib.sha256).hexdigest()
        if signature and hmac.compare_digest(signature, expected):
            return True
    return False


@dataclass
class FlightStats:
    started: int = 0
    in_flight: int = 0
    remembered: int = 0
    failed: int = 0
    busy: int = 0


@dataclass
class SingleFlight:
    """One ``starter`` call per idempotency key at a time, and a bounded memory of the run ids
    of recent keys (the module docstring says why). Thread-safe; nothing here blocks the event
    loop: ``begin`` only looks at a dict, and the start runs in the pool."""

    starter: Starter
    remember_s: float = 600.0
    remember_max: int = 10_000
    workers: int = 8
    #: distinct keys being started at once, at most; beyond, a new key is answered 503 (retry)
    max_flying: int = 1_000
    clock: Callable[[], float] = time.monotonic
    stats: FlightStats = field(default_factory=FlightStats)

    def __post_init__(self) -> None:
        if self.remember_max < 0 or self.remember_s < 0:
            raise ValueError("remember_s and remember_max cannot be negative")
        self._lock = threading.Lock()
        self._flying: dict[str, Future] = {}
        self._recent: OrderedDict[str, tuple[str | None, float]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="spikeops-start")

    def begin(self, alert: Alert, key: str) -> tuple[str, Any]:
        """``("remembered", run id)``, ``("in-flight", None)``, ``("started", future)`` whose
        result is the run id (or the starter's exception), or ``("busy", None)`` when
        ``max_flying`` other keys are being started (a flood of distinct alerts queues no
        further in memory)."""
        with self._lock:
            hit = self._recent.get(key)
            if hit is not None:
                if hit[1] > self.clock():
                    self.stats.remembered += 1
                    return "remembered", hit[0]
                del self._recent[key]
            if key in self._flying:
                self.stats.in_flight += 1
                return "in-flight", None
            if len(self._flying) >= self.max_flying:
                self.stats.busy += 1
                return "busy", None
            future = self._pool.submit(self._start, alert, key)
            self._flying[key] = future
            self.stats.started += 1
        return "started", future

    def peek_all(self, keys: list[str]) -> list[tuple[str, str | None]] | None:
        """``[(how, run id)]`` when every key is remembered or in flight (counted as answered),
        else None and nothing counted: the caller takes the full path, which may start one."""
        with self._lock:
            now = self.clock()
            found: list[tuple[str, str | None]] = []
            for key in keys:
                hit = self._recent.get(key)
                if hit is not None and hit[1] > now:
                    found.append(("remembered", hit[0]))
                elif key in self._flying:
                    found.append(("in-flight", None))
                else:
                    return None
            for how, _ in found:
                if how == "remembered":
                    self.stats.remembered += 1
                else:
                    self.stats.in_flight += 1
            return found

    def _start(self, alert: Alert, key: str) -> str | None:
        """In the pool: the start, then its settling, before the future completes (so a copy
        that comes after the answer always finds the key remembered)."""
        try:
            run = self.starter(alert, key)
        except BaseException:
            with self._lock:
                self._flying.pop(key, None)
                self.stats.failed += 1  # not remembered: the next copy tries again
            raise
        with self._lock:
            self._flying.pop(key, None)
            if self.remember_max > 0:
                self._recent[key] = (run, self.clock() + self.remember_s)
                self._recent.move_to_end(key)
                while len(self._recent) > self.remember_max:
                    self._recent.popitem(last=False)
        return run

    def remembered(self) -> int:
        with self._lock:
            return len(self._recent)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class _ReceiverApp(FastAPI):
    """FastAPI, with the storm's fast path in front of it (``_FastPath``)."""

    fast_path: _FastPath | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        fast = self.fast_path
        if fast is not None and scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"].startswith("/alerts/"):
            receive = await fast(scope, receive, send)
            if receive is None:
                return
            try:
                await super().__call__(scope, receive, send)
            finally:  # copies parked behind this request (HTTP front) get their turn, whatever it was
                fast.wake(scope["path"], getattr(receive, "body", None))
            return
        await super().__call__(scope, receive, send)


class _Rendered(NamedTuple):
    """A fast answer, rendered once: for ASGI (headers, payload) and as raw HTTP (``tail``: its
    own header lines, the blank line and the payload, after the status line and the server's
    default headers)."""

    headers: list[tuple[bytes, bytes]]
    payload: bytes
    tail: bytes


#: the states of one body's keys whose answers are kept rendered (in practice two: all in
#: flight, then all remembered)
_RENDERED_STATES = 4


@dataclass
class _Known:
    """A body the full path has parsed: its firing alerts with their keys, and its answers
    rendered once per state of those keys (``(how, run id)`` each)."""

    firing: list[tuple[Alert, str]]
    keys: list[str]
    rendered: dict[tuple[tuple[str, str | None], ...], _Rendered] = field(default_factory=dict)

    def answer(self, found: list[tuple[str, str | None]]) -> _Rendered:
        state = tuple(found)
        hit = self.rendered.get(state)
        if hit is None:
            payload = json.dumps({"accepted": [
                {"job": alert.job, "status": "firing", "flow_run": run, "idempotency_key": key, "start": how}
                for (alert, key), (how, run) in zip(self.firing, found, strict=True)]}).encode()
            length = str(len(payload)).encode()
            hit = _Rendered([(b"content-type", b"application/json"), (b"content-length", length)], payload,
                            b"content-type: application/json\r\ncontent-length: " + length + b"\r\n\r\n" + payload)
            if len(self.rendered) >= _RENDERED_STATES:
                self.rendered.clear()
            self.rendered[state] = hit
        return hit


class _FastPath:
    """A copy of a body the receiver has already parsed, all of whose firing alerts are
    remembered or in flight, is answered here: its credentials checked as the full path checks
    them, then a dict lookup of the body and of its keys, and an answer rendered once
    for all its copies. No routing, no request object, no JSON parsing or rendering. That is
    what a storm is made of; everything else (a new key, a resolved alert, bad input, bad
    credentials) goes on to the full path with the body replayed.

    Two layers use it: this raw ASGI layer in front of FastAPI (under any ASGI server, and for
    a connection uvicorn's own protocol serves), and, in ``spikeops serve``, the HTTP protocol in
    front of uvicorn's (``spikeops.deployments.receiver_http``), which answers a copy before uvicorn ever
    sees it."""

    def __init__(self, config: ReceiverConfig, flight: SingleFlight, size: int = 1024) -> None:
        self.config, self.flight, self.size = config, flight, size
        self.parsed: OrderedDict[tuple[str, bytes | tuple[int, bytes]], _Known] = OrderedDict()
        self.lock = threading.Lock()
        #: Copies waiting for the full path's answer to the first copy of their body (event loop
        #: only): ``park`` and ``wake``.
        self.waiting: dict[tuple[str, bytes | tuple[int, bytes]], list[Callable[[], None]]] = {}

    def park(self, path: str, body: bytes, retry: Callable[[], None]) -> bool:
        """A copy the fast path could not answer, at the HTTP front. The first copy of a body
        leads (False: hand it to the full path); a copy of a body whose leader is on the full
        path waits (True) and is ``retry``-ed when the leader has started its keys, or ended.

        The front reads every connection of a storm in one turn of the event loop, before the
        full path has run for any of them: without this, every copy of a new alert went the
        full path (about 200 µs each), the whole first storm; with it, one does."""
        key = (path[8:], _body_key(body))
        waiting = self.waiting.get(key)
        if waiting is None:
            if len(self.waiting) >= self.size:  # a flood of distinct bodies: no more leaders kept
                return False
            self.waiting[key] = []
            return False
        waiting.append(retry)
        return True

    def wake(self, path: str, body: bytes | None) -> None:
        """The full path has begun (or refused) the leader of ``body``: its parked copies try again."""
        if body is None or not self.waiting:
            return
        for retry in self.waiting.pop((path[8:], _body_key(body)), ()):
            retry()

    def learn(self, source: str, body: bytes, firing: list[tuple[Alert, str]]) -> None:
        """The full path's parse of a body of firing alerts only (with their keys)."""
        with self.lock:
            self.parsed[(source, _body_key(body))] = _Known(firing, [key for _, key in firing])
            while len(self.parsed) > self.size:
                self.parsed.popitem(last=False)

    def answer(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> _Rendered | None:
        """The 202 for a copy to ``path`` (``/alerts/SOURCE``) with ASGI ``headers``, or None:
        the full path's to answer."""
        source = path[8:]  # after "/alerts/"
        if len(body) > MAX_BODY or source not in SOURCES:
            return None
        config = self.config
        if config.authenticated:  # first, so that the answer's speed tells a stranger nothing
            given: dict[str, str] = {}
            for name, value in headers:  # lowercase in ASGI; the first of each, as Starlette's
                if name == b"authorization" or name == b"x-spikeops-signature":
                    given.setdefault(name.decode("latin-1"), value.decode("latin-1"))
            if not _authorised(config, given, body):
                return None  # the full path answers 401
        with self.lock:
            known = self.parsed.get((source, _body_key(body)))
        if known is None:
            return None
        found = self.flight.peek_all(known.keys)
        return None if found is None else known.answer(found)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        """None when answered; else a ``receive`` that replays the body to the full path."""
        message = await receive()
        if message["type"] != "http.request":
            return _replay(None, receive, message)  # a disconnect: let the full path see it
        body = message.get("body", b"")
        if message.get("more_body", False):
            chunks = [body]
            while message.get("more_body", False):
                message = await receive()
                if message["type"] != "http.request":  # gone mid-body: the full path sees that
                    return _replay(b"".join(chunks), receive, message, more=True)
                chunks.append(message.get("body", b""))
            body = b"".join(chunks)
        rendered = self.answer(scope["path"], body, scope["headers"])
        if rendered is None:
            return _replay(body, receive)
        await send({"type": "http.response.start", "status": 202, "headers": rendered.headers})
        await send({"type": "http.response.body", "body": rendered.payload})
        return None


#: bodies up to this size are their own key in the fast path's table (a dict hashes them faster
#: than any digest); larger ones are keyed by their SHA-256, so the table stays small
_KEYED_AS_IS = 16 * 1024


def _body_key(body: bytes) -> bytes | tuple[int, bytes]:
    """A body's key in the fast path's table: the body, or its length and SHA-256 (a tuple,
    never equal to a body kept whole)."""
    return body if len(body) <= _KEYED_AS_IS else (len(body), hashlib.sha256(body).digest())


def _replay(body: bytes | None, receive: Any, pending: Any = None, more: bool = False) -> Any:
    """A ``receive`` for the full path: the body already read (as one message; ``more`` when it
    is not all of it), then a message already taken from the server (a disconnect), then the
    server's own ``receive``."""
    queue: list[Any] = []
    if body is not None:
        queue.append({"type": "http.request", "body": body, "more_body": more})
    if pending is not None:
        queue.append(pending)

    async def replay() -> Any:
        if queue:
            return queue.pop(0)
        return await receive()

    replay.body = body  # type: ignore[attr-defined]  # what the full path was given (``wake``)
    return replay


def create_app(starter: Starter, config: ReceiverConfig | None = None,
               emit: Callable[[Alert], None] | None = None, *, coalesce: bool = True,
               metrics: Callable[[], tuple[bytes, str]] | None = None) -> Any:
    """The FastAPI app. ``starter(alert, idempotency_key)`` starts (or finds) the flow run and
    returns its id; ``emit(alert)`` publishes an event (a Prefect event in production).
    ``coalesce=False`` sends every copy to the starter (the receiver before single-flight: the
    benchmark's baseline). ``app.state.flight`` is the ``SingleFlight`` (its ``stats``).
    ``metrics()``: the body and content type of ``GET /metrics`` (the ledger's, in ``spikeops
    serve``: ``spikeops.ledger.metrics``); aggregate counts, served without credentials as
    Prometheus scrapes them."""
    config = config or ReceiverConfig.from_env()
    app = _ReceiverApp(title="spikeops alert receiver", docs_url=None, redoc_url=None)
    flight = SingleFlight(starter, remember_s=config.remember_s, remember_max=config.remember_max)
    app.state.flight = flight
    fast = app.fast_path = _FastPath(config, flight) if coalesce else None

    @app.get("/healthz")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    if metrics is not None:
        from starlette.responses import Response

        async def scrape(_request: Request) -> Response:
            body, content_type = await run_in_threadpool(metrics)  # the ledger's I/O, off the event loop
            return Response(body, media_type=content_type)

        app.add_route("/metrics", scrape, methods=["GET"])

    async def receive(request: Request) -> JSONResponse:
        source = request.path_params["source"]
        body = await request.body()
        if not _authorised(config, request.headers, body):
            return JSONResponse({"error": "unauthorised"}, status_code=401)
        try:
            alerts = parse_alerts(source, body, config.default_cluster)
        except AlertError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400 if source in SOURCES else 404)
        if fast is not None and all(alert.status == "firing" for alert in alerts):
            # known before the start: the copies that arrive while it is in flight are answered
            # by the fast path too (it answers only keys in flight or remembered)
            fast.learn(source, body, [(alert, idempotency_key(alert)) for alert in alerts])
        begun = []
        for alert in alerts:
            if alert.status != "firing":
                begun.append((alert, None, "resolved", None))
                continue
            key = idempotency_key(alert)
            how, run = flight.begin(alert, key) if coalesce else ("started", None)
            if how == "busy":
                return JSONResponse({"error": "too many incidents being started at once; retry"},
                                    status_code=503, headers={"Retry-After": "5"})
            begun.append((alert, key, how, run))
        if fast is not None:  # every key is in flight or remembered now: parked copies are answered
            fast.wake(request.url.path, body)
        answers = []
        for alert, key, how, run in begun:
            if how == "resolved":
                _emit(emit, alert)
                answers.append({"job": alert.job, "status": alert.status, "flow_run": None, "ignored": "resolved"})
                continue
            if how == "started":
                _emit(emit, alert)
                try:
                    # the starter blocks (HTTP to the Prefect API): off the event loop
                    run = await (asyncio.wrap_future(run) if coalesce else run_in_threadpool(starter, alert, key))
                except InputError as exc:  # the labels name no configured cluster, and the like
                    return JSONResponse({"error": f"cannot map the alert: {exc}"}, status_code=400)
                except Exception as exc:
                    # Alertmanager and Grafana retry a 5xx; Retry-After says when
                    return JSONResponse({"error": f"could not start the incident flow: {type(exc).__name__}"},
                                        status_code=503, headers={"Retry-After": "5"})
            answers.append({"job": alert.job, "status": "firing", "flow_run": run, "idempotency_key": key,
                            "start": how})
        return JSONResponse({"accepted": answers}, status_code=202)

    # A plain Starlette route, not a FastAPI one: no parameter solving or telemetry per alert.
    app.add_route("/alerts/{source}", receive, methods=["POST"])
    return app


def _emit(emit: Callable[[Alert], None] | None, alert: Alert) -> None:
    if emit is None:
        return
    try:
        emit(alert)
    except Exception:  # an event is a courtesy; the incident must still start
        pass
