"""A TCP tarpit: accepts connections on one address and never sends a byte.

The ``silent`` fault of the simulated cluster (``spikeops.sim.cluster``): a node whose port
answers the TCP handshake but whose sshd never speaks, the way a wedged node or a
half-dead firewall looks from the collector. The collector must time out on it, not hang.

It is run by file path with the standard library only (``python -I -S tarpit.py HOST PORT
PIDFILE``) so it starts in a few tens of milliseconds and imports nothing of spikeops. It
binds and listens first, then detaches (fork, new session) and the parent exits 0 after
writing the child's pid to PIDFILE: when the launching command returns, the port already
accepts connections and the pid file names the process to stop, the same contract as
``sshd``. It holds every connection it accepts (the file-descriptor limit is raised to its
hard maximum), reads and discards whatever clients send, and closes a connection only when
the client does. SIGTERM stops it.
"""

from __future__ import annotations

import os
import resource
import selectors
import socket
import sys
import time
from collections.abc import Sequence

__all__ = ["serve", "main"]


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def serve(listener: socket.socket) -> None:
    """Accept forever; keep each connection open and silent until its client closes it."""
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            sock = key.fileobj
            if sock is listener:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    continue
                except OSError:  # out of descriptors: let clients wait in the backlog a moment
                    time.sleep(0.05)
                    continue
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ)
                continue
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                selector.unregister(sock)
                sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``tarpit.py HOST PORT PIDFILE``: listen, detach, write the pid, serve."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        sys.stderr.write("usage: tarpit.py HOST PORT PIDFILE\n")
        return 2
    host, port, pidfile = args[0], int(args[1]), args[2]
    _raise_fd_limit()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(4096)
    except OSError as exc:
        sys.stderr.write(f"tarpit: cannot listen on {host}:{port}: {exc.strerror or exc}\n")
        return 1
    child = os.fork()
    if child:
        tmp = f"{pidfile}.tmp"
        with open(tmp, "w", encoding="ascii") as handle:
            handle.write(f"{child}\n")
        os.replace(tmp, pidfile)
        return 0
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        serve(listener)
    finally:
        os._exit(0)
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
