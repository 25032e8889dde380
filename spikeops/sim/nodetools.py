"""The shell side of a simulated node: sshd's ForceCommand and the fake node tools.

Every SSH session of the simulated cluster runs ``D/bin/node-shell`` (sshd's
``ForceCommand``). It learns which node the client reached from the server address in
``$SSH_CONNECTION`` (each node has its own loopback address), points ``PATH`` at the node's
overrides and at the fake tools, and runs the client's command with ``/bin/sh``: pipes,
``timeout``, ``grep`` and ``cat`` are the real ones. Only the tools a GPU node has and this
machine has not are faked (``nvidia-smi``, ``dmesg``, ``journalctl``, ``ethtool``,
``ibstat``, a site's ``healthy-run``; and, only on the nodes where a test installs them, for
node validation, ``dcgmi``, nccl-tests' ``all_reduce_perf`` and ``mpirun``), each a few lines of ``/bin/sh`` that print the node's captured file: a benchmark
opens thousands of sessions on two cores, so a Python start per call would be the bottleneck.

A tool whose file the node lacks behaves like a command that is not installed (``sh: 1:
TOOL: not found``, exit 127), which is what the collector meets on a node without GPUs or
InfiniBand. Faults that change a tool's behaviour (``hang``, ``flood``, ``slow``, ...) are a
per-node script in ``D/nodes/<node>/bin``, found first on ``PATH``.

A session here is cheaper than on a real node: this sshd runs without PAM and the login
shell reads no profile. ``LoginCost`` puts the real cost back, as waiting (see
``login_cost_block``): ``connection_ms`` once per SSH connection (the PAM session stack:
pam_systemd, pam_slurm_adopt, pam_namespace run once per connection, after authentication)
and ``session_ms`` once per session (sshd forks and the login shell starts and reads
``~/.bashrc``, which on RHEL-like nodes sources ``/etc/profile.d``: Lmod and the like).

The fake tools answer at once, where the real ones wait on a driver or on firmware:
``nvidia-smi -q`` on an 8-GPU node takes about a second, ``ethtool -S`` and ``ibstat`` tens of
milliseconds. ``ToolTimes`` puts that back, as waiting (a ``sleep`` before the answer);
``NO_TOOL_TIMES`` (the default) leaves the tools instant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TOOLS", "INSTALLABLE", "OVERRIDES", "real_pyspy", "BINARY_OUTPUT", "LoginCost", "CHEAP_LOGIN", "REAL_LOGIN", "REAL_LOGIN_CPU",
           "ToolTimes", "NO_TOOL_TIMES", "REAL_TOOL_TIMES", "write_tools", "write_override", "login_cost_block",
           "NOT_FOUND_EXIT"]

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
@LOGIN@
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
    @DELAY_NVIDIA_SMI@
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
@DELAY_KERNEL@
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
        @DELAY_ETHTOOL@
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
@DELAY_IBSTAT@
exec cat "$SPIKEOPS_SIM_NODE/ibstat.txt"
"""

_DCGMI = """#!/bin/sh
# spikeops sim: dcgmi. 'dcgmi diag ...' prints the node's dcgmi-diag.txt, a real dcgmi capture
# (spikeops.sim.nodelife.set_tool); without it DCGM is not installed on the node.
d=$SPIKEOPS_SIM_NODE
[ -f "$d/dcgmi-diag.txt" ] || { @MISSING@; }
case " $* " in
    *" diag "*) cat "$d/dcgmi-diag.txt"; exit "$(cat "$d/dcgmi.exit" 2>/dev/null || echo 0)" ;;
esac
echo "dcgmi: only 'dcgmi diag' is simulated on spikeops nodes" >&2
exit 1
"""

