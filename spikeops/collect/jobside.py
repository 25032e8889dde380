"""Node-side commands that need the job's own processes: its flight recorder dumps and stacks.

Pure functions returning POSIX sh, so the exact text is testable without a node. Both
probes start from the job's processes on the node:

- ``[job] pids`` (a command printing process ids; ``scontrol listpids {job}`` on Slurm) when
  the inventory gives one: the first column of its lines that start with a number;
- otherwise every process whose environment (``/proc/PID/environ``) holds
  ``SLURM_JOB_ID=JOB`` (Slurm sets it in every task) or ``SPIKEOPS_LOCAL_JOB=JOB`` (the local
  scheduler), minus those whose ``SLURMD_NODENAME`` / ``SPIKEOPS_NODE`` names another node
  (several simulated nodes on one host). GNU grep reads all environments in one process
  (``-z``); without it (busybox) each is read with ``tr`` and ``grep``.

The flight recorder probe takes the dump prefix from ``[job] flight_recorder``, else from
those processes' ``TORCH_FR_DUMP_TEMP_FILE`` (or the older ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``),
else torch's default ``/tmp/nccl_trace_rank_``, and prints a tar archive of every file named
prefix + digits (one per rank: the dumps as torch wrote them). The stacks probe runs
``py-spy dump --pid PID`` for each process, eight at a time, each under its own ``timeout``,
and prints a tar archive of ``PID.txt``. A process that is not Python is skipped quietly; a
refused attach (ptrace) or a missing py-spy is said on stderr, which the collector keeps as
the probe's gap. Neither probe ever passes ``--locals`` (local variables can hold secrets).

Only the job id, the node name and the inventory's own text reach these scripts, each
shell-quoted (the inventory's templates are the operator's shell, as in ``[job] nccl_log``).
"""

from __future__ import annotations

import shlex

__all__ = ["pids_function", "flight_recorder_command", "stacks_command", "MAX_PROCESSES", "PYSPY_TIMEOUT",
           "PYSPY_PARALLEL"]

#: Processes whose stacks are taken on one node (ranks and their data-loader workers).
MAX_PROCESSES = 64
#: Seconds one ``py-spy dump`` may take (it pauses the process while it reads it).
PYSPY_TIMEOUT = 10
PYSPY_PARALLEL = 8

_DEFAULT_PIDS = r"""
    _e=$(grep -lazxF -e "SLURM_JOB_ID=$_J" -e "SPIKEOPS_LOCAL_JOB=$_J" /proc/[0-9]*/environ 2>/dev/null)
    if [ -z "$_e" ]; then
        grep -qz . /dev/null 2>/dev/null
        if [ $? -gt 1 ]; then  # no grep -z (busybox): one environment at a time
            _e=$(for _f in /proc/[0-9]*/environ; do
                tr '\0' '\n' <"$_f" 2>/dev/null | grep -qxF -e "SLURM_JOB_ID=$_J" -e "SPIKEOPS_LOCAL_JOB=$_J" \
                    && echo "$_f"
            done)
        fi
    fi
    _found=
    for _f in $_e; do
        _p=${_f#/proc/}; _p=${_p%/environ}
        [ "$_p" = "$$" ] && continue
        _n=$(tr '\0' '\n' <"$_f" 2>/dev/null | sed -n 's/^SLURMD_NODENAME=//p;s/^SPIKEOPS_NODE=//p' | head -n 1)
        [ -z "$_n" ] || [ "$_n" = "$_N" ] || continue
        _found="$_found $_p"
    done"""


def pids_function(job: str, node: str, command: str | None) -> str:
    """``_pids``: sets ``_all`` to the job's process ids on this node (sorted, at most
    ``MAX_PROCESSES``, empty when none), forking little when there are none (the common case
    on the nodes of an incident's other jobs, and where the collector cannot read them).
    ``command`` (already filled with job and node) replaces the search."""
    if command:
        body = (f"\n    _found=$({{ {command}\n    }} 2>/dev/null | awk '$1 ~ /^[0-9]+$/ {{ print $1 }}')")
    else:
        body = _DEFAULT_PIDS
    return (f"_J={shlex.quote(job)}; _N={shlex.quote(node)}\n"
            f"_pids() {{{body}\n    _all=\n"
            f"    [ -z \"$_found\" ] || _all=$(printf '%s\\n' $_found | sort -n -u | head -n {MAX_PROCESSES})\n}}\n"
            + _HIDDEN)


#: ``_hidden``: sets ``_why`` to why a search by environment may have found nothing (another
#: user's processes), with shell builtins only.
_HIDDEN = r"""_hidden() {
    _why=
    for _f in /proc/[0-9]*/environ; do
        if [ ! -r "$_f" ]; then
            _why=" (the environment of other users' processes could not be read: collect as root or as the job's user)"
            return
        fi
    done
}
"""


