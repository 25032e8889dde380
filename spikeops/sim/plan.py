"""The incident plan: everything a bundle will show, decided before anything is written.

A scenario (one cause) and the distractors edit one ``Plan``: which steps spike, which rank
departs, which GPU logs an Xid and when, which counters grow. The renderers then turn the
plan into bytes. Keeping the decisions in one place is what makes the ground truth honest:
``Expected`` is read off the same plan the files are written from.

Planning runs in two phases because wall-clock times depend on step durations, which
causes change (a stalled collective, a throttled node, a restart gap): phase one edits
durations and step-indexed effects, ``freeze`` fixes the clock, and phase two places timed
evidence (kernel events, NCCL warnings) on it via ``after_freeze`` callbacks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from spikeops.sim.world import World

__all__ = [
    "ECC_KEYS",
    "GpuState",
    "IbPort",
    "Iface",
    "KernelEvent",
    "TimedLine",
    "NodeState",
    "RankOverride",
    "Resume",
    "Plan",
    "sub_rng",
]

#: nvidia-smi's ECC counters as the plan keeps them (volatile; aggregate adds lifetime counts).
ECC_KEYS = ("sram_corr", "sram_unc_parity", "sram_unc_secded", "dram_corr", "dram_unc")


def sub_rng(cause: str, seed: int, part: str) -> random.Random:
    """An independent, reproducible stream per concern: adding a draw to one part of the
    simulator must not reshuffle every other part of every bundle."""
    return random.Random(f"spikeops-sim/1:{cause}:{seed}:{part}")


@dataclass
class GpuState:
    index: int
    bus: str
    uuid: str
    serial: str
    module_id: int
    temp_c: int
    mem_temp_c: int
    power_w: float
    sm_clock_mhz: int
    pcie_replays: int
    util_pct: int
    mem_used_mib: int
    ecc_now: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ECC_KEYS, 0))
    ecc_base: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ECC_KEYS, 0))
    #: Lifetime counts from before the current driver load (aggregate = volatile + these).
    ecc_lifetime: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ECC_KEYS, 0))
    remap_now: tuple[int, int, bool, bool] = (0, 0, False, False)  # corr, unc, pending, failure
    remap_base: tuple[int, int, bool, bool] = (0, 0, False, False)
    thermal: bool = False
    reset_required: bool = False
    lost: bool = False


@dataclass
class IbPort:
    hca: str
    port: int
    ca_type: str
    fw: str
    guid: str
    link_layer: str
    rate: int
    base_lid: int
    sm_lid: int
    state: str = "Active"
    phys: str = "LinkUp"
    now_rate: int | None = None
    base: dict[str, int] = field(default_factory=dict)
    now: dict[str, int] = field(default_factory=dict)
    in_counters: bool = True  # a job port: listed in ib-counters.txt


@dataclass
class Iface:
    name: str
    base: dict[str, int]
    now: dict[str, int]


@dataclass
class KernelEvent:
    """Kernel messages logged together at one moment (an Xid with its context lines)."""

    time: float
    level: str
    messages: list[str]
    uptime: float | None = None  # only for plain dmesg, where the time is unknown


@dataclass
class TimedLine:
    time: float | None
    text: str


@dataclass
class NodeState:
    name: str
    index: int
    ip: str
    pid_base: int
    kernel_format: str
    boot: float
    gpus: list[GpuState]
    ports: list[IbPort]
    ifaces: list[Iface]
    nccl_version: str
    kernel_events: list[KernelEvent] = field(default_factory=list)
    nccl_lines: list[TimedLine] = field(default_factory=list)
    probe_errors: dict[str, str] = field(default_factory=dict)
    unreachable: bool = False
    smi_failure: str | None = None  # None, "stderr_only", "timeout"
    lost_bus: str | None = None
    #: Files of the job's own state on the node (``flight-recorder/NAME``, ``stacks/PID.txt``).
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass
class RankOverride:
    """One rank's values at one step, replacing the healthy ones (None keeps healthy)."""

    loss: float | None = None
    grad: float | None = None
    mem_add: float = 0.0


@dataclass
class Resume:
    """The run was restarted from checkpoint ``step``; ``index`` is the plan index of the
    first step the new run logged (``step + 1``). ``reference_until`` is the last step the
    run before the resume reached; ``data_changed`` says the data order did not survive."""

    step: int
    path: str
    index: int
    reference_until: int
    data_changed: bool
    gap_s: float
    reference: bool = True


