"""Slurm: stop, preserve, isolate and resume, with the safety rules of NHC.

- A node is drained only with a reason spikeops writes (``spikeops: <cause> <incident>``),
  and only from a state spikeops understands (idle, allocated, mixed, completing). A node
  drained or downed by anyone else is never touched: not re-drained with our reason, never
  resumed. Unknown states (maintenance, reboot, power saving) are left alone.
- A node is released (``State=RESUME``) only when its reason is spikeops'.
- Every action reads the state first and again after: a repeat is ``nothing-to-do``, and a
  command that exited 0 without the effect is ``failed``, not ``done``.
- A resubmission carries ``--comment=spikeops-resume:<job>:<key>``; a second resume of the
  same incident finds it and submits nothing.
- A resubmitted job gets the environment it was submitted with (Slurm's own copy, kept by
  ``preserve``) plus the remediation, through ``sbatch --export-file``; never the environment
  of the process resuming it. Where the job's environment cannot be read, resume refuses.

Commands are argument lists run by a ``Runner`` (locally with ``SLURM_CONF`` honoured, or on
a login node over SSH); each path is configurable (``SlurmConfig``).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.collect.plan import check_job_id
from spikeops.errors import InputError
from spikeops.inventory import fold_nodes
from spikeops.remediation import check_env
from spikeops.probes.slurm import (
    REASON_PREFIX,
    SlurmJob,
    SlurmNode,
    parse_show_job,
    parse_show_node,
)
from spikeops.schedulers.base import ActionLog, ActionResult, CommandRun, Runner, SchedulerError
from spikeops.schedulers.jobenv import (
    ENV_FILE_LIMIT,
    EnvFormatError,
    format_env_file,
    parse_env_file,
    parse_slurm_state_env,
    resume_environment,
    slurm_state_env_path,
)
from spikeops.schedulers.policy import drain_verdict, reboot_verdict, rebooting, release_verdict

__all__ = ["SlurmConfig", "SlurmScheduler", "drain_reason", "env_file_name", "STOP_MODES", "reboot_progress"]

STOP_MODES = ("cancel", "requeue", "hold")
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SIGNAL = re.compile(r"^(?:SIG)?[A-Z][A-Z0-9]{1,10}$|^[0-9]{1,2}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _from_env(name: str, default: str) -> Any:
    return field(default_factory=lambda: os.environ.get(name, default))


@dataclass(frozen=True)
class SlurmConfig:
    """Paths and policy. Paths default to ``$SPIKEOPS_<NAME>`` when set (read when the config
    is made, not when spikeops is imported), else the bare name."""

    scontrol: str = _from_env("SPIKEOPS_SCONTROL", "scontrol")
    sbatch: str = _from_env("SPIKEOPS_SBATCH", "sbatch")
    scancel: str = _from_env("SPIKEOPS_SCANCEL", "scancel")
    squeue: str = _from_env("SPIKEOPS_SQUEUE", "squeue")
    timeout: float = 30.0
    #: Seconds between the signal (a checkpoint-and-exit request) and the cancel.
    signal_grace: float = 30.0
    #: How the resume checkpoint reaches the job: an environment variable...
    resume_env: str | None = "SPIKEOPS_RESUME_FROM"
    #: ...and/or arguments for the batch script, ``{checkpoint}`` filled in (local runner).
    resume_args: str | None = None
    #: slurmctld's StateSaveLocation as the runner sees it, where Slurm keeps each job's
    #: submission environment; None: asked from ``scontrol show config``.
    state_save_location: str | None = field(default_factory=lambda: os.environ.get("SPIKEOPS_SLURM_STATE") or None)


def env_file_name(job: str) -> str:
    """The name ``preserve`` gives a job's submission environment in ``BUNDLE/scheduler/``,
    beside ``batch-JOB.sh``; ``resume`` with that script looks for it there."""
    return f"env-{job}"


def drain_reason(reason: str, incident: str | None) -> str:
    """``spikeops: <reason> <incident>``, one line, within Slurm's limits."""
    text = " ".join(reason.split())
    if text.startswith(REASON_PREFIX):
        text = text[len(REASON_PREFIX):].strip()
    if incident and incident not in text:
        text = f"{text} {incident}".strip()
    return f"{REASON_PREFIX} {text}"[:240]


