"""What each node of the simulated SSH cluster answers from: its files on disk.

A node of ``spikeops.sim.cluster`` is a directory ``D/nodes/<node>/`` that the fake tools in
``D/bin`` read (``nvidia-smi -q`` prints ``nvidia-smi-q.txt``), a small ``sys/`` tree that
real ``grep``, ``cat`` and ``ls`` read through ``$SPIKEOPS_SYSFS``, and the job's log files
under ``D/jobs/<job>/<node>/``. Where those bytes come from is a ``NodeSource``: either a
node of a ``spikeops.sim`` bundle (``bundle_sources``) or real tool output from
``shared/fixtures/real`` (``real_sources``), so the collector is tested against the very
bytes the diagnosis tests know the answer for, and against text real machines printed.

Faults that remove evidence (``nogpu``, ``noib``) are applied while writing, so the layout
rules live in one place.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "NodeSource",
    "bundle_sources",
    "real_sources",
    "write_node",
    "sysfs_counters",
    "GPU_FILES",
    "ARPHRD_ETHER",
    "ARPHRD_INFINIBAND",
    "ARPHRD_LOOPBACK",
]

#: Node files that only a node with GPUs has (the ``nogpu`` fault drops them).
GPU_FILES = ("nvidia-smi-q.txt", "nvidia-smi-q.xml")
#: ``/sys/class/net/<iface>/type`` values (linux/if_arp.h).
ARPHRD_ETHER = 1
ARPHRD_INFINIBAND = 32
ARPHRD_LOOPBACK = 772

_PROBE_FILES = ("nvidia-smi-q.txt", "nvidia-smi-q.xml", "kernel.log", "ibstat.txt")
_SYSFS_LINE = re.compile(r"^/sys/(?P<path>[^:]+):(?P<value>.*)$")
_SMI_Q = re.compile(r"^Attached GPUs\s*:", re.MULTILINE)
# dmesg --time-format iso (optionally with -x's "kern  :warn  : " prefix) and
# journalctl -k -o short-iso-precise both start a line with an ISO 8601 time.
_ISO_KERNEL = re.compile(r"^(?:\w+\s*:\s*\w+\s*: )?\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
_NCCL_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")


@dataclass
class NodeSource:
    """Where one node's answers come from.

    ``files``: node file name -> source file (copied byte for byte into the node dir);
    ``ethtool``: interface -> source of its ``ethtool -S`` output;
    ``ib_counters``: sysfs path below ``/sys`` -> value lines (rebuilt as one file each);
    ``ib_tree``: a captured ``/sys/class/infiniband`` tree copied as it is;
    ``job``: job file name (``nccl.out``, ``train.out``, ``nccl-version.txt``) -> source or text.
    A node with nothing at all (a bundle node that was unreachable) is ``reachable=False``.
    """

    files: dict[str, Path] = field(default_factory=dict)
    ethtool: dict[str, Path] = field(default_factory=dict)
    ib_counters: dict[str, list[str]] = field(default_factory=dict)
    ib_tree: Path | None = None
    job: dict[str, Path | str] = field(default_factory=dict)
    reachable: bool = True


def sysfs_counters(text: str) -> dict[str, list[str]]:
    """``grep -H . /sys/...`` output -> {path below /sys: value lines}, in first-seen order.

    ``grep -H .`` prints one line per non-empty line of each file, so a path may repeat;
    its lines are kept in order and become the file's lines again.
    """
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = _SYSFS_LINE.match(line)
        if match:
            out.setdefault(match["path"], []).append(match["value"])
    return out


def bundle_sources(bundle: Path, nodes: Sequence[str]) -> dict[str, NodeSource]:
    """The sources of each node of a ``spikeops.sim`` bundle (``bundle/nodes/<node>/``)."""
    out = {}
    for node in nodes:
        folder = bundle / "nodes" / node
        source = NodeSource()
        for name in _PROBE_FILES:
            if (folder / name).is_file():
                source.files[name] = folder / name
        for path in sorted(folder.glob("ethtool-*.txt")):
            source.ethtool[path.name[len("ethtool-"):-len(".txt")]] = path
        counters = folder / "ib-counters.txt"
        if counters.is_file():
            source.ib_counters = sysfs_counters(counters.read_text(encoding="utf-8", errors="replace"))
        for job_name, name in (("nccl.out", "nccl.log"), ("train.out", "train.log"),
                               ("nccl-version.txt", "nccl-version.txt")):
            if (folder / name).is_file():
                source.job[job_name] = folder / name
        for dump in sorted((folder / "flight-recorder").glob("*")) if (folder / "flight-recorder").is_dir() else []:
            source.job[f"flight-recorder/{dump.name}"] = dump  # the job's dumps, where it wrote them
        source.reachable = bool(source.files or source.ethtool or source.ib_counters or source.job)
        out[node] = source
    return out


def _pick(items: Sequence[Path], index: int) -> Path | None:
    return items[index % len(items)] if items else None


def _matching(folder: Path, pattern: str, test: re.Pattern[str] | None = None) -> list[Path]:
    paths = sorted(p for p in folder.glob(pattern) if p.is_file())
    if test is None:
        return paths
    return [p for p in paths if test.search(p.read_text(encoding="utf-8", errors="replace"))]


def real_sources(fixtures: Path, nodes: Sequence[str], seed: int = 0) -> dict[str, NodeSource]:
    """Node sources drawn round-robin from real tool output (``shared/fixtures/real``).

    Each node gets one ``nvidia-smi -q`` page, one kernel log in an ISO form (``dmesg
    --time-format iso`` or ``journalctl -o short-iso-precise``), every ``ethtool -S`` capture
    as ``eth0``, ``eth1``... (rotated so nodes differ), one ``ibstat``, the captured sysfs
    InfiniBand tree, an NCCL log and a training log; ``seed`` shifts where the rotation starts.
    Raises ``FileNotFoundError`` naming any kind of fixture that is missing.
    """
    smi = _matching(fixtures / "nvidia-smi", "*.txt", _SMI_Q)
    kernel = [p for p in _matching(fixtures / "xid", "*.txt")
              if _ISO_KERNEL.match(p.read_text(encoding="utf-8", errors="replace").lstrip("\n"))]
    ethtool = _matching(fixtures / "ethtool", "*.txt")
    ibstat = _matching(fixtures / "infiniband", "ibstat-*.txt")
    trees = sorted(p for p in (fixtures / "infiniband").glob("sysfs-*") if p.is_dir())
    nccl = _matching(fixtures / "nccl", "*.txt")
    train = _matching(fixtures / "training-logs", "*.txt")
    wanted = {"nvidia-smi -q text": smi, "ISO kernel log": kernel, "ethtool -S": ethtool, "ibstat": ibstat,
              "sysfs infiniband tree": trees}
    missing = [kind for kind, found in wanted.items() if not found]
    if missing:
        raise FileNotFoundError(f"{fixtures}: no real fixture for {', '.join(missing)}")
    out = {}
    for index, node in enumerate(nodes):
        i = index + seed
        source = NodeSource(ib_tree=_pick(trees, i))
        source.files["nvidia-smi-q.txt"] = smi[i % len(smi)]
        source.files["kernel.log"] = kernel[i % len(kernel)]
        source.files["ibstat.txt"] = ibstat[i % len(ibstat)]
        for k in range(len(ethtool)):
            source.ethtool[f"eth{k}"] = ethtool[(i + k) % len(ethtool)]
        log = _pick(nccl, i)
        if log is not None:
            source.job["nccl.out"] = log
            version = _NCCL_VERSION.search(log.read_text(encoding="utf-8", errors="replace"))
            if version:
                source.job["nccl-version.txt"] = version.group(1) + "\n"
        train_log = _pick(train, i)
        if train_log is not None:
            source.job["train.out"] = train_log
        out[node] = source
    return out


def _put(target: Path, what: Path | str) -> None:
    if isinstance(what, Path):
        shutil.copyfile(what, target)
    else:
        target.write_text(what, encoding="utf-8")


def _write_lines(root: Path, entries: Iterable[tuple[str, str]]) -> None:
    """Many tiny files (a node's sysfs): raw os calls, about a third cheaper than ``open``
    at the ~200,000 files of a 1024-node cluster."""
    made: set[str] = set()
    base = str(root)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for relative, text in entries:
        target = f"{base}/{relative}"
        parent = target.rpartition("/")[0]
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        fd = os.open(target, flags, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def _copy_tree(source: Path, target: Path) -> None:
    """Copy file contents only: a read-only fixture tree must not make the copy read-only."""
    for folder, _, names in os.walk(source):
        into = target / Path(folder).relative_to(source)
        into.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(Path(folder, name), into / name)


def _net_type(iface: str) -> int:
    if iface == "lo":
        return ARPHRD_LOOPBACK
    return ARPHRD_INFINIBAND if iface.startswith("ib") else ARPHRD_ETHER


def write_node(node_dir: Path, job_dir: Path | None, source: NodeSource, *, gpu: bool = True,
               ib: bool = True) -> None:
    """Lay out one node: probe files, ``sys/class/net``, ``sys/class/infiniband``, job files.

    ``gpu=False`` leaves out the nvidia-smi pages (``nogpu``); ``ib=False`` leaves out
    ``ibstat.txt`` and the InfiniBand sysfs tree (``noib``). ``job_dir`` None writes no job files.
    """
    (node_dir / "bin").mkdir(parents=True, exist_ok=True)
    for name, path in source.files.items():
        if (name in GPU_FILES and not gpu) or (name == "ibstat.txt" and not ib):
            continue
        _put(node_dir / name, path)
    for iface, path in source.ethtool.items():
        _put(node_dir / f"ethtool-{iface}.txt", path)
    net = [(f"sys/class/net/{iface}/{name}", value)
           for iface in (*source.ethtool, "lo")
           for name, value in (("operstate", "up\n"), ("type", f"{_net_type(iface)}\n"))]
    _write_lines(node_dir, net)
    if ib:
        _write_lines(node_dir, ((f"sys/{path}", "\n".join(lines) + "\n") for path, lines in source.ib_counters.items()))
        if source.ib_tree is not None:
            _copy_tree(source.ib_tree, node_dir / "sys" / "class" / "infiniband")
    if job_dir is not None and source.job:
        job_dir.mkdir(parents=True, exist_ok=True)
        for name, what in source.job.items():
            (job_dir / name).parent.mkdir(parents=True, exist_ok=True)
            _put(job_dir / name, what)
