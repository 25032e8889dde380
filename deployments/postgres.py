"""A private PostgreSQL cluster for the Prefect server of the scale-out layout.

SQLite-backed Prefect servers lock up under concurrent writes (503s near 2,000 task runs,
``database is locked`` on an approval click), so the layout of ``infra/prefect/up`` keeps
Prefect's database in Debian's PostgreSQL: ``initdb`` in a directory of our own, ``pg_ctl``
on a free loopback port, password authentication (SCRAM) for TCP, no Unix socket, and nothing
of the machine's own PostgreSQL (``/etc/postgresql``, port 5432) touched or needed.

PostgreSQL refuses to run as root, so as root it runs as Debian's ``postgres`` user (made by
the package): its data directory is that user's, and the directories above it get the search
bit (never read) so that user reaches it, as the simulated cluster does for its login user.
The password is generated, kept in ``DIR/pgpass`` (mode 0600, libpq's format: ``PGPASSFILE=
DIR/pgpass psql -h 127.0.0.1 -p PORT -U spikeops prefect`` opens a shell), and never printed.
``create_ledger`` adds spikeops' ledger beside Prefect's database: its own role and password
(``DIR/ledger-pgpass``), so what writes the ledger never holds Prefect's password.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from spikeops.errors import SpikeopsError
from spikeops.sim.processes import pid_alive, read_pid

__all__ = ["PostgresError", "PostgresServer", "bin_dir", "ensure_installed", "server_account", "init", "start",
           "stop", "running", "remove", "free_port", "create_ledger", "SUPERUSER", "DATABASE", "LEDGER_ROLE",
           "LEDGER_DATABASE"]

PG_ROOT = Path("/usr/lib/postgresql")
SUPERUSER = "spikeops"
DATABASE = "prefect"
#: spikeops' ledger (docs/ledger.md): a database of its own, owned by a role of its own, so the
#: workers that write it never hold the password of Prefect's database.
LEDGER_ROLE = "spikeops_ledger"
LEDGER_DATABASE = "spikeops"
REPO = Path(__file__).resolve().parents[1]


class PostgresError(SpikeopsError):
    """PostgreSQL cannot be installed, initialised, started or stopped; one line says why."""


@dataclass(frozen=True)
class PostgresServer:
    """A cluster made by ``init``: its data directory, port and the password of ``SUPERUSER``."""

    data: Path
    port: int
    password: str
    bin: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        """The SQLAlchemy URL Prefect's server takes (``postgresql+asyncpg``); holds the password."""
        return f"postgresql+asyncpg://{SUPERUSER}:{self.password}@{self.host}:{self.port}/{DATABASE}"

    @property
    def display_url(self) -> str:
        """The same, with the password masked: what may be printed or logged."""
        return f"postgresql+asyncpg://{SUPERUSER}:***@{self.host}:{self.port}/{DATABASE}"


