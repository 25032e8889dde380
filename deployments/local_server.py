"""The Prefect server ``spikeops serve`` starts for itself when no ``PREFECT_API_URL`` is set.

Prefect's own fallback, a temporary server started on first use, gives up after its default
wait on a loaded 2-core machine, keeps nothing across restarts, serves no UI (so nobody can
answer an approval) and sends telemetry. This one is ``prefect server start`` itself:

- its database and settings live in a home of spikeops' own (``[prefect] home``), never the
  user's ``~/.prefect`` profile, so incidents and approvals survive a restart of ``serve``;
- it listens on loopback only, on ``[prefect] port`` (Prefect's 4200 by default), UI included;
- analytics and telemetry are off, on the server and in ``serve``;
- ``serve`` waits for it as long as it really takes (the process is alive and starting), and
  says where it stands while it waits;
- it is stopped when ``serve`` ends, and dies with it if ``serve`` is killed (``PDEATHSIG``).

Secrets in ``serve``'s environment (Slack, receiver and webhook tokens) are not passed to it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LocalServer", "prefect_api", "configured_api", "start_local_server", "server_environment", "quiet_client_environment",
           "DEFAULT_WAIT_S"]

#: The longest ``serve`` waits for the server's first health answer while its process lives.
#: A cold start (database migrations, UI assets) took 25-70 s on a loaded 2-core machine.
DEFAULT_WAIT_S = 600.0
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "WEBHOOK")
#: What ``serve`` and its server set so nothing is sent home (Prefect's analytics, the generic
#: DO_NOT_TRACK convention other libraries honour).
_QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


@dataclass
class LocalServer:
    """A running ``prefect server start`` of ours."""

    home: Path
    port: int
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    started_s: float = 0.0
    _log_file: object = field(default=None, repr=False)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, grace_s: float = 15.0) -> None:
        """Terminate the server (its whole process group), then kill it after ``grace_s``."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(5)
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def server_environment(home: Path, port: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: this one without secrets and without a ``PREFECT_API_URL``
    that would point it at itself, plus its home, loopback address and quiet settings."""
    env = {name: value for name, value in (os.environ if environ is None else environ).items()
           if not any(word in name.upper() for word in _SECRET_WORDS)}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_API_KEY", None)
    env.update(_QUIET)
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
    })
    return env


def quiet_client_environment(api_url: str) -> None:
    """``serve``'s own process (and the runs it starts) talk to ``api_url`` and send nothing
    home. Set before Prefect is imported, so its settings read them."""
    os.environ.update(_QUIET)
    os.environ["PREFECT_API_URL"] = api_url


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The server gets SIGTERM when ``serve`` dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _last_line(path: Path | None) -> str:
    if path is None or not path.is_file():
        return ""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def start_local_server(home: str | Path, port: int, *, wait_s: float = DEFAULT_WAIT_S,
                       say: Callable[[str], None] = lambda _line: None) -> LocalServer:
    """Start ``prefect server start`` on loopback and wait until it answers. ValueError (one
    line) when the port is taken, the server exits while starting, or ``wait_s`` passes."""
    home = Path(home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    if not _port_free(port):
        raise ValueError(f"port {port} on 127.0.0.1 is taken (another Prefect server? to use it, set "
                         f"PREFECT_API_URL=http://127.0.0.1:{port}/api; or set [prefect] port in spikeops.toml)")
    server = LocalServer(home=home, port=port, log=home / "server.log")
    server._log_file = open(server.log, "ab")  # noqa: SIM115 - closed by stop()
    prefect = Path(sys.executable).with_name("prefect")
    argv = ([str(prefect)] if prefect.exists() else [sys.executable, "-m", "prefect"]) + [
        "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    start = time.monotonic()
    server.process = subprocess.Popen(argv, env=server_environment(home, port), stdin=subprocess.DEVNULL,
                                      stdout=server._log_file, stderr=subprocess.STDOUT,  # type: ignore[arg-type]
                                      start_new_session=True, preexec_fn=_die_with_parent)
    health, next_note = f"{server.api_url}/health", start + 15
    try:
        while True:
            if server.process.poll() is not None:
                raise ValueError(f"the local Prefect server exited ({server.process.returncode}) while starting: "
                                 f"{_last_line(server.log) or 'no output'} (log: {server.log})")
            if _healthy(health):
                break
            now = time.monotonic()
            if now - start > wait_s:
                raise ValueError(f"the local Prefect server did not answer within {wait_s:.0f} s (log: {server.log})")
            if now >= next_note:
                say(f"still starting the local Prefect server ({now - start:.0f} s)")
                next_note = now + 15
            time.sleep(0.25)
    except BaseException:
        server.stop()
        raise
    server.started_s = time.monotonic() - start
    return server


def configured_api() -> str | None:
    """The API URL Prefect's settings name (environment, profile, ``prefect.toml``), if any."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


@contextlib.contextmanager
def prefect_api(home: str | Path, port: int, *, say: Callable[[str], None] = lambda _line: None,
                wait_s: float = DEFAULT_WAIT_S) -> Iterator[str]:
    """The Prefect API ``serve`` uses: ``PREFECT_API_URL`` (environment or Prefect profile) when
    set; otherwise a local server of its own (``start_local_server``) for as long as the
    context lasts, which every client and run of this process then talks to."""
    configured = configured_api()
    if configured:
        yield configured
        return
    say(f"no PREFECT_API_URL: starting a local Prefect server on 127.0.0.1:{port} (its data in {home})")
    server = start_local_server(home, port, say=say, wait_s=wait_s)
    try:
        say(f"local Prefect server up in {server.started_s:.0f} s: API {server.api_url}, UI {server.ui_url} "
            "(stopped when serve ends; set PREFECT_API_URL to use another server)")
        before = {name: os.environ.get(name) for name in (*_QUIET, "PREFECT_API_URL")}
        quiet_client_environment(server.api_url)  # the runs serve starts inherit it
        _refresh_settings()  # every thread's clients (receiver, runner, events), not only this one's
        try:
            yield server.api_url
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _refresh_settings()
    finally:
        server.stop()
        say("local Prefect server stopped")


def _refresh_settings() -> None:
    """Prefect's process-wide settings read the environment again. A ``temporary_settings``
    would hold in this thread's context only: the receiver's and the runner's threads would
    still see no API URL and each start a temporary server of Prefect's own."""
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()