@dataclass
class Plan:
    world: World
    cause: str
    seed: int
    n: int
    first_step: int
    dur: list[float]
    nodes: list[NodeState]
    rng: random.Random
    ckpt_interval: int
    ckpt_keep: int
    # Step-indexed effects (sparse: index -> value); see spikeops.sim.metrics.
    loss_factor: dict[int, float] = field(default_factory=dict)
    rank_loss_factor: dict[int, float] = field(default_factory=dict)
    grad_factor: dict[int, float] = field(default_factory=dict)
    rank_grad_factor: dict[int, float] = field(default_factory=dict)
    lr_factor_from: tuple[int, float] | None = None
    lr_peak_factor: float = 1.0
    nan_from: int | None = None
    rank_nan_from: int | None = None
    loss_scale: list[float] | None = None
    skipped: set[int] = field(default_factory=set)
    rank_overrides: dict[tuple[int, int], RankOverride] = field(default_factory=dict)
    batch_overrides: dict[tuple[int, int], dict[str, object]] = field(default_factory=dict)
    resume: Resume | None = None
    corrupt_checkpoints: dict[int, str] = field(default_factory=dict)
    # Ground truth (plan indices; converted to steps by Expected).
    symptom: str = "none"
    spike: int | None = None
    onset: int | None = None
    culprit_nodes: list[int] = field(default_factory=list)
    culprit_ranks: list[int] = field(default_factory=list)
    #: Nodes whose files carry the cause's evidence; distractors leave them alone.
    involved: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    distractors: list[str] = field(default_factory=list)
    # Timeline (after freeze).
    times: list[float] = field(default_factory=list)
    created: float = 0.0
    window_start: float = 0.0
    job_started: float = 0.0
    must_see: list[float] = field(default_factory=list)
    pauses: dict[int, float] = field(default_factory=dict)
    after_freeze: list[Callable[[Plan], None]] = field(default_factory=list)
    rank_window: tuple[int, int] = (0, 0)
    #: The node whose kernel log is plain ``dmesg`` (the ``plain_dmesg`` distractor).
    plain_node: int | None = None
    #: Nodes already carrying a distractor (each goes to its own node where possible).
    distractor_nodes: list[int] = field(default_factory=list)

    # -- steps and times ------------------------------------------------------------------
    @property
    def last_step(self) -> int:
        return self.first_step + self.n - 1

    def step(self, index: int) -> int:
        return self.first_step + index

    def index(self, step: int) -> int:
        return step - self.first_step

    @property
    def frozen(self) -> bool:
        return bool(self.times)

    def slow(self, start: int, end: int, factor: float) -> None:
        """Steps ``start..end-1`` take ``factor`` times longer (throttling, congestion)."""
        assert not self.frozen, "durations are fixed once the clock is frozen"
        for i in range(max(0, start), min(self.n, end)):
            self.dur[i] *= factor

    def stall(self, index: int, seconds: float) -> None:
        """Step ``index`` itself takes ``seconds`` longer (a hung collective)."""
        assert not self.frozen, "durations are fixed once the clock is frozen"
        self.dur[index] += seconds

    def pause(self, index: int, seconds: float) -> None:
        """Wall-clock time passes before step ``index`` starts (the job was down and
        restarted): the step's own duration, and so its throughput, stay normal."""
        assert not self.frozen, "durations are fixed once the clock is frozen"
        self.pauses[index] = self.pauses.get(index, 0.0) + seconds

    def freeze(self, clock_end: float) -> None:
        """Fix wall-clock times: the last step is logged at ``clock_end``."""
        total = 0.0
        cumulative = []
        pauses = self.pauses
        for index, value in enumerate(self.dur):
            total += value + (pauses.get(index, 0.0) if pauses else 0.0)
            cumulative.append(total)
        self.times = [clock_end - total + c for c in cumulative]

    def printed(self, moment: float) -> float:
        """A step's log time as the metrics file prints it (whole seconds or milliseconds)."""
        if self.world.metrics_form == "jsonl" and self.world.time_form != "iso":
            return math.floor(moment * 1000.0) / 1000.0
        return float(math.floor(moment))

    def event_time(self, index: int, rng: random.Random) -> float:
        """A moment during step ``index`` that every reader puts in that step: after the
        printed time of step index-1 even when the log prints whole seconds (dmesg -T, NCCL's
        stamps), and no later than the printed time of step ``index``, so "the first step
        logged at or after the event" is ``index`` whatever the precision on either side."""
        before = self.times[index - 1] if index > 0 else self.times[0] - self.dur[0]
        before = max(before, self.times[index] - self.dur[index])
        low = math.floor(before) + 1.0
        high = self.printed(self.times[index])
        if high <= low:
            return low
        return rng.uniform(low, min(high, low + 0.999))

    def time_of_step(self, step: int) -> float:
        """Log time of any step, extrapolated before the first logged one."""
        index = self.index(step)
        if index >= 0:
            return self.times[min(index, self.n - 1)]
        return self.times[0] - (-index) * self.world.step_seconds

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_steps(self) -> list[int]:
        """The checkpoints the job's storage still holds (the newest ``ckpt_keep``)."""
        k = self.ckpt_interval
        newest = self.last_step // k * k
        if self.resume is not None:
            newest = max(newest, self.resume.step)
        steps = [newest - i * k for i in range(self.ckpt_keep) if newest - i * k > 0]
        return sorted(steps)

    def checkpoint_path(self, step: int) -> str:
        """Where the job's storage keeps the checkpoint of ``step`` (the job's own naming)."""
        return f"{self.world.ckpt_root}/{self.world.ckpt_style.format(step=step)}"

    def verified_before(self, step: int | None) -> int | None:
        """The spec's resume rule: newest verified checkpoint strictly before ``step``."""
        if step is None:
            return None
        candidates = [s for s in self.checkpoint_steps() if s < step and s not in self.corrupt_checkpoints]
        return max(candidates) if candidates else None

    # -- nodes and ranks ------------------------------------------------------------------
    def healthy_nodes(self) -> list[int]:
        """Nodes that carry no evidence of the cause: where distractors may go."""
        blocked = set(self.culprit_nodes) | self.involved
        return [n.index for n in self.nodes if n.index not in blocked and not n.unreachable]


