"""``build_bundle``: plan an incident, write it as a bundle, return the answer.

The order is the plan's (see ``spikeops.sim.plan``): world, healthy plan, the cause's
effects, distractors that change durations, the frozen clock, timed evidence, the window,
timed distractors, and only then bytes. Small files go through ``spikeops.bundle``'s
``BundleWriter``; the big JSONL files (and a Megatron ``train.log``) are streamed through
the same temp-file-and-rename discipline, because ``BundleWriter.write_jsonl`` builds the
whole body in memory with one ``json.dumps`` per record, which a 2,000,000-row benchmark
bundle cannot afford.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from spikeops.bundle import atomic_write, BUNDLE_FORMAT, BundleWriter
from spikeops.probes.bundle_files import ProbeStatus
from spikeops.sim.distractors import choose, plant_structural, plant_timed
from spikeops.sim.metrics import breathing_loss_scale, iter_rows, jsonl_line, megatron_header, megatron_line
from spikeops.sim.model import CAUSES, LAYER_OF, Expected
from spikeops.sim.plan import GpuState, IbPort, Iface, NodeState, Plan, sub_rng
from spikeops.sim.ranks import iter_batch_lines, iter_rank_lines
from spikeops.sim.render import (
    KERNEL_COMMANDS,
    NCCL_VERSION_COMMANDS,
    ethtool_counters,
    ib_counter_defaults,
    kernel_noise,
    render_ethtool,
    render_ib_counters,
    render_ibstat,
    render_kernel,
    render_nccl,
    render_nccl_version,
    render_smi,
    smi_lost_stderr,
)
from spikeops.sim.scenarios import MIN_STEPS, SCENARIOS
from spikeops.sim.world import World, make_uuid, make_world, rand_hex

__all__ = ["build_bundle", "make_plan", "plan_incident", "write_bundle", "expected_of", "DEFAULT_RANK_STEPS",
           "EXPECTED_FILE"]

#: Per-rank steps written by default: a window of about this many steps around the incident.
DEFAULT_RANK_STEPS = 60
#: Where ``write_diagnosis_expected`` puts the answer (an unknown file to the bundle reader).
EXPECTED_FILE = "diagnosis.expected.json"

_EPOCH_LOW = datetime(2025, 1, 6, tzinfo=UTC).timestamp()
_EPOCH_HIGH = datetime(2026, 12, 20, tzinfo=UTC).timestamp()


# ------------------------------------------------------------------------------ planning


def _gpu(world: World, rng: random.Random, index: int, bus: str, module: int) -> GpuState:
    hopper = world.gpu.hopper
    used = int(world.curve.mem_gb * 1024) + rng.randrange(1500, 4000)
    return GpuState(
        index=index,
        bus=bus,
        uuid="GPU-" + make_uuid(rng),
        serial=str(rng.randrange(1650124000000, 1653999999999) if hopper else rng.randrange(1323021000000, 1324999999999)),
        module_id=module,
        temp_c=rng.randint(38, 62),
        mem_temp_c=rng.randint(44, 70),
        power_w=round(world.gpu.power_limit_w * rng.uniform(0.55, 0.97), 2),
        sm_clock_mhz=world.gpu.max_graphics_mhz if rng.random() < 0.7 else world.gpu.max_graphics_mhz - 225,
        pcie_replays=rng.randrange(0, 90),
        util_pct=rng.randint(96, 100),
        mem_used_mib=min(used, world.gpu.fb_total_mib - world.gpu.fb_reserved_mib - 200),
    )


def _ports(world: World, rng: random.Random, node_index: int, hours: float) -> list[IbPort]:
    ports = []
    infiniband = world.fabric == "ib"
    sm_lid = world.extra["sm_lid"]
    for i, hca in enumerate(world.hcas):
        guid = f"0x{rng.getrandbits(64):016x}"
        base = ib_counter_defaults(rng, hours * rng.uniform(0.05, 0.3), busy=True)
        now = dict(base)
        grow = ib_counter_defaults(rng, hours, busy=True)
        for name in ("port_rcv_data", "port_xmit_data", "port_rcv_packets", "port_xmit_packets", "port_xmit_wait",
                     "unicast_rcv_packets", "unicast_xmit_packets", "multicast_rcv_packets"):
            now[name] += grow[name]
        ports.append(IbPort(
            hca=hca, port=1, ca_type=world.gpu.hca_type, fw=world.gpu.hca_fw, guid=guid,
            link_layer="InfiniBand" if infiniband else "Ethernet", rate=world.gpu.link_rate,
            base_lid=int(world.extra["lid_base"]) + node_index * len(world.hcas) + i, sm_lid=int(sm_lid),
            base=base, now=now,
        ))
    for hca in world.eth_hcas:
        guid = f"0x{rng.getrandbits(64):016x}"
        base = ib_counter_defaults(rng, hours * 0.2, busy=False)
        now = dict(base)
        now["port_rcv_data"] += rng.randrange(10**6, 10**9)
        now["port_xmit_data"] += rng.randrange(10**6, 10**9)
        ports.append(IbPort(hca=hca, port=1, ca_type="MT4125", fw="22.39.1002", guid=guid, link_layer="Ethernet",
                            rate=rng.choice((100, 200)), base_lid=0, sm_lid=0, base=base, now=now))
    return ports


def _ifaces(world: World, rng: random.Random, hours: float) -> list[Iface]:
    out = []
    scale = 1.0 if world.fabric == "roce" else 0.02
    for name in world.ifaces:
        base = ethtool_counters(rng, hours * rng.uniform(0.05, 0.3), scale)
        grow = ethtool_counters(rng, hours, scale)
        now = {key: value + (grow[key] if key in grow and ("packets" in key or "bytes" in key
                                                          or key.startswith(("ch", "tx_cqes", "tx_xmit")))
                             else 0) for key, value in base.items()}
        out.append(Iface(name, base, now))
    return out


def make_plan(cause: str, seed: int, nodes: int, gpus_per_node: int, steps: int) -> Plan:
    """The healthy plan of a job for ``cause`` (before the cause is planted)."""
    world = make_world(sub_rng(cause, seed, "world"), cause, nodes, gpus_per_node)
    rng = sub_rng(cause, seed, "plan")
    world.extra.update({
        "comm_id": rand_hex(rng, 16),
        "tflops": rng.uniform(360.0, 470.0) if world.gpu.hopper else rng.uniform(140.0, 190.0),
        "sm_lid": rng.randrange(1, 400), "lid_base": rng.randrange(2, 4000),
    })
    gauss = rng.gauss
    dt, jitter = world.step_seconds, world.step_jitter
    dur = [dt * max(0.5, 1.0 + gauss(0.0, jitter)) for _ in range(steps)]
    hours = steps * dt / 3600.0 + rng.uniform(2.0, 200.0)
    node_states = []
    for index, name in enumerate(world.nodes):
        node_rng = sub_rng(cause, seed, f"node:{index}")
        modules = list(range(1, gpus_per_node + 1))
        node_rng.shuffle(modules)
        gpus = [_gpu(world, node_rng, g, bus, modules[g]) for g, bus in enumerate(world.bus_ids)]
        node_states.append(NodeState(
            name=name, index=index, ip=world.ips[index], pid_base=world.pid_bases[index],
            kernel_format=world.kernel_formats[index], boot=0.0, gpus=gpus,
            ports=_ports(world, node_rng, index, hours), ifaces=_ifaces(world, node_rng, hours),
            nccl_version=world.nccl,
        ))
    if rng.random() < 0.15:  # early in training: the LR warmup and the steep first descent show
        first_step = rng.randrange(max(200, world.curve.warmup // 3), world.curve.warmup * 2)
    else:
        first_step = rng.randrange(2000, 400_000)
    intervals = [k for k in (100, 200, 250, 500, 1000) if k * 3 <= first_step + steps] or [50]
    plan = Plan(
        world=world, cause=cause, seed=seed, n=steps, first_step=first_step, dur=dur,
        nodes=node_states, rng=sub_rng(cause, seed, "scenario"),
        ckpt_interval=rng.choice(intervals), ckpt_keep=rng.randint(4, 8),
    )
    if world.precision == "fp16":
        plan.loss_scale, plan.skipped = breathing_loss_scale(sub_rng(cause, seed, "loss-scale"), steps)
    return plan


def _finish_effects(plan: Plan) -> None:
    """Consequences every cause shares: fp16 overflows on non-finite steps halve the scale
    and skip the step; the LR schedule spans the whole run."""
    curve = plan.world.curve
    rng = sub_rng(plan.cause, plan.seed, "finish")
    curve.total_steps = max(curve.warmup + 1000, int(plan.last_step * rng.uniform(1.3, 3.0)),
                            rng.randrange(60_000, 600_000))
    plan.world.extra["train_iters"] = curve.total_steps
    if plan.loss_scale is not None and plan.nan_from is not None:
        scale = plan.loss_scale[plan.nan_from - 1] if plan.nan_from > 0 else plan.loss_scale[0]
        for i in range(plan.nan_from, plan.n):
            scale = max(scale / 2.0, 2.0**-24)
            plan.loss_scale[i] = scale
            plan.skipped.add(i)


def _rank_window(plan: Plan, rank_steps: int | None) -> tuple[int, int]:
    if rank_steps is not None:
        return max(0, plan.n - max(0, rank_steps)), plan.n
    anchors = [i for i in (plan.onset, plan.spike) if i is not None]
    if plan.cause == "rng_not_restored" or not anchors:
        return max(0, plan.n - DEFAULT_RANK_STEPS), plan.n
    start = min(anchors) - plan.rng.randint(5, 15)
    start = min(start, plan.n - DEFAULT_RANK_STEPS)
    return max(0, start), plan.n


def _set_clock(plan: Plan) -> None:
    """Window, alert time, job start and node boots, once the timed evidence is placed."""
    rng = sub_rng(plan.cause, plan.seed, "clock")
    world = plan.world
    latest = max([plan.times[-1]] + [line.time for node in plan.nodes for line in node.nccl_lines
                                      if line.time is not None] + plan.must_see)
    plan.created = latest + rng.uniform(8.0, 75.0)
    span = rng.uniform(300.0, 900.0)
    if plan.must_see:
        span = max(span, plan.created - min(plan.must_see) + rng.uniform(30.0, 120.0))
    plan.window_start = plan.created - span
    startup = rng.uniform(60.0, 300.0)
    if plan.resume is not None:
        plan.job_started = plan.time_of_step(plan.resume.step + 1) - world.step_seconds - startup
    else:
        plan.job_started = plan.times[0] - plan.dur[0] - (plan.first_step - 1) * world.step_seconds - startup
    for node in plan.nodes:
        node.boot = plan.job_started - rng.uniform(2.0 * 3600.0, 30.0 * 86400.0)


def plan_incident(cause: str, *, seed: int = 0, nodes: int = 8, gpus_per_node: int = 8, steps: int = 600,
                  rank_steps: int | None = None, distractors: bool | Iterable[str] = True) -> Plan:
    """Every decision of a bundle, no bytes written (``write_bundle`` writes them)."""
    if cause not in CAUSES:
        raise ValueError(f"unknown cause {cause!r}; known: {', '.join(CAUSES)}")
    if steps < MIN_STEPS:
        raise ValueError(f"steps must be at least {MIN_STEPS} (got {steps})")
    if nodes < 1 or not 1 <= gpus_per_node <= 16:
        raise ValueError("nodes must be >= 1 and gpus_per_node in 1..16")
    plan = make_plan(cause, seed, nodes, gpus_per_node, steps)
    SCENARIOS[cause](plan)
    _finish_effects(plan)
    plan.rank_window = _rank_window(plan, rank_steps)
    pick = sub_rng(cause, seed, "distractors")
    names = choose(plan, distractors, pick)
    names = plant_structural(plan, names, pick)
    plan.freeze(sub_rng(cause, seed, "epoch").uniform(_EPOCH_LOW, _EPOCH_HIGH))
    for callback in plan.after_freeze:
        callback(plan)
    _set_clock(plan)
    plan.distractors = plant_timed(plan, names, pick)
    _check_coverage(plan)
    return plan


def _check_coverage(plan: Plan) -> None:
    start, _ = plan.rank_window
    anchor = plan.onset if plan.cause == "rank_data_misalignment" else plan.spike
    if anchor is not None and anchor < start and plan.culprit_ranks and plan.cause in (
        "overlong_sample", "corrupted_sample", "rank_data_misalignment"
    ):
        plan.notes.append("rank window does not reach the incident: the per-rank evidence is not in the bundle")


def expected_of(plan: Plan) -> Expected:
    """The ground truth, read off the plan (conventions: ``spikeops.sim.model``)."""
    onset = plan.step(plan.onset) if plan.onset is not None else None
    resume_step = plan.verified_before(onset)
    return Expected(
        symptom=plan.symptom,
        layer=LAYER_OF[plan.cause],
        cause=plan.cause,
        culprit_nodes=[plan.nodes[i].name for i in sorted(plan.culprit_nodes)],
        culprit_ranks=sorted(plan.culprit_ranks),
        spike_step=plan.step(plan.spike) if plan.spike is not None else None,
        onset_step=onset,
        resume_from=None if resume_step is None else {"step": resume_step, "path": plan.checkpoint_path(resume_step)},
        distractors=list(plan.distractors),
        notes="; ".join(plan.notes),
    )


# ------------------------------------------------------------------------------- writing


def _iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stream(path: Path, lines: Iterable[str]) -> None:
    """Write ``lines`` to ``path`` so a reader sees no file or the whole one (temp + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="", buffering=1 << 20) as handle:
            handle.writelines(lines)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _incident(plan: Plan) -> dict:
    world = plan.world
    rng = sub_rng(plan.cause, plan.seed, "incident")
    created = datetime.fromtimestamp(plan.created, UTC)
    job: dict = {
        "id": world.job_id,
        "scheduler": world.scheduler,
        "name": world.job_name,
        "nodes": list(world.nodes),
        "gpus_per_node": world.gpus_per_node,
    }
    if world.explicit_ranks:
        job["ranks"] = {str(rank): world.nodes[world.node_of_rank(rank)] for rank in range(world.ranks)}
    job["max_length"] = world.max_length
    job["started"] = _iso(plan.job_started)
    job["resumed_from"] = None if plan.resume is None else {"step": plan.resume.step, "path": plan.resume.path}
    return {
        "format": BUNDLE_FORMAT,
        "incident_id": f"inc-{created:%Y%m%dT%H%M%SZ}-{world.job_id}",
        "created": _iso(plan.created),
        "alert": {
            "source": world.alert_source,
            "received": _iso(plan.created - rng.uniform(1.0, 8.0)),
            "payload": {"alertname": world.alert_name, "job": world.job_id, "severity": rng.choice(("page", "warning"))},
        },
        "job": job,
        "window": {"start": _iso(plan.window_start), "end": _iso(plan.created)},
    }


