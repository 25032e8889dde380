"""Validating a drained node over SSH: each check of ``spikeops.lifecycle.checks`` run on the
node, one after the other, each under its own timeout, and judged.

The commands run through the same SSH layer as the collector and the control run
(``spikeops.baselines.remote_run``: strict host keys, ``timeout`` on the node, the output's
tail kept, a failure a verdict and never an exception). ``nvidia-smi -q`` runs first: the
evidence check reads its report too. A node that does not answer its first check is not
asked again: every check is then ``unreachable``, and the validation has not passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spikeops.lifecycle.checks import (
    CHECKS,
    NOT_INSTALLED,
    CheckContext,
    CheckResult,
    check_command,
    judge_allreduce,
    judge_control,
    judge_dcgm,
    judge_evidence,
    judge_nvidia_smi,
    validation_passed,
)

__all__ = ["Validation", "validate_node", "OUTPUT_LIMIT"]

#: Output kept per check (a kernel log is cut to its last 8 MiB on the node already).
OUTPUT_LIMIT = 16 << 20


@dataclass
class Validation:
    node: str
    passed: bool
    checks: list[CheckResult]
    started: str
    seconds: float
    peer: str | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return ("passed" if self.passed else "FAILED") + ": " + "; ".join(c.line() for c in self.checks)

    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.verdict not in ("passed", "skipped")]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "passed": self.passed, "started": self.started, "seconds": round(self.seconds, 1),
                "peer": self.peer, "notes": self.notes, "checks": [c.to_json() for c in self.checks]}


def _ordered(names: Sequence[str]) -> list[str]:
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown validation check {unknown[0]!r} (known: {', '.join(CHECKS)})")
    chosen = list(dict.fromkeys(names))
    return (["nvidia-smi"] if "nvidia-smi" in chosen else []) + [n for n in chosen if n != "nvidia-smi"]


def validate_node(connector: Any, target: Any, ctx: CheckContext, checks: Sequence[str], *,
                  say: Callable[[str], None] | None = None) -> Validation:
    """Run ``checks`` on the node behind ``target`` (``spikeops.inventory.Target``)."""
    from spikeops.baselines import remote_run

    started = datetime.now(UTC)
    t0 = time.monotonic()
    results: list[CheckResult] = []
    report = None
    gone: str | None = None
    for name in _ordered(checks):
        if gone is not None:
            results.append(CheckResult(name, "unreachable", f"not run: {gone}"))
            continue
        if say:
            say(f"{ctx.node}: {name}...")
        command = check_command(name, ctx)
        if command is None:
            results.append(_not_run(name, ctx, connector, target))
            continue
        timeout = float(ctx.timeouts.get(name, 600))
        run = remote_run(connector, target, [name], command, timeout, keep=OUTPUT_LIMIT)
        if run.verdict == "unreachable":
            gone = run.detail or "the node did not answer"
            results.append(CheckResult(name, "unreachable", gone, run.seconds, command))
            continue
        if run.verdict == "timeout":
            result = CheckResult(name, "timeout", run.detail or f"over {timeout:g} s", exit=run.exit)
        elif name == "nvidia-smi":
            result, report = judge_nvidia_smi(run.stdout_tail, run.exit, ctx)
        elif name == "dcgmi-diag":
            result = judge_dcgm(run.stdout_tail, run.stderr_tail, run.exit)
        elif name == "control":
            result = judge_control(run.verdict, run.exit, run.detail, run.stderr_tail)
        elif name == "all-reduce":
            result = judge_allreduce(run.stdout_tail, run.stderr_tail, run.exit, ctx)
        else:
            result = judge_evidence(run.stdout_tail, run.exit, ctx, report)
        result.seconds, result.command = run.seconds, command
        result.tail = (run.stdout_tail[-1200:] + ("\n" + run.stderr_tail[-300:] if run.stderr_tail.strip() else ""))
        results.append(result)
        if say:
            say(f"{ctx.node}: {result.line()}")
    notes = [] if ctx.drain_smi else ["no drain-time nvidia-smi capture: GPUs judged on their own values"]
    return Validation(ctx.node, validation_passed(results), results, started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                      time.monotonic() - t0, ctx.peer, notes)


def _not_run(name: str, ctx: CheckContext, connector: Any, target: Any) -> CheckResult:
    """A check with nothing to run: not configured (skipped), or the AllReduce without a peer:
    skipped where nccl-tests is not installed, unchecked where it is (it applies, and could
    not be run)."""
    if name == "control":
        return CheckResult(name, "skipped", "the cluster has no control_command")
    from spikeops.baselines import remote_run
    from spikeops.lifecycle.checks import allreduce_tools, fill_allreduce, guarded_command

    tools = allreduce_tools(fill_allreduce(ctx.allreduce_command, ctx.node, "PEER", ctx.gpus_expected))
    run = remote_run(connector, target, ["command", "-v", *tools], guarded_command(tools, ["true"], 30), 30.0)
    if run.exit == NOT_INSTALLED:
        return CheckResult(name, "skipped", "nccl-tests (or its launcher) is not installed on the node", exit=run.exit)
    return CheckResult(name, "unchecked", "no idle healthy peer to run the AllReduce with: not judged", exit=run.exit)
