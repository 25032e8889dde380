"""The validation checks a drained node must pass before it serves a job again: what each runs
on the node, and how its output is judged. Pure: ``spikeops.lifecycle.validate`` runs the
commands over SSH and hands the outputs here.

| check | runs on the node | passes when |
| --- | --- | --- |
| ``nvidia-smi`` | ``nvidia-smi -q`` | every GPU present (as many as at the drain, and as the inventory's ``gpus_per_node``), nvidia-smi reports no lost GPU, no volatile uncorrectable ECC, no uncorrectable ECC growth, no row-remap failure or pending remap, no retired-page growth or pending retirement since the drain-time capture |
| ``dcgmi-diag`` | ``dcgmi diag -r 2`` where DCGM is installed | every test ran and none failed on any GPU |
| ``control`` | the cluster's ``control_command`` (the healthy-run control) | it exits 0 within its time |
| ``all-reduce`` | ``all_reduce_perf`` (nccl-tests) with an idle healthy peer, where installed | the run finished, no element wrong, no NCCL/CUDA failure, both nodes took part, and the average bus bandwidth meets ``allreduce_min_busbw`` when set |
| ``evidence`` | the kernel log (and ``ibstat`` for a link fault) | what convicted the node is not there again: no new Xid of the convicting codes nor any GPU-implicating Xid, no GPU lost, no ECC growth on its GPUs, its IB ports up, no thermal throttling on an idle node |

Verdicts (``VERDICTS``): ``passed``; ``failed``; ``skipped`` (not applicable: the tool is not
installed where "where installed" allows it, nothing is configured, nothing of the conviction
to re-check); ``unchecked`` (applicable, but it could not be judged); ``unreachable``;
``timeout``. A validation passes only when every check passed or was skipped, and at least
one passed: a node that cannot be reached or checked has not passed.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from spikeops.lifecycle.faults import ConvictionEvidence

__all__ = ["CHECKS", "VERDICTS", "GOOD", "DEFAULT_TIMEOUTS", "DEFAULT_ALLREDUCE", "NOT_INSTALLED", "CheckContext",
           "CheckResult", "check_command", "judge_nvidia_smi", "judge_dcgm", "judge_control", "judge_allreduce",
           "judge_evidence", "validation_passed", "fill_allreduce", "guarded_command", "allreduce_tools"]

CHECKS = ("nvidia-smi", "dcgmi-diag", "control", "all-reduce", "evidence")
VERDICTS = ("passed", "failed", "skipped", "unchecked", "unreachable", "timeout")
GOOD = ("passed", "skipped")
#: Seconds each check may take on the node (``validation_timeouts`` in spikeops.toml changes
#: them; ``control`` takes the cluster's ``control_timeout_s``).
DEFAULT_TIMEOUTS = {"nvidia-smi": 120, "dcgmi-diag": 1800, "control": 600, "all-reduce": 900, "evidence": 120}
#: nccl-tests between the node and its peer: one process per node, every GPU of each.
DEFAULT_ALLREDUCE = ("mpirun", "--host", "{node},{peer}", "-np", "2", "all_reduce_perf", "-b", "8M", "-e", "1G",
                     "-f", "2", "-g", "{gpus}")
#: The exit status of ``command -v TOOL || exit 127``: the tool is not installed.
NOT_INSTALLED = 127
_KILL_AFTER = 5


@dataclass
class CheckResult:
    name: str
    verdict: str
    detail: str
    seconds: float = 0.0
    command: str | None = None
    exit: int | None = None
    #: The end of the output, for the evidence a person reads.
    tail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "detail": self.detail, "seconds": round(self.seconds, 1),
                "command": self.command, "exit": self.exit, "tail": self.tail[-1500:]}

    def line(self) -> str:
        return f"{self.name}: {self.verdict} ({self.detail})"


@dataclass
class CheckContext:
    """What the checks of one node need to know."""

    node: str
    gpus_expected: int | None = None
    #: ``nvidia-smi -q`` at the drain (the incident's bundle), the baseline of "new".
    drain_smi: str | None = None
    #: What convicted the node (None: a manual drain, nothing known).
    evidence: ConvictionEvidence | None = None
    #: Evidence at or after this time is new (the drain, or the end of its reboot).
    since: datetime | None = None
    #: The node booted after its conviction (its kernel log is a new one).
    rebooted: bool = False
    control_command: Sequence[str] | None = None
    peer: str | None = None
    allreduce_command: Sequence[str] = DEFAULT_ALLREDUCE
    allreduce_min_busbw: float | None = None
    timeouts: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_TIMEOUTS))


def guarded_command(tools: Sequence[str], argv: Sequence[str], timeout: int) -> str:
    """``command -v`` each tool (exit 127 when one is missing: "not installed"), then the
    command under ``timeout`` on the node, every word quoted."""
    probe = " && ".join(f"command -v {shlex.quote(t)} >/dev/null 2>&1" for t in tools)
    run = "exec " + shlex.join(["timeout", "-k", str(_KILL_AFTER), str(max(1, int(timeout))), *argv])
    return f"{{ {probe}; }} || exit {NOT_INSTALLED}; {run}" if tools else run


def fill_allreduce(template: Sequence[str], node: str, peer: str, gpus: int | None) -> list[str]:
    return [word.replace("{node}", node).replace("{peer}", peer).replace("{gpus}", str(gpus or 8))
            for word in template]


def allreduce_tools(argv: Sequence[str]) -> list[str]:
    """The programs an AllReduce command needs on the node: its launcher and the ``*_perf`` binary."""
    return list(dict.fromkeys([argv[0], *[w for w in argv[1:] if w.rsplit("/", 1)[-1].endswith("_perf")]]))


def check_command(name: str, ctx: CheckContext) -> str | None:
    """The remote command of a check (None: nothing to run, e.g. no control configured)."""
    from spikeops.probes.kernel_log import REMOTE as KERNEL

    timeout = int(ctx.timeouts.get(name, DEFAULT_TIMEOUTS.get(name, 600)))
    if name == "nvidia-smi":
        return guarded_command([], ["nvidia-smi", "-q"], timeout)
    if name == "dcgmi-diag":
        return guarded_command(["dcgmi"], ["dcgmi", "diag", "-r", "2"], timeout)
    if name == "control":
        return guarded_command([], list(ctx.control_command), timeout) if ctx.control_command else None
    if name == "all-reduce":
        if ctx.peer is None:
            return None
        argv = fill_allreduce(ctx.allreduce_command, ctx.node, ctx.peer, ctx.gpus_expected)
        return guarded_command(allreduce_tools(argv), argv, timeout)
    if name == "evidence":
        command = f"{{ {KERNEL.command}; }} | tail -c 8388608"
        if ctx.evidence is not None and ctx.evidence.cause == "ib_link_flap":
            command += "; echo '@@spikeops ibstat@@'; ibstat 2>&1"
        return command
    raise ValueError(f"unknown check {name!r} (known: {', '.join(CHECKS)})")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


# ------------------------------------------------------------------------------ nvidia-smi


def _by_pci(report: Any) -> dict[str, Any]:
    return {gpu.pci: gpu for gpu in getattr(report, "gpus", None) or [] if gpu.pci}


def _grew(now: int | None, then: int | None) -> bool:
    return now is not None and then is not None and now > then


def judge_nvidia_smi(stdout: str, exit_code: int | None, ctx: CheckContext) -> tuple[CheckResult, Any]:
    """The GPUs' health now against the drain-time capture; the parsed report beside it."""
    from spikeops.probes.nvidia_smi import parse_q

    report = parse_q(stdout) if stdout.strip() else None
    if report is None or (not report.gpus and not report.errors):
        why = "nvidia-smi is not installed" if exit_code == NOT_INSTALLED else (
            f"exit {exit_code}, no GPU report" if exit_code else "no GPU in the output")
        return CheckResult("nvidia-smi", "failed", why, exit=exit_code), report
    drain = parse_q(ctx.drain_smi) if ctx.drain_smi else None
    before = _by_pci(drain)
    problems = [f"nvidia-smi: {message.text[:160]}" for message in report.errors[:3]]
    expected = max(ctx.gpus_expected or 0, len(drain.gpus) if drain else 0, (drain.attached_gpus or 0) if drain else 0)
    present = len(report.gpus)
    if expected and present < expected:
        missing = sorted(set(before) - set(_by_pci(report)))
        problems.append(f"{present} of {expected} GPUs present" + (f" (missing {', '.join(missing)})" if missing else ""))
    for gpu in report.gpus:
        name = f"GPU {gpu.pci or gpu.index}"
        then = before.get(gpu.pci)
        volatile = gpu.ecc_volatile.uncorrectable_total() if gpu.ecc_volatile else None
        if volatile:
            problems.append(f"{name}: {volatile} uncorrectable ECC error(s) since the driver loaded")
        aggregate = gpu.ecc_aggregate.uncorrectable_total() if gpu.ecc_aggregate else None
        earlier = then.ecc_aggregate.uncorrectable_total() if then is not None and then.ecc_aggregate else None
        if _grew(aggregate, earlier):
            problems.append(f"{name}: uncorrectable ECC grew since the drain ({earlier} -> {aggregate})")
        rows = gpu.remapped_rows
        if rows is not None and rows.failure:
            problems.append(f"{name}: row remapping failed (no spare rows left)")
        if rows is not None and rows.pending:
            problems.append(f"{name}: a row remap is pending (needs a GPU reset)")
        pages = gpu.retired_pages
        if pages is not None and pages.pending:
            problems.append(f"{name}: a page retirement is pending (needs a reset)")
        old_pages = then.retired_pages if then is not None else None
        if pages is not None and old_pages is not None and (_grew(pages.double_bit, old_pages.double_bit)
                                                           or _grew(pages.single_bit, old_pages.single_bit)):
            problems.append(f"{name}: retired pages grew since the drain ({old_pages.double_bit}/"
                            f"{old_pages.single_bit} -> {pages.double_bit}/{pages.single_bit} double/single bit)")
    basis = "against the drain-time capture" if drain else "no drain-time capture: judged on its own values"
    if problems:
        return CheckResult("nvidia-smi", "failed", "; ".join(problems[:6]), exit=exit_code), report
    return CheckResult("nvidia-smi", "passed", f"{present} GPU(s) clean ({basis})", exit=exit_code), report


