"""The real alert receiver in a process of its own, with counters: for the monitoring chain's
test and the receiver benchmark (run as ``python -m tests.receiver_process PORT CONFIG``).

It is what ``spikeops serve`` builds (``create_app`` with ``spikeops.tasks.start.prefect_starter`` and the
Prefect event emitter, under uvicorn), with the incident deployment registered on the Prefect
server of ``PREFECT_API_URL`` but no runner: runs are created, never executed (that the served
deployment runs them is tests/test_e2e_serve.py's). Around it, the counts a test or benchmark
needs and cannot see from outside: the starter's calls, every HTTP request to the Prefect API,
the events emitted, and each alert received (status, job, alert name, how it was answered).
``GET /test/record`` returns them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def prefect_env(work: Path, api: str, **extra: str) -> dict[str, str]:
    """The environment of the processes around a test's own Prefect server: its home in
    ``work``, analytics and UI off, no Slack token unless given, the checkout importable."""
    env = dict(os.environ, PREFECT_HOME=str(work / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
               PREFECT_LOGGING_LEVEL="WARNING", PYTHONPATH=str(ROOT))
    env.pop("SLACK_BOT_TOKEN", None)
    return {**env, **extra}


def http_json(url: str, body: dict | None = None) -> Any:
    """GET (or POST ``body``) and decode the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def wait_for(what: str, check: Callable[[], Any], seconds: float, why: Callable[[], str] = lambda: "",
             poll: float = 0.1) -> Any:
    """``check()``'s first truthy value; AssertionError naming ``what`` (and ``why()``) after
    ``seconds``. A deadline for something that must happen, never a timing assert."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {seconds:.0f} s. {why()}")


def serve(port: int, config_path: str, *, coalesce: bool = True, record_alerts: bool = True,
          http: str | None = None) -> None:
    import httpx
    import uvicorn

    from spikeops.deployments.receiver import ReceiverConfig, create_app
    from spikeops.deployments.receiver_http import freeze_heap, server_config
    from spikeops.deployments.serve import incident_deployment, prefect_emitter
    from spikeops.config import load_config
    from spikeops.tasks.start import prefect_starter

    api = os.environ["PREFECT_API_URL"]
    record: dict[str, Any] = {"starter_calls": 0, "api_requests": 0, "events": 0, "alerts": []}
    for cls in (httpx.AsyncClient, httpx.Client):
        original = cls.send

        def counted(self: Any, request: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if str(request.url).startswith(api):
                record["api_requests"] += 1
            return _original(self, request, *args, **kwargs)

        cls.send = counted  # type: ignore[method-assign]
    incident_deployment().apply()
    record["api_requests"] = 0  # the registration is not an alert's
    start = prefect_starter(load_config(config_path), announce=False)
    emit_event = prefect_emitter()

    def starter(alert: Any, key: str) -> str:
        record["starter_calls"] += 1
        return start(alert, key)

    def emit(alert: Any) -> None:
        record["events"] += 1
        emit_event(alert)

    app = create_app(starter, ReceiverConfig(), emit=emit, coalesce=coalesce)

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        """Each alert received, with the answer's ``start`` (what a test asserts about)."""
        if scope["type"] != "http" or not scope["path"].startswith("/alerts/"):
            return await app(scope, receive, send)
        chunks: list[bytes] = []

        async def answer(message: Any) -> None:
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        await app(scope, receive, answer)
        try:
            accepted = json.loads(b"".join(chunks)).get("accepted", [])
        except ValueError:
            accepted = []
        for entry in accepted:
            record["alerts"].append({"status": entry.get("status"), "job": entry.get("job"),
                                     "start": entry.get("start"), "flow_run": entry.get("flow_run")})

    @app.get("/test/record")
    async def report() -> dict[str, Any]:  # not in the thread pool the starts may fill
        flight = app.state.flight.stats
        return {**record, "in_flight_answers": flight.in_flight, "remembered_answers": flight.remembered}

    server = uvicorn.Server(server_config(recording if record_alerts else app, "127.0.0.1", port,
                                          **({"http": http} if http else {})))
    freeze_heap()  # as spikeops serve does
    server.run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("config")
    parser.add_argument("--no-coalesce", action="store_true", help="every copy asks Prefect (the old receiver)")
    parser.add_argument("--no-record", action="store_true",
                        help="do not record each alert received (a benchmark's storm: that would be measured)")
    parser.add_argument("--http", choices=["httptools"],
                        help="uvicorn's own protocol, without the receiver's front (a benchmark's baseline)")
    args = parser.parse_args()
    serve(args.port, args.config, coalesce=not args.no_coalesce, record_alerts=not args.no_record, http=args.http)
    return 0


if __name__ == "__main__":
    sys.exit(main())
