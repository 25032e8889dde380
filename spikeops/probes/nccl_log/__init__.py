"""NCCL ``NCCL_DEBUG=INFO`` output, PyTorch distributed (c10d / ProcessGroupNCCL) errors,
and the node's NCCL version file.

A loss spike that every rank shows at once often starts in the communication layer: an IB
completion error that NCCL retried into a hang, a watchdog that killed a collective, a rank
that never joined an AllReduce, or one node running a different NCCL build. This module reads
what those layers print, in the shapes they really print it:

- NCCL's own lines, ``host:pid:tid [cudaDev] NCCL INFO|WARN ...``. WARNs carry the source
  location (``transport/net_ib.cc:1296``) and, since 2.23, a ``[%F %T]`` wall-clock stamp;
  NCCL 2.7-2.11 print the version as a bare ``NCCL version 2.10.3+cuda11.3`` line with no
  host prefix, on the rank that made the unique id.
- PyTorch lines, raw (``RuntimeError: NCCL error in: ...``, the ``TORCH_NCCL_DESYNC_DEBUG``
  report) or behind c10/glog prefixes (``[E ProcessGroupNCCL.cpp:475]``,
  ``E1129 18:01:02.123456  1234 ProcessGroupNCCL.cpp:616]``). glog stamps have no year, so
  their time is only placed on the clock when the caller supplies one.
- Launcher prefixes that wrap all of the above: ``srun -l`` task ids (``12: ``), torchrun's
  ``[default3]:`` / ``[rank3]:`` tags and the ISO or bracketed stamps some wrappers add.

Everything else in a log (training output, bash traces) is ignored without a gap: the bundle's
``nccl.log`` is a grep of a bigger log, and a training log handed to this parser must still
yield its NCCL lines.

One module per concern: ``model`` (what is read), ``lines`` (prefixes stripped), ``events``
(which message is which event), ``reader`` (the streaming pass), ``version`` (NCCL versions).
This module registers the two kinds and re-exports the API.
"""

from __future__ import annotations

from spikeops.probes.base import Kind, RemoteProbe, register, register_remote
from spikeops.probes.nccl_log.model import EVENT_KINDS, NcclEvent, NcclProcess, NcclLog, NcclVersion
from spikeops.probes.nccl_log.version import normalise_version, parse_version, detect_version, summarize_version
from spikeops.probes.nccl_log.lines import strip_launcher
from spikeops.probes.nccl_log.reader import parse, detect, summarize

__all__ = [
    "REMOTE", "REMOTE_VERSION",
    "strip_launcher",
    "EVENT_KINDS",
    "NcclEvent",
    "NcclProcess",
    "NcclLog",
    "NcclVersion",
    "parse",
    "parse_version",
    "normalise_version",
    "detect",
    "detect_version",
    "summarize",
    "summarize_version",
    "KIND",
    "VERSION_KIND",
]

KIND = register(
    Kind(
        name="nccl-log",
        description="NCCL_DEBUG=INFO lines and PyTorch distributed (c10d/ProcessGroupNCCL) errors: "
        "processes, ranks, NCCL versions, network, WARNs, IB errors, watchdog timeouts, desyncs",
        command="the job's NCCL_DEBUG=INFO and PyTorch distributed lines",
        parse=parse,
        detect=detect,
        summarize=summarize,
        streaming=True,
    )
)

VERSION_KIND = register(
    Kind(
        name="nccl-version",
        description="the node's NCCL version (torch.cuda.nccl.version(), libnccl.so.X.Y.Z, ...)",
        command="python3 -c 'import torch; print(torch.cuda.nccl.version())'",
        parse=parse_version,
        detect=detect_version,
        summarize=summarize_version,
        streaming=False,
    )
)

#: The NCCL and torch.distributed lines of the job's logs on this node (the inventory's
#: ``[job] nccl_log``); the newest lines are kept when they exceed the cap, since the
#: failure is at the end.
REMOTE = register_remote(RemoteProbe(
    name="nccl", filename="nccl.log",
    command="grep -h -a -E 'NCCL|ProcessGroupNCCL|c10d|torch\\.distributed|Watchdog' {files}",
    kind="nccl-log", order=60, max_bytes=64 << 20, keep="tail", needs="nccl_log",
))
#: The NCCL version of the job's environment; the inventory's ``[job] nccl_version`` replaces it.
REMOTE_VERSION = register_remote(RemoteProbe(
    name="nccl-version", filename="nccl-version.txt",
    command=("python3 -c 'import torch; print(torch.cuda.nccl.version())' 2>/dev/null || "
             "ls -1 /usr/lib/*/libnccl.so.2.* /usr/local/lib/libnccl.so.2.* /usr/lib64/libnccl.so.2.*"
             " 2>/dev/null | head -n 1 | grep ."),
    kind="nccl-version", order=70, max_bytes=64 << 10,
))