# ------------------------------------------------------------------------------ dcgmi diag


def judge_dcgm(stdout: str, stderr: str, exit_code: int | None) -> CheckResult:
    from spikeops.probes.dcgm import ALL_GPUS, parse_diag

    if exit_code == NOT_INSTALLED:
        return CheckResult("dcgmi-diag", "skipped", "DCGM is not installed on the node", exit=exit_code)
    diag = parse_diag(stdout)
    if not diag.tests:
        why = next((gap.reason for gap in diag.gaps), None) or _first_line(stderr) or _first_line(stdout) or \
            f"exit {exit_code}"
        return CheckResult("dcgmi-diag", "failed", f"no diagnostic result ({why[:200]})", exit=exit_code)
    failed = diag.failed_gpus()
    if failed:
        parts = [f"{'all GPUs' if gpu == ALL_GPUS else f'GPU {gpu}'}: {'; '.join(entries)[:200]}"
                 for gpu, entries in sorted(failed.items())]
        return CheckResult("dcgmi-diag", "failed", "; ".join(parts[:4]), exit=exit_code)
    ran = sum(1 for test in diag.tests if test.status in ("Pass", "Warn"))
    return CheckResult("dcgmi-diag", "passed", f"{ran} test(s) passed on {len(diag.gpu_indices()) or '?'} GPU(s)"
                       + (f", DCGM {diag.dcgm_version}" if diag.dcgm_version else ""), exit=exit_code)


