"""Distractors: true but irrelevant evidence planted beside the cause.

Real bundles are never clean. A node logged an Xid last week, an application crashed a GPU
context inside the window, a counter has been non-zero since before the job, a checkpoint
from days ago failed its check, one node could not be reached, a probe timed out. None of
these changes the answer; each tempts a diagnosis that reads evidence without its time,
its class or its baseline. Every distractor goes on a node that carries none of the
cause's evidence (``Plan.healthy_nodes``) and leaves the ground truth untouched; one that
cannot be planted without touching it is skipped (and not listed in ``Expected``).

Planting runs in the plan's phases: ``plant_structural`` before the clock is frozen (a
resume changes step durations), ``plant_timed`` once the window is known (an Xid "days
before the window" or "inside it" needs the window).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from spikeops.sim.model import DISTRACTORS, RESUME_CAUSES
from spikeops.sim.plan import KernelEvent, Plan, Resume
from spikeops.sim.render import xid_lines
from spikeops.sim.scenarios import corruption_text

__all__ = ["choose", "plant_structural", "plant_timed", "compatible"]

_DAY = 86400.0


def compatible(cause: str, name: str) -> bool:
    """Whether a distractor can go with a cause at all (a resume cause owns the resume)."""
    if name not in DISTRACTORS:
        raise ValueError(f"unknown distractor {name!r}; known: {', '.join(DISTRACTORS)}")
    return not (name == "intact_resume" and cause in RESUME_CAUSES)


def choose(plan: Plan, requested: bool | Iterable[str], rng: random.Random) -> list[str]:
    """The distractors to plant: a seeded subset of the compatible ones, or exactly those
    asked for (ValueError for an unknown name or one that can never go with the cause)."""
    if requested is False:
        return []
    if requested is True:
        pool = [name for name in DISTRACTORS if compatible(plan.cause, name)]
        return sorted(rng.sample(pool, rng.randint(1, min(4, len(pool)))), key=DISTRACTORS.index)
    names = list(dict.fromkeys([requested] if isinstance(requested, str) else requested))
    for name in names:
        if not compatible(plan.cause, name):
            raise ValueError(f"distractor {name!r} cannot go with cause {plan.cause!r}")
    return sorted(names, key=DISTRACTORS.index)


def _free_node(plan: Plan, rng: random.Random, *, strict: bool = False, needs: str | None = None) -> int | None:
    """A healthy node for one distractor, preferring nodes no other distractor uses (a
    ``strict`` one, like an unreachable node, never shares: it would hide the other).
    ``needs`` names a probe the distractor shows in, which must not have failed there."""
    healthy = [n for n in plan.healthy_nodes() if needs is None or needs not in plan.nodes[n].probe_errors]
    candidates = [n for n in healthy if n not in plan.distractor_nodes]
    if not candidates and not strict:
        candidates = healthy
    if not candidates:
        return None
    index = rng.choice(candidates)
    plan.distractor_nodes.append(index)
    return index


def _free_nodes(plan: Plan, rng: random.Random, most: int) -> list[int]:
    chosen: list[int] = []
    for _ in range(rng.randint(1, most)):
        index = _free_node(plan, rng)
        if index is not None and index not in chosen:
            chosen.append(index)
    return chosen


def _majority_safe(plan: Plan, index: int) -> bool:
    """For a version mismatch, a majority node may lose evidence only while the majority
    stays larger than the minority."""
    if plan.cause != "nccl_version_mismatch":
        return True
    usable = [n for n in plan.nodes if not n.unreachable and not n.probe_errors and n.index != index]
    majority = [n for n in usable if n.index not in plan.culprit_nodes]
    return len(majority) > len(plan.culprit_nodes) + 1


def _intact_resume(plan: Plan, rng: random.Random) -> bool:
    """A resume whose data order survived: ``reference/`` fingerprints equal the current
    ones. The run before it died before the incident's onset, so the reference holds only
    healthy steps."""
    k = plan.ckpt_interval
    first_rank_step = plan.step(plan.rank_window[0])
    anchor = plan.onset if plan.onset is not None else plan.spike
    limit = plan.step(anchor) if anchor is not None else plan.last_step + 1
    step = (first_rank_step - 1) // k * k
    if step + k - 1 < first_rank_step:  # the window starts on a checkpoint step
        step = first_rank_step
    until = min(step + k - 1, limit - 1, plan.last_step)
    if step <= 0 or until < max(first_rank_step, step + 1):
        return False
    index = plan.index(step + 1)
    gap = (until - step) * plan.world.step_seconds + rng.uniform(400.0, 1800.0)
    plan.resume = Resume(step, plan.checkpoint_path(step), index, until, False, gap)
    if 0 < index < plan.n:
        plan.pause(index, gap)
    plan.ckpt_keep = max(plan.ckpt_keep, (plan.last_step // k * k - step) // k + 1)
    return True


def _corrupt_old(plan: Plan, rng: random.Random) -> bool:
    steps = plan.checkpoint_steps()
    keep_out = {plan.resume.step} if plan.resume is not None else set()
    anchor = plan.onset
    resume_from = plan.verified_before(plan.step(anchor)) if anchor is not None else None
    if resume_from is not None:
        candidates = [s for s in steps if s < resume_from and s not in keep_out and s not in plan.corrupt_checkpoints]
    else:
        candidates = [s for s in steps[:-1] if s not in keep_out and s not in plan.corrupt_checkpoints]
    if not candidates:
        return False
    plan.corrupt_checkpoints[rng.choice(candidates)] = corruption_text(rng)
    return True


def _steady_ecc(plan: Plan, rng: random.Random) -> bool:
    nodes = _free_nodes(plan, rng, 3)
    if not nodes:
        return False
    for index in nodes:
        gpu = plan.nodes[index].gpus[rng.randrange(len(plan.nodes[index].gpus))]
        volatile = rng.randint(1, 400)
        gpu.ecc_base["dram_corr"] = gpu.ecc_now["dram_corr"] = volatile
        gpu.ecc_lifetime["dram_corr"] += rng.randint(0, 900)
        if rng.random() < 0.4:
            gpu.remap_base = gpu.remap_now = (1, 0, False, False)
    return True


def _steady_pause(plan: Plan, rng: random.Random) -> bool:
    nodes = _free_nodes(plan, rng, 3)
    if not nodes:
        return False
    for index in nodes:
        for iface in plan.nodes[index].ifaces:
            for name in ("rx_pause_ctrl_phy", "tx_pause_ctrl_phy", "rx_prio3_pause", "tx_prio3_pause",
                         "rx_discards_phy", "rx_out_of_buffer", "rx_prio3_discards"):
                value = rng.randrange(1_000_000, 900_000_000)
                iface.base[name] = iface.now[name] = value
            for name in ("tx_mac_control_phy", "rx_mac_control_phy"):
                iface.base[name] = iface.now[name] = iface.base[name.replace("mac_control", "pause_ctrl")]
    return True


def _unreachable(plan: Plan, rng: random.Random) -> bool:
    if len(plan.nodes) < 2:
        return False
    index = _free_node(plan, rng, strict=True)
    if index is None or not _majority_safe(plan, index):
        return False
    plan.nodes[index].unreachable = True
    return True


def _missing_probe(plan: Plan, rng: random.Random) -> bool:
    index = _free_node(plan, rng)
    if index is None or not _majority_safe(plan, index):
        return False
    node = plan.nodes[index]
    probes = ["nvidia-smi-q", "kernel", "ibstat", "ib-counters", "nccl", "nccl-version"]
    probes += [f"ethtool-{iface.name}" for iface in node.ifaces]
    node.probe_errors[rng.choice(probes)] = "timeout"
    return True


def _plain_dmesg(plan: Plan, rng: random.Random) -> bool:
    index = _free_node(plan, rng, needs="kernel")
    if index is None:
        return False
    node = plan.nodes[index]
    node.kernel_format = "plain"
    plan.plain_node = index
    return True


def plant_structural(plan: Plan, names: list[str], rng: random.Random) -> list[str]:
    """Plant what must exist before the clock is frozen; returns the names planted."""
    planted = []
    actions = {
        "intact_resume": _intact_resume,
        "corrupt_old_checkpoint": _corrupt_old,
        "steady_correctable_ecc": _steady_ecc,
        "steady_pause": _steady_pause,
        "unreachable_node": _unreachable,
        "missing_probe": _missing_probe,
        "plain_dmesg": _plain_dmesg,
    }
    for name in names:
        action = actions.get(name)
        if action is None:
            planted.append(name)  # timed: planted later, kept in order
            continue
        if action(plan, rng):
            planted.append(name)
        else:
            plan.notes.append(f"distractor {name} skipped: no place for it in this bundle")
    return planted


def _xid_event(plan: Plan, index: int, codes: tuple[int, ...], moment: float, rng: random.Random,
               uptime: float | None = None) -> KernelEvent:
    node = plan.nodes[index]
    gpu = node.gpus[rng.randrange(len(node.gpus))]
    code = rng.choice(codes)
    pid = rng.randrange(3000, 4_000_000)
    if code == 48:
        gpu.ecc_lifetime["dram_unc"] += 1
        corr, unc, _, _ = gpu.remap_base
        gpu.remap_base = gpu.remap_now = (corr, unc + 1, False, False)
    return KernelEvent(moment, "warn", xid_lines(code, gpu, pid, rng), uptime=uptime)


def plant_timed(plan: Plan, names: list[str], rng: random.Random) -> list[str]:
    """Plant the distractors that need the window; returns the names kept."""
    kept = []
    for name in names:
        if name == "old_xid":
            index = _free_node(plan, rng, needs="kernel")
            if index is None:
                plan.notes.append("distractor old_xid skipped: no healthy node")
                continue
            node = plan.nodes[index]
            moment = plan.window_start - rng.uniform(1.0, 20.0) * _DAY
            node.boot = min(node.boot, moment - rng.uniform(0.1, 6.0) * _DAY)
            node.kernel_events.append(_xid_event(plan, index, (79, 48), moment, rng))
        elif name == "app_xid":
            index = _free_node(plan, rng, needs="kernel")
            if index is None:
                plan.notes.append("distractor app_xid skipped: no healthy node")
                continue
            node = plan.nodes[index]
            gpu = node.gpus[rng.randrange(len(node.gpus))]
            moment = rng.uniform(plan.window_start + 5.0, plan.created - 5.0)
            pid = rng.randrange(3000, 4_000_000)
            first = rng.choice((13, 31))
            lines = [line for _ in range(rng.randint(1, 3)) for line in xid_lines(first, gpu, pid, rng)]
            node.kernel_events.append(KernelEvent(moment, "warn", lines))
            node.kernel_events.append(KernelEvent(moment + rng.uniform(0.001, 0.05), "warn",
                                                  xid_lines(43, gpu, pid, rng)))
        elif name == "plain_dmesg":
            index = plan.plain_node
            if index is None:
                continue
            node = plan.nodes[index]
            uptime = rng.uniform(600.0, max(900.0, plan.job_started - node.boot - 600.0))
            node.kernel_events.append(_xid_event(plan, index, (79, 48, 94, 119), node.boot + uptime, rng, uptime))
        kept.append(name)
    return kept
