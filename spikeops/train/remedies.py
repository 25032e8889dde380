"""The job's side of a remediated resume: what spikeops asked the resumed run to do.

When the incident flow resubmits a job it passes the checkpoint and the diagnosis's
remediations as environment variables (``spikeops.remediation``). ``ResumeRequest.from_env()``
reads them back in the training script, so the seed's recovery steps (skip the bad batch,
test at 0.3x LR, restore the RNG strictly, locate the operator) are a few lines:

    request = ResumeRequest.from_env()
    if request.checkpoint: load(request.checkpoint)
    for step in ...:
        if request.skips(step, rank): continue
        lr = request.scale_lr(schedule(step))

A malformed variable is ignored with a warning rather than crashing the job: a resumed run
that starts is worth more than a perfect one that does not.

The replay gate (``spikeops.replay``) uses the same channel: ``SPIKEOPS_REPLAY=RUN`` with
``SPIKEOPS_REPLAY_UNTIL=STEP`` (and ``SPIKEOPS_REPLAY_OUT=DIR``) asks the job to replay the
steps after the checkpoint through STEP and record them (``request.replay``). There the
rule is the opposite: a malformed replay request is never ignored (the job would train for
real and write checkpoints), it is a ``problem`` the job must refuse to start with.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from spikeops.remediation import (
    ENV_CLIP_GRAD,
    ENV_DATA_FILTER,
    ENV_DETECT_ANOMALY,
    ENV_LR_SCALE,
    ENV_RESTORE_RNG,
    ENV_SKIP_RANKS,
    ENV_SKIP_STEPS,
)

__all__ = ["ResumeRequest", "ReplayRequest", "ENV_RESUME_FROM", "ENV_REPLAY", "ENV_REPLAY_UNTIL", "ENV_REPLAY_OUT",
           "ENV_RANK_NODES", "RUN_NAME"]

#: Where the scheduler puts the checkpoint to resume from (``SlurmConfig.resume_env``).
ENV_RESUME_FROM = "SPIKEOPS_RESUME_FROM"
#: The replay gate's request (spikeops.replay.plan): the run's name, its last step, its output.
ENV_REPLAY = "SPIKEOPS_REPLAY"
ENV_REPLAY_UNTIL = "SPIKEOPS_REPLAY_UNTIL"
ENV_REPLAY_OUT = "SPIKEOPS_REPLAY_OUT"
#: The node of each rank, in rank order (``a:b:c``): a job started one task per node derives
#: its rank from its node, so a replay can put any rank on any node.
ENV_RANK_NODES = "SPIKEOPS_RANK_NODES"
#: A replay's name is a folder of the bundle (``replay/RUN/``).
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _ints(text: str, name: str) -> frozenset[int]:
    out = set()
    for part in text.split(":"):
        if not part.strip():
            continue
        try:
            out.add(int(part))
        except ValueError:
            warnings.warn(f"{name}: ignoring {part!r} (not a step number)", stacklevel=3)
    return frozenset(out)


def _positive(text: str | None, name: str) -> float | None:
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value:
        warnings.warn(f"{name}: ignoring {text!r} (not a positive number)", stacklevel=3)
        return None
    return value


@dataclass(frozen=True)
class ReplayRequest:
    """A replay of the steps after the checkpoint through ``until``, recorded in
    ``out/replay.jsonl`` (``ReplayRecorder``), with no checkpoint written and none of the real
    run's files touched. ``problem`` says why the request cannot be honoured."""

    run: str
    until: int | None = None
    out: str | None = None
    rank_nodes: tuple[str, ...] = ()
    problem: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ReplayRequest | None:
        run = env.get(ENV_REPLAY, "").strip()
        if not run:
            return None
        problems = []
        if not RUN_NAME.match(run):
            problems.append(f"{ENV_REPLAY}={run!r} is not a run name (letters, digits, '_', '.', '-')")
        text = env.get(ENV_REPLAY_UNTIL, "").strip()
        until = int(text) if text.isdigit() and int(text) > 0 else None
        if until is None:
            problems.append(f"{ENV_REPLAY_UNTIL}={text!r}: a replay needs the step to replay through"
                            if text else f"{ENV_REPLAY_UNTIL} is not set: a replay needs the step to replay through")
        nodes = tuple(part for part in env.get(ENV_RANK_NODES, "").split(":") if part)
        return cls(run=run, until=until, out=env.get(ENV_REPLAY_OUT) or None, rank_nodes=nodes,
                   problem="; ".join(problems) or None)

    def directory(self, default_root: str | os.PathLike[str]) -> str:
        """Where replay.jsonl goes: ``SPIKEOPS_REPLAY_OUT``, else ROOT/replay/RUN."""
        return self.out or os.path.join(os.fspath(default_root), "replay", self.run)

    def describe(self) -> str:
        return f"replay {self.run!r} through step {self.until}" + (f" into {self.out}" if self.out else "")