# ------------------------------------------------------------------------------ control


def judge_control(verdict: str, exit_code: int | None, detail: str | None, stderr: str) -> CheckResult:
    """The healthy-run control's own verdict (``spikeops.baselines``): ok, failed, timeout."""
    if verdict == "ok":
        return CheckResult("control", "passed", "the healthy-run control exited 0", exit=exit_code)
    if verdict == "timeout":
        return CheckResult("control", "timeout", detail or "timed out", exit=exit_code)
    last = _first_line(stderr)
    return CheckResult("control", "failed", (detail or f"exit {exit_code}") + (f": {last}" if last else ""),
                       exit=exit_code)


# ------------------------------------------------------------------------------ all_reduce_perf


def judge_allreduce(stdout: str, stderr: str, exit_code: int | None, ctx: CheckContext) -> CheckResult:
    from spikeops.probes.nccl_tests import parse

    if exit_code == NOT_INSTALLED:
        return CheckResult("all-reduce", "skipped", "nccl-tests (or its launcher) is not installed on the node",
                           exit=exit_code)
    run = parse(stdout + ("\n" + stderr if stderr else ""))
    problems = [text for _, text in run.failures[:2]]
    if not run.complete:
        problems.append("the run did not finish (no 'Out of bounds values' line)" + (
            f": {_first_line(stderr)}" if _first_line(stderr) else ""))
    if run.out_of_bounds:
        problems.append(f"{run.out_of_bounds} out-of-bounds value(s)")
    wrong = run.wrong_rows()
    if wrong:
        problems.append(f"wrong elements at {len(wrong)} size(s), first at {wrong[0].size} B")
    hosts = set(run.hosts)
    if run.ranks and ctx.peer and not {ctx.node, ctx.peer} <= hosts:
        problems.append(f"ranks ran on {', '.join(sorted(hosts))}, not on {ctx.node} and {ctx.peer}")
    if ctx.allreduce_min_busbw is not None and run.avg_busbw is not None and run.avg_busbw < ctx.allreduce_min_busbw:
        problems.append(f"average bus bandwidth {run.avg_busbw:g} GB/s below the {ctx.allreduce_min_busbw:g} GB/s "
                        "expected")
    if run.busbw_verdict == "FAILED":
        problems.append("nccl-tests says the bandwidth FAILED (NCCL_TESTS_MIN_BW)")
    if exit_code not in (0, None) and not problems:
        problems.append(f"exit {exit_code}")
    if problems:
        return CheckResult("all-reduce", "failed", "; ".join(problems[:4]), exit=exit_code)
    return CheckResult("all-reduce", "passed", f"{len(run.ranks)} rank(s) with {ctx.peer}: no wrong element, "
                       f"average bus bandwidth {run.avg_busbw:g} GB/s, peak {run.peak_busbw()} GB/s", exit=exit_code)


