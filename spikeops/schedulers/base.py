"""What every scheduler action shares: running commands, results, the audit log.

Scheduler actions touch a shared production cluster, so four rules hold for all of them:
- commands are argument lists, never shell strings: a node name or job id from an alert
  cannot become shell syntax (over SSH the list is quoted word by word with ``shlex``);
- commands run with a scrubbed environment (``jobenv.command_env``): no token, no Prefect
  setting, no virtual environment of spikeops on ``PATH`` reaches ``sbatch`` or ``scontrol``;
- every action returns an ``ActionResult`` whose outcome is one of ``done``,
  ``nothing-to-do`` (the idempotent repeat), ``refused`` (a safety rule said no, with the
  reason), ``failed`` (the scheduler said no) or ``dry-run`` (what would have run);
- every result is appended to the incident's ``actions.jsonl`` with the commands that ran,
  their output and their exit status, whatever the outcome.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from spikeops.errors import SpikeopsError
from spikeops.schedulers.jobenv import command_env, orchestrator_prefixes
from spikeops.timeparse import iso

__all__ = [
    "SchedulerError",
    "CommandRun",
    "ActionResult",
    "Runner",
    "LocalRunner",
    "SshRunner",
    "ActionLog",
    "OUTCOMES",
    "default_log_path",
]

OUTCOMES = ("done", "nothing-to-do", "refused", "failed", "dry-run")
#: Output kept per command in the audit log (scontrol show job -d can be long; a runaway
#: command must not grow the log without bound).
_OUTPUT_CAP = 64 << 10


class SchedulerError(SpikeopsError):
    """The scheduler could not be asked (controller down, command missing, timeout) or said
    the target does not exist. One line, for a person."""


@dataclass
class CommandRun:
    argv: list[str]
    exit: int | None
    stdout: str
    stderr: str
    seconds: float
    ran: bool = True  # False: a dry run, printed and not executed

    @property
    def ok(self) -> bool:
        return self.ran and self.exit == 0

    def to_json(self) -> dict[str, Any]:
        return {"argv": self.argv, "ran": self.ran, "exit": self.exit, "seconds": round(self.seconds, 3),
                "stdout": self.stdout[-_OUTPUT_CAP:], "stderr": self.stderr[-_OUTPUT_CAP:]}


@dataclass
class ActionResult:
    action: str
    target: str
    outcome: str
    detail: str
    commands: list[CommandRun] = field(default_factory=list)
    incident: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"time": iso(datetime.now(UTC)), "action": self.action, "target": self.target,
                "outcome": self.outcome, "detail": self.detail, "incident": self.incident,
                **({"extra": self.extra} if self.extra else {}),
                "commands": [run.to_json() for run in self.commands]}

    def line(self) -> str:
        return f"{self.action} {self.target}: {self.outcome} ({self.detail})"


class Runner(Protocol):
    """Runs one command (an argument list) where the scheduler's clients are, and moves the
    few files a command needs (an ``sbatch --export-file``) or spikeops reads there."""

    def run(self, argv: Sequence[str], *, timeout: float, stdin: str | None = None,
            umask: int | None = None) -> CommandRun: ...

    def where(self) -> str: ...

    def read_file(self, path: str, limit: int) -> bytes: ...

    def put_file(self, data: bytes, prefix: str) -> str: ...

    def remove_file(self, path: str) -> None: ...


class LocalRunner:
    """Runs commands on this machine with a scrubbed environment (``jobenv.command_env``:
    no token, no Prefect setting, no virtual environment of spikeops on ``PATH``); ``env``
    adds to it (``SLURM_CONF``...), ``keep`` names more variables to pass on (a site's
    ``KRB5CCNAME``, say; default: the names in ``$SPIKEOPS_PASS_ENV``)."""

    def __init__(self, env: Mapping[str, str] | None = None, *, keep: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        source = os.environ if environ is None else environ
        if keep is None:
            keep = source.get("SPIKEOPS_PASS_ENV", "").replace(",", " ").split()
        self.env = {**command_env(source, keep=keep, drop_path_under=orchestrator_prefixes(source)), **(env or {})}

    def where(self) -> str:
        return "this machine"

    def run(self, argv: Sequence[str], *, timeout: float, stdin: str | None = None,
            umask: int | None = None) -> CommandRun:
        argv = [str(a) for a in argv]
        t0 = time.monotonic()
        try:
            done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout,
                                  env=self.env, check=False, errors="replace",
                                  umask=-1 if umask is None else umask)
        except FileNotFoundError:
            raise SchedulerError(f"{argv[0]}: command not found (set its path in the scheduler config)") from None
        except subprocess.TimeoutExpired as exc:
            return CommandRun(argv, None, _text(exc.stdout), _text(exc.stderr) + f"\ntimed out after {timeout:g} s",
                              time.monotonic() - t0)
        return CommandRun(argv, done.returncode, done.stdout, done.stderr, time.monotonic() - t0)

    def read_file(self, path: str, limit: int) -> bytes:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise OSError(f"{path}: over {limit} bytes")
        return data

    def put_file(self, data: bytes, prefix: str) -> str:
        """A new file only this user can read (mkstemp: 0600), holding ``data``."""
        fd, path = tempfile.mkstemp(prefix=prefix)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return path

    def remove_file(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class SshRunner:
    """Runs commands on a login node over SSH (paramiko, strict host keys): the argument list
    is joined with ``shlex.join``, so each word reaches the remote shell as one word. Only
    ``env`` is sent along: the login node's own environment is the rest."""

    def __init__(self, client: Any, name: str, env: Mapping[str, str] | None = None) -> None:
        self.client = client
        self.name = name
        self.env = dict(env or {})
        self._lock = threading.Lock()

    def where(self) -> str:
        return self.name

    def run(self, argv: Sequence[str], *, timeout: float, stdin: str | None = None,
            umask: int | None = None) -> CommandRun:
        argv = [str(a) for a in argv]
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        command = (f"env {prefix} " if prefix else "") + shlex.join(argv)
        if umask is not None:
            command = f"umask {umask:04o} && {command}"
        t0 = time.monotonic()
        with self._lock:
            try:
                channel_in, channel_out, channel_err = self.client.exec_command(command, timeout=timeout)
                if stdin is not None:
                    channel_in.write(stdin)
                channel_in.channel.shutdown_write()
                out = channel_out.read().decode("utf-8", "replace")
                err = channel_err.read().decode("utf-8", "replace")
                code = channel_out.channel.recv_exit_status()
            except TimeoutError:
                return CommandRun(argv, None, "", f"timed out after {timeout:g} s on {self.name}", time.monotonic() - t0)
            except Exception as exc:  # paramiko's SSHException, socket errors
                raise SchedulerError(f"cannot run {argv[0]} on {self.name}: {exc}") from None
        return CommandRun(argv, code, out, err, time.monotonic() - t0)

    def _sftp(self) -> Any:
        try:
            return self.client.open_sftp()
        except Exception as exc:  # paramiko's SSHException: no SFTP subsystem
            raise OSError(f"no SFTP on {self.name}: {exc}") from None

    def read_file(self, path: str, limit: int) -> bytes:
        with self._lock, self._sftp() as sftp, sftp.open(path, "rb") as handle:
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise OSError(f"{path} on {self.name}: over {limit} bytes")
        return data

    def put_file(self, data: bytes, prefix: str) -> str:
        """``mktemp`` there (0600 from the start), then the bytes over SFTP."""
        made = self.run(["mktemp", "-t", f"{prefix}XXXXXXXX"], timeout=30)
        path = made.stdout.strip()
        if made.exit != 0 or not path.startswith("/"):
            raise OSError(f"mktemp on {self.name}: {(made.stderr or made.stdout).strip()[:200]}")
        with self._lock, self._sftp() as sftp, sftp.open(path, "wb") as handle:
            handle.write(data)
        return path

    def remove_file(self, path: str) -> None:
        self.run(["rm", "-f", "--", path], timeout=30)


def default_log_path() -> Path:
    """Where actions are logged when no incident bundle is named."""
    base = os.environ.get("SPIKEOPS_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "spikeops")
    return Path(base) / "actions.jsonl"


class ActionLog:
    """Appends results to an ``actions.jsonl`` (the bundle's, or the default one). One JSON
    object per line, written with a single append so concurrent writers never interleave."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()

    def append(self, result: ActionResult) -> None:
        if self.path is None:
            return
        line = (json.dumps(result.to_json(), ensure_ascii=False) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        if self.path is None or not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records
