"""Opening SSH connections to nodes, strictly, and naming every way it can fail.

Host keys are checked against known_hosts and nothing else: an unknown or changed key is a
refusal, never a prompt and never an automatic add, because an incident is exactly when an
impostor would be believed. Every failure maps to one of the bundle spec's probe errors
(``unreachable``, ``host-key``, ``auth``) and to how a person would say it in the summary
(unreachable, timed out, refused), since a failed node is evidence, not an exception.

Keys and known_hosts files are read once per collection, not once per node: with 1,000
nodes that is the difference between reading a file once and a million times.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

from spikeops.inventory import Target

__all__ = ["ConnectFailure", "Connector"]


# paramiko's transport threads log their own failures (a banner timeout, a socket closed
# under them) at ERROR; without a handler Python prints those with tracebacks on stderr.
# Every such failure is already classified and recorded here.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class ConnectFailure(Exception):
    """The node was not reached. ``outcome`` is the summary bucket (``unreachable``,
    ``timeout``, ``refused``), ``error`` the probes.json value, ``detail`` one line."""

    def __init__(self, outcome: str, error: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.error = error
        self.detail = detail


class _UnknownHostKey(Exception):
    def __init__(self, hostname: str, key: Any) -> None:
        super().__init__(hostname)
        self.hostname = hostname
        self.key = key


def _refuse_policy() -> Any:
    import paramiko

    class Refuse(paramiko.MissingHostKeyPolicy):
        """paramiko's RejectPolicy, but with a type we can tell apart from other errors."""

        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            raise _UnknownHostKey(hostname, key)

    return Refuse()


def _no_delay(client: Any) -> None:
    """Send small packets at once (TCP_NODELAY). The collector's packets are small and each
    waits for an answer (a channel request, a probe's start line); with Nagle's algorithm one
    sent while an earlier one is unacknowledged waits for the node's delayed ACK, up to 40 ms
    on Linux. A tunnel through a jump host is not a socket: left as it is."""
    sock = getattr(client.get_transport(), "sock", None)
    if isinstance(sock, socket.socket):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


@dataclass
class _Jump:
    client: Any
    lock: threading.Lock