def bin_dir() -> Path | None:
    """The newest installed server's ``bin`` (``$SPIKEOPS_PG_BINDIR`` overrides), None without one."""
    override = os.environ.get("SPIKEOPS_PG_BINDIR")
    candidates = [Path(override)] if override else sorted(
        (p / "bin" for p in PG_ROOT.glob("*") if p.name.replace(".", "").isdigit()),
        key=lambda p: float(p.parent.name), reverse=True) if PG_ROOT.is_dir() else []
    for candidate in candidates:
        if all((candidate / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres", "createdb")):
            return candidate
    return None


def ensure_installed() -> Path:
    """The server's ``bin``, installing Debian's ``postgresql`` (``infra/apt-ensure.sh``) when
    it is missing and we are root."""
    found = bin_dir()
    if found is not None:
        return found
    script = REPO / "infra" / "apt-ensure.sh"
    if os.geteuid() != 0 or not script.is_file():
        raise PostgresError("PostgreSQL is not installed (apt-get install postgresql, or set SPIKEOPS_PG_BINDIR)")
    done = subprocess.run([str(script), "postgresql"], capture_output=True, text=True, check=False)
    found = bin_dir()
    if done.returncode != 0 or found is None:
        last = (done.stderr or done.stdout).strip().splitlines()
        raise PostgresError(f"cannot install postgresql: {last[-1] if last else 'apt-get failed'}")
    return found


def server_account() -> tuple[int, int, str]:
    """(uid, gid, name) PostgreSQL runs as: ourselves, or Debian's ``postgres`` when we are root."""
    if os.geteuid() != 0:
        entry = pwd.getpwuid(os.geteuid())
    else:
        try:
            entry = pwd.getpwnam("postgres")
        except KeyError:
            raise PostgresError("running as root and there is no postgres user to run PostgreSQL as "
                                "(Debian's postgresql package creates it)") from None
    return entry.pw_uid, entry.pw_gid, entry.pw_name


def _as_server(argv: list[str], what: str, *, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    uid, gid, _ = server_account()
    switch = {"user": uid, "group": gid, "extra_groups": []} if os.geteuid() == 0 and uid != 0 else {}
    base = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, cwd="/",
                              env={**base, **(env or {})}, **switch)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PostgresError(f"{what}: {exc}") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).strip().splitlines() if line.strip()]
        raise PostgresError(f"{what}: {lines[-1] if lines else f'exit {done.returncode}'}")
    return done


def _reachable(path: Path) -> None:
    """The search bit on every directory above ``path`` (pytest's and mkdtemp's are 0700), so
    the server's account reaches its data directory; nothing is made readable."""
    for folder in path.parents:
        mode = folder.stat().st_mode
        if not mode & 0o001:
            os.chmod(folder, (mode & 0o7777) | 0o001)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init(home: Path, *, port: int | None = None) -> PostgresServer:
    """A new cluster in ``home/data`` (``home`` must not hold one), its password in
    ``home/../pgpass``; listening only on 127.0.0.1:``port`` (free when None) once started."""
    binaries = ensure_installed()
    uid, gid, _ = server_account()
    data = home / "data"
    if data.exists():
        raise PostgresError(f"{data} exists: a cluster was made here before (infra/prefect/down, then remove it)")
    home.mkdir(parents=True, exist_ok=True)
    _reachable(home)
    os.chmod(home, 0o711)
    password = secrets.token_urlsafe(24)
    pwfile = home / ".initdb-password"
    pwfile.write_text(password + "\n")
    os.chmod(pwfile, 0o600)
    data.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(pwfile, uid, gid)
        os.chown(data, uid, gid)
    try:
        _as_server([str(binaries / "initdb"), "-D", str(data), "-U", SUPERUSER, f"--pwfile={pwfile}",
                    "--auth-host=scram-sha-256", "--auth-local=reject", "-E", "UTF8", "--locale=C.UTF-8",
                    "--no-instructions"], "initdb")
    finally:
        pwfile.unlink(missing_ok=True)
    port = port or free_port()
    settings = (f"\n# spikeops (deployments/postgres.py): loopback only, no Unix socket\n"
                f"listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = ''\n"
                f"max_connections = 200\n")
    with open(data / "postgresql.conf", "a", encoding="utf-8") as conf:
        conf.write(settings)
    server = PostgresServer(data=data, port=port, password=password, bin=binaries)
    passfile = home.parent / "pgpass"
    passfile.write_text(f"{server.host}:{port}:*:{SUPERUSER}:{password}\n")
    os.chmod(passfile, 0o600)
    return server


