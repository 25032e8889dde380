"""What the resumed job must do differently: the diagnosis's actions, as the job's environment.

The diagnosis names remediations (``skip_batches``, ``lr_test``, ``fix_rng_restore``,
``enable_nccl_debug``...); a resume that ignores them repeats the incident. The scheduler can
only pass a resubmitted job its environment, so each remediation a job can apply by itself
becomes one environment variable that ``spikeops.train.ResumeRequest`` reads (or, for NCCL,
the variable NCCL itself reads). A job that does not use ``spikeops.train`` still gets
``NCCL_DEBUG`` and can read the others in a few lines.

Remediations that need a person (check the data loader, the fabric, the cooling, align NCCL
versions) are listed apart, so the thread says what is left to do, and nothing pretends
they were done.

Values stay plain (``[A-Za-z0-9_.:/+@%=-]``, no comma, no newline, no space): a diagnosis is
data, and data must not smuggle shell or list syntax into a production job's environment. (The
resubmission itself carries any value: ``sbatch --export-file``, docs/schedulers.md.) These
variables are the only ones the resumed job gets beyond its own submission environment.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ResumePlan", "resume_plan", "ENV_SKIP_STEPS", "ENV_SKIP_RANKS", "ENV_LR_SCALE", "ENV_RESTORE_RNG",
           "ENV_DETECT_ANOMALY", "ENV_CLIP_GRAD", "ENV_DATA_FILTER", "check_env"]

ENV_SKIP_STEPS = "SPIKEOPS_SKIP_STEPS"
ENV_SKIP_RANKS = "SPIKEOPS_SKIP_RANKS"
ENV_LR_SCALE = "SPIKEOPS_LR_SCALE"
ENV_RESTORE_RNG = "SPIKEOPS_RESTORE_RNG"
ENV_DETECT_ANOMALY = "SPIKEOPS_DETECT_ANOMALY_STEPS"
ENV_CLIP_GRAD = "SPIKEOPS_CLIP_GRAD"
ENV_DATA_FILTER = "SPIKEOPS_DATA_FILTER"

#: The variables a job may be handed; anything else in an action's ``env`` is refused
#: (a diagnosis is data, and data must not set LD_PRELOAD on a production job).
_ALLOWED_FOREIGN = {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "TORCH_DISTRIBUTED_DEBUG",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                    "TORCH_NCCL_DUMP_ON_TIMEOUT"}
_NAME = re.compile(r"^[A-Z_][A-Z0-9_]{0,63}$")
_VALUE = re.compile(r"^[A-Za-z0-9_.:/+@%=-]{0,4096}$")

#: Actions a person must carry out; said in the thread, never done automatically.
_FOR_A_PERSON = {
    "check_dataloader": "check the data loader of ranks {ranks}",
    "check_loss_scale": "check the fp16 loss-scale settings (or move to bf16)",
    "check_fabric": "check the fabric of {nodes} (switch ports, cables, congestion control)",
    "align_nccl_version": "install one NCCL version on every node ({nodes} differ)",
    "check_cooling": "check the cooling and power capping of {nodes}",
    "quarantine_checkpoint": "find out what wrote the checkpoint that failed its checksums ({path}); "
                             "the flow marks it quarantined",
    "check_ranks": "find out why rank(s) {ranks} on {nodes} never joined the collective (their stacks are in "
                   "the bundle)",
    "fix_parallel_config": "fix the parallel configuration: rank(s) {ranks} issued another collective than their "
                           "peers (a software fault; resuming the same code hangs again)",
}
#: ... and for a checkpoint that verifies but gave the same anomaly after every resume from it.
_POISONED = ("find out why the run fails again after every load of {path} (it verifies: its state, not its files, "
             "is suspect); the flow marks it quarantined")


@dataclass
class ResumePlan:
    """The resumed job's extra environment, what each variable is for, and what is left to a person."""

    env: dict[str, str] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    for_a_person: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the thread: what the resumed job was told."""
        return "; ".join(self.applied) if self.applied else "no remediation beyond the resume itself"


def _numbers(values: Iterable[Any]) -> list[int]:
    out = []
    for value in values or ():
        try:
            out.append(int(value))
        except (TypeError, ValueError):
            continue
    return sorted(set(out))


def _fill(template: str, action: Mapping[str, Any]) -> str:
    def join(key: str) -> str:
        value = action.get(key)
        if isinstance(value, (list, tuple)):
            return ", ".join(str(v) for v in value) or "?"
        return str(value) if value is not None else "?"

    return template.format(ranks=join("ranks"), nodes=join("nodes"), path=join("path"))


def check_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment, or ValueError naming the first variable that is not safe to export."""
    for name, value in env.items():
        if not _NAME.match(name) or not (name.startswith("SPIKEOPS_") or name in _ALLOWED_FOREIGN):
            raise ValueError(f"refusing to set environment variable {name!r} on a job")
        if not _VALUE.match(value):
            raise ValueError(f"refusing value {value!r} for {name}: only [A-Za-z0-9_.:/+@%=-], no comma")
    return dict(env)