_ALL_REDUCE = """#!/bin/sh
# spikeops sim: nccl-tests' all_reduce_perf in its printed form (nccl-tests' PRINT formats,
# src/util.cu): the header, one line per rank on each host mpirun named ($SPIKEOPS_SIM_HOSTS),
# then the table and footer spikeops.sim.nodelife rendered (pass, wrong, slow, error). Without
# all_reduce_perf.rows nccl-tests is not installed on the node.
d=$SPIKEOPS_SIM_NODE
[ -f "$d/all_reduce_perf.rows" ] || { @MISSING@; }
g=8
while [ $# -gt 0 ]; do
    case $1 in -g) g=$2; shift ;; esac
    shift
done
printf '# nccl-tests version 2.13.9 nccl-headers=21903 nccl-library=21903\\n'
printf '# Collective test starting: all_reduce_perf\\n'
printf '# nThread %d nGpus %d minBytes %d maxBytes %d step: %d(%s) warmup iters: %d iters: %d agg iters: %d validation: %d graph: %d\\n' 1 "$g" 8388608 1073741824 2 factor 5 20 1 1 0
printf '#\\n# Using devices\\n'
rank=0
old=$IFS; IFS=,
for h in ${SPIKEOPS_SIM_HOSTS:-$SPIKEOPS_SIM_NAME}; do
    i=0
    while [ "$i" -lt "$g" ]; do
        printf '#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s\\n' "$rank" 0 $((4100 + rank)) "$h" "$i" 0 $((25 + 16 * i)) 0 "NVIDIA H100 80GB HBM3"
        rank=$((rank + 1)); i=$((i + 1))
    done
done
IFS=$old
cat "$d/all_reduce_perf.rows"
exit "$(cat "$d/all_reduce_perf.exit" 2>/dev/null || echo 0)"
"""

_MPIRUN = """#!/bin/sh
# spikeops sim: mpirun, as far as spikeops' AllReduce uses it: --host/-H LIST names the hosts
# (passed to the program as $SPIKEOPS_SIM_HOSTS), -np/-x/--map-by/--bind-to take a value,
# --mca two, other options none; then the program runs.
hosts=
while [ $# -gt 0 ]; do
    case $1 in
        --host|-H) hosts=$2; shift 2 ;;
        -np|-n|-x|--map-by|--bind-to|-N|--npernode) shift 2 ;;
        --mca) shift 3 ;;
        -*) shift ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "mpirun: no program given" >&2; exit 1; }
SPIKEOPS_SIM_HOSTS=${hosts:-$SPIKEOPS_SIM_NAME}
export SPIKEOPS_SIM_HOSTS
exec "$@"
"""

_HEALTHY_RUN = """#!/bin/sh
# spikeops sim: a site's healthy-run control (the seed's periodic short run of pure compute):
# a few steps and exit 0, or, with the node's healthy-run.mode "fail", the CUDA error a broken
# GPU gives a real one, and exit 1 (spikeops.sim.nodelife.set_tool).
mode=$(cat "$SPIKEOPS_SIM_NODE/healthy-run.mode" 2>/dev/null || echo pass)
if [ "$mode" = fail ]; then
    echo "healthy-run: step 1 loss 2.3117"
    echo "RuntimeError: CUDA error: an illegal memory access was encountered" >&2
    exit 1
fi
for step in 1 2 3; do echo "healthy-run: step $step loss 2.31$step"; done
exit 0
"""

#: Fake tools in D/bin: name -> script.
TOOLS = {
    "nvidia-smi": _NVIDIA_SMI,
    "dmesg": _KERNEL,
    "journalctl": _KERNEL,
    "ethtool": _ETHTOOL,
    "ibstat": _IBSTAT,
    "healthy-run": _HEALTHY_RUN,
}
#: Tools a node has only once installed on it (``spikeops.sim.nodelife.set_tool`` puts them in
#: ``D/nodes/<node>/bin``, so ``command -v`` finds them exactly where they are installed).
INSTALLABLE = {
    "dcgmi": _DCGMI,
    "all_reduce_perf": _ALL_REDUCE,
    "mpirun": _MPIRUN,
}

_DIES = """#!/bin/sh
# spikeops sim fault: dies (2 s in, the SSH connection's own sshd process is killed, as when
# sshd is OOM-killed or the node panics mid-collection)
sleep 2
p=$PPID
while [ "$p" -gt 1 ] && read -r s <"/proc/$p/stat"; do
    case $s in *"(sshd"*) kill -9 "$p"; exit 1 ;; esac
    set -f
    set -- ${s##*) }
    p=$2
done
exit 1
"""