def _checkpoints(plan: Plan) -> list[dict]:
    rng = sub_rng(plan.cause, plan.seed, "checkpoints")
    out = []
    for step in plan.checkpoint_steps():
        path = plan.checkpoint_path(step)
        problem = plan.corrupt_checkpoints.get(step)
        out.append({
            "step": step,
            "path": path,
            "time": _iso(plan.time_of_step(step) + rng.uniform(15.0, 90.0)),
            "manifest": f"{path}/MANIFEST.json",
            "verified": problem is None,
            "problem": problem,
        })
    return out


def _node_commands(plan: Plan, node: NodeState) -> dict[str, str]:
    world = plan.world
    commands = {
        "nvidia-smi-q": "nvidia-smi -q",
        "kernel": KERNEL_COMMANDS[node.kernel_format],
    }
    for iface in node.ifaces:
        commands[f"ethtool-{iface.name}"] = f"ethtool -S {iface.name}"
    commands["ibstat"] = "ibstat"
    commands["ib-counters"] = "grep -H . /sys/class/infiniband/*/ports/*/counters/*"
    commands["nccl"] = (f"grep -hE 'NCCL|ProcessGroupNCCL|c10d' /var/log/slurm/{world.job_id}/{node.name}.out"
                        if world.scheduler == "slurm" else f"kubectl logs {world.job_name}-{node.index} | grep -E NCCL")
    commands["nccl-version"] = NCCL_VERSION_COMMANDS[world.nccl_form]
    return commands