class Connector:
    """Connects to targets with shared, once-loaded keys and known_hosts."""

    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._known: dict[str, Any] = {}
        self._keys: dict[str, Any] = {}
        self._jumps: dict[tuple[str, int, str], _Jump | ConnectFailure] = {}

    # -- shared material -------------------------------------------------------------------
    def _known_hosts(self, path: str) -> Any:
        import paramiko

        with self._lock:
            if path not in self._known:
                try:
                    self._known[path] = paramiko.HostKeys(path)
                except FileNotFoundError:
                    self._known[path] = None
                except (OSError, paramiko.SSHException) as exc:
                    self._known[path] = ConnectFailure("refused", "host-key", f"known_hosts {path}: {exc}")
            value = self._known[path]
        if isinstance(value, ConnectFailure):
            raise value
        return value

    def _key(self, path: str) -> Any:
        import paramiko

        with self._lock:
            if path not in self._keys:
                try:
                    self._keys[path] = paramiko.PKey.from_path(path)
                except FileNotFoundError:
                    self._keys[path] = ConnectFailure("refused", "auth", f"identity file {path} not found")
                except paramiko.PasswordRequiredException:
                    self._keys[path] = ConnectFailure(
                        "refused", "auth", f"identity file {path} is passphrase-protected (load it into ssh-agent)")
                except (OSError, ValueError, paramiko.SSHException) as exc:
                    self._keys[path] = ConnectFailure("refused", "auth", f"identity file {path}: {exc}")
            value = self._keys[path]
        if isinstance(value, ConnectFailure):
            raise value
        return value

    def _host_key_names(self, target: Target) -> list[str]:
        return [target.hostname] if target.port == 22 else [f"[{target.hostname}]:{target.port}"]

    # -- connecting --------------------------------------------------------------------------
    def connect(self, target: Target) -> Any:
        """An authenticated ``paramiko.SSHClient``; ConnectFailure otherwise."""
        import paramiko

        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(_refuse_policy())
        store = client.get_host_keys()
        for path in target.known_hosts:
            known = self._known_hosts(path)
            if known is None:
                continue
            for name in self._host_key_names(target):
                entry = known.lookup(name)
                if entry:
                    for keytype, key in entry.items():
                        store.add(name, keytype, key)
        sock = self._tunnel(target.jump, target) if target.jump is not None else None
        pkey = self._key(target.identity_files[0]) if target.identity_files else None
        timeout = self.connect_timeout
        try:
            client.connect(
                target.hostname, port=target.port, username=target.user, pkey=pkey,
                allow_agent=pkey is None, look_for_keys=pkey is None,
                timeout=timeout, banner_timeout=timeout, auth_timeout=timeout, channel_timeout=timeout,
                sock=sock,
            )
        except BaseException as exc:
            client.close()
            if isinstance(exc, Exception):
                raise self._classify(exc, target) from None
            raise
        _no_delay(client)
        return client

    def _classify(self, exc: Exception, target: Target) -> ConnectFailure:
        import paramiko

        # Messages leave out the node's own name and address (the summary prints the node),
        # so equal failures on many nodes fold into one line.
        if isinstance(exc, ConnectFailure):
            return exc
        if isinstance(exc, _UnknownHostKey):
            return ConnectFailure("refused", "host-key",
                                  f"host key not in known_hosts ({exc.key.get_name()}); not trusted")
        if isinstance(exc, paramiko.BadHostKeyException):
            return ConnectFailure("refused", "host-key", "host key does not match known_hosts (changed or impostor)")
        if isinstance(exc, paramiko.AuthenticationException):
            return ConnectFailure("refused", "auth", f"authentication as {target.user} failed")
        refused = isinstance(exc, ConnectionRefusedError) or (
            isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError)
            and all(isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED
                    for e in exc.errors.values())
        )
        if refused:
            return ConnectFailure("unreachable", "unreachable", f"connection refused (port {target.port})")
        if isinstance(exc, socket.timeout | TimeoutError):
            return ConnectFailure("timeout", "unreachable", f"no TCP connection within {self.connect_timeout:g} s")
        if isinstance(exc, socket.gaierror):
            return ConnectFailure("unreachable", "unreachable", f"cannot resolve {target.hostname} ({exc.strerror})")
        if isinstance(exc, paramiko.SSHException):
            text = str(exc)
            # paramiko's start_client returns at its timeout without raising, and the next
            # step finds "No existing session": a handshake that did not finish in time.
            if any(mark in text.lower() for mark in ("banner", "timeout", "timed out", "no existing session")):
                return ConnectFailure("timeout", "unreachable",
                                      f"accepted the connection but did not speak SSH within {self.connect_timeout:g} s")
            return ConnectFailure("unreachable", "unreachable", f"SSH failed ({text or type(exc).__name__})")
        if isinstance(exc, OSError):
            reasons = {str(getattr(e, "strerror", None) or e) for e in getattr(exc, "errors", {}).values()}
            why = ", ".join(sorted(reasons)) if reasons else (exc.strerror or str(exc))
            return ConnectFailure("unreachable", "unreachable", f"cannot connect ({why})")
        if isinstance(exc, EOFError):
            return ConnectFailure("unreachable", "unreachable", "closed the connection during the handshake")
        return ConnectFailure("unreachable", "unreachable", f"SSH failed ({type(exc).__name__}: {exc})")

    def _tunnel(self, jump: Target, target: Target) -> Any:
        """A direct-tcpip channel through the (shared, lazily opened) jump host."""
        import paramiko

        key = (jump.hostname, jump.port, jump.user)
        with self._lock:
            entry = self._jumps.get(key)
            if entry is None:
                entry = self._jumps[key] = _Jump(None, threading.Lock())
        if isinstance(entry, ConnectFailure):
            raise entry
        with entry.lock:
            if entry.client is None or not entry.client.get_transport() or not entry.client.get_transport().is_active():
                try:
                    entry.client = self.connect(jump)
                except ConnectFailure as exc:
                    failure = ConnectFailure(exc.outcome, "unreachable", f"jump host {jump.node}: {exc.detail}")
                    with self._lock:
                        self._jumps[key] = failure
                    raise failure from None
            transport = entry.client.get_transport()
        try:
            return transport.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                                          timeout=self.connect_timeout)
        except paramiko.ChannelException as exc:
            raise ConnectFailure("unreachable", "unreachable",
                                 f"jump host {jump.node} cannot open a tunnel to the node, port {target.port} ({exc.text})") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectFailure("timeout", "unreachable",
                                 f"jump host {jump.node}: no tunnel to the node, port {target.port} ({exc})") from None

    def close(self) -> None:
        with self._lock:
            jumps = list(self._jumps.values())
            self._jumps.clear()
        for entry in jumps:
            if isinstance(entry, _Jump) and entry.client is not None:
                entry.client.close()
