"""A node's session through OpenSSH's own client (``[ssh] client = "openssh"``).

One ``ssh`` process per node runs ``exec sh -s``; the single-session runner goes to its stdin
and the runner's groups come back on its stdout, read by the same code as over paramiko
(``spikeops.collect.single.run_single``). The handshake and the ciphers then run in C, one
process per node, on every core of the collecting machine, and whatever the site's OpenSSH
client does (GSSAPI/Kerberos, certificates, FIDO keys, ``ProxyJump`` chains) works as it does
for ``ssh`` at a prompt.

The same rules hold as over paramiko: the host key must be in the target's known_hosts files
and nowhere else (``StrictHostKeyChecking=yes``, no global file, no updates), nothing
prompts (``BatchMode``), no agent or X11 forwarding, no multiplexing left behind, no
environment sent, and the process gets only the environment ssh needs (never the
collector's tokens). ssh says why a connection failed only on its stderr, with exit status
255: ``classify`` maps those lines to the same failures (refused, unreachable, timed out, host
key, authentication) and the same one-line details as ``spikeops.collect.ssh``. A node that
answers but cannot run the runner falls back to a session per probe over paramiko.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spikeops.bundle import AtomicSink
from spikeops.collect.plan import PlannedProbe
from spikeops.collect.runner import STDERR_CAP
from spikeops.collect.single import SESSION_COMMAND, SingleResult, run_single
from spikeops.collect.ssh import ConnectFailure
from spikeops.inventory import Target

__all__ = ["ssh_argv", "classify", "ProcessConduit", "run_node", "ssh_binary", "ENVIRONMENT"]

#: What of the collector's environment the ssh process sees: where it is and who runs it,
#: the agent, Kerberos' credential cache. Nothing else (tokens stay with the collector).
ENVIRONMENT = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "SSH_AUTH_SOCK", "KRB5CCNAME")
_CHUNK = 1 << 16
#: ssh's exit status for its own failures (any other status is the remote command's).
_SSH_FAILED = 255


def ssh_binary() -> str:
    """``SPIKEOPS_SSH`` or ``ssh`` on PATH (overridable as the sim's programs are)."""
    return os.environ.get("SPIKEOPS_SSH", "ssh")


def _percent(text: str) -> str:
    """ssh expands ``%`` tokens in ProxyCommand; a path's own ``%`` must stay one."""
    return text.replace("%", "%%")


def _options(target: Target, connect_timeout: float, config: str | None) -> list[str]:
    """Everything but the destination and the command: the inventory's word wins over any
    ssh_config (options on the command line come first), and the strict rules over both."""
    found = os.path.expanduser(config) if config else None
    argv = [ssh_binary(), "-F", found if found and os.path.isfile(found) else "/dev/null", "-T", "-x", "-a",
            "-e", "none"]
    fixed = {
        "BatchMode": "yes",
        "StrictHostKeyChecking": "yes",
        "UpdateHostKeys": "no",
        "GlobalKnownHostsFile": "/dev/null",
        "UserKnownHostsFile": " ".join(shlex.quote(path) for path in target.known_hosts) or "/dev/null",
        "ConnectTimeout": str(max(1, int(round(connect_timeout)))),
        "ControlMaster": "no",
        "ControlPath": "none",
        "ForwardAgent": "no",
        "ForwardX11": "no",
        "ClearAllForwardings": "yes",
        "PermitLocalCommand": "no",
        "SendEnv": "-*",
        "LogLevel": "ERROR",
        "HostName": target.hostname,
    }
    for key, value in fixed.items():
        argv += ["-o", f"{key}={value}"]
    argv += ["-p", str(target.port), "-l", target.user]
    if target.identity_files:
        argv += ["-o", "IdentitiesOnly=yes"]
        for path in target.identity_files:
            argv += ["-i", path]
    return argv


def ssh_argv(target: Target, connect_timeout: float, config: str | None = None,
             command: str = SESSION_COMMAND) -> list[str]:
    """The ssh command line that runs ``command`` on ``target`` (through its jump host, as a
    ProxyCommand built from the same strict options)."""
    argv = _options(target, connect_timeout, config)
    if target.jump is not None:
        hop = _options(target.jump, connect_timeout, config) + ["-W", "%h:%p", "--", target.jump.node]
        argv += ["-o", "ProxyCommand=" + " ".join(shlex.quote(_percent(word)) if word != "%h:%p" else word
                                                  for word in hop)]
    return argv + ["--", target.node, command]


# ------------------------------------------------------------------------------- failures


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    outcome: str
    error: str
    detail: Callable[[Target, float, re.Match[str]], str]


_RULES = (
    _Rule(re.compile(r"REMOTE HOST IDENTIFICATION HAS CHANGED|Host key for .* has changed"), "refused", "host-key",
          lambda t, s, m: "host key does not match known_hosts (changed or impostor)"),
    _Rule(re.compile(r"No (\S+) host key is known for"), "refused", "host-key",
          lambda t, s, m: f"host key not in known_hosts ({m.group(1)}); not trusted"),
    _Rule(re.compile(r"Host key verification failed"), "refused", "host-key",
          lambda t, s, m: "host key not trusted (known_hosts)"),
    _Rule(re.compile(r"Permission denied|Too many authentication failures"), "refused", "auth",
          lambda t, s, m: f"authentication as {t.user} failed"),
    _Rule(re.compile(r"timed out during banner exchange|Connection timed out during"), "timeout", "unreachable",
          lambda t, s, m: f"accepted the connection but did not speak SSH within {s:g} s"),
    _Rule(re.compile(r"port \d+: Connection refused"), "unreachable", "unreachable",
          lambda t, s, m: f"connection refused (port {t.port})"),
    _Rule(re.compile(r"port \d+: (Connection timed out|Operation timed out)"), "timeout", "unreachable",
          lambda t, s, m: f"no TCP connection within {s:g} s"),
    _Rule(re.compile(r"Could not resolve hostname [^:]*: (.*)"), "unreachable", "unreachable",
          lambda t, s, m: f"cannot resolve {t.hostname} ({m.group(1).strip()})"),
    _Rule(re.compile(r"port \d+: (No route to host|Network is unreachable|Connection reset by peer)"),
          "unreachable", "unreachable", lambda t, s, m: f"cannot connect ({m.group(1)})"),
    _Rule(re.compile(r"Connection (closed|reset) by|kex_exchange_identification"), "unreachable", "unreachable",
          lambda t, s, m: "closed the connection during the handshake"),
)


def classify(status: int | None, stderr: str, target: Target, connect_timeout: float) -> ConnectFailure | None:
    """The connection failure ssh's exit status and stderr describe, or None when ssh got
    through (the status is the remote command's, or ssh still runs). Unknown complaints keep
    ssh's own last line."""
    if status != _SSH_FAILED:
        return None
    lines = [line.strip() for line in stderr.splitlines() if line.strip().strip("@")]
    text = "\n".join(lines)
    failure = None
    for rule in _RULES:
        match = rule.pattern.search(text)
        if match:
            failure = ConnectFailure(rule.outcome, rule.error, rule.detail(target, connect_timeout, match))
            break
    if failure is None:
        last = lines[-1][:200] if lines else "no message"
        failure = ConnectFailure("unreachable", "unreachable", f"SSH failed ({last})")
    if target.jump is not None and _through_jump(text, target):
        failure = ConnectFailure(failure.outcome, "unreachable", f"jump host {target.jump.node}: {failure.detail}")
    return failure


def _through_jump(text: str, target: Target) -> bool:
    """Whether ssh's complaint is about the jump host (or the tunnel through it), not the node:
    the node's own failures name the node's address; the tunnel's say "open failed"."""
    assert target.jump is not None
    if re.search(r"open failed|stdio forwarding failed", text):
        return True
    jump = target.jump
    return any(mark in text for mark in (f"host {jump.hostname} port", f"{jump.user}@{jump.hostname}",
                                         f"for {jump.hostname}", f"[{jump.hostname}]:{jump.port}"))


# ------------------------------------------------------------------------------- the session


class ProcessConduit:
    """An ssh process as a ``single.Conduit``: its stdin and stdout, and its stderr in an
    unlinked temp file (ssh's own complaints, and the session's stderr), read as it grows."""

    def __init__(self, process: subprocess.Popen[bytes], stderr: Any) -> None:
        self.process = process
        self._stderr = stderr
        self._read = 0
        self._eof = False
        assert process.stdout is not None and process.stdin is not None
        os.set_blocking(process.stdout.fileno(), False)

    @classmethod
    def start(cls, argv: Sequence[str]) -> ProcessConduit:
        stderr = tempfile.TemporaryFile(prefix="spikeops-ssh-")
        env = {key: os.environ[key] for key in ENVIRONMENT if key in os.environ}
        try:
            process = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                       env=env, start_new_session=True, bufsize=0)
        except BaseException:
            stderr.close()
            raise
        return cls(process, stderr)

    def selectables(self) -> list[Any]:
        return [self.process.stdout]

    def send(self, data: bytes) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        view = memoryview(data)
        while view:
            written = stdin.write(view)
            view = view[written or 0:]

    def receive(self) -> tuple[list[bytes], bytes, bool]:
        out: list[bytes] = []
        stdout = self.process.stdout
        assert stdout is not None
        while not self._eof:
            try:
                data = os.read(stdout.fileno(), _CHUNK)
            except BlockingIOError:
                break
            if not data:
                self._eof = True
                break
            out.append(data)
        return out, self.stderr_since(), self._eof

    def stderr_since(self) -> bytes:
        """What ssh and the session wrote on stderr since the last call (the first 64 KiB)."""
        if self._read >= STDERR_CAP:
            return b""
        data = os.pread(self._stderr.fileno(), STDERR_CAP - self._read, self._read)
        self._read += len(data)
        return data

    def stderr_text(self) -> str:
        return os.pread(self._stderr.fileno(), STDERR_CAP, 0).decode("utf-8", "replace")

    def close(self) -> int | None:
        """End the session and the process; its exit status (None if it had to be killed)."""
        process = self.process
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()
        try:
            return process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return None
        finally:
            with contextlib.suppress(OSError):
                if process.stdout is not None:
                    process.stdout.close()

    def discard(self) -> None:
        self._stderr.close()