# ------------------------------------------------------------------------------ the evidence


def judge_evidence(stdout: str, exit_code: int | None, ctx: CheckContext, smi_report: Any) -> CheckResult:
    """What convicted the node must not be there again (module docstring)."""
    from spikeops.probes.kernel_log import parse as parse_kernel
    from spikeops.probes.xid_catalog import APPLICATION_CLASS

    evidence = ctx.evidence
    if evidence is None or evidence.cause is None:
        return CheckResult("evidence", "skipped", "no conviction recorded for this drain: nothing of its own to re-check")
    kernel_text, _, ib_text = stdout.partition("@@spikeops ibstat@@")
    log = parse_kernel(kernel_text)
    problems: list[str] = []
    unknown: list[str] = []

    def new(moment: datetime | None) -> bool | None:
        if moment is None:
            return True if ctx.rebooted else None
        return ctx.since is None or moment >= ctx.since

    for event in log.xids:
        if event.code in APPLICATION_CLASS or not event.info.implicates_gpu:
            continue
        fresh = new(event.time)
        what = f"Xid {event.code} on {event.pci}" + (" (the convicting code)" if event.code in evidence.xids else "")
        if fresh:
            problems.append(f"{what} again (line {event.line})")
        elif fresh is None:
            unknown.append(what)
    for lost in log.gpu_lost:
        fresh = new(lost.time)
        if fresh:
            problems.append(f"GPU {lost.pci or '?'} lost again ({lost.reason}, line {lost.line})")
        elif fresh is None:
            unknown.append(f"GPU {lost.pci or '?'} lost")
    if evidence.cause == "thermal_throttle" and smi_report is not None:
        hot = [gpu.pci for gpu in smi_report.gpus if gpu.thermal_throttling]
        if hot:
            problems.append(f"thermal throttling on an idle node: {', '.join(str(h) for h in hot)}")
    if evidence.cause == "gpu_ecc" and smi_report is not None:
        for gpu in smi_report.gpus:
            if evidence.gpus and gpu.pci not in evidence.gpus:
                continue
            count = gpu.ecc_volatile.uncorrectable_total() if gpu.ecc_volatile else None
            if count:
                problems.append(f"GPU {gpu.pci}: uncorrectable ECC errors again ({count})")
    if evidence.cause == "ib_link_flap":
        from spikeops.probes.infiniband.ibstat import parse_ibstat

        stat = parse_ibstat(ib_text)
        ports = [p for p in stat.ports() if (p.link_layer or "InfiniBand").lower() == "infiniband"]
        down = [f"{p.ca}/{p.port} {p.state}/{p.physical_state}" for p in ports if not p.active]
        if not ports:
            unknown.append("ibstat printed no InfiniBand port")
        elif down:
            problems.append(f"IB port(s) not active: {', '.join(down[:4])}")
    if problems:
        return CheckResult("evidence", "failed", f"{evidence.describe()} is back: " + "; ".join(problems[:4]),
                           exit=exit_code)
    if log.format == "empty" and not kernel_text.strip():
        return CheckResult("evidence", "unchecked", "the kernel log could not be read", exit=exit_code)
    if unknown:
        return CheckResult("evidence", "unchecked", f"{'; '.join(unknown[:3])} at an unknown time, and the node has "
                           "not rebooted since: cannot tell old from new", exit=exit_code)
    since = f" since {ctx.since:%Y-%m-%dT%H:%M:%SZ}" if ctx.since else ""
    return CheckResult("evidence", "passed", f"{evidence.describe()}: not seen again{since}", exit=exit_code)


def validation_passed(results: Sequence[CheckResult]) -> bool:
    """Every check passed or was skipped, and at least one passed (module docstring)."""
    return bool(results) and all(r.verdict in GOOD for r in results) and any(r.verdict == "passed" for r in results)