#: Faults that replace a node's nvidia-smi: kind -> script (D/nodes/<node>/bin/nvidia-smi).
OVERRIDES = {
    "hang": "#!/bin/sh\n# spikeops sim fault: hang\nexec sleep 2147483647\n",
    "flood": "#!/bin/sh\n# spikeops sim fault: flood (1 GiB of output)\nhead -c 1073741824 /dev/zero | tr '\\0' x\n",
    "slow": "#!/bin/sh\n# spikeops sim fault: slow (3 s, then the normal answer)\nsleep 3\n"
            "exec @ROOT@/bin/nvidia-smi \"$@\"\n",
    "binary": "#!/bin/sh\n# spikeops sim fault: binary (NUL bytes, every byte value, a 300 kB line, no final newline)\n"
              "exec cat \"$SPIKEOPS_SIM_NODE/binary.out\"\n",
    "linger": "#!/bin/sh\n# spikeops sim fault: linger (answers, exits 0, and leaves a detached child holding stdout)\n"
              "echo 'partial answer'\nsetsid sleep 120 &\nexit 0\n",
    "dies": _DIES,
}


@dataclass(frozen=True)
class LoginCost:
    """What a login costs a node beyond this sim's bare sshd, in milliseconds: waiting, or
    for the session part with ``session_cpu``, CPU burnt by the session's shell (a login
    shell reading its profile is CPU work on the node)."""

    connection_ms: int = 0
    session_ms: int = 0
    session_cpu: bool = False

    @property
    def free(self) -> bool:
        return self.connection_ms <= 0 and self.session_ms <= 0


#: The sim as it is: sshd without PAM, a login shell without profile.
CHEAP_LOGIN = LoginCost()
#: A compute node's login (bench/README.md, "What a login costs"): 50 ms of PAM session
#: stack per connection, 40 ms of login shell and profile per session.
REAL_LOGIN = LoginCost(connection_ms=50, session_ms=40)
#: The same, the 40 ms of each session spent as CPU (all simulated nodes share this machine's
#: cores, so this charges each session's cost to every other node too: an upper bound).
REAL_LOGIN_CPU = LoginCost(connection_ms=50, session_ms=40, session_cpu=True)

@dataclass(frozen=True)
class ToolTimes:
    """How long a node's tools take to answer, in milliseconds of waiting (a real tool waits
    on the driver, the firmware or the kernel, and spends little CPU): ``nvidia-smi -q``,
    ``ethtool -S`` (each interface), ``ibstat``, and the kernel log (``dmesg``/``journalctl``)."""

    nvidia_smi_ms: int = 0
    ethtool_ms: int = 0
    ibstat_ms: int = 0
    kernel_ms: int = 0

    @property
    def free(self) -> bool:
        return max(self.nvidia_smi_ms, self.ethtool_ms, self.ibstat_ms, self.kernel_ms) <= 0


#: The sim as it is: every tool answers at once.
NO_TOOL_TIMES = ToolTimes()
#: An 8-GPU node's tools (the README, "What the tools take"): nvidia-smi -q about a second,
#: ethtool -S and ibstat tens of milliseconds. The kernel log is CPU work (reading and
#: formatting the ring buffer), which the sim's ``cat`` already does: no waiting added.
REAL_TOOL_TIMES = ToolTimes(nvidia_smi_ms=1000, ethtool_ms=30, ibstat_ms=20)


def _delay(ms: int) -> str:
    return f"sleep {ms / 1000:.3f}" if ms > 0 else ":"


_LOGIN_BLOCK = """# What a real node's login costs beyond this bare sshd (spikeops.sim.nodetools.LoginCost),
# as waiting: on a cluster that work runs on each node's own cores, here two cores serve all.
# Once per connection (the first session of the connection's sshd process pays it, marked by
# that process's pid and start time), then once per session.
c=$PPID
while [ -r "/proc/$c/stat" ]; do
    read -r s <"/proc/$c/stat"
    case $s in *"(sshd"*) break ;; esac
    set -- ${s##*) }
    c=$2
    [ "$c" -gt 1 ] || break
done
set -- ${s##*) }
if mkdir "@ROOT@/run/conn/$c-${20}" 2>/dev/null; then sleep @CONNECTION@; fi
@SESSION@
"""
_SPIN = 'i=0\nwhile [ "$i" -lt @N@ ]; do i=$((i + 1)); done'
_SPIN_PROBE = 200_000