_FILES = {"nvidia-smi-q": "nvidia-smi-q.txt", "kernel": "kernel.log", "ibstat": "ibstat.txt",
          "ib-counters": "ib-counters.txt", "nccl": "nccl.log", "nccl-version": "nccl-version.txt"}


def _probe_file(name: str) -> str:
    return _FILES.get(name, f"{name}.txt")


def _write_node(plan: Plan, writer: BundleWriter, node: NodeState) -> None:
    world = plan.world
    rng = sub_rng(plan.cause, plan.seed, f"render:{node.index}")
    commands = _node_commands(plan, node)
    collected = plan.created + rng.uniform(5.0, 40.0)
    started = datetime.fromtimestamp(collected, UTC).replace(microsecond=0)
    if node.unreachable:
        writer.write_unreachable(node.name, commands, seconds=float(rng.choice((10, 15, 30))))
        return
    baseline_at = plan.job_started - rng.uniform(10.0, 60.0)
    outputs: dict[str, tuple[str, str]] = {}
    outputs["nvidia-smi-q"] = (render_smi(world, node, collected, baseline=False), "")
    noise = kernel_noise(world, node, rng, collected)
    outputs["kernel"] = (render_kernel(node, noise + node.kernel_events, fmt=node.kernel_format,
                                       tz_minutes=world.tz_minutes), "")
    for iface in node.ifaces:
        outputs[f"ethtool-{iface.name}"] = (render_ethtool(iface.now), "")
    ports = node.ports
    outputs["ibstat"] = (render_ibstat(ports), "")
    outputs["ib-counters"] = (render_ib_counters(ports, baseline=False), "")
    outputs["nccl"] = (render_nccl(plan, node, rng), "")
    outputs["nccl-version"] = (render_nccl_version(node.nccl_version, world.nccl_form), "")
    statuses = []
    for name, command in commands.items():
        error = node.probe_errors.get(name)
        exit_code: int | None = 0
        seconds = round(rng.uniform(0.02, 0.6), 2)
        stdout, stderr = outputs[name]
        if name == "nvidia-smi-q" and node.smi_failure == "stderr_only" and error is None:
            stdout, stderr, exit_code, error = "", smi_lost_stderr(node.lost_bus or node.gpus[0].bus), 255, \
                "command-failed"
            seconds = round(rng.uniform(1.5, 6.0), 2)
        elif name == "nvidia-smi-q" and node.smi_failure == "timeout" and error is None:
            error = "timeout"
        if error == "timeout":
            exit_code, seconds = None, float(rng.choice((10, 30, 60)))
        else:
            writer.write_probe_output(node.name, _probe_file(name), stdout.encode(), stderr.encode())
        statuses.append(ProbeStatus(name, command, exit_code, started, seconds, error))
    folder = writer.node_folder(node.name)
    for relative, data in sorted(node.files.items()):
        atomic_write(folder / relative, data)
    for folder_name, command in (("flight-recorder", "tar of the flight recorder dumps /tmp/nccl_trace_rank_<rank>"),
                                 ("stacks", "py-spy dump --pid PID for each of the processes of the job: tar of PID.txt")):
        if any(relative.startswith(folder_name + "/") for relative in node.files):
            statuses.append(ProbeStatus(folder_name, command, 0, started, round(rng.uniform(0.1, 2.0), 2), None))
    writer.write_probes_json(node.name, statuses)
    writer.write_probe_output(node.name, "nvidia-smi-q.txt", render_smi(world, node, baseline_at, baseline=True)
                              .encode(), baseline=True)
    for iface in node.ifaces:
        writer.write_probe_output(node.name, f"ethtool-{iface.name}.txt", render_ethtool(iface.base).encode(),
                                  baseline=True)
    writer.write_probe_output(node.name, "ib-counters.txt", render_ib_counters(ports, baseline=True).encode(),
                              baseline=True)


