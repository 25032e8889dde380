"""Real OpenSSH servers for the simulated cluster: keys, login user, config, start, stop.

``spikeops.sim.cluster`` runs one ``sshd`` per group of at most 16 node addresses (sshd
binds at most 16 ``ListenAddress`` sockets) on loopback addresses, all with the same port,
so the collector meets the real protocol, real host-key checking, real authentication and
real timeouts, not a mock. This module holds the mechanics that do not depend on what a
node answers:

- the login user: as root a dedicated system user ``spikeops-sim`` whose shell is
  ``/bin/sh`` and whose home is an empty directory, so no shell rc file runs on each of the
  thousands of connections a benchmark makes; otherwise the invoking user;
- keys (``ssh-keygen``), the ``sshd_config`` text, starting daemons and tarpits, and
  waiting until every address listens (read from ``/proc/net/tcp``, so readiness costs no
  connection: each connection to sshd forks and re-executes a server process);
- finding every process started for a cluster directory (``find_processes``); starting and
  stopping them is ``spikeops.sim.processes``'s, shared with the local Slurm cluster.

External programs are overridable (``SPIKEOPS_SSHD``, ``SPIKEOPS_SSH_KEYGEN``), as NHC does.
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from spikeops.sim.processes import ClusterError, pid_alive, proc_read, read_pid, scan, start_daemons, stop

__all__ = [
    "ClusterError",
    "LOGIN_USER",
    "LOGIN_HOME",
    "MAX_LISTEN",
    "sshd_path",
    "login_user",
    "ensure_privsep_dir",
    "keygen",
    "sshd_config",
    "start_daemons",
    "tarpit_command",
    "listening",
    "wait_listening",
    "check_free",
    "find_processes",
    "stop_processes",
    "pid_alive",
    "read_pid",
]

#: The login user when running as root (created on demand).
LOGIN_USER = "spikeops-sim"
LOGIN_HOME = Path("/var/lib/spikeops-sim")
#: sshd's limit on ListenAddress sockets per process (MAX_LISTEN_SOCKS).
MAX_LISTEN = 16
_TARPIT = Path(__file__).with_name("tarpit.py")


def sshd_path() -> str:
    """The sshd binary (``SPIKEOPS_SSHD`` or ``/usr/sbin/sshd``); a clear error when absent."""
    path = os.environ.get("SPIKEOPS_SSHD", "/usr/sbin/sshd")
    if not os.access(path, os.X_OK):
        raise ClusterError(f"{path} not found: install openssh-server (apt-get install openssh-server)")
    return path


def _run(argv: Sequence[str], what: str) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"{what}: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"{what} failed (exit {proc.returncode}): {detail[-1] if detail else 'no output'}")
    return proc


def _locked(user: str) -> bool:
    """True when the account's shadow password starts with ``!`` (locked): sshd without PAM
    refuses even public-key logins to a locked account."""
    try:
        with open("/etc/shadow", encoding="utf-8") as handle:
            for line in handle:
                fields = line.split(":")
                if fields[0] == user and len(fields) > 1:
                    return fields[1].startswith("!")
    except OSError:
        pass
    return False


def login_user() -> str:
    """The user nodes are logged in as; as root, ``spikeops-sim`` is created if missing.

    The home is created empty and owned by root (the user never writes there); the password
    field is ``*`` (no password login, and not "locked", which sshd would refuse).
    """
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name
    LOGIN_HOME.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        pwd.getpwnam(LOGIN_USER)
    except KeyError:
        try:
            _run(["useradd", "--system", "--shell", "/bin/sh", "--home-dir", str(LOGIN_HOME), "--no-create-home",
                  "--password", "*", LOGIN_USER], f"creating user {LOGIN_USER}")
        except ClusterError:
            try:  # another process created it in the meantime
                pwd.getpwnam(LOGIN_USER)
            except KeyError:
                raise
    if _locked(LOGIN_USER):
        _run(["usermod", "--password", "*", LOGIN_USER], f"unlocking user {LOGIN_USER}")
    return LOGIN_USER


def ensure_privsep_dir() -> None:
    """sshd (as root) refuses to start without its privilege-separation directory."""
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)


def keygen(path: Path, comment: str = "spikeops-sim") -> str:
    """Write a new ed25519 key pair at ``path`` (0600) and ``path.pub``; return the public line."""
    for stale in (path, path.with_name(path.name + ".pub")):
        stale.unlink(missing_ok=True)
    keygen_bin = os.environ.get("SPIKEOPS_SSH_KEYGEN", "ssh-keygen")
    _run([keygen_bin, "-t", "ed25519", "-N", "", "-q", "-C", comment, "-f", str(path)], f"ssh-keygen {path}")
    return path.with_name(path.name + ".pub").read_text(encoding="ascii").strip()


def sshd_config(*, listen: Iterable[str], port: int, host_key: Path, authorized_keys: Path, pid_file: Path,
                force_command: Path) -> str:
    """The ``sshd_config`` of one server process (``listen``: at most 16 addresses)."""
    addresses = list(listen)
    if not 1 <= len(addresses) <= MAX_LISTEN:
        raise ValueError(f"one sshd listens on 1 to {MAX_LISTEN} addresses, not {len(addresses)}")
    lines = [f"ListenAddress {address}:{port}" for address in addresses]
    lines += [
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized_keys}",
        f"PidFile {pid_file}",
        "StrictModes no",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "MaxStartups 10000",
        "MaxSessions 64",
        "LoginGraceTime 30",
        "UseDNS no",
        "PrintMotd no",
        "PrintLastLog no",
        "AllowTcpForwarding yes",
        "X11Forwarding no",
        "PermitUserEnvironment no",
        "LogLevel ERROR",
        f"ForceCommand {force_command}",
    ]
    return "\n".join(lines) + "\n"


def tarpit_command(address: str, port: int, pid_file: Path) -> list[str]:
    """The command that starts a ``silent`` node's tarpit (stdlib only, ~30 ms to start)."""
    return [sys.executable, "-I", "-S", str(_TARPIT), address, str(port), str(pid_file)]