def _spin_rate() -> float:
    """Iterations of the node shell's counting loop per CPU millisecond on this machine."""
    import resource
    import subprocess

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["/bin/sh", "-c", _SPIN.replace("@N@", str(_SPIN_PROBE))], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return _SPIN_PROBE / max(cpu * 1000, 1e-3)


def login_cost_block(cost: LoginCost) -> str:
    """The node-shell lines that make a session cost what a real login costs ("" when free)."""
    if cost.free:
        return ""
    if cost.session_cpu:
        session = _SPIN.replace("@N@", str(int(_spin_rate() * max(0, cost.session_ms))))
    else:
        session = f"sleep {max(0, cost.session_ms) / 1000:.3f}"
    return (_LOGIN_BLOCK.replace("@CONNECTION@", f"{max(0, cost.connection_ms) / 1000:.3f}")
            .replace("@SESSION@", session))


def _write_script(path: Path, text: str) -> None:
    """Write (or replace) an executable script whole: a session starting meanwhile runs the
    old one or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)


def _fill(template: str, root: Path, tools: ToolTimes = NO_TOOL_TIMES) -> str:
    return (template.replace("@MISSING@", _MISSING).replace("@ROOT@", str(root))
            .replace("@DELAY_NVIDIA_SMI@", _delay(tools.nvidia_smi_ms))
            .replace("@DELAY_ETHTOOL@", _delay(tools.ethtool_ms))
            .replace("@DELAY_IBSTAT@", _delay(tools.ibstat_ms))
            .replace("@DELAY_KERNEL@", _delay(tools.kernel_ms)))


def real_pyspy() -> str | None:
    """This machine's py-spy (on PATH, or beside the running Python: the venv's), if any."""
    import shutil
    import sys

    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def write_tools(root: Path, login: LoginCost = CHEAP_LOGIN, tools: ToolTimes = NO_TOOL_TIMES) -> Path:
    """Write ``root/bin/node-shell`` and the fake tools (taking ``tools``' times); return the
    node-shell path. With a login cost, ``root/run/conn`` (world-writable, sticky) holds the
    per-connection marks."""
    folder = root / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    for name, template in TOOLS.items():
        _write_script(folder / name, _fill(template, root, tools))
    shell = folder / "node-shell"
    _write_script(shell, _fill(_NODE_SHELL.replace("@LOGIN@", login_cost_block(login).rstrip("\n")), root))
    pyspy = real_pyspy()
    if pyspy is not None and not (folder / "py-spy").exists():
        # The nodes' py-spy is this machine's own (it reads the job's real processes)
        os.symlink(pyspy, folder / "py-spy")
    if not login.free:
        marks = root / "run" / "conn"
        marks.mkdir(parents=True, exist_ok=True)
        os.chmod(marks, 0o1777)
    return shell


#: What the ``binary`` fault's nvidia-smi prints.
BINARY_OUTPUT = bytes(range(256)) * 64 + b"\0\0" + b"x" * 300_000 + b"\n\0tail without a newline \xff\xfe"


def install_tool(root: Path, node_dir: Path, tool: str, installed: bool) -> None:
    """Put one of ``INSTALLABLE`` on the node's PATH (``node_dir/bin``), or take it off."""
    target = node_dir / "bin" / tool
    if installed:
        target.parent.mkdir(exist_ok=True)
        _write_script(target, _fill(INSTALLABLE[tool], root))
    else:
        target.unlink(missing_ok=True)


def write_override(root: Path, node_dir: Path, kind: str) -> None:
    """Install the per-node nvidia-smi of fault ``kind`` (one of ``OVERRIDES``)."""
    if kind == "binary":
        (node_dir / "binary.out").write_bytes(BINARY_OUTPUT)
    _write_script(node_dir / "bin" / "nvidia-smi", _fill(OVERRIDES[kind], root))