def resume_plan(actions: Iterable[Mapping[str, Any]], findings: Iterable[Mapping[str, Any]] = ()) -> ResumePlan:
    """The diagnosis's ``actions``, as a resume plan. Unknown kinds are ignored (a newer
    diagnosis may name more); malformed values are dropped, never passed on. ``findings``:
    any communication finding, even one that is not the primary cause, turns NCCL's debug
    output on, so the next occurrence leaves the evidence this one lacked."""
    actions = list(actions or ())
    if any(f.get("layer") == "communication" for f in findings or ()) \
            and not any(a.get("kind") == "enable_nccl_debug" for a in actions):
        actions.append({"kind": "enable_nccl_debug", "env": {"NCCL_DEBUG": "INFO"}})
    plan = ResumePlan()
    for action in actions:
        kind = action.get("kind")
        if kind == "skip_batches":
            steps = _numbers(action.get("steps") or [])
            if steps:
                plan.env[ENV_SKIP_STEPS] = ":".join(str(s) for s in steps)
                ranks = _numbers(action.get("ranks") or [])
                if ranks:
                    plan.env[ENV_SKIP_RANKS] = ":".join(str(r) for r in ranks)
                plan.applied.append(f"skip the batches of step{'s' if len(steps) > 1 else ''} "
                                    f"{', '.join(str(s) for s in steps)}")
        elif kind == "lr_test":
            try:
                factor = float(action.get("factor", 0.3))
            except (TypeError, ValueError):
                continue
            if 0 < factor < 1:
                plan.env[ENV_LR_SCALE] = f"{factor:g}"
                plan.applied.append(f"test at {factor:g}x LR")
        elif kind == "fix_rng_restore":
            plan.env[ENV_RESTORE_RNG] = "strict"
            plan.applied.append("restore RNG and sampler state strictly, and check batch fingerprints")
        elif kind == "detect_anomaly":
            steps = _numbers([action.get("steps", 10)])
            if steps and 0 < steps[0] <= 1000:
                plan.env[ENV_DETECT_ANOMALY] = str(steps[0])
                plan.applied.append(f"run the first {steps[0]} steps under detect_anomaly")
        elif kind == "clip_grad":
            try:
                norm = float(action.get("max_norm", 1.0))
            except (TypeError, ValueError):
                continue
            if norm > 0:
                plan.env[ENV_CLIP_GRAD] = f"{norm:g}"
                plan.applied.append(f"clip gradients at {norm:g}")
        elif kind == "filter_data":
            plan.env[ENV_DATA_FILTER] = "max_length:empty" if "length" in str(action.get("filter", "")) else "empty"
            plan.applied.append(f"filter the data ({action.get('filter') or 'empty samples'})")
        elif kind == "enable_flight_recorder":
            wanted = {str(k): str(v) for k, v in (action.get("env") or {"TORCH_FR_BUFFER_SIZE": "2000"}).items()}
            try:
                plan.env.update(check_env(wanted))
            except ValueError:
                plan.env["TORCH_FR_BUFFER_SIZE"] = "2000"
            plan.applied.append("flight recorder on (TORCH_FR_BUFFER_SIZE)")
        elif kind == "enable_nccl_debug":
            wanted = {str(k): str(v) for k, v in (action.get("env") or {"NCCL_DEBUG": "INFO"}).items()}
            try:
                plan.env.update(check_env(wanted))
            except ValueError:
                plan.env["NCCL_DEBUG"] = "INFO"
            plan.applied.append("NCCL_DEBUG=INFO")
        elif kind == "quarantine_checkpoint" and action.get("reason") == "poisoned":
            plan.for_a_person.append(_fill(_POISONED, action))
        elif kind in _FOR_A_PERSON:
            plan.for_a_person.append(_fill(_FOR_A_PERSON[kind], action))
    check_env(plan.env)
    return plan
