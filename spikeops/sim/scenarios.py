"""One scenario per cause of the diagnosis spec: what the cause does to the plan.

Each scenario encodes the spec's "what shows it" column and the domain notes
(shared/seed-loss-spike-debugging.txt), not any engine's rules:

- data causes leave their trace in one rank's batch descriptor and values (overlong or empty
  samples, a rank departing from its peers) or in the data order after a resume;
- numeric causes show in the global curves: a grad norm climbing before the spike, an LR
  that jumped or peaked too high, an fp16 loss scale collapsing through repeated overflow;
- communication causes move every rank at once and leave NCCL/PyTorch lines, NIC counters
  or mixed NCCL versions behind; a hang (one rank never enters a collective) or a collective
  mismatch (some ranks issue another one) stops the step counter with no loss anomaly, and
  leaves every rank's flight recorder dump and the processes' stacks on their nodes;
- hardware causes are node-correlated: an Xid, ECC growth against the baseline, a link
  that went down, a GPU that throttles;
- a checkpoint cause is a resume from a checkpoint whose manifest check failed.

Phase one (the function itself) sets step-indexed effects and durations; evidence that
needs wall-clock time is placed by a callback appended to ``plan.after_freeze``. Every
scenario sets the plan's ground truth: symptom, spike and onset indices, culprits.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from spikeops.sim.collectives import DUMP_PREFIX, STUCK_FRAMES, WAITING_FRAMES, RankScript, dump_bytes, stack_text
from spikeops.sim.metrics import breathing_loss_scale, healthy_grad, healthy_loss
from spikeops.sim.model import CAUSES
from spikeops.sim.plan import KernelEvent, NodeState, Plan, RankOverride, Resume, TimedLine, sub_rng
from spikeops.sim.render import glog_stamp, nccl_warn_prefix, xid_lines
from spikeops.sim.world import NCCL_RELEASES

__all__ = ["SCENARIOS", "MIN_STEPS", "GPU_XIDS", "MEMORY_XIDS", "corruption_text"]

#: The shortest run a scenario can be planted in (a running level, a precursor, a tail).
MIN_STEPS = 150
#: GPU-implicating Xids that are not memory-class (gpu_xid), and memory-class ones (gpu_ecc).
GPU_XIDS = (62, 74, 79, 119, 120)
MEMORY_XIDS = (48, 63, 64, 94, 95)

Scenario = Callable[[Plan], None]


# ---------------------------------------------------------------------------- shared shapes


def _tail_index(p: Plan, low: int, high: int) -> int:
    """A spike index leaving ``low..high`` logged steps after it (fewer on short runs)."""
    high = min(high, p.n - 60)
    low = min(low, high)
    return p.n - 1 - p.rng.randint(low, high)


def _spike_for(p: Plan, symptom: str) -> int:
    if symptom == "instant_nan":
        return _tail_index(p, 2, 10)
    if symptom == "spike_no_recovery":
        return _tail_index(p, 18, 45)
    return _tail_index(p, 12, 40)


def _cap(p: Plan, j: int, factor: float) -> float:
    """A jump never takes the loss far past ln(vocab) (what an untrained model scores): early
    in training, where the loss is still high, jumps are smaller, but always far above
    the running level."""
    level = healthy_loss(p.world.curve, p.step(j))
    return min(factor, max(1.45, 0.95 * p.world.curve.loss_start / level))


def _single_spike(p: Plan, j: int, factor: float, grad: float) -> None:
    """One step far above the running level, then back to it within a few steps."""
    rng = p.rng
    factor = _cap(p, j, factor)
    echo = rng.uniform(0.12, 0.3)
    p.loss_factor[j] = factor
    p.loss_factor[j + 1] = 1.0 + (factor - 1.0) * echo
    p.loss_factor[j + 2] = 1.0 + (factor - 1.0) * echo * 0.25
    p.loss_factor[j + 3] = 1.0 + (factor - 1.0) * 0.015
    p.grad_factor[j] = grad
    p.grad_factor[j + 1] = max(1.0, math.sqrt(grad) * 0.8)
    p.grad_factor[j + 2] = max(1.0, math.sqrt(math.sqrt(grad)))


def _no_recovery(p: Plan, j: int, factor: float, grad: float) -> None:
    """A jump that stays: the loss plateaus (or keeps creeping up) above its old level."""
    rng = p.rng
    factor = _cap(p, j, factor)
    climb = rng.choice((0.0, 0.0, 0.002, 0.004))
    for i in range(j, p.n):
        p.loss_factor[i] = factor * (1.0 + climb * (i - j)) * (1.0 + rng.gauss(0.0, 0.02))
        p.grad_factor[i] = grad * math.exp(rng.gauss(0.0, 0.25))


def _nan(p: Plan, j: int, *, ranks_from: int | None = None) -> None:
    p.nan_from = j
    p.rank_nan_from = j if ranks_from is None else ranks_from


def _shape(p: Plan, symptom: str, j: int, factor: float, grad: float) -> None:
    if symptom == "instant_nan":
        _nan(p, j)
    elif symptom == "spike_no_recovery":
        _no_recovery(p, j, factor, grad)
    else:
        _single_spike(p, j, factor, grad)


def _pick(rng: random.Random, weighted: tuple[tuple[str, float], ...]) -> str:
    roll = rng.random() * sum(w for _, w in weighted)
    for name, weight in weighted:
        roll -= weight
        if roll <= 0:
            return name
    return weighted[-1][0]


def _truth(p: Plan, symptom: str, spike: int | None, onset: int | None) -> None:
    p.symptom, p.spike, p.onset = symptom, spike, onset


def _see_step(p: Plan, index: int) -> None:
    """Ask the window to show the running level just before ``index`` (phase two)."""
    p.after_freeze.append(lambda plan: plan.must_see.append(plan.times[max(0, index - 1)]))


def _one_rank_spike(p: Plan, j: int, rank: int, symptom: str, *, mem_add: float) -> None:
    """A spike one rank's batch caused: at ``j`` only that rank departs (on small jobs its
    values carry the whole global jump, the global loss being the ranks' mean), from ``j+1``
    everyone feels the bad update."""
    rng = p.rng
    world = p.world
    step = p.step(j)
    base = healthy_loss(world.curve, step)
    if symptom == "instant_nan":
        _nan(p, j, ranks_from=j + 1)
        p.rank_overrides[(j, rank)] = RankOverride(loss=math.nan, grad=math.nan, mem_add=mem_add)
        return
    factor = _cap(p, j, rng.uniform(1.6, 3.5))
    grad = rng.uniform(8.0, 60.0)
    _single_spike(p, j, factor, grad)
    p.rank_loss_factor[j] = 1.0
    p.rank_grad_factor[j] = 1.0
    # The rank's own loss carries the jump (the logged loss is the ranks' mean), up to what a
    # per-token cross-entropy can reach before it overflows outright.
    culprit_loss = min(base * (1.0 + (factor - 1.0) * world.ranks), rng.uniform(30.0, 120.0))
    culprit_grad = healthy_grad(world.curve, step) * grad * world.ranks * world.curve.rank_grad_scale
    p.rank_overrides[(j, rank)] = RankOverride(loss=culprit_loss, grad=culprit_grad, mem_add=mem_add)


def _require_nodes(p: Plan, count: int) -> None:
    if len(p.nodes) < count:
        raise ValueError(f"cause {p.cause!r} needs at least {count} nodes (got {len(p.nodes)})")


def _align_first_step(p: Plan, index: int, multiple: int, *, low: int = 1000, high: int = 400_000) -> None:
    """Shift the run's step numbers so the step at ``index`` is a multiple of ``multiple``."""
    rng = p.rng
    m = rng.randrange(max(1, (low + index) // multiple + 1), max(2, (high + index) // multiple))
    p.first_step = m * multiple - index


# ------------------------------------------------------------------------------- data


def overlong_sample(p: Plan) -> None:
    """One rank's batch at the spike step holds a sample 50-300x max_length; that rank alone
    departs at the spike, the global loss jumps (or goes NaN), everyone feels the bad update
    after."""
    rng = p.rng
    symptom = _pick(rng, (("single_spike", 0.75), ("instant_nan", 0.25)))
    j = _spike_for(p, symptom)
    rank = rng.randrange(p.world.ranks)
    length = p.world.max_length
    longest = int(length * rng.uniform(50.0, 300.0))
    override: dict[str, object] = {"max_tokens": longest}
    if p.world.micro_batch == 1:
        override["min_tokens"] = longest
    p.batch_overrides[(j, rank)] = override
    _one_rank_spike(p, j, rank, symptom, mem_add=rng.uniform(6.0, 14.0))
    _truth(p, symptom, j, j)
    p.culprit_ranks = [rank]
    p.involved.add(p.world.node_of_rank(rank))
    _see_step(p, j)
    p.notes.append(f"rank {rank}'s batch at the spike step holds a {longest}-token sample (max_length {length})")


def corrupted_sample(p: Plan) -> None:
    """One rank's batch at the spike step holds empty (zero-token) samples; same per-rank
    signature as an overlong sample, with ``num_empty`` > 0 instead."""
    rng = p.rng
    p.world.micro_batch = max(2, p.world.micro_batch)
    symptom = _pick(rng, (("single_spike", 0.8), ("instant_nan", 0.2)))
    j = _spike_for(p, symptom)
    rank = rng.randrange(p.world.ranks)
    empty = rng.randint(1, max(1, p.world.micro_batch - 1))
    p.batch_overrides[(j, rank)] = {"num_empty": empty, "min_tokens": 0}
    _one_rank_spike(p, j, rank, symptom, mem_add=-rng.uniform(0.5, 3.0))
    _truth(p, symptom, j, j)
    p.culprit_ranks = [rank]
    p.involved.add(p.world.node_of_rank(rank))
    _see_step(p, j)
    p.notes.append(f"rank {rank}'s batch at the spike step has {empty} empty sample(s)")


def rng_not_restored(p: Plan) -> None:
    """The run resumed from a checkpoint with a different data seed: fingerprints differ from
    ``reference/`` for the same steps, and the loss trend turns upward over hundreds of steps
    with no single jump."""
    rng = p.rng
    interval = rng.choice((500, 1000, 2000))
    p.ckpt_interval = interval
    high = min(400, p.n - 60, interval - 2)
    low = min(150, high)
    after = rng.randint(low, high)  # steps logged by the new run
    resume_index = p.n - after
    _align_first_step(p, resume_index - 1, interval, low=20_000)  # late enough for a flat trend
    step = p.step(resume_index - 1)
    until = rng.randint(p.last_step, step + interval - 1)
    gap = (until - step) * p.world.step_seconds + rng.uniform(400.0, 1800.0)
    p.resume = Resume(step, p.checkpoint_path(step), resume_index, until, True, gap)
    p.pause(resume_index, gap)
    rise = rng.uniform(0.08, 0.2)
    power = rng.uniform(1.0, 1.6)
    for i in range(resume_index, p.n):
        p.loss_factor[i] = 1.0 + rise * ((i - resume_index + 1) / after) ** power
        p.grad_factor[i] = 1.0 + rise * 0.8 * ((i - resume_index + 1) / after) ** power
    _truth(p, "creeping_increase", None, resume_index)
    p.notes.append(f"resumed from step {step} with a different data seed; loss creeps up {rise:.0%} over "
                   f"{after} steps")


def rank_data_misalignment(p: Plan) -> None:
    """One rank reads the wrong samples (a neighbour's, or its previous batch) for a stretch:
    its loss, grad norm and memory depart while its peers stay normal, then the global loss
    spikes. No hardware evidence on its node."""
    rng = p.rng
    world = p.world
    j = _tail_index(p, 12, 40)
    start = j - rng.randint(3, 12)
    end = j + rng.randint(0, 3)
    rank = rng.randrange(world.ranks)
    other = (rank + rng.randrange(1, world.ranks)) % world.ranks if world.ranks > 1 else rank
    stale = rng.random() < 0.5 or world.ranks == 1
    level_loss = rng.uniform(1.4, 2.4)
    level_grad = rng.uniform(6.0, 25.0)
    memory = rng.uniform(4.0, 12.0)
    for i in range(start, end + 1):
        step = p.step(i)
        loss = healthy_loss(world.curve, step) * level_loss * (1.0 + rng.gauss(0.0, 0.05))
        grad = healthy_grad(world.curve, step) * world.curve.rank_grad_scale * level_grad * math.exp(rng.gauss(0, 0.2))
        p.rank_overrides[(i, rank)] = RankOverride(loss=loss, grad=grad, mem_add=memory + rng.gauss(0.0, 0.4))
        p.batch_overrides[(i, rank)] = {"same_as": (step - 1, rank) if stale else (step, other)}
    _single_spike(p, j, rng.uniform(1.45, 2.3), rng.uniform(4.0, 15.0))
    _truth(p, "single_spike", j, start)
    p.culprit_ranks = [rank]
    p.involved.add(world.node_of_rank(rank))
    _see_step(p, start)
    how = "re-reads its previous batch" if stale else f"reads rank {other}'s samples"
    p.notes.append(f"rank {rank} {how} from step {p.step(start)} to {p.step(end)}")


# ---------------------------------------------------------------------------- numeric


def grad_explosion(p: Plan) -> None:
    """The global grad norm climbs x1.5-3 per step for 5-15 steps before the loss spike; every
    batch is clean."""
    rng = p.rng
    symptom = _pick(rng, (("single_spike", 0.6), ("instant_nan", 0.25), ("spike_no_recovery", 0.15)))
    j = _spike_for(p, symptom)
    climb = rng.randint(5, 15)
    start = j - climb
    factor = 1.0
    for i in range(start, j + 1):
        factor *= rng.uniform(1.5, 3.0)
        p.grad_factor[i] = factor
    if symptom == "instant_nan":
        _nan(p, j)
    elif symptom == "spike_no_recovery":
        _no_recovery(p, j, rng.uniform(1.5, 2.6), factor * 0.05)
        p.grad_factor[j] = factor
    else:
        spike_grad = factor
        _single_spike(p, j, rng.uniform(1.6, 3.2), spike_grad)
    _truth(p, symptom, j, start)
    _see_step(p, start)
    p.notes.append(f"grad norm climbs for {climb} steps from step {p.step(start)}, x{factor:.3g} at the spike")


def lr_too_high(p: Plan) -> None:
    """The LR schedule jumps x3-10 a few steps before a jump that does not recover, or a warmup
    peaks 3-8x too high and the loss breaks near the peak."""
    rng = p.rng
    world = p.world
    if rng.random() < 0.7:
        j = _tail_index(p, 18, 45)
        change = j - rng.randint(1, 8)
        factor = rng.uniform(3.0, 10.0)
        p.lr_factor_from = (change, factor)
        for i in range(change, j):
            p.grad_factor[i] = rng.uniform(1.2, 2.0)
        _no_recovery(p, j, rng.uniform(1.5, 2.6), rng.uniform(2.0, 5.0))
        _truth(p, "spike_no_recovery", j, change)
        _see_step(p, change)
        p.notes.append(f"LR schedule jumps x{factor:.1f} at step {p.step(change)}")
        return
    # A warmup that peaks too high: the loss breaks as the LR nears the (too high) peak. The
    # break comes late enough in training that the loss has left its first steep descent.
    curve = world.curve
    target = min(6.0, curve.loss_floor + 0.45 * (curve.loss_start - curve.loss_floor))
    earliest = curve.tau * ((curve.loss_start - curve.loss_floor) / (target - curve.loss_floor)) ** (1 / curve.alpha)
    tail = rng.randint(18, min(45, p.n - 60))
    j = p.n - 1 - tail
    breaks = max(int(earliest), p.n + 50) + rng.randint(0, 3000)
    p.first_step = breaks - j
    curve.warmup = breaks + rng.randint(-15, 5)
    p.lr_peak_factor = rng.uniform(3.0, 8.0)
    p.ckpt_interval = rng.choice((100, 200, 250))
    level = healthy_loss(curve, breaks)
    factor = min(rng.uniform(1.4, 1.9), 0.92 * curve.loss_start / level)
    _no_recovery(p, j, factor, rng.uniform(2.0, 5.0))
    _truth(p, "spike_no_recovery", j, j)
    _see_step(p, j)
    p.notes.append(f"warmup peaks at {p.lr_peak_factor:.1f}x the planned LR; loss breaks near the peak")


def loss_scale_collapse(p: Plan) -> None:
    """fp16: the loss scale halves on every step (skipped steps) down to below 1, then the loss
    spikes and stays up or goes NaN."""
    rng = p.rng
    symptom = _pick(rng, (("instant_nan", 0.5), ("spike_no_recovery", 0.5)))
    j = _spike_for(p, symptom)
    floor_exponent = -rng.randint(2, 5)
    # Normal breathing before, kept quiet over the collapse and the 40 steps before it so
    # its first halving is unambiguous (a collapse is at most ~30 halvings long).
    scales, skipped = breathing_loss_scale(sub_rng(p.cause, p.seed, "loss-scale"), p.n, quiet=(j - 75, p.n))
    halvings = int(round(math.log2(scales[j - 35]))) - floor_exponent
    start = max(40, j - halvings)
    scale = scales[start - 1]
    for i in range(start, p.n):
        if i < j:
            scale /= 2.0
            skipped.add(i)
        scales[i] = scale
    p.loss_scale, p.skipped = scales, skipped
    level = healthy_loss(p.world.curve, p.step(start))
    for i in range(start, j):
        p.loss_factor[i] = level / healthy_loss(p.world.curve, p.step(i))
    _shape(p, symptom, j, rng.uniform(1.5, 2.6), rng.uniform(2.0, 6.0))
    _truth(p, symptom, j, start)
    _see_step(p, start)
    p.notes.append(f"loss scale halves on every step from {p.step(start)} down to {scale:g}")


# ---------------------------------------------------------------------- communication


def _stall_at_end(p: Plan) -> float:
    """The job stops advancing after its last logged step and stays silent, alive, for far
    longer than the stall rule needs (10 steps' time, at least 5 minutes); the truth is
    ``stalled`` at the last step logged, which is also the onset (a checkpoint written at it,
    while a rank hung, is not to be trusted)."""
    stall = p.rng.uniform(900.0, 3600.0)
    _truth(p, "stalled", p.n - 1, p.n - 1)
    p.after_freeze.append(lambda plan: plan.must_see.extend((plan.times[-1], plan.times[-1] + stall)))
    return stall


def _collective_files(p: Plan, seq: int, ops: dict[int, tuple[str, int]], odd_ops: dict[int, tuple[str, int]],
                      behind: set[int], odd: set[int], stuck_node: int | None) -> None:
    """After the clock is fixed: every reachable node's dumps (its ranks'), and the stacks
    of the processes of the nodes that matter (the stuck or odd node, and one waiting node)."""
    world = p.world
    form = p.rng.choice(("pickle", "json"))
    per_step = p.rng.randrange(8, 40)
    depth = p.rng.randrange(12, 40)

    def place(plan: Plan) -> None:
        rng = sub_rng(plan.cause, plan.seed, "collectives")
        step_ns = int(world.step_seconds * 1e9 / per_step)
        last_ns = int(plan.times[-1] * 1e9)
        started = last_ns - depth * step_ns
        waiting = [n.index for n in plan.nodes if n.index != stuck_node and not n.unreachable]
        shown = {stuck_node} if stuck_node is not None else set()
        if waiting:
            shown.add(rng.choice(waiting))
        for node in plan.nodes:
            if node.unreachable:
                continue
            for local, rank in enumerate(world.ranks_of_node(node.index)):
                last = seq - 1 if rank in behind else seq
                script = RankScript(rank, seq - depth, last, odd_ops if rank in odd else ops,
                                    pending=rank not in behind, started_ns=started, step_ns=step_ns)
                node.files[f"flight-recorder/{DUMP_PREFIX}{rank}"] = dump_bytes(script, world.ranks, form=form)
                if node.index in shown:
                    pid = node.pid_base + local
                    frames = STUCK_FRAMES[rng.randrange(len(STUCK_FRAMES))] if rank in behind else WAITING_FRAMES
                    command = f"/usr/bin/python3 -u pretrain_gpt.py --local_rank={local}"
                    node.files[f"stacks/{pid}.txt"] = stack_text(pid, command, frames, rng).encode()

    p.after_freeze.append(place)


def collective_hang(p: Plan) -> None:
    """One rank stops before a collective (its data loader, a checkpoint write) while every
    other rank waits in it: no NaN, no spike, the step counter just stops. Every rank's
    flight recorder says so (the others' last collective is pending, the stuck rank's ring
    ends one before it) and the stuck rank's process sits outside torch.distributed. No node
    is at fault; the stuck rank is named."""
    _require_nodes(p, 2)
    rng = p.rng
    stall = _stall_at_end(p)
    node = rng.randrange(len(p.nodes))
    rank = rng.choice(p.world.ranks_of_node(node))
    p.involved.add(node)
    p.culprit_ranks = [rank]
    seq = rng.randrange(10_000, 900_000)
    numel = rng.choice((262144000, 131072000, 524288000))
    ops = {s: ("all_reduce", numel) if s % 3 else ("all_gather", numel // 8) for s in range(seq - 64, seq + 1)}
    _collective_files(p, seq, ops, ops, {rank}, set(), node)
    timeout_ms = rng.choice((600000, 1800000))
    if stall > timeout_ms / 1000.0 + 60 and rng.random() < 0.5:
        _hang_watchdogs(p, node, seq, timeout_ms)
    p.notes.append(f"rank {rank} on {p.nodes[node].name} never entered collective {seq}; the job hung "
                   f"{stall:.0f} s after its last step")


def _hang_watchdogs(p: Plan, skip: int, seq: int, timeout_ms: int) -> None:
    """NCCL's watchdog on the waiting ranks fires when the collective times out."""
    def place(plan: Plan) -> None:
        rng = sub_rng(plan.cause, plan.seed, "hang-watchdog")
        moment = plan.times[-1] + timeout_ms / 1000.0 + rng.uniform(1.0, 20.0)
        for node in plan.nodes:
            if node.index != skip and not node.unreachable:
                node.nccl_lines.append(_watchdog_line(plan, node, 0, moment, timeout_ms, seq, rng))

    p.after_freeze.append(place)


def collective_mismatch(p: Plan) -> None:
    """The ranks of one node (a pipeline stage whose schedule is off) issue another
    operation, or the same one with another size, at one collective sequence number; every
    rank then waits forever. A software fault: no node is at fault, the odd ranks are named."""
    _require_nodes(p, 3)
    rng = p.rng
    _stall_at_end(p)
    node = rng.randrange(len(p.nodes))
    odd = set(p.world.ranks_of_node(node))
    p.involved.add(node)
    p.culprit_ranks = sorted(odd)
    seq = rng.randrange(10_000, 900_000)
    numel = rng.choice((262144000, 131072000, 524288000))
    ops = {s: ("all_reduce", numel) for s in range(seq - 64, seq + 1)}
    odd_ops = dict(ops)
    if rng.random() < 0.5:
        odd_ops[seq] = ("broadcast", numel)
        what = "a broadcast where the others all_reduce"
    else:
        odd_ops[seq] = ("all_reduce", numel // 2)
        what = "an all_reduce of half the size"
    _collective_files(p, seq, ops, odd_ops, set(), odd, node)
    p.notes.append(f"the ranks of {p.nodes[node].name} issued {what} at collective {seq}")



def _ib_error_lines(p: Plan, node: NodeState, local: int, peer: NodeState, moment: float, rng: random.Random) -> list[TimedLine]:
    pid = node.pid_base + local
    tid = pid + rng.randrange(300, 900)
    head = f"{nccl_warn_prefix(p.world, moment)}{node.name}:{pid}:{tid} [{local}]"
    port = rng.randrange(32768, 61000)
    text = (f"{head} transport/net_ib.cc:1296 NCCL WARN NET/IB : Got completion from peer {peer.ip}<{port}> with error "
            f"12, opcode 0, len 0, vendor err 129 (Recv) localGid ::ffff:{node.ip} remoteGids::ffff:{peer.ip}")
    plain = f"{node.name}:{pid}:{tid} [{local}]"
    return [
        TimedLine(moment, text),
        TimedLine(moment + 0.0001, f"{plain} NCCL INFO transport/net.cc:1134 -> 6"),
        TimedLine(moment + 0.0002, f"{plain} NCCL INFO proxy.cc:679 -> 6"),
        TimedLine(moment + 0.0003, f"{plain} NCCL INFO proxy.cc:858 -> 6 [Proxy Thread]"),
    ]


def _watchdog_line(p: Plan, node: NodeState, local: int, moment: float, timeout_ms: int, seq: int,
                   rng: random.Random) -> TimedLine:
    """PyTorch's watchdog report for the collective that hung (same SeqNum and size on
    every rank: it is one AllReduce)."""
    rank = p.world.ranks_of_node(node.index)[local]
    ran = timeout_ms + rng.randrange(20, 400)
    numel = (262144000, 131072000, 524288000)[seq % 3]
    text = (f"[rank{rank}]:[E{glog_stamp(moment)} {node.pid_base + local} ProcessGroupNCCL.cpp:616] [Rank {rank}] "
            f"Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, "
            f"NumelIn={numel}, NumelOut={numel}, Timeout(ms)={timeout_ms}) ran for {ran} milliseconds before "
            "timing out.")
    return TimedLine(moment, text)


def nccl_error(p: Plan) -> None:
    """NCCL IB completion errors (and sometimes watchdog timeouts) on several nodes during the
    spike step, which also stalls; every rank jumps together."""
    rng = p.rng
    symptom = _pick(rng, (("single_spike", 0.7), ("instant_nan", 0.3)))
    j = _spike_for(p, symptom)
    _shape(p, symptom, j, rng.uniform(1.5, 3.0), rng.uniform(3.0, 20.0))
    watchdog = rng.random() < 0.5
    timeout_ms = rng.choice((60000, 120000, 300000)) if watchdog else 0
    p.stall(j, timeout_ms / 1000.0 + rng.uniform(5.0, 40.0) if watchdog else rng.uniform(15.0, 90.0))
    count = min(len(p.nodes), rng.randint(2, 6))
    chosen = sorted(rng.sample(range(len(p.nodes)), count))
    p.involved.update(chosen)
    _truth(p, symptom, j, j)
    seq = rng.randrange(10000, 900000)

    def place(plan: Plan) -> None:
        local_rng = sub_rng(plan.cause, plan.seed, "nccl-error")
        first = plan.times[j]
        for k, index in enumerate(chosen):
            node = plan.nodes[index]
            peer = plan.nodes[chosen[(k + 1) % len(chosen)]] if len(chosen) > 1 else node
            moment = plan.event_time(j, local_rng)
            first = min(first, moment)
            local = local_rng.randrange(len(node.gpus))
            node.nccl_lines.extend(_ib_error_lines(plan, node, local, peer, moment, local_rng))
            if watchdog:
                node.nccl_lines.append(_watchdog_line(plan, node, 0, moment + timeout_ms / 1000.0, timeout_ms, seq,
                                                      local_rng))
        plan.must_see.append(first)

    p.after_freeze.append(place)
    p.notes.append(f"NCCL IB completion errors{' and watchdog timeouts' if watchdog else ''} on "
                   f"{count} node(s) during the spike step")


def network_congestion(p: Plan) -> None:
    """Pause, discard and out-of-buffer counters grow far past the baseline on most nodes' RoCE
    NICs; throughput drops, then every rank jumps together."""
    rng = p.rng
    j = _tail_index(p, 12, 40)
    start = j - rng.randint(0, 6)
    p.slow(start, j + rng.randint(3, 10), rng.uniform(1.6, 3.5))
    _single_spike(p, j, rng.uniform(1.45, 2.4), rng.uniform(2.0, 8.0))
    count = max(1, min(len(p.nodes), math.ceil(len(p.nodes) * rng.uniform(0.6, 1.0))))
    chosen = sorted(rng.sample(range(len(p.nodes)), count))
    for index in chosen:
        for iface in p.nodes[index].ifaces[:1]:
            grow = {
                "rx_pause_ctrl_phy": rng.randrange(200_000, 40_000_000),
                "tx_pause_ctrl_phy": rng.randrange(200_000, 40_000_000),
                "rx_discards_phy": rng.randrange(50_000, 9_000_000),
                "rx_out_of_buffer": rng.randrange(100_000, 90_000_000),
                "rx_prio3_discards": rng.randrange(50_000, 9_000_000),
                "rx_prio3_pause": rng.randrange(200_000, 40_000_000),
                "tx_prio3_pause": rng.randrange(200_000, 40_000_000),
            }
            grow["rx_prio3_pause_duration"] = grow["rx_prio3_pause"] * rng.randrange(3, 40)
            grow["tx_prio3_pause_duration"] = grow["tx_prio3_pause"] * rng.randrange(3, 40)
            grow["rx_prio3_pause_transition"] = grow["rx_prio3_pause"] // rng.randrange(2, 9)
            grow["rx_mac_control_phy"] = grow["rx_pause_ctrl_phy"]
            grow["tx_mac_control_phy"] = grow["tx_pause_ctrl_phy"]
            for name, value in grow.items():
                iface.now[name] = iface.now.get(name, 0) + value
    p.involved.update(chosen)
    _truth(p, "single_spike", j, start)
    _see_step(p, start)
    p.notes.append(f"pause/discard counters grew on {count} node(s); throughput drops from step {p.step(start)}")


def nccl_version_mismatch(p: Plan) -> None:
    """One or two nodes (always a minority) run another NCCL release than the rest of the job;
    every rank jumps together."""
    rng = p.rng
    _require_nodes(p, 3)
    symptom = _pick(rng, (("single_spike", 0.5), ("spike_no_recovery", 0.3), ("instant_nan", 0.2)))
    j = _spike_for(p, symptom)
    _shape(p, symptom, j, rng.uniform(1.5, 3.0), rng.uniform(3.0, 15.0))
    minority = 2 if len(p.nodes) >= 6 and rng.random() < 0.4 else 1
    chosen = sorted(rng.sample(range(len(p.nodes)), minority))
    other = rng.choice([v for v in NCCL_RELEASES if v.split("+")[0] != p.world.nccl.split("+")[0]])
    for index in chosen:
        p.nodes[index].nccl_version = other
    p.culprit_nodes = chosen
    _truth(p, symptom, j, j)
    _see_step(p, j)
    p.notes.append(f"{minority} node(s) run NCCL {other} while the job runs {p.world.nccl}")


# ---------------------------------------------------------------------------- hardware


def _pick_gpu(p: Plan) -> tuple[NodeState, int]:
    node = p.nodes[p.rng.randrange(len(p.nodes))]
    return node, p.rng.randrange(len(node.gpus))


def _watchdogs_elsewhere(p: Plan, skip: int, rng: random.Random) -> None:
    """After a GPU dies the other nodes' collectives hang until PyTorch's watchdog fires."""
    timeout_ms = rng.choice((60000, 120000))
    seq = rng.randrange(10000, 900000)

    def place(plan: Plan) -> None:
        local = sub_rng(plan.cause, plan.seed, "watchdogs")
        moment = plan.times[-1] + local.uniform(2.0, 20.0)
        for node in plan.nodes:
            if node.index != skip and local.random() < 0.7:
                node.nccl_lines.append(_watchdog_line(plan, node, 0, moment + local.random(), timeout_ms, seq, local))
        plan.must_see.append(moment + 1.0)

    p.after_freeze.append(place)


def _kernel_event_in_step(p: Plan, node: NodeState, gpu: int, code: int, j: int) -> None:
    def place(plan: Plan) -> None:
        local = sub_rng(plan.cause, plan.seed, "xid")
        moment = plan.event_time(j, local)
        pid = node.pid_base + gpu
        node.kernel_events.append(KernelEvent(moment, "warn", xid_lines(code, node.gpus[gpu], pid, local)))
        plan.must_see.append(moment)

    p.after_freeze.append(place)


def gpu_xid(p: Plan) -> None:
    """A GPU-implicating, non-memory Xid (62, 74, 79, 119, 120) during the spike step on one
    node; metrics go NaN (or spike) at the first step logged after it. A GPU that fell off the
    bus also fails nvidia-smi."""
    rng = p.rng
    node, gpu = _pick_gpu(p)
    code = rng.choice(GPU_XIDS)
    symptom = "instant_nan" if code == 79 else _pick(rng, (("instant_nan", 0.65), ("single_spike", 0.35)))
    j = _spike_for(p, symptom)
    _shape(p, symptom, j, rng.uniform(1.6, 3.5), rng.uniform(5.0, 40.0))
    _kernel_event_in_step(p, node, gpu, code, j)
    state = node.gpus[gpu]
    if code == 79:
        state.lost = True
        node.smi_failure = "stderr_only" if rng.random() < 0.7 else "timeout"
        node.lost_bus = state.bus
    elif code == 119 and rng.random() < 0.5:
        node.smi_failure = "timeout"
    else:
        state.reset_required = True
        state.util_pct = 0
    if rng.random() < 0.5:
        _watchdogs_elsewhere(p, node.index, rng)
    p.culprit_nodes = [node.index]
    p.culprit_ranks = [p.world.rank_of(node.index, gpu)]
    _truth(p, symptom, j, j)
    p.notes.append(f"Xid {code} on {node.name} GPU {gpu} (bus {state.bus}) during step {p.step(j)}")


def gpu_ecc(p: Plan) -> None:
    """Uncorrectable DRAM ECC errors grew on one GPU since the baseline (rows pending remap),
    usually with a memory-class Xid during the spike step."""
    rng = p.rng
    node, gpu = _pick_gpu(p)
    state = node.gpus[gpu]
    symptom = _pick(rng, (("instant_nan", 0.5), ("single_spike", 0.5)))
    j = _spike_for(p, symptom)
    _shape(p, symptom, j, rng.uniform(1.6, 3.5), rng.uniform(5.0, 40.0))
    errors = rng.randint(1, 4)
    state.ecc_now["dram_unc"] = state.ecc_base["dram_unc"] + errors
    state.ecc_now["dram_corr"] = state.ecc_base["dram_corr"] + rng.randint(0, 30)
    corr, unc, _, _ = state.remap_base
    state.remap_now = (corr, unc + rng.randint(1, errors), True, rng.random() < 0.15)
    state.reset_required = True
    xid = None
    if rng.random() < 0.75:
        xid = rng.choice(MEMORY_XIDS)
        _kernel_event_in_step(p, node, gpu, xid, j)
    else:
        _see_step(p, j)
    p.culprit_nodes = [node.index]
    p.culprit_ranks = [p.world.rank_of(node.index, gpu)]
    _truth(p, symptom, j, j)
    p.notes.append(f"{errors} uncorrectable DRAM ECC error(s) since baseline on {node.name} GPU {gpu}"
                   + (f" with Xid {xid}" if xid else ""))


def ib_link_flap(p: Plan) -> None:
    """``link_downed``/``link_error_recovery`` grew on one node's HCA port (which may still be
    Down/Polling or at half rate); sometimes NCCL IB errors with a peer."""
    rng = p.rng
    node = p.nodes[rng.randrange(len(p.nodes))]
    port = node.ports[rng.randrange(len(p.world.hcas))]
    symptom = _pick(rng, (("single_spike", 0.65), ("instant_nan", 0.15), ("spike_no_recovery", 0.2)))
    j = _spike_for(p, symptom)
    _shape(p, symptom, j, rng.uniform(1.5, 3.0), rng.uniform(3.0, 20.0))
    p.stall(j, rng.uniform(10.0, 60.0))
    port.now["link_downed"] += rng.randint(1, 5)
    port.now["link_error_recovery"] += rng.randint(2, 40)
    port.now["symbol_error"] += rng.randint(10, 5000)
    port.now["port_rcv_errors"] += rng.randint(0, 50)
    port.now["local_link_integrity_errors"] += rng.randint(0, 3)
    variant = _pick(rng, (("down", 0.4), ("slow", 0.3), ("recovered", 0.3)))
    if variant == "down":
        port.state, port.phys, port.now_rate = "Down", "Polling", rng.choice((10, 40))
    elif variant == "slow":
        port.now_rate = port.rate // 2
    if rng.random() < 0.5 and len(p.nodes) > 1:
        peer = p.nodes[(node.index + rng.randrange(1, len(p.nodes))) % len(p.nodes)]
        local = p.world.hcas.index(port.hca) % len(node.gpus)

        def place(plan: Plan) -> None:
            local_rng = sub_rng(plan.cause, plan.seed, "flap-nccl")
            moment = plan.event_time(j, local_rng)
            node.nccl_lines.extend(_ib_error_lines(plan, node, local, peer, moment, local_rng))
            peer.nccl_lines.extend(_ib_error_lines(plan, peer, local, node, plan.event_time(j, local_rng),
                                                   local_rng))
            plan.must_see.append(moment)

        p.after_freeze.append(place)
        p.involved.add(peer.index)
    else:
        _see_step(p, j)
    p.culprit_nodes = [node.index]
    _truth(p, symptom, j, j)
    p.notes.append(f"{node.name} {port.hca} port {port.port}: link_downed/link_error_recovery grew ({variant})")


def thermal_throttle(p: Plan) -> None:
    """Some or all GPUs of one node in HW/SW thermal slowdown at 86-93 C: throughput drops, the
    loss does not jump."""
    rng = p.rng
    node = p.nodes[rng.randrange(len(p.nodes))]
    count = len(node.gpus) if rng.random() < 0.4 else rng.randint(1, len(node.gpus))
    gpus = sorted(rng.sample(range(len(node.gpus)), count))
    hopper = p.world.gpu.hopper
    for index in gpus:
        gpu = node.gpus[index]
        gpu.thermal = True
        gpu.temp_c = rng.randint(86, 91) if hopper else rng.randint(88, 92)
        gpu.mem_temp_c = rng.randint(86, 95)
        gpu.power_w = round(p.world.gpu.power_limit_w * rng.uniform(0.55, 0.8), 2)
        gpu.sm_clock_mhz = rng.randrange(1005, 1500, 15)
    start = p.n - 1 - rng.randint(20, min(80, p.n - 60))
    p.slow(start, p.n, rng.uniform(1.15, 1.8))
    p.culprit_nodes = [node.index]
    p.culprit_ranks = [p.world.rank_of(node.index, g) for g in gpus]
    _truth(p, "none", None, start)
    _see_step(p, start)
    p.notes.append(f"{count} GPU(s) of {node.name} in thermal slowdown; throughput drops from step {p.step(start)}")


# -------------------------------------------------------------------------- checkpoint

_CORRUPTIONS = (
    "mp_rank_{a:02d}_model_states.pt: size {small} != {big} (truncated)",
    "layer_{b:02d}-model_{a:02d}-model_states.pt: sha256 mismatch (manifest {h1}, file {h2})",
    "zero_pp_rank_{c}_mp_rank_{a:02d}_optim_states.pt: missing",
    "__{a}_0.distcp: size {small} != {big} (truncated)",
)


def corruption_text(rng: random.Random) -> str:
    """A ``problem`` as a manifest check words it: which file, and how it differs."""
    big = rng.choice((4194304, 1073741824, 2147483648, 3221225472))
    return rng.choice(_CORRUPTIONS).format(
        a=rng.randrange(0, 8), b=rng.randrange(1, 80), c=rng.randrange(0, 512), small=big // rng.choice((2, 4, 16)),
        big=big, h1=f"{rng.getrandbits(32):08x}", h2=f"{rng.getrandbits(32):08x}",
    )


def corrupted_checkpoint(p: Plan) -> None:
    """The run resumed from a checkpoint that failed its manifest check and diverged within a
    few steps (no recovery, or NaN)."""
    rng = p.rng
    interval = rng.choice((100, 200, 250, 500))
    p.ckpt_interval = interval
    p.ckpt_keep = max(p.ckpt_keep, 4)
    after = rng.randint(12, min(50, p.n - 60))
    resume_index = p.n - after
    _align_first_step(p, resume_index - 1, interval)
    step = p.step(resume_index - 1)
    until = step + rng.randint(1, interval - 1)
    gap = (until - step) * p.world.step_seconds + rng.uniform(400.0, 1800.0)
    p.resume = Resume(step, p.checkpoint_path(step), resume_index, until, False, gap,
                      reference=rng.random() < 0.5)
    p.pause(resume_index, gap)
    p.corrupt_checkpoints[step] = corruption_text(rng)
    symptom = _pick(rng, (("spike_no_recovery", 0.6), ("instant_nan", 0.4)))
    j = resume_index + rng.randint(0, 5)
    for i in range(resume_index, j):
        p.grad_factor[i] = rng.uniform(1.3, 2.5)
    _shape(p, symptom, j, rng.uniform(1.5, 3.0), rng.uniform(2.0, 8.0))
    _truth(p, symptom, j, resume_index)
    _see_step(p, j)
    p.notes.append(f"resumed from step {step}, whose checkpoint fails its manifest check")


def false_alarm(p: Plan) -> None:
    """Nothing: noise, benign grad-norm bumps, fp16 breathing, sometimes a planned LR decay step
    down."""
    rng = p.rng
    if rng.random() < 0.4:
        p.lr_factor_from = (p.n - 1 - rng.randint(20, min(200, p.n - 60)), rng.uniform(0.3, 0.7))
        p.notes.append("a planned LR decay step down; nothing else")
    _truth(p, "none", None, None)


#: Every cause of the spec, with the function that plants it.
SCENARIOS: dict[str, Scenario] = {
    "overlong_sample": overlong_sample,
    "corrupted_sample": corrupted_sample,
    "rng_not_restored": rng_not_restored,
    "rank_data_misalignment": rank_data_misalignment,
    "grad_explosion": grad_explosion,
    "lr_too_high": lr_too_high,
    "loss_scale_collapse": loss_scale_collapse,
    "nccl_error": nccl_error,
    "network_congestion": network_congestion,
    "nccl_version_mismatch": nccl_version_mismatch,
    "collective_hang": collective_hang,
    "collective_mismatch": collective_mismatch,
    "gpu_xid": gpu_xid,
    "gpu_ecc": gpu_ecc,
    "ib_link_flap": ib_link_flap,
    "thermal_throttle": thermal_throttle,
    "corrupted_checkpoint": corrupted_checkpoint,
    "false_alarm": false_alarm,
}
assert tuple(SCENARIOS) == CAUSES, "the scenario table must cover exactly the spec's causes"