@dataclass(frozen=True)
class ResumeRequest:
    checkpoint: str | None = None
    skip_steps: frozenset[int] = field(default_factory=frozenset)
    #: Ranks whose batches to skip at ``skip_steps``; empty means every rank's.
    skip_ranks: frozenset[int] = field(default_factory=frozenset)
    lr_scale: float = 1.0
    strict_rng: bool = False
    detect_anomaly_steps: int = 0
    clip_grad: float | None = None
    data_filters: frozenset[str] = field(default_factory=frozenset)
    #: Set when the job is to replay, not train (``SPIKEOPS_REPLAY``).
    replay: ReplayRequest | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ResumeRequest:
        env = os.environ if environ is None else environ
        scale = _positive(env.get(ENV_LR_SCALE), ENV_LR_SCALE)
        anomaly = _positive(env.get(ENV_DETECT_ANOMALY), ENV_DETECT_ANOMALY)
        return cls(
            checkpoint=env.get(ENV_RESUME_FROM) or None,
            skip_steps=_ints(env.get(ENV_SKIP_STEPS, ""), ENV_SKIP_STEPS),
            skip_ranks=_ints(env.get(ENV_SKIP_RANKS, ""), ENV_SKIP_RANKS),
            lr_scale=scale if scale is not None and scale <= 1 else 1.0,
            strict_rng=env.get(ENV_RESTORE_RNG, "").lower() in ("strict", "1", "true", "yes"),
            detect_anomaly_steps=int(anomaly) if anomaly else 0,
            clip_grad=_positive(env.get(ENV_CLIP_GRAD), ENV_CLIP_GRAD),
            data_filters=frozenset(p for p in env.get(ENV_DATA_FILTER, "").split(":") if p),
            replay=ReplayRequest.from_env(env),
        )

    @property
    def remediated(self) -> bool:
        """Whether spikeops asked for anything beyond the plain resume."""
        return bool(self.skip_steps or self.lr_scale != 1.0 or self.strict_rng or self.detect_anomaly_steps
                    or self.clip_grad or self.data_filters)

    def skips(self, step: int, rank: int | None = None) -> bool:
        """Whether this step's batch (this rank's, when ranks were named) is to be skipped."""
        if step not in self.skip_steps:
            return False
        return not self.skip_ranks or rank is None or rank in self.skip_ranks

    def scale_lr(self, lr: float) -> float:
        """The LR for the 0.3x test (never raises an LR: a scale above 1 is ignored)."""
        return lr * self.lr_scale

    def describe(self) -> str:
        parts = []
        if self.skip_steps:
            parts.append(f"skipping step(s) {sorted(self.skip_steps)}"
                         + (f" on rank(s) {sorted(self.skip_ranks)}" if self.skip_ranks else ""))
        if self.lr_scale != 1.0:
            parts.append(f"LR x{self.lr_scale:g}")
        if self.strict_rng:
            parts.append("strict RNG restore")
        if self.detect_anomaly_steps:
            parts.append(f"detect_anomaly for {self.detect_anomaly_steps} steps")
        if self.clip_grad:
            parts.append(f"clip at {self.clip_grad:g}")
        if self.data_filters:
            parts.append("filters " + ", ".join(sorted(self.data_filters)))
        if self.replay is not None:
            parts.append(self.replay.describe())
        return "; ".join(parts) or "plain resume"
