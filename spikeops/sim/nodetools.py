"""The shell side of a simulated node: sshd's ForceCommand and the fake node tools.

Every SSH session of the simulated cluster runs ``D/bin/node-shell`` (sshd's
``ForceCommand``). It learns which node the client reached from the server address in
``$SSH_CONNECTION`` (each node has its own loopback address), points ``PATH`` at the node's
overrides and at the fake tools, and runs the client's command with ``/bin/sh``: pipes,
``timeout``, ``grep`` and ``cat`` are the real ones. Only the tools a GPU node has and this
machine has not are faked (``nvidia-smi``, ``dmesg``, ``journalctl``, ``ethtool``,
``ibstat``), each a few lines of ``/bin/sh`` that print the node's captured file: a benchmark
opens thousands of sessions on two cores, so a Python start per call would be the bottleneck.

A tool whose file the node lacks behaves like a command that is not installed (``sh: 1:
TOOL: not found``, exit 127), which is what the collector meets on a node without GPUs or
InfiniBand. Faults that change a tool's behaviour (``hang``, ``flood``, ``slow``) are a
per-node script in ``D/nodes/<node>/bin``, found first on ``PATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TOOLS", "OVERRIDES", "write_tools", "write_override", "NOT_FOUND_EXIT"]

NOT_FOUND_EXIT = 127

_NODE_SHELL = """#!/bin/sh
# spikeops sim: sshd ForceCommand. The node is the server address the client connected to
# (3rd field of SSH_CONNECTION); @ROOT@/addr/<address> links to the node's directory.
set -f
set -- $SSH_CONNECTION
if [ -z "$3" ] || ! cd -P "@ROOT@/addr/$3" 2>/dev/null; then
    echo "spikeops-sim: no simulated node at address ${3:-unknown}" >&2
    exit 1
fi
SPIKEOPS_SIM_NODE=$PWD
SPIKEOPS_SIM_NAME=${PWD##*/}
SPIKEOPS_SYSFS=$PWD/sys
PATH=$PWD/bin:@ROOT@/bin:/usr/bin:/bin
export SPIKEOPS_SIM_NODE SPIKEOPS_SIM_NAME SPIKEOPS_SYSFS PATH
cd "${HOME:-/}" 2>/dev/null || cd /
if [ -z "$SSH_ORIGINAL_COMMAND" ]; then
    printf '%s\\n' "$SPIKEOPS_SIM_NAME"
    exit 0
fi
exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"
"""

_MISSING = 'echo "sh: 1: ${0##*/}: not found" >&2; exit 127'

_NVIDIA_SMI = """#!/bin/sh
# spikeops sim: nvidia-smi. -q prints nvidia-smi-q.txt, -q -x nvidia-smi-q.xml; no page: not installed.
d=$SPIKEOPS_SIM_NODE
if [ ! -f "$d/nvidia-smi-q.txt" ] && [ ! -f "$d/nvidia-smi-q.xml" ]; then
    @MISSING@
fi
q=; x=
for a in "$@"; do
    case $a in
        -q|--query) q=1 ;;
        -x|--xml-format) x=1 ;;
        -qx|-xq) q=1; x=1 ;;
    esac
done
if [ -n "$q" ]; then
    if [ -n "$x" ]; then f=$d/nvidia-smi-q.xml; else f=$d/nvidia-smi-q.txt; fi
    if [ -f "$f" ]; then exec cat "$f"; fi
    echo "nvidia-smi: this simulated node has no ${f##*/}" >&2
    exit 2
fi
echo "NVIDIA-SMI (spikeops simulated node $SPIKEOPS_SIM_NAME)"
exit 0
"""

_KERNEL = """#!/bin/sh
# spikeops sim: dmesg / journalctl. Any arguments print the node's kernel.log.
[ -f "$SPIKEOPS_SIM_NODE/kernel.log" ] || { @MISSING@; }
exec cat "$SPIKEOPS_SIM_NODE/kernel.log"
"""

_ETHTOOL = """#!/bin/sh
# spikeops sim: ethtool -S IFACE prints ethtool-IFACE.txt.
d=$SPIKEOPS_SIM_NODE
have=
for f in "$d"/ethtool-*.txt; do [ -f "$f" ] && have=1; break; done
[ -n "$have" ] || { @MISSING@; }
case $1 in
    -S|--statistics)
        case $2 in
            ""|*/*) ;;
            *) [ -f "$d/ethtool-$2.txt" ] && exec cat "$d/ethtool-$2.txt" ;;
        esac
        echo "netlink error: no device matches name (offset 24)" >&2
        exit 1 ;;
    --version)
        echo "ethtool version 6.1"
        exit 0 ;;
esac
echo "ethtool: only -S IFACE is simulated on spikeops nodes" >&2
exit 1
"""

_IBSTAT = """#!/bin/sh
# spikeops sim: ibstat prints the node's ibstat.txt.
[ -f "$SPIKEOPS_SIM_NODE/ibstat.txt" ] || { @MISSING@; }
exec cat "$SPIKEOPS_SIM_NODE/ibstat.txt"
"""

#: Fake tools in D/bin: name -> script.
TOOLS = {
    "nvidia-smi": _NVIDIA_SMI,
    "dmesg": _KERNEL,
    "journalctl": _KERNEL,
    "ethtool": _ETHTOOL,
    "ibstat": _IBSTAT,
}

#: Faults that replace a node's nvidia-smi: kind -> script (D/nodes/<node>/bin/nvidia-smi).
OVERRIDES = {
    "hang": "#!/bin/sh\n# spikeops sim fault: hang\nexec sleep 2147483647\n",
    "flood": "#!/bin/sh\n# spikeops sim fault: flood (1 GiB of output)\nhead -c 1073741824 /dev/zero | tr '\\0' x\n",
    "slow": "#!/bin/sh\n# spikeops sim fault: slow (3 s, then the normal answer)\nsleep 3\n"
            "exec @ROOT@/bin/nvidia-smi \"$@\"\n",
}


def _write_script(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    os.chmod(path, 0o755)


def _fill(template: str, root: Path) -> str:
    return template.replace("@MISSING@", _MISSING).replace("@ROOT@", str(root))


def write_tools(root: Path) -> Path:
    """Write ``root/bin/node-shell`` and the fake tools; return the node-shell path."""
    folder = root / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    for name, template in TOOLS.items():
        _write_script(folder / name, _fill(template, root))
    shell = folder / "node-shell"
    _write_script(shell, _fill(_NODE_SHELL, root))
    return shell


def write_override(root: Path, node_dir: Path, kind: str) -> None:
    """Install the per-node nvidia-smi of fault ``kind`` (one of ``OVERRIDES``)."""
    _write_script(node_dir / "bin" / "nvidia-smi", _fill(OVERRIDES[kind], root))