def run_node(
    target: Target,
    probes: list[PlannedProbe],
    open_sink: Callable[[PlannedProbe], AtomicSink],
    *,
    sessions: int,
    expand_interfaces: Callable[[list[str]], list[PlannedProbe]] | None,
    connect_timeout: float,
    node_deadline: float | None,
    spool: Sequence[str] | None,
    config: str | None,
    started: Callable[[ProcessConduit], None] | None = None,
    discovery_timeout: float | None = None,
) -> SingleResult:
    """Run ``probes`` on ``target`` in one OpenSSH session. Raises ConnectFailure when ssh
    did not get through; a result with ``fallback`` set when it did but the runner cannot run
    there (nothing was started). ``started`` learns of the ssh process (its ``close`` ends
    it), for a caller that may have to abandon the node."""
    argv = ssh_argv(target, connect_timeout, config)
    try:
        conduit = ProcessConduit.start(argv)
    except OSError as exc:
        raise ConnectFailure("unreachable", "unreachable", f"cannot run {argv[0]} ({exc.strerror or exc})") from None
    if started is not None:
        started(conduit)
    try:
        # the connection, authentication and login all come before the hello
        result = run_single(None, probes, open_sink, sessions=sessions, expand_interfaces=expand_interfaces,
                            channel_timeout=connect_timeout, node_deadline=node_deadline, spool=spool,
                            conduit=lambda: conduit, hello_timeout=3 * connect_timeout + 2,
                            discovery_timeout=discovery_timeout)
        status = conduit.close()
        if result.fallback is not None:
            failure = classify(status, conduit.stderr_text(), target, connect_timeout)
            if failure is not None:
                raise failure
            if status is None and "did not start within" in result.fallback:
                raise ConnectFailure("timeout", "unreachable",
                                     f"no SSH session within {3 * connect_timeout + 2:g} s")
        elif result.lost is not None:
            failure = classify(status, conduit.stderr_text(), target, connect_timeout)
            if failure is not None:
                result.lost = f"{result.lost}: {failure.detail}"
        return result
    finally:
        conduit.close()
        conduit.discard()