def write_bundle(plan: Plan, path: str | Path, expected: Expected | None = None) -> Path:
    """Write every file of the planned bundle under ``path`` (created; must not hold files)."""
    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"{root}: exists and is not an empty directory")
    root.mkdir(parents=True, exist_ok=True)
    writer = BundleWriter(root)
    writer.write_incident(_incident(plan))
    rows = iter_rows(plan)
    if plan.world.metrics_form == "megatron":
        _stream(root / "train.log", _chain(megatron_header(plan), (megatron_line(plan, row) for row in rows)))
    else:
        _stream(root / "metrics.jsonl", (jsonl_line(plan, row) for row in rows))
    start, end = plan.rank_window
    if end > start:
        _stream(root / "ranks.jsonl", iter_rank_lines(plan, start, end))
        _stream(root / "batches.jsonl", iter_batch_lines(plan, plan.step(start), plan.step(end)))
    resume = plan.resume
    if resume is not None and resume.reference:
        low = max(resume.step + 1, plan.step(start))
        high = min(resume.reference_until, plan.last_step) + 1
        if high > low:
            _stream(root / "reference" / "batches.jsonl", iter_batch_lines(plan, low, high, reference=True))
    checkpoints = _checkpoints(plan)
    if checkpoints:  # a run too young to have saved one has no checkpoint list
        writer.write_checkpoints(checkpoints)
    for node in plan.nodes:
        _write_node(plan, writer, node)
    if expected is not None:
        document = {**expected.as_diagnosis(), "expected": expected.to_dict()}
        (root / EXPECTED_FILE).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return root


