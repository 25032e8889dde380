"""Starting, finding and stopping, by pid, the processes of a local simulated cluster.

The local clusters (real sshd in ``spikeops.sim.cluster``, real Slurm daemons in
``spikeops.sim.slurmcluster``) run in a directory D, several at once, beside each other and
beside whatever else the machine runs. Stopping one must end everything started for its D
and nothing else, so nothing here kills by name: each cluster says which processes are its
own (``scan(match)`` with its own test of a pid: pid files, a marker in the command line or
the environment), the scan adds their descendants (forked children often rename themselves,
so only the tree finds them) and never includes the scanning process or its parents, and
``stop`` signals what was found until nothing is left. ``start_daemons`` starts
self-daemonizing servers side by side and names the one that failed with its last words.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from spikeops.errors import SpikeopsError

__all__ = [
    "ClusterError",
    "read_pid",
    "pid_alive",
    "proc_read",
    "scan",
    "stop",
    "start_daemons",
]


class ClusterError(SpikeopsError):
    """The simulated cluster cannot be started, found or stopped; the message says why."""


def read_pid(path: Path) -> int | None:
    """The pid in a pid file, None when the file is missing or holds no number."""
    try:
        return int(path.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[1])


def pid_alive(pid: int) -> bool:
    """True for a live process (a zombie is dead: it only waits for its parent to reap it)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def proc_read(pid: int, name: str) -> bytes:
    """``/proc/PID/NAME`` (``cmdline``, ``environ``), b"" when gone or not readable."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _own_lineage() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        stat = _stat(pid)
        if stat is None:
            break
        pid = stat[1]
    return pids


def scan(match: Callable[[int], bool], seeds: Iterable[int] = ()) -> set[int]:
    """Every live process for which ``match(pid)`` is true, plus the live ``seeds``, plus
    all their descendants; never this process or its parents."""
    children: dict[int, list[int]] = {}
    found = {pid for pid in seeds if pid_alive(pid)}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        stat = _stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        children.setdefault(stat[1], []).append(pid)
        if pid not in found and match(pid):
            found.add(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found - _own_lineage()


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop(find: Callable[[], set[int]], what: str, *, grace: float = 3.0, timeout: float = 10.0) -> int:
    """SIGTERM everything ``find()`` returns, SIGKILL what outlives ``grace``; call ``find``
    again until it returns nothing (a process started meanwhile is found next round).
    Returns how many processes were signalled; ClusterError lists survivors after ``timeout``.
    """
    start = time.monotonic()
    signalled: set[int] = set()
    while True:
        alive = find()
        if not alive:
            return len(signalled)
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise ClusterError(f"processes of {what} still running after {timeout:.0f} s: "
                               f"{', '.join(map(str, sorted(alive)[:20]))}")
        _signal(sorted(alive - signalled), signal.SIGTERM)
        if elapsed > grace:
            _signal(alive, signal.SIGKILL)
        signalled |= alive
        time.sleep(0.02)


def start_daemons(commands: Mapping[str, Sequence[str]], logs: Mapping[str, Path], *,
                  env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
    """Start self-daemonizing commands side by side; each must exit 0 once it has detached.

    sshd and the tarpit bind before they detach, so for them a zero exit means "listening";
    slurmctld and slurmd detach first, so their callers still wait for readiness. A failure
    names the command and the end of its stderr, else of its log. ``env`` replaces the
    environment (None: this process's); ``cwd``, where the daemons start (None: here).
    """
    procs = {}
    for name, argv in commands.items():
        try:
            procs[name] = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, start_new_session=True,
                                           env=dict(env) if env is not None else None, cwd=cwd)
        except OSError as exc:
            raise ClusterError(f"cannot start {name}: {exc}") from exc
    failed = []
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            why = _last_words(err.decode(errors="replace"), logs.get(name))
            failed.append(f"{name} exited {proc.returncode}: {why}")
    if failed:
        raise ClusterError("; ".join(failed))


def _last_words(stderr: str, log: Path | None) -> str:
    lines = stderr.strip().splitlines()
    if not lines and log is not None and log.is_file():
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"
