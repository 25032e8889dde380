"""A scheduler of local processes, for the demo and for machines without Slurm.

The same actions and safety rules as Slurm (``policy``), over a state directory: jobs are
process groups started here (their pid, command, added variables and node list in
``jobs/<id>.json``, their whole submission environment in ``jobs/<id>.env``, NUL-separated
and 0600, as Slurm keeps one; their exit status in ``jobs/<id>.exit``), nodes are names with
a state, a reason, flags and a boot time in ``nodes.json``. A resume starts the job again with its own stored
environment plus the remediation, never with the environment of the process resuming it. It is what ``spikeops demo`` uses when Slurm's packages are
absent, so the pipeline runs end to end on one laptop with the same audit trail.

A reboot keeps Slurm's state machine (docs/lifecycle.md): the node is marked
``REBOOT_ISSUED`` (and is DOWN, still drained), the state directory's ``reboot-program NODE``
runs (what Slurm's ``RebootProgram`` is: a machine of the demo's or the tests' sim cluster,
restarted), and when it exits 0 the node has a new boot time and is back drained; a program
that fails or is missing leaves the node DOWN with "reboot failed" in spikeops' reason.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal as signals
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.bundle import atomic_write
from spikeops.errors import InputError
from spikeops.inventory import fold_nodes
from spikeops.remediation import check_env
from spikeops.probes.slurm import is_spikeops_reason
from spikeops.schedulers.base import ActionLog, ActionResult, SchedulerError
from spikeops.schedulers.jobenv import (
    ENV_FILE_LIMIT,
    EnvFormatError,
    format_env_file,
    parse_env_file,
    resume_environment,
)
from spikeops.schedulers.policy import drain_verdict, reboot_verdict, release_verdict
from spikeops.schedulers.slurm import STOP_MODES, _check_nodes, drain_reason, reboot_progress

__all__ = ["LocalScheduler", "LocalNode", "LocalJob"]

#: Set by ``submit`` for each start, so never carried from one start to the next.
_PER_JOB = ("SPIKEOPS_LOCAL_JOB", "SPIKEOPS_JOB_NODES")


@dataclass
class LocalNode:
    name: str
    base_state: str = "IDLE"
    reason: str | None = None
    reason_user: str | None = None
    flags: frozenset[str] = frozenset()
    #: When the node last booted (ISO 8601), as Slurm's BootTime; None before its first reboot.
    boot_time: str | None = None

    @property
    def drained(self) -> bool:
        # a node being rebooted is DOWN and keeps its drain, as in Slurm (DOWN+DRAIN+REBOOT_ISSUED)
        return self.base_state == "DRAIN" or (self.base_state == "DOWN" and is_spikeops_reason(self.reason))

    @property
    def down(self) -> bool:
        return self.base_state == "DOWN"

    @property
    def drained_by_spikeops(self) -> bool:
        return self.drained and is_spikeops_reason(self.reason)

    @property
    def state(self) -> str:
        shown = self.base_state
        if self.base_state == "DOWN" and self.reason and is_spikeops_reason(self.reason):
            shown += "+DRAIN"
        return "+".join([shown, *sorted(self.flags)])

    @property
    def fields(self) -> dict[str, str]:
        """The Slurm-like fields the lifecycle reads (``BootTime``)."""
        return {"BootTime": self.boot_time} if self.boot_time else {}


@dataclass
class LocalJob:
    job_id: str
    argv: list[str]
    nodes: list[str]
    pid: int | None
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    comment: str | None = None
    exclude: list[str] = field(default_factory=list)
    state: str = "RUNNING"


class LocalScheduler:
    name = "local"

    def __init__(self, directory: str | Path, log: ActionLog | None = None, *, dry_run: bool = False,
                 incident: str | None = None) -> None:
        self.directory = Path(directory)
        self.log = log or ActionLog(None)
        self.dry_run = dry_run
        self.incident = incident
        (self.directory / "jobs").mkdir(parents=True, exist_ok=True)
        self._mutex = threading.RLock()
        self._depth = 0

    # ------------------------------------------------------------------ state files
    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The state directory to ourselves: other processes' (and threads') changes wait.
        Re-entrant in one thread (a resume holds it around its check and its submit)."""
        with self._mutex:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            with open(self.directory / "state.lock", "a+b") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                self._depth = 1
                try:
                    yield
                finally:
                    self._depth = 0
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def _nodes_path(self) -> Path:
        return self.directory / "nodes.json"

    def nodes(self) -> dict[str, LocalNode]:
        try:
            raw = json.loads(self._nodes_path().read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise SchedulerError(f"{self._nodes_path()}: unreadable state ({exc})") from None
        return {name: LocalNode(name, entry.get("state", "IDLE"), entry.get("reason"), entry.get("user"),
                                frozenset(entry.get("flags") or ()), entry.get("boot"))
                for name, entry in raw.items()}

    def _save_nodes(self, nodes: Mapping[str, LocalNode]) -> None:
        document = {n.name: {"state": n.base_state, "reason": n.reason, "user": n.reason_user,
                             **({"flags": sorted(n.flags)} if n.flags else {}),
                             **({"boot": n.boot_time} if n.boot_time else {})} for n in nodes.values()}
        atomic_write(self._nodes_path(), (json.dumps(document, indent=1) + "\n").encode())

    def add_nodes(self, names: Iterable[str]) -> None:
        with self._locked():
            nodes = self.nodes()
            for name in _check_nodes(names):
                nodes.setdefault(name, LocalNode(name))
            self._save_nodes(nodes)

    def set_node(self, name: str, state: str, reason: str | None, user: str | None = None) -> None:
        """Change a node as someone else would (an operator, a health check)."""
        with self._locked():
            nodes = self.nodes()
            was = nodes.get(name)
            nodes[name] = LocalNode(name, state, reason, user, boot_time=was.boot_time if was else None)
            self._save_nodes(nodes)

    def _job_path(self, job: str) -> Path:
        return self.directory / "jobs" / f"{job}.json"

    def show_job(self, job: str) -> LocalJob:
        path = self._job_path(job)
        if not job.isdigit() or not path.is_file():
            raise SchedulerError(f"job {job} not found")
        raw = json.loads(path.read_text())
        info = LocalJob(job, raw["argv"], raw["nodes"], raw.get("pid"), raw.get("cwd"), raw.get("env", {}),
                        raw.get("comment"), raw.get("exclude", []), raw.get("state", "RUNNING"))
        if info.state == "RUNNING":
            exit_file = self.directory / "jobs" / f"{job}.exit"
            if exit_file.is_file():
                code = exit_file.read_text().strip()
                info.state = "COMPLETED" if code == "0" else "FAILED"
            elif info.pid is None or not _alive(info.pid):
                info.state = "FAILED"
        return info

    def _save_job(self, info: LocalJob) -> None:
        document = {"argv": info.argv, "nodes": info.nodes, "pid": info.pid, "cwd": info.cwd, "env": info.env,
                    "comment": info.comment, "exclude": info.exclude, "state": info.state}
        atomic_write(self._job_path(info.job_id), (json.dumps(document, indent=1) + "\n").encode())

    def jobs(self) -> list[LocalJob]:
        return [self.show_job(p.stem) for p in sorted((self.directory / "jobs").glob("*.json"))]

    def _env_path(self, job: str) -> Path:
        return self.directory / "jobs" / f"{job}.env"

    def job_environment(self, job: str) -> tuple[dict[str, str] | None, str]:
        """The environment ``job`` was submitted with (``jobs/<id>.env``), or None and why."""
        path = self._env_path(job)
        try:
            with path.open("rb") as handle:
                data = handle.read(ENV_FILE_LIMIT + 1)
            if len(data) > ENV_FILE_LIMIT:
                raise EnvFormatError(f"over {ENV_FILE_LIMIT} bytes")
            environment = parse_env_file(data)
        except FileNotFoundError:
            return None, f"job {job} has no stored environment ({path} is missing)"
        except (OSError, EnvFormatError) as exc:
            return None, f"job {job}'s environment could not be read: {str(exc).splitlines()[0][:200]}"
        for name in _PER_JOB:
            environment.pop(name, None)
        return environment, f"stored ({path})"

    # ------------------------------------------------------------------ submitting
    def submit(self, argv: Sequence[str], nodes: Iterable[str], *, env: Mapping[str, str] | None = None,
               cwd: str | None = None, comment: str | None = None, exclude: Iterable[str] = (),
               environment: Mapping[str, str] | None = None) -> str:
        """Start ``argv`` as a job on ``nodes`` (minus ``exclude``); its id. The job's
        environment is ``environment`` (default: the caller's, as ``sbatch`` exports it)
        with ``env`` added; it is stored, so that a resume can give it back."""
        with self._locked():  # the id is taken (its file written) before another submit looks
            existing = [int(p.stem) for p in (self.directory / "jobs").glob("*.json") if p.stem.isdigit()]
            job = str(max(existing, default=1000) + 1)
            self._save_job(LocalJob(job, list(argv), list(nodes), None, cwd, dict(env or {}), comment,
                                    list(exclude), state="PENDING"))
        exit_file = self.directory / "jobs" / f"{job}.exit"
        # -I: the job's PYTHONPATH/PYTHONHOME must not change the interpreter of this wrapper.
        # A stop's USR1/USR2 reach the whole process group; they are the job's to act on, so the
        # wrapper catches them (a caught signal is back to its default in the job after exec):
        # by default they would end the wrapper and the job would look ended while it still ran.
        wrapper = [sys.executable, "-I", "-c",
                   "import signal,subprocess,sys\n"
                   "for s in (signal.SIGUSR1, signal.SIGUSR2): signal.signal(s, lambda *a: None)\n"
                   "code=subprocess.call(sys.argv[2:]); open(sys.argv[1],'w').write(str(code))",
                   str(exit_file), *argv]
        submitted = {**dict(os.environ if environment is None else environment), **(env or {})}
        try:
            stored = format_env_file(submitted)
        except EnvFormatError as exc:
            raise InputError(str(exc)) from None
        atomic_write(self._env_path(job), stored)
        os.chmod(self._env_path(job), 0o600)
        full_env = dict(submitted, SPIKEOPS_LOCAL_JOB=job,
                        SPIKEOPS_JOB_NODES=fold_nodes([n for n in nodes if n not in set(exclude)]))
        log_file = open(self.directory / "jobs" / f"{job}.out", "wb")  # noqa: SIM115
        with log_file:
            process = subprocess.Popen(wrapper, cwd=cwd, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self._save_job(LocalJob(job, list(argv), list(nodes), process.pid, cwd, dict(env or {}), comment,
                                list(exclude)))
        return job

    # ------------------------------------------------------------------ actions
    def _finish(self, result: ActionResult) -> ActionResult:
        result.incident = result.incident or self.incident
        self.log.append(result)
        return result

    def drained(self) -> list[LocalNode]:
        return [node for node in self.nodes().values() if node.drained_by_spikeops]

    def idle_nodes(self) -> list[str]:
        """Nodes in no running job and neither drained nor down (the control run's candidates)."""
        busy = {node for job in self.jobs() if job.state == "RUNNING" for node in job.nodes}
        return [name for name, node in sorted(self.nodes().items()) if node.base_state == "IDLE" and name not in busy]

    def _known(self, names: list[str]) -> dict[str, LocalNode]:
        nodes = self.nodes()
        strangers = [n for n in names if n not in nodes]
        if strangers:
            raise SchedulerError(f"not in the cluster: {fold_nodes(strangers)}")
        return nodes

    def drain(self, nodes: Iterable[str], reason: str, incident: str | None = None) -> list[ActionResult]:
        with self._locked():
            return self._drain(nodes, reason, incident)

    def _drain(self, nodes: Iterable[str], reason: str, incident: str | None) -> list[ActionResult]:
        names = _check_nodes(nodes)
        incident = incident or self.incident
        text = drain_reason(reason, incident)
        state = self._known(names)
        results = []
        for name in names:
            result = ActionResult("drain", name, "", "", incident=incident)
            verdict = drain_verdict(state[name])
            if verdict is not None:
                result.outcome, result.detail = verdict
            elif self.dry_run:
                result.outcome, result.detail = "dry-run", f"would drain with reason {text!r}"
            else:
                state[name] = LocalNode(name, "DRAIN", text, os.environ.get("USER", "spikeops"),
                                        boot_time=state[name].boot_time)
                self._save_nodes(state)
                result.outcome, result.detail = "done", f"drained: {text}"
            results.append(self._finish(result))
        return results

    def release(self, nodes: Iterable[str]) -> list[ActionResult]:
        with self._locked():
            return self._release(nodes)

    def _release(self, nodes: Iterable[str]) -> list[ActionResult]:
        names = _check_nodes(nodes)
        state = self._known(names)
        results = []
        for name in names:
            result = ActionResult("release", name, "", "")
            verdict = release_verdict(state[name])
            if verdict is not None:
                result.outcome, result.detail = verdict
            elif self.dry_run:
                result.outcome, result.detail = "dry-run", "would set IDLE"
            else:
                was = state[name].reason
                state[name] = LocalNode(name, boot_time=state[name].boot_time)
                self._save_nodes(state)
                result.outcome, result.detail = "done", f"released (was: {was})"
            results.append(self._finish(result))
        return results

    #: The program a reboot runs (Slurm's RebootProgram): ``STATE/reboot-program NODE``.
    REBOOT_PROGRAM = "reboot-program"
    #: Seconds it may take (Slurm's ResumeTimeout).
    REBOOT_TIMEOUT_S = 300.0

    def reboot(self, nodes: Iterable[str], reason: str, incident: str | None = None) -> list[ActionResult]:
        """Reboot nodes spikeops drained, into the drained state (module docstring)."""
        names = _check_nodes(nodes)
        incident = incident or self.incident
        text = drain_reason(reason, incident)
        results = []
        for name in names:
            with self._locked():
                state = self._known([name])
                node = state[name]
                result = ActionResult("reboot", name, "", "", incident=incident, extra={"boot_before": node.boot_time})
                verdict = reboot_verdict(node)
                if verdict is None and self.dry_run:
                    verdict = ("dry-run", f"would run {self.directory / self.REBOOT_PROGRAM} {name}")
                if verdict is not None:
                    result.outcome, result.detail = verdict
                    results.append(self._finish(result))
                    continue
                state[name] = LocalNode(name, "DOWN", f"{text} : reboot issued", node.reason_user,
                                        node.flags | {"REBOOT_ISSUED"}, node.boot_time)
                self._save_nodes(state)
            booted, why = self._run_reboot_program(name)  # outside the lock: a reboot takes a while
            with self._locked():
                state = self._known([name])
                now = state[name]
                if not now.drained_by_spikeops or "REBOOT_ISSUED" not in now.flags:
                    result.outcome, result.detail = "failed", f"changed by someone else during the reboot ({now.state})"
                elif booted:
                    from datetime import UTC, datetime

                    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S")
                    state[name] = LocalNode(name, "DRAIN", text, now.reason_user, now.flags - {"REBOOT_ISSUED"}, stamp)
                    result.outcome, result.detail = "done", f"reboot requested into the drained state: {text} ({why})"
                else:
                    state[name] = LocalNode(name, "DOWN", f"{text} : reboot failed", now.reason_user,
                                            now.flags - {"REBOOT_ISSUED"}, now.boot_time)
                    result.outcome, result.detail = "failed", why
                self._save_nodes(state)
            results.append(self._finish(result))
        return results

    def _run_reboot_program(self, name: str) -> tuple[bool, str]:
        program = self.directory / self.REBOOT_PROGRAM
        if not os.access(program, os.X_OK):
            return False, f"no reboot program ({program} is missing or not executable): the node cannot be rebooted"
        try:
            done = subprocess.run([str(program), name], capture_output=True, text=True, errors="replace",
                                  timeout=self.REBOOT_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"{program} {name}: still running after {self.REBOOT_TIMEOUT_S:g} s (reboot timed out)"
        except OSError as exc:
            return False, f"{program} {name}: {exc.strerror or exc}"
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [f"exit {done.returncode}"]
            return False, f"{program.name} {name}: exit {done.returncode} ({tail[0][:200]})"
        return True, f"{program.name} {name}: exit 0"

    def set_reason(self, nodes: Iterable[str], reason: str, incident: str | None = None) -> list[ActionResult]:
        """Rewrite the reason of nodes spikeops drained (as ``SlurmScheduler.set_reason``)."""
        text = drain_reason(reason, incident)
        results = []
        with self._locked():
            names = _check_nodes(nodes)
            state = self._known(names)
            for name in names:
                node = state[name]
                result = ActionResult("reason", name, "", "", incident=incident or self.incident)
                if not node.drained_by_spikeops:
                    result.outcome, result.detail = "refused", f"{node.state} ({node.reason or 'no reason'}): not " \
                                                               "drained by spikeops, left alone"
                elif (node.reason or "").startswith(text):
                    result.outcome, result.detail = "nothing-to-do", f"already: {node.reason}"
                elif self.dry_run:
                    result.outcome, result.detail = "dry-run", f"would set the reason {text!r}"
                else:
                    state[name] = LocalNode(name, node.base_state, text, node.reason_user, node.flags, node.boot_time)
                    self._save_nodes(state)
                    result.outcome, result.detail = "done", f"reason: {text}"
                results.append(self._finish(result))
        return results

    def reboot_status(self, name: str, boot_before: str | None) -> tuple[str, str]:
        """Where a reboot stands (as ``SlurmScheduler.reboot_status``)."""
        node = self.nodes().get(name)
        return reboot_progress(node, boot_before, node.boot_time if node else None)

    def stop(self, job: str, *, signal: str | None = None, mode: str = "cancel", grace: float = 10.0) -> ActionResult:
        if mode not in STOP_MODES:
            raise InputError(f"unknown stop mode {mode!r} (known: {', '.join(STOP_MODES)})")
        info = self.show_job(job)
        result = ActionResult("stop", job, "", "", extra={"mode": mode, "state_before": info.state})
        if info.state != "RUNNING":
            result.outcome, result.detail = "nothing-to-do", f"already {info.state}"
            return self._finish(result)
        if self.dry_run:
            result.outcome, result.detail = "dry-run", (f"would send SIG{signal.removeprefix('SIG')}, then " if signal
                                                        else "would ") + f"{mode} pid {info.pid}"
            return self._finish(result)
        if signal:
            number = _signal_number(signal)
            _killpg(info.pid, number)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.show_job(job).state == "RUNNING":
                time.sleep(0.1)
            if self.show_job(job).state != "RUNNING":
                result.outcome, result.detail = "done", f"SIG{signal.removeprefix('SIG')} sent; the job ended by itself"
                return self._finish(result)
        _killpg(info.pid, signals.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(info.pid):
            time.sleep(0.05)
        if _alive(info.pid):
            _killpg(info.pid, signals.SIGKILL)
        info.state = "CANCELLED" if mode == "cancel" else "REQUEUED" if mode == "requeue" else "HELD"
        self._save_job(info)
        result.outcome, result.detail = "done", f"{mode}: {info.state}"
        return self._finish(result)

    def resume(self, job: str, checkpoint: str, *, exclude: Iterable[str] = (), resume_env: str = "SPIKEOPS_RESUME_FROM",
               key: str | None = None, env: Mapping[str, str] | None = None, on: Sequence[str] | None = None,
               action: str = "resume", **_: Any) -> ActionResult:
        """Start the job again on healthy nodes, with the environment it was submitted with,
        ``env`` (the remediation) and ``resume_env=checkpoint``; refused when its stored
        environment is gone rather than started with the caller's. ``on`` names exactly the
        nodes to run on (a replay of the spike window, ``action="replay"``)."""
        with self._locked():  # the check for an earlier resubmission and the submission, as one
            return self._resume(job, checkpoint, exclude=exclude, resume_env=resume_env, key=key, env=env, on=on,
                                action=action)

    def _resume(self, job: str, checkpoint: str, *, exclude: Iterable[str], resume_env: str, key: str | None,
                env: Mapping[str, str] | None, on: Sequence[str] | None, action: str) -> ActionResult:
        excluded = _check_nodes(exclude) if list(exclude) else []
        try:
            extra_env = check_env(env or {})
        except ValueError as exc:
            raise InputError(str(exc)) from None
        info = self.show_job(job)
        key = key or f"spikeops-resume:{job}:{checkpoint}"
        result = ActionResult(action, job, "", "", extra={"checkpoint": checkpoint, "exclude": fold_nodes(excluded)})
        existing = next((j for j in self.jobs() if j.comment == key), None)
        if existing is not None:
            result.outcome, result.detail = "nothing-to-do", f"already resubmitted as job {existing.job_id}"
            result.extra["new_job"] = existing.job_id
            return self._finish(result)
        known = self.nodes()
        if on is not None:
            nodes = _check_nodes(on)
            unusable = [n for n in nodes if n not in known or known[n].drained or known[n].down or n in excluded]
            if unusable:
                result.outcome, result.detail = "refused", f"cannot run on {fold_nodes(unusable)}"
                return self._finish(result)
        else:
            nodes = [n for n in info.nodes if n not in excluded]
            spare = [n for n in sorted(known) if n not in info.nodes and n not in excluded
                     and not known[n].drained and not known[n].down]
            nodes += spare[: len(info.nodes) - len(nodes)]
        if len(nodes) < len(info.nodes) and on is None:
            result.outcome, result.detail = "refused", f"not enough healthy nodes: {len(nodes)} of {len(info.nodes)}"
            return self._finish(result)
        own_env, source = self.job_environment(job)
        if own_env is None:
            result.outcome = "refused"
            result.detail = f"{source}; not restarted with the environment of the process resuming it"
            return self._finish(result)
        result.extra["environment"] = {"source": source, "variables": len(own_env)}
        if self.dry_run:
            result.outcome, result.detail = "dry-run", f"would start {' '.join(info.argv)} on {fold_nodes(nodes)}"
            return self._finish(result)
        if extra_env:
            result.extra["env"] = extra_env
        remediation = {**extra_env, resume_env: checkpoint}
        new = self.submit(info.argv, nodes, environment=resume_environment(own_env, remediation), env=remediation,
                          cwd=info.cwd, comment=key, exclude=excluded)
        result.extra["new_job"] = new
        result.outcome, result.detail = "done", f"{'started' if on is not None else 'resubmitted'} as job {new} on " \
            f"{fold_nodes(nodes)} from {checkpoint}"
        return self._finish(result)


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return True


def _killpg(pid: int | None, number: int) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, number)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_number(name: str) -> int:
    text = name.upper().removeprefix("SIG")
    if text.isdigit():
        return int(text)
    try:
        return int(getattr(signals, f"SIG{text}"))
    except AttributeError:
        raise InputError(f"unknown signal {name!r}") from None