def _chain(head: str, rest: Iterable[str]) -> Iterable[str]:
    yield head
    yield from rest


def build_bundle(
    path: Path,
    cause: str,
    *,
    seed: int = 0,
    nodes: int = 8,
    gpus_per_node: int = 8,
    steps: int = 600,
    rank_steps: int | None = None,
    distractors: bool | Iterable[str] = True,
    write_diagnosis_expected: bool = False,
) -> Expected:
    """Write a synthetic incident bundle for ``cause`` at ``path`` and return its answer.

    Deterministic for (cause, seed, sizes, rank_steps, distractors): the same arguments give
    the same bytes. ``path`` must not exist or be an empty directory. ``rank_steps`` is how
    many trailing steps get per-rank rows (default: a window of ~60 steps reaching 5-15
    steps before the incident). ``distractors`` is True (a seeded subset), False (none) or
    the names to plant. ``write_diagnosis_expected`` also writes the answer to
    ``diagnosis.expected.json`` in the bundle (off by default: an engine must not see it).
    """
    plan = plan_incident(cause, seed=seed, nodes=nodes, gpus_per_node=gpus_per_node, steps=steps,
                         rank_steps=rank_steps, distractors=distractors)
    expected = expected_of(plan)
    write_bundle(plan, path, expected if write_diagnosis_expected else None)
    return expected