def reboot_progress(node: Any, boot_before: str | None, boot_now: str | None) -> tuple[str, str]:
    """Where a reboot stands (``SlurmScheduler.reboot_status``; the local scheduler's too)."""
    if node is None:
        return "gone", "the node is no longer in the cluster"
    if rebooting(node):
        return "rebooting", f"{node.state}: the node has not registered again yet"
    if not node.drained_by_spikeops:
        return "gone", f"{node.state} ({node.reason or 'no reason'}): no longer drained by spikeops"
    if boot_now and boot_now != boot_before:
        return "done", f"booted at {boot_now}, back drained ({node.state})"
    if node.down:
        return "failed", f"{node.state}: the node did not boot again ({node.reason})"
    return "failed", f"the reboot ended without a new boot time ({node.state}, BootTime {boot_now})"


def _check_nodes(nodes: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(nodes))
    if not names:
        raise InputError("no nodes given")
    for name in names:
        if not _NODE.match(name):
            raise InputError(f"bad node name {name!r} (letters, digits and ._- only)")
    return names


class SlurmScheduler:
    name = "slurm"

    def __init__(self, runner: Runner, config: SlurmConfig | None = None, log: ActionLog | None = None,
                 *, dry_run: bool = False, incident: str | None = None) -> None:
        self.runner = runner
        self.config = config or SlurmConfig()
        self.log = log or ActionLog(None)
        self.dry_run = dry_run
        self.incident = incident
        self._state_dir: str | None = None

    # ------------------------------------------------------------------ running commands
    def _read(self, argv: list[str], what: str) -> CommandRun:
        """A read-only command: always runs (also in a dry run); failure is a SchedulerError."""
        run = self.runner.run(argv, timeout=self.config.timeout)
        if run.exit != 0:
            first = (run.stderr.strip() or run.stdout.strip() or f"exit {run.exit}").splitlines()[0]
            raise SchedulerError(f"{what}: {first[:200]}")
        return run

    def _act(self, argv: list[str], stdin: str | None = None, umask: int | None = None) -> CommandRun:
        """A changing command: not run in a dry run (recorded as what would have run)."""
        if self.dry_run:
            return CommandRun([str(a) for a in argv], None, "", "", 0.0, ran=False)
        if umask is None:
            return self.runner.run(argv, timeout=self.config.timeout, stdin=stdin)
        return self.runner.run(argv, timeout=self.config.timeout, stdin=stdin, umask=umask)

    def _finish(self, result: ActionResult) -> ActionResult:
        result.incident = result.incident or self.incident
        self.log.append(result)
        return result

    # ------------------------------------------------------------------ reading state
    def show_nodes(self) -> tuple[dict[str, SlurmNode], CommandRun]:
        run = self._read([self.config.scontrol, "show", "node", "-o"], "cannot read node states")
        return parse_show_node(run.stdout).by_name(), run

    def show_job(self, job: str) -> tuple[SlurmJob, CommandRun]:
        check_job_id(job)
        run = self.runner.run([self.config.scontrol, "show", "job", "-d", "-o", job], timeout=self.config.timeout)
        if run.exit != 0:
            text = (run.stderr.strip() or run.stdout.strip()).splitlines()[:1]
            if text and "invalid job id" in text[0].lower():
                raise SchedulerError(f"job {job} not found (Slurm: {text[0][:120]})")
            raise SchedulerError(f"cannot read job {job}: {text[0][:200] if text else f'exit {run.exit}'}")
        jobs = [j for j in parse_show_job(run.stdout) if j.job_id == job or j.fields.get("ArrayJobId") == job]
        if not jobs:
            raise SchedulerError(f"job {job} not found")
        return jobs[0], run

    def drained(self) -> list[SlurmNode]:
        """The nodes spikeops has drained (reason starts with ``spikeops:``)."""
        nodes, _ = self.show_nodes()
        return [node for node in nodes.values() if node.drained_by_spikeops]

    def idle_nodes(self) -> list[str]:
        """Nodes Slurm calls IDLE with no flag beyond the harmless ones: a drained, reserved,
        rebooting, powered-down or not-responding node, or one in a state spikeops does not
        know, is not idle (the baseline control run leaves it alone)."""
        harmless = {"CLOUD", "DYNAMIC_NORM"}
        nodes, _ = self.show_nodes()
        return [node.name for node in nodes.values()
                if node.base_state == "IDLE" and not node.drained and not node.down and node.flags <= harmless]

    def _known(self, names: list[str]) -> tuple[dict[str, SlurmNode], CommandRun]:
        state, run = self.show_nodes()
        strangers = [name for name in names if name not in state]
        if strangers:
            raise SchedulerError(f"not in the cluster: {fold_nodes(strangers)}")
        return state, run

    # ------------------------------------------------------------------ a job's environment
    def _state_save_location(self) -> str:
        if self.config.state_save_location:
            return self.config.state_save_location
        if self._state_dir is None:
            run = self._read([self.config.scontrol, "show", "config"], "cannot read Slurm's configuration")
            found = re.search(r"^StateSaveLocation\s*=\s*(\S+)", run.stdout, re.M)
            if not found:
                raise SchedulerError("scontrol show config names no StateSaveLocation")
            self._state_dir = found.group(1)
        return self._state_dir

    def job_environment(self, info: SlurmJob) -> tuple[dict[str, str] | None, str]:
        """The environment ``info`` was submitted with, as slurmctld stored it (the source a
        requeue uses too), and where it came from; or None and why it could not be read."""
        try:
            array = info.fields.get("ArrayJobId") if info.fields.get("ArrayTaskId") not in (None, "", "N/A") else None
            path = slurm_state_env_path(self._state_save_location(), info.job_id, array)
            return parse_slurm_state_env(self.runner.read_file(path, ENV_FILE_LIMIT)), f"Slurm's copy ({path})"
        except PermissionError:
            return None, (f"Slurm's copy of job {info.job_id}'s environment is not readable here "
                          "(StateSaveLocation belongs to SlurmUser)")
        except FileNotFoundError:
            return None, f"Slurm keeps no environment for job {info.job_id} (not a batch job, or already purged)"
        except (OSError, EnvFormatError, SchedulerError) as exc:
            return None, f"job {info.job_id}'s environment could not be read: {str(exc).splitlines()[0][:200]}"

    def _resume_environment(self, info: SlurmJob, script: str | Path | None,
                            env_file: str | Path | None) -> tuple[dict[str, str] | None, str]:
        """An explicit file, else the one ``preserve`` saved beside the preserved script,
        else Slurm's copy while the job record lasts."""
        chosen = Path(env_file) if env_file else None
        if chosen is None and script and (Path(script).parent / env_file_name(info.job_id)).is_file():
            chosen = Path(script).parent / env_file_name(info.job_id)
        if chosen is None:
            return self.job_environment(info)
        try:
            with chosen.open("rb") as handle:
                data = handle.read(ENV_FILE_LIMIT + 1)
            if len(data) > ENV_FILE_LIMIT:
                raise EnvFormatError(f"over {ENV_FILE_LIMIT} bytes")
            return parse_env_file(data), f"preserved ({chosen})"
        except (OSError, EnvFormatError) as exc:
            return None, f"{chosen}: {str(exc).splitlines()[0][:200]}"

    # ------------------------------------------------------------------ nodes
    def _node_action(self, action: str, nodes: Iterable[str], incident: str | None, verdict: Any,
                     argv: Any, check: Any, done: Any, extra: Any = None) -> list[ActionResult]:
        """One change per node, the same way for every node action: read the state, ask the
        safety rule (``verdict(node)``: None or an outcome and why), run ``argv(name)``, read
        the node again and confirm with ``check(node_before, node_after)``; logged whatever
        the outcome. ``done(node)`` is the detail of a success."""
        names = _check_nodes(nodes)
        state, looked = self._known(names)
        results = []
        for name in names:
            node = state[name]
            result = ActionResult(action, name, "", "", [looked], incident, extra=extra(node) if extra else {})
            said = verdict(node)
            if said is not None:
                result.outcome, result.detail = said
            else:
                run = self._act(argv(name))
                result.commands.append(run)
                result.outcome, result.detail = self._confirm(name, run, lambda after, before=node: check(before, after),
                                                              done(node), result)
            results.append(self._finish(result))
        return results

    def drain(self, nodes: Iterable[str], reason: str, incident: str | None = None) -> list[ActionResult]:
        """Drain each node with a spikeops reason, unless the rules above say no."""
        incident = incident or self.incident
        text = drain_reason(reason, incident)
        return self._node_action(
            "drain", nodes, incident, drain_verdict,
            lambda name: [self.config.scontrol, "update", f"NodeName={name}", "State=DRAIN", f"Reason={text}"],
            lambda before, after: after.drained_by_spikeops, lambda node: f"drained: {text}")

    def release(self, nodes: Iterable[str]) -> list[ActionResult]:
        """Resume nodes spikeops drained; never one drained by anyone else."""
        return self._node_action(
            "release", nodes, None, release_verdict,
            lambda name: [self.config.scontrol, "update", f"NodeName={name}", "State=RESUME"],
            lambda before, after: not after.drained_by_spikeops, lambda node: f"released (was: {node.reason})")

    def reboot(self, nodes: Iterable[str], reason: str, incident: str | None = None) -> list[ActionResult]:
        """Reboot nodes spikeops drained, into the drained state: ``scontrol reboot
        reason="spikeops: ..." NODES`` on a node that already carries spikeops' drain, without
        ``ASAP`` and without ``nextstate`` (docs/lifecycle.md, "Reboot"): Slurm clears the DRAIN
        flag after a reboot asked with either (22.05 refuses ``nextstate=DRAIN``), and a node
        must come back drained, to be validated before it serves a job. The result's
        ``extra.boot_before`` is the node's BootTime when asked: the reboot is over when its
        REBOOT flags are gone and BootTime is another (``reboot_status``)."""
        incident = incident or self.incident
        text = drain_reason(reason, incident)
        return self._node_action(
            "reboot", nodes, incident, reboot_verdict,
            lambda name: [self.config.scontrol, "reboot", f"reason={text}", name],
            lambda before, after: after.drained_by_spikeops and (
                rebooting(after) or after.fields.get("BootTime") != before.fields.get("BootTime")),
            lambda node: f"reboot requested into the drained state: {text}",
            extra=lambda node: {"boot_before": node.fields.get("BootTime")})

    def set_reason(self, nodes: Iterable[str], reason: str, incident: str | None = None) -> list[ActionResult]:
        """Rewrite the reason of nodes spikeops drained (a node marked for replacement says so
        in it); a node someone else drained, or not drained, is refused."""
        text = drain_reason(reason, incident)

        def verdict(node: Any) -> tuple[str, str] | None:
            if not node.drained_by_spikeops:
                return "refused", f"{node.state} ({node.reason or 'no reason'}): not drained by spikeops, left alone"
            if (node.reason or "").startswith(text):
                return "nothing-to-do", f"already: {node.reason}"
            return None

        return self._node_action(
            "reason", nodes, incident or self.incident, verdict,
            lambda name: [self.config.scontrol, "update", f"NodeName={name}", "State=DRAIN", f"Reason={text}"],
            lambda before, after: after.drained_by_spikeops and (after.reason or "").startswith(text),
            lambda node: f"reason: {text}")

    def reboot_status(self, name: str, boot_before: str | None) -> tuple[str, str]:
        """``(status, detail)`` of a reboot asked when the node's BootTime was ``boot_before``:
        ``rebooting`` (Slurm's REBOOT flags), ``done`` (booted since, still drained by
        spikeops), ``failed`` (flags gone without a new boot: Slurm timed it out, the node is
        DOWN) or ``gone`` (someone else changed the node meanwhile)."""
        nodes, _ = self.show_nodes()
        node = nodes.get(name)
        return reboot_progress(node, boot_before, node.fields.get("BootTime") if node else None)

    def _confirm(self, name: str, run: CommandRun, check, done: str, result: ActionResult) -> tuple[str, str]:
        if not run.ran:
            return "dry-run", f"would run: {' '.join(run.argv)}"
        if run.exit != 0:
            return "failed", (run.stderr.strip() or run.stdout.strip() or f"exit {run.exit}").splitlines()[0][:200]
        after, again = self.show_nodes()
        result.commands.append(again)
        node = after.get(name)
        if node is None or not check(node):
            return "failed", f"command succeeded but the node is {node.state if node else 'gone'} ({node.reason if node else ''})"
        return "done", done

    # ------------------------------------------------------------------ jobs
    def _wait_job(self, job: str, done, seconds: float) -> tuple[SlurmJob, list[CommandRun]]:
        runs = []
        deadline = time.monotonic() + seconds
        while True:
            info, run = self.show_job(job)
            runs = [run]
            if done(info) or time.monotonic() >= deadline:
                return info, runs
            time.sleep(0.2)

    def stop(self, job: str, *, signal: str | None = None, mode: str = "cancel",
             grace: float | None = None) -> ActionResult:
        """Signal the batch script first when asked (``scancel --signal=SIG --batch``: plain
        ``--signal`` reaches only the steps), give it ``grace`` seconds to save and exit,
        then cancel, requeue or hold it."""
        if mode not in STOP_MODES:
            raise InputError(f"unknown stop mode {mode!r} (known: {', '.join(STOP_MODES)})")
        if signal is not None and not _SIGNAL.match(signal):
            raise InputError(f"bad signal {signal!r} (a name such as USR1, or a number)")
        info, looked = self.show_job(job)
        result = ActionResult("stop", job, "", "", [looked], extra={"mode": mode, "state_before": info.state})
        if info.finished:
            result.outcome, result.detail = "nothing-to-do", f"already {info.state}"
            return self._finish(result)
        if info.state == "PENDING" and mode in ("requeue", "hold") and (
                "held" in (info.reason or "").lower() or info.fields.get("Priority") == "0"):
            result.outcome, result.detail = "nothing-to-do", f"already pending and held ({info.reason})"
            return self._finish(result)
        if mode == "requeue" and info.state == "PENDING":
            result.outcome, result.detail = "nothing-to-do", f"already pending ({info.reason})"
            return self._finish(result)
        signalled = False
        if signal and info.state == "RUNNING":
            name = signal.removeprefix("SIG")
            signalled = True
            run = self._act([self.config.scancel, f"--signal={name}", "--batch", job])
            result.commands.append(run)
            if run.ran and run.exit != 0:
                result.outcome, result.detail = "failed", _first(run)
                return self._finish(result)
            if run.ran:
                wait = self.config.signal_grace if grace is None else grace
                info, runs = self._wait_job(job, lambda j: j.finished, wait)
                result.commands.extend(runs)
                if info.finished:
                    result.outcome, result.detail = "done", f"SIG{name} sent; the job ended by itself ({info.state})"
                    return self._finish(result)
        if mode == "cancel":
            argv = [self.config.scancel, job]
            ended = lambda j: j.finished  # noqa: E731
        elif mode == "requeue":
            argv = [self.config.scontrol, "requeue", job]
            ended = lambda j: j.state in ("PENDING", "REQUEUED") or j.finished  # noqa: E731
        else:
            argv = [self.config.scontrol, "requeuehold" if info.state != "PENDING" else "hold", job]
            ended = lambda j: j.state == "PENDING" or j.finished  # noqa: E731
        run = self._act(argv)
        result.commands.append(run)
        if not run.ran:
            result.outcome, result.detail = "dry-run", "would run: " + " ; ".join(
                " ".join(c.argv) for c in result.commands if not c.ran)
            return self._finish(result)
        if run.exit != 0:
            result.outcome, result.detail = "failed", _first(run)
            return self._finish(result)
        info, runs = self._wait_job(job, ended, self.config.timeout)
        result.commands.extend(runs)
        result.extra["state_after"] = info.state
        if ended(info):
            result.outcome = "done"
            result.detail = (f"SIG{signal.removeprefix('SIG')} sent, then " if signalled else "") + f"{mode}: {info.state}"
        else:
            result.outcome, result.detail = "failed", f"{mode} accepted but the job is still {info.state}"
        return self._finish(result)

    def preserve(self, job: str, bundle: str | Path, checkpoint: str | Path | None = None) -> ActionResult:
        """Record the job (``scontrol show job -d``), its batch script, its submission
        environment and its node list into ``BUNDLE/scheduler/`` before anything else changes
        them (Slurm forgets a finished job after MinJobAge, and a resume may wait an hour for
        a person); with ``checkpoint``, also keep that checkpoint out of the job's retention
        (``checkpoints.protect``). The environment file (``env-JOB``, NUL-separated, 0600)
        holds the job owner's variables: what the resume gives back to the job, never logged."""
        from spikeops.bundle import atomic_write

        info, looked = self.show_job(job)
        folder = Path(bundle) / "scheduler"
        script = self.runner.run([self.config.scontrol, "write", "batch_script", job, "-"], timeout=self.config.timeout)
        result = ActionResult("preserve", job, "", "", [looked, script])
        atomic_write(folder / f"job-{job}.txt", looked.stdout.encode())
        atomic_write(folder / f"nodes-{job}.txt", ("\n".join(info.nodes) + "\n").encode() if info.nodes else b"")
        if script.exit == 0 and script.stdout:
            atomic_write(folder / f"batch-{job}.sh", script.stdout.encode())
            result.outcome, result.detail = "done", f"job record, batch script and {len(info.nodes)} node(s) saved"
        else:
            result.outcome = "done"
            result.detail = f"job record and node list saved; no batch script ({_first(script) or 'not a batch job'})"
        environment, source = self.job_environment(info)
        if environment is not None:
            target = folder / env_file_name(job)
            atomic_write(target, format_env_file(environment))
            os.chmod(target, 0o600)
            result.detail += f"; its submission environment ({len(environment)} variables)"
            result.extra["environment"] = {"source": source, "variables": len(environment)}
        else:
            result.detail += f"; environment not saved ({source})"
            result.extra["environment"] = {"source": None, "why": source}
        result.extra["files"] = sorted(p.name for p in folder.iterdir())
        if checkpoint is not None:
            from spikeops.checkpoints.protect import protect

            kept, made = protect(checkpoint, f"incident {self.incident or ''} job {job}".strip())
            result.extra["protected"] = str(kept)
            result.detail += f"; checkpoint kept at {kept} ({made} new links)"
        return self._finish(result)

    def _existing_resume(self, key: str) -> str | None:
        run = self.runner.run([self.config.squeue, "--states=all", "-h", "-o", "%i|%k"], timeout=self.config.timeout)
        for line in run.stdout.splitlines():
            job_id, _, comment = line.partition("|")
            if comment.strip() == key:
                return job_id.strip()
        return None

    def resume(self, job: str, checkpoint: str, *, exclude: Iterable[str] = (), requeue: bool = False,
               script: str | Path | None = None, key: str | None = None,
               env: Mapping[str, str] | None = None, env_file: str | Path | None = None,
               on: Sequence[str] | None = None, action: str = "resume") -> ActionResult:
        """Resubmit the job's batch script without ``exclude``, pointing it at ``checkpoint``
        (or requeue the job with ``ExcNodeList``). Idempotent by ``--comment``.

        The new job gets the environment the original was submitted with (``env_file``, the
        ``env-JOB`` that ``preserve`` saved beside ``script``, or Slurm's own copy), plus
        ``env`` (the remediation's variables, ``spikeops.remediation``) and the checkpoint's
        variable, through ``sbatch --export-file``: sbatch then drops its own environment, so
        nothing of spikeops' process reaches the job. Where the job's environment cannot be
        read, the resume is refused with the reason rather than run with another one. ``on``
        names exactly the nodes to run on (``--nodelist``; a replay of the spike window,
        ``action="replay"``)."""
        excluded = _check_nodes(exclude) if list(exclude) else []
        placed = _check_nodes(on) if on is not None else None
        try:
            extra_env = check_env(env or {})
        except ValueError as exc:
            raise InputError(str(exc)) from None
        if requeue and extra_env:
            raise InputError("a requeued job keeps its environment: remediations need a resubmission")
        info, looked = self.show_job(job)
        if requeue:
            return self._requeue(info, excluded, looked)
        if not checkpoint or "\n" in checkpoint or "\0" in checkpoint:
            raise InputError("a checkpoint path is required to resume (--from)")
        if self.config.resume_env and not _ENV_NAME.match(self.config.resume_env):
            raise InputError(f"bad environment variable name {self.config.resume_env!r}")
        digest = hashlib.sha256(f"{self.incident or ''}|{checkpoint}|{','.join(excluded)}".encode()).hexdigest()[:12]
        key = key or f"spikeops-resume:{job}:{digest}"
        result = ActionResult(action, job, "", "", [looked],
                              extra={"checkpoint": checkpoint, "exclude": fold_nodes(excluded), "comment": key})
        existing = self._existing_resume(key)
        if existing:
            result.outcome, result.detail = "nothing-to-do", f"already resubmitted as job {existing}"
            result.extra["new_job"] = existing
            return self._finish(result)
        own_env, source = self._resume_environment(info, script, env_file)
        if own_env is None:
            result.outcome = "refused"
            result.detail = (f"{source}; not resubmitted, so that spikeops' own environment cannot stand in for "
                             "the job's (run spikeops where StateSaveLocation is readable and preserve the job "
                             "while it runs, or use --requeue: docs/schedulers.md)")
            return self._finish(result)
        body = Path(script).read_text() if script else None
        if body is None:
            run = self.runner.run([self.config.scontrol, "write", "batch_script", job, "-"], timeout=self.config.timeout)
            result.commands.append(run)
            if run.exit != 0 or not run.stdout.strip():
                raise SchedulerError(f"job {job}: no batch script to resubmit ({_first(run) or 'empty'}); "
                                     "use --requeue, or preserve it first")
            body = run.stdout
        remediation = dict(extra_env)
        if self.config.resume_env:
            remediation[self.config.resume_env] = checkpoint
        exports = resume_environment(own_env, remediation)
        try:
            export_file = format_env_file(exports)
        except EnvFormatError as exc:
            result.outcome, result.detail = "refused", f"job {job}'s environment: {exc}"
            return self._finish(result)
        result.extra["environment"] = {"source": source, "variables": len(own_env)}
        if extra_env:
            result.extra["env"] = dict(extra_env)
        argv = [self.config.sbatch, "--parsable", f"--comment={key}"]
        if info.name:
            argv.append(f"--job-name={info.name}")
        if info.partition:
            argv.append(f"--partition={info.partition}")
        if info.work_dir:
            argv.append(f"--chdir={info.work_dir}")
        nodes = info.fields.get("NumNodes", "")
        if placed is not None:
            # a plain list: Slurm's hostlist parser does not read every node set ClusterShell folds
            argv += [f"--nodes={len(placed)}", f"--nodelist={','.join(placed)}"]
        elif re.fullmatch(r"\d+(-\d+)?", nodes):
            # a size given on sbatch's command line is not in the script: keep the job's size
            argv.append(f"--nodes={nodes}")
        if excluded:
            argv.append(f"--exclude={','.join(excluded)}")
        staged: list[str] = []
        try:
            if self.dry_run:
                where = f"<a 0600 file: {len(exports)} variables>"
            else:
                where = self.runner.put_file(export_file, f"spikeops-env-{job}-")
                staged.append(where)
            # ALL: an SBATCH_EXPORT=NONE in sbatch's environment would otherwise discard the file
            argv += ["--export=ALL", f"--export-file={where}"]
            stdin: str | None = body
            if self.config.resume_args:
                if self.dry_run:
                    argv.append("<the batch script>")
                else:
                    staged.append(self.runner.put_file(body.encode(), f"spikeops-resume-{job}-"))
                    argv.append(staged[-1])
                argv.extend(self.config.resume_args.replace("{checkpoint}", checkpoint).split())
                stdin = None
            run = self._act(argv, stdin=stdin, umask=_umask(own_env))
        finally:
            for path in staged:
                self.runner.remove_file(path)
        result.commands.append(run)
        if not run.ran:
            result.outcome, result.detail = "dry-run", "would run: " + " ".join(argv)
        elif run.exit != 0:
            result.outcome, result.detail = "failed", _first(run)
        else:
            new_job = run.stdout.strip().split(";")[0]
            result.extra["new_job"] = new_job
            result.outcome = "done"
            result.detail = f"resubmitted as job {new_job} from {checkpoint}" + (
                f", excluding {fold_nodes(excluded)}" if excluded else "") + (
                f", on {fold_nodes(placed)}" if placed is not None else "")
        return self._finish(result)

    def _requeue(self, info: SlurmJob, excluded: list[str], looked: CommandRun) -> ActionResult:
        job = info.job_id
        result = ActionResult("resume", job, "", "", [looked], extra={"mode": "requeue",
                                                                      "exclude": fold_nodes(excluded)})
        current, _ = _expand(info.fields.get("ExcNodeList", ""))
        wanted = sorted(set(current) | set(excluded))
        active = info.state in ("RUNNING", "PENDING", "CONFIGURING") and "held" not in (info.reason or "").lower()
        if active and set(excluded) <= set(current) and info.state != "RUNNING":
            result.outcome, result.detail = "nothing-to-do", f"already {info.state} excluding {fold_nodes(current)}"
            return self._finish(result)
        runs = []
        if excluded and set(excluded) - set(current):
            runs.append(self._act([self.config.scontrol, "update", f"JobId={job}", f"ExcNodeList={fold_nodes(wanted)}"]))
        if info.state == "RUNNING":
            runs.append(self._act([self.config.scontrol, "requeue", job]))
        elif info.state == "PENDING":
            runs.append(self._act([self.config.scontrol, "release", job]))
        elif info.finished:
            runs.append(self._act([self.config.scontrol, "requeue", job]))
        result.commands.extend(runs)
        if any(not r.ran for r in runs):
            result.outcome, result.detail = "dry-run", "would run: " + " ; ".join(" ".join(r.argv) for r in runs)
        elif any(r.exit != 0 for r in runs):
            bad = next(r for r in runs if r.exit != 0)
            result.outcome, result.detail = "failed", _first(bad)
        else:
            result.outcome = "done"
            result.detail = f"requeued" + (f" excluding {fold_nodes(wanted)}" if wanted else "")
        return self._finish(result)


def _expand(text: str) -> tuple[list[str], str | None]:
    from spikeops.probes.slurm import expand_nodelist

    if not text or text in ("(null)", "None"):
        return [], None
    return expand_nodelist(text)


def _umask(environment: Mapping[str, str]) -> int | None:
    """The umask the job was submitted under (``SLURM_UMASK``, which sbatch sets from its own
    process and not from ``--export-file``): sbatch runs under it, so the resumed job writes
    its checkpoints with the permissions the original did."""
    value = environment.get("SLURM_UMASK", "")
    return int(value, 8) if re.fullmatch(r"0?[0-7]{3}", value) else None


def _first(run: CommandRun) -> str:
    text = (run.stderr.strip() or run.stdout.strip())
    return text.splitlines()[0][:200] if text else (f"exit {run.exit}" if run.exit else "")