_FR = r"""_P=%(prefix)s
_given=$_P
if [ -z "$_P" ]; then
    _pids
    for _p in $_all; do
        _x=$(tr '\0' '\n' <"/proc/$_p/environ" 2>/dev/null \
            | sed -n 's/^TORCH_FR_DUMP_TEMP_FILE=//p;s/^TORCH_NCCL_DEBUG_INFO_TEMP_FILE=//p' | head -n 1)
        case "
$_P
" in *"
$_x
"*) continue ;; esac
        [ -z "$_x" ] || _P="$_P${_P:+
}$_x"
    done
    [ -n "$_P" ] || _P=%(default)s
fi
_found=0 _looked=
_old=$IFS
IFS='
'
for _x in $_P; do
    case $_x in */*) _d=${_x%%/*}; _b=${_x##*/} ;; *) _d=.; _b=$_x ;; esac
    [ -n "$_d" ] || _d=/
    _looked="$_looked${_looked:+, }$_x<rank>"
    _names=
    for _f in "$_d/$_b"*; do
        [ -f "$_f" ] || continue
        _r=${_f#"$_d/$_b"}
        case $_r in ''|*[!0-9]*) continue ;; esac
        _names="$_names
./$_b$_r"
    done
    [ -n "$_names" ] || continue
    _found=1
    (cd "$_d" && tar -cf - $_names) || exit 1
done
IFS=$_old
if [ "$_found" = 0 ]; then
    _why=
    [ -n "$_given" ] || _hidden
    printf 'no flight recorder dump on this node (looked for %%s)%%s\n' "$_looked" "$_why" >&2
    exit 1
fi
"""


def flight_recorder_command(job: str, node: str, prefix: str | None, pids_command: str | None) -> str:
    """The flight recorder probe: a tar archive of the job's dumps on this node on stdout.
    ``prefix`` is ``[job] flight_recorder`` with job and node filled in (None: from the
    job's environment)."""
    from spikeops.probes.flight_recorder import DEFAULT_PREFIX

    return pids_function(job, node, pids_command) + _FR % {
        "prefix": shlex.quote(prefix) if prefix else "''", "default": shlex.quote(DEFAULT_PREFIX)}


_STACKS = r"""command -v py-spy >/dev/null 2>&1 || { echo 'py-spy: not installed on this node' >&2; exit 127; }
_pids
if [ -z "$_all" ]; then
    _hidden
    echo "no process of job $_J on this node$_why" >&2
    exit 1
fi
_d=$(mktemp -d 2>/dev/null) || { echo 'spikeops: no temporary directory for the stacks' >&2; exit 1; }
trap 'rm -rf "$_d"' EXIT
_i=0
for _p in $_all; do
    ( timeout -k 2 %(timeout)d py-spy dump --pid "$_p" >"$_d/$_p.txt" 2>"$_d/$_p.err"
      echo $? >"$_d/$_p.rc" ) &
    _i=$((_i + 1))
    [ $((_i %% %(parallel)d)) -ne 0 ] || wait
done
wait
_n=0 _skipped=0
for _p in $_all; do
    _rc=$(cat "$_d/$_p.rc" 2>/dev/null)
    if [ "$_rc" = 0 ] && [ -s "$_d/$_p.txt" ]; then
        _n=$((_n + 1))
    elif grep -qi -e 'python version' -e 'not a python' -e 'No such process' -e 'Failed to find python' \
            "$_d/$_p.err" 2>/dev/null; then
        _skipped=$((_skipped + 1))
        rm -f "$_d/$_p.txt"
    else
        printf 'pid %%s: %%s\n' "$_p" "$(grep -v -e '^ *[0-9]*:' -e 'Stack backtrace' "$_d/$_p.err" 2>/dev/null \
            | head -n 1 | cut -c 1-200)${_rc:+ (exit $_rc)}" >&2
        rm -f "$_d/$_p.txt"
    fi
    rm -f "$_d/$_p.err" "$_d/$_p.rc"
done
if [ "$_n" = 0 ]; then
    echo "no Python stack taken ($_skipped of the job's processes are not Python)" >&2
    exit 1
fi
cd "$_d" && tar -cf - ./*.txt
"""


def stacks_command(job: str, node: str, pids_command: str | None) -> str:
    """The stacks probe: a tar archive of ``PID.txt`` (``py-spy dump``) on stdout."""
    return pids_function(job, node, pids_command) + _STACKS % {"timeout": PYSPY_TIMEOUT,
                                                               "parallel": PYSPY_PARALLEL}