def listening(port: int) -> set[str]:
    """The IPv4 addresses with a TCP socket in LISTEN state on ``port`` (from /proc/net/tcp)."""
    out = set()
    with open("/proc/net/tcp", encoding="ascii") as handle:
        next(handle, None)
        for line in handle:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "0A":
                continue
            address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) == port:
                out.add(socket.inet_ntoa(struct.pack("=I", int(address, 16))))
    return out


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1.0):
            return True
    except OSError:
        return False


def wait_listening(addresses: Iterable[str], port: int, timeout: float = 30.0) -> None:
    """Wait (bounded) until every address accepts TCP on ``port``; ClusterError names the rest.

    Reads /proc/net/tcp where it exists (no connection made), else tries to connect.
    """
    waiting = set(addresses)
    deadline = time.monotonic() + timeout
    use_proc = Path("/proc/net/tcp").is_file()
    while waiting:
        if use_proc:
            waiting -= listening(port)
        else:
            waiting = {address for address in waiting if not _accepts(address, port)}
        if not waiting:
            return
        if time.monotonic() > deadline:
            shown = ", ".join(sorted(waiting)[:8]) + (" ..." if len(waiting) > 8 else "")
            raise ClusterError(f"{len(waiting)} address(es) not listening on port {port} after {timeout:.0f} s: "
                               f"{shown}")
        time.sleep(0.02)


def check_free(addresses: Iterable[str], port: int) -> None:
    """ClusterError when something already listens on one of ``addresses`` at ``port``."""
    for address in addresses:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError as exc:
                raise ClusterError(f"{address}:{port} is not free ({exc.strerror or exc}): another cluster or "
                                   f"server uses it; pick another --port or --first-address") from exc


# ---------------------------------------------------------------------------- processes


def find_processes(root: Path, pid_files: Iterable[Path] = ()) -> set[int]:
    """Every live process started for the cluster at ``root`` (a resolved path).

    That is: the pids in ``pid_files`` whose command line names ``root``; processes whose
    command line runs something of the cluster (``root/sshd/sshd-*`` listeners,
    ``root/run/tarpit-*`` tarpits, ``root/bin/*`` node scripts); processes whose environment
    has ``SPIKEOPS_SIM_NODE=root/nodes/...`` (everything a session ran, even a ``sleep``);
    and every descendant of those (sshd's per-connection children rename themselves to
    ``sshd: user [priv]``, so only the tree finds them). Never this process or its parents.
    """
    prefix = os.fsencode(str(root)) + b"/"
    markers = (prefix + b"sshd/sshd-", prefix + b"run/tarpit-", prefix + b"bin/")
    env_marker = b"SPIKEOPS_SIM_NODE=" + prefix + b"nodes/"

    def match(pid: int) -> bool:
        cmdline = proc_read(pid, "cmdline")
        return any(marker in cmdline for marker in markers) or env_marker in proc_read(pid, "environ")

    seeds = [pid for pid in map(read_pid, pid_files) if pid is not None and prefix in proc_read(pid, "cmdline")]
    return scan(match, seeds)


def stop_processes(root: Path, pid_files: Iterable[Path] = (), *, grace: float = 3.0, timeout: float = 10.0) -> int:
    """SIGTERM everything ``find_processes`` finds, SIGKILL what outlives ``grace``; repeat
    the search until nothing is left (a connection accepted meanwhile is found next round).
    Returns how many processes were signalled; ClusterError lists survivors after ``timeout``.
    """
    pid_files = list(pid_files)
    return stop(lambda: find_processes(root, pid_files), str(root), grace=grace, timeout=timeout)
