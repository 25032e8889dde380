"""What the local simulated clusters share: their directory, cluster.json and command line.

The SSH cluster (``spikeops.sim.cluster``) and the Slurm cluster
(``spikeops.sim.slurmcluster``) each live in a directory D that holds everything they
write, described by ``D/cluster.json``. They follow the same rules, kept in one place so
the two cannot drift apart:

- ``prepare``: ``up`` on a D whose cluster runs fails; on a stopped cluster's D it removes
  that cluster's own entries (nothing else); on any other non-empty directory it fails;
- ``save`` replaces cluster.json atomically; ``up`` writes a stub before any process
  starts, so a half-started cluster is still one that ``down`` and the next ``up`` know;
- ``load`` reads it strictly (format tag, a finished ``up``) into the cluster's dataclass;
- ``command_line``: ``up|down|status --dir D``; one line and exit 2 on failure, 1 for
  ``status`` of a cluster that is not fully up; a closed stdout after a successful action is
  not a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from spikeops.jsonable import to_jsonable
from spikeops.sim.processes import ClusterError, pid_alive

__all__ = ["SAFE_PATH", "prepare", "save", "load", "session", "recorded_processes", "command_line"]

#: Paths that need no quoting in any config or script a cluster writes them into.
SAFE_PATH = re.compile(r"^[A-Za-z0-9._/@+,=:-]+$")

_Record = TypeVar("_Record")


def prepare(root: Path, entries: Sequence[str], running: Callable[[Path], bool], *, what: str, written_into: str,
            down_command: str) -> None:
    """Make ``root`` ready for ``up`` (see the module docstring); ClusterError says why not.

    ``entries`` are the names ``up`` writes in D; ``running(root)`` tells whether a process
    of the cluster there is alive; ``written_into`` and ``down_command`` finish the messages.
    """
    if not SAFE_PATH.match(str(root)):
        raise ClusterError(f"{root}: cluster directory paths may only hold letters, digits and ._/@+,=:- "
                           f"(they are written unquoted into {written_into})")
    if not root.exists():
        return
    if not root.is_dir():
        raise ClusterError(f"{root} exists and is not a directory")
    if (root / "cluster.json").is_file():
        if running(root):
            raise ClusterError(f"{what} is already running in {root}; stop it first ({down_command} --dir {root})")
        for name in entries:
            target = root / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    elif any(root.iterdir()):
        raise ClusterError(f"{root} is not empty and holds no cluster; give an empty or new directory")


def save(root: Path, fmt: str, record: Any, extra: Mapping[str, Any] = ()) -> None:
    """Write ``D/cluster.json`` (format tag, the dataclass ``record`` or a mapping, ``extra``)
    atomically: a reader sees the old document or the new one, never half of one."""
    document = {"format": fmt, **to_jsonable(record), **dict(extra)}
    path = root / "cluster.json"
    tmp = path.with_name(".cluster.json.tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load(directory: str | Path, fmt: str, cls: type[_Record], paths: Collection[str], *, what: str) -> _Record:
    """The ``cls`` dataclass that ``up`` wrote to ``D/cluster.json``; the fields named in
    ``paths`` become Paths. ClusterError for a missing, unreadable, foreign or stub file."""
    path = Path(directory).resolve() / "cluster.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ClusterError(f"no {what} in {path.parent} (no cluster.json)") from None
    except (OSError, ValueError) as exc:
        raise ClusterError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != fmt:
        raise ClusterError(f"{path}: not a {fmt} file")
    kwargs = {f.name: (Path(document[f.name]) if f.name in paths else document[f.name])
              for f in dataclasses.fields(cls) if f.name in document}  # type: ignore[arg-type]
    try:
        return cls(**kwargs)
    except TypeError:
        raise ClusterError(f"{path}: an up that did not finish (run up again, or down)") from None


@contextmanager
def session(up: Callable[..., _Record], down: Callable[[Path], None], directory: str | Path,
            kwargs: Mapping[str, Any]) -> Iterator[_Record]:
    """``up(directory, **kwargs)`` ... ``down(directory)``, with ``down`` even when the body
    raises (each cluster's ``running``)."""
    try:
        yield up(directory, **kwargs)
    finally:
        down(Path(directory))


def recorded_processes(root: Path) -> dict[str, dict[str, Any]]:
    """{name: {"pid", "alive"}} for every process ``up`` recorded in ``D/cluster.json``."""
    document = json.loads((root / "cluster.json").read_text(encoding="utf-8"))
    return {name: {"pid": pid, "alive": pid_alive(pid)} for name, pid in document.get("pids", {}).items()}


def command_line(name: str, args: argparse.Namespace, *, start: Callable[[], Any],
                 down: Callable[[Path], None], status: Callable[[Path], Mapping[str, Any]],
                 show_up: Callable[[Any, float], None], show_status: Callable[[Mapping[str, Any]], None]) -> int:
    """Run ``args.command`` (``up``: ``start()``; ``down``/``status`` of ``args.dir``), print
    its result, and return the exit status of ``python -m NAME ...``.

    2 with ``NAME: reason`` on stderr when the action fails; 1 for ``status`` of a cluster
    that is not fully up (``running`` false); else 0. Only the action decides: a closed
    stdout (``| head``) after a successful ``up`` must not report a failure while the
    cluster runs.
    """
    started = time.monotonic()
    try:
        if args.command == "up":
            result: Any = start()
        elif args.command == "down":
            result = down(args.dir)
        else:
            result = status(args.dir)
    except (ClusterError, ValueError, OSError) as exc:
        sys.stderr.write(f"{name}: {exc}\n")
        return 2
    try:
        if args.command == "up":
            show_up(result, time.monotonic() - started)
        elif args.command == "down":
            print(f"down: nothing of {Path(args.dir).resolve()} is running")
        elif args.json:
            print(json.dumps(result, indent=2))
        else:
            show_status(result)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 1 if args.command == "status" and not result["running"] else 0
