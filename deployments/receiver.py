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
from typing import Any

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
        if self.fast_path is not None and scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"].startswith("/alerts/"):
            receive = await self.fast_path(scope, receive, send)
            if receive is None:
                return
        await super().__call__(scope, receive, send)


class _FastPath:
    """A copy of a body the receiver has already parsed, all of whose firing alerts are
    remembered or in flight, is answered here, in raw ASGI: no routing, no request object, no
    JSON parsing. That is what a storm is made of, and it is several times cheaper than the
    full path (which answers everything else: a new key, a resolved alert, bad input)."""

    def __init__(self, config: ReceiverConfig, flight: SingleFlight, size: int = 1024) -> None:
        self.config, self.flight, self.size = config, flight, size
        self.parsed: OrderedDict[tuple[str, bytes], list[tuple[Alert, str]]] = OrderedDict()
        self.lock = threading.Lock()

    def learn(self, source: str, body: bytes, firing: list[tuple[Alert, str]]) -> None:
        """The full path's parse of a body of firing alerts only (with their keys)."""
        digest = hashlib.blake2b(body, digest_size=16).digest()
        with self.lock:
            self.parsed[(source, digest)] = firing
            while len(self.parsed) > self.size:
                self.parsed.popitem(last=False)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        """None when answered; else a ``receive`` that replays the body to the full path."""
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return receive  # a disconnect: let the full path see it
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)

        async def replay() -> dict[str, Any]:
            nonlocal body
            if body is None:
                return await receive()
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        source = scope["path"][len("/alerts/"):]
        if len(body) > MAX_BODY or source not in SOURCES:
            return replay
        with self.lock:
            firing = self.parsed.get((source, hashlib.blake2b(body, digest_size=16).digest()))
        if firing is None:
            return replay
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]  # lowercase in ASGI
                   if k in (b"authorization", b"x-spikeops-signature")}
        if not _authorised(self.config, headers, body):
            return replay  # the full path answers 401
        found = self.flight.peek_all([key for _, key in firing])
        if found is None:
            return replay
        payload = json.dumps({"accepted": [
            {"job": alert.job, "status": "firing", "flow_run": run, "idempotency_key": key, "start": how}
            for (alert, key), (how, run) in zip(firing, found, strict=True)]}).encode()
        await send({"type": "http.response.start", "status": 202, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
        return None


def create_app(starter: Starter, config: ReceiverConfig | None = None,
               emit: Callable[[Alert], None] | None = None, *, coalesce: bool = True) -> Any:
    """The FastAPI app. ``starter(alert, idempotency_key)`` starts (or finds) the flow run and
    returns its id; ``emit(alert)`` publishes an event (a Prefect event in production).
    ``coalesce=False`` sends every copy to the starter (the receiver before single-flight: the
    benchmark's baseline). ``app.state.flight`` is the ``SingleFlight`` (its ``stats``)."""
    config = config or ReceiverConfig.from_env()
    app = _ReceiverApp(title="spikeops alert receiver", docs_url=None, redoc_url=None)
    flight = SingleFlight(starter, remember_s=config.remember_s, remember_max=config.remember_max)
    app.state.flight = flight
    fast = app.fast_path = _FastPath(config, flight) if coalesce else None

    @app.get("/healthz")
    def health() -> dict[str, str]:
        return {"status": "ok"}

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
        answers = []
        for alert in alerts:
            if alert.status != "firing":
                _emit(emit, alert)
                answers.append({"job": alert.job, "status": alert.status, "flow_run": None, "ignored": "resolved"})
                continue
            key = idempotency_key(alert)
            how, run = flight.begin(alert, key) if coalesce else ("started", None)
            if how == "busy":
                return JSONResponse({"error": "too many incidents being started at once; retry"},
                                    status_code=503, headers={"Retry-After": "5"})
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