def start(server: PostgresServer, log: Path, marker: dict[str, str] | None = None) -> None:
    """Start the server (``pg_ctl -w``: returns once it accepts connections) and create
    Prefect's database when it is not there yet. ``marker``: variables put in the server's
    environment, by which its processes are found again."""
    uid, gid, _ = server_account()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.touch()
    if os.geteuid() == 0:
        os.chown(log, uid, gid)
    _reachable(log)
    _as_server([str(server.bin / "pg_ctl"), "-D", str(server.data), "-l", str(log), "-w", "-t", "90", "start"],
               f"pg_ctl start (log: {log})", env=marker)
    env = {"PGPASSWORD": server.password, "PGCONNECT_TIMEOUT": "10"}
    listed = subprocess.run([str(server.bin / "psql"), "-h", server.host, "-p", str(server.port),
                             "-U", SUPERUSER, "-d", "postgres", "-tAc",
                             f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'"],
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env}, check=False)
    if listed.returncode == 0 and listed.stdout.strip() == "1":
        return
    made = subprocess.run([str(server.bin / "createdb"), "-h", server.host, "-p", str(server.port), "-U", SUPERUSER,
                           DATABASE], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env},
                          check=False)
    if made.returncode != 0:
        lines = made.stderr.strip().splitlines()
        raise PostgresError(f"createdb {DATABASE}: {lines[-1] if lines else f'exit {made.returncode}'}")


def _psql(server: PostgresServer, sql: str, database: str = "postgres") -> subprocess.CompletedProcess[str]:
    """SQL as the superuser, on stdin (never on a command line, where ``ps`` shows it)."""
    env = {"PATH": "/usr/bin:/bin", "PGPASSWORD": server.password, "PGCONNECT_TIMEOUT": "10"}
    done = subprocess.run([str(server.bin / "psql"), "-h", server.host, "-p", str(server.port), "-U", SUPERUSER,
                           "-d", database, "-v", "ON_ERROR_STOP=1", "-tAq", "-f", "-"], input=sql,
                          capture_output=True, text=True, env=env, check=False, timeout=60)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise PostgresError(f"psql: {lines[-1] if lines else f'exit {done.returncode}'}")
    return done


def create_ledger(server: PostgresServer, passfile: Path) -> str:
    """spikeops' ledger in this cluster: the role ``LEDGER_ROLE`` (a new password, kept in
    ``passfile``, mode 0600, libpq's format, and nowhere else) owning the database
    ``LEDGER_DATABASE``. Returns the ledger's URL, which holds no password: a client finds it
    with ``PGPASSFILE=passfile``. Idempotent (a second call changes the password)."""
    password = secrets.token_urlsafe(24)
    _psql(server, f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{LEDGER_ROLE}') THEN "
                  f"CREATE ROLE {LEDGER_ROLE} LOGIN; END IF; END $$;\n"
                  f"ALTER ROLE {LEDGER_ROLE} PASSWORD '{password}';\n")
    listed = _psql(server, f"SELECT 1 FROM pg_database WHERE datname = '{LEDGER_DATABASE}';")
    if listed.stdout.strip() != "1":
        _psql(server, f"CREATE DATABASE {LEDGER_DATABASE} OWNER {LEDGER_ROLE};")
    passfile.write_text(f"{server.host}:{server.port}:{LEDGER_DATABASE}:{LEDGER_ROLE}:{password}\n")
    os.chmod(passfile, 0o600)
    return f"postgresql://{LEDGER_ROLE}@{server.host}:{server.port}/{LEDGER_DATABASE}"


def running(data: Path) -> bool:
    """Whether the cluster in ``data`` runs (its postmaster.pid names a live process)."""
    pid = read_pid(data / "postmaster.pid")
    return pid is not None and pid_alive(pid)


def stop(data: Path, bin_path: Path | None = None) -> bool:
    """``pg_ctl stop -m fast``; True when a server was running. Idempotent."""
    if not running(data):
        return False
    binaries = bin_path or bin_dir()
    if binaries is None:
        raise PostgresError("cannot stop PostgreSQL: no pg_ctl found")
    _as_server([str(binaries / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60", "stop"], "pg_ctl stop")
    return True


def remove(home: Path) -> None:
    """Delete a stopped cluster's files (the throwaway database of a test or a demo)."""
    if running(home / "data"):
        raise PostgresError(f"{home / 'data'}: PostgreSQL still runs there; stop it first")
    shutil.rmtree(home, ignore_errors=True)
