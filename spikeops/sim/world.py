"""Who and what a simulated job runs on: node names, GPUs, fabric, software, the training run.

Everything a diagnosis could key on by accident (a node name, a bus id, a step number, a
step duration, an NCCL version, a kernel log format) is drawn here from the seed, so a
rule that only works for ``gpu-003`` or step 12345 fails on the next bundle. The draws are
plain functions of a ``random.Random``; nothing here knows about causes except the few
facts a cause needs from its world (a RoCE fabric for pause frames, fp16 for a loss scale).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

__all__ = [
    "GpuModel",
    "H100",
    "A100",
    "Curve",
    "World",
    "node_names",
    "make_world",
    "rand_hex",
    "make_uuid",
]


def rand_hex(rng: random.Random, digits: int) -> str:
    """Seeded hex digits (GUIDs, UUIDs, ids): never Python's process-random ``uuid4``."""
    return f"{rng.getrandbits(4 * digits):0{digits}x}"


def make_uuid(rng: random.Random) -> str:
    """A UUID-shaped string from the seed (nvidia-smi prints GPU UUIDs in this form)."""
    return f"{rand_hex(rng, 8)}-{rand_hex(rng, 4)}-{rand_hex(rng, 4)}-{rand_hex(rng, 4)}-{rand_hex(rng, 12)}"


@dataclass(frozen=True)
class GpuModel:
    """The facts of one GPU product that its ``nvidia-smi -q`` page prints."""

    family: str
    product: str
    architecture: str
    bus_ids: tuple[str, ...]
    device_id: str
    subsystem_id: str
    board_part: str
    gpu_part: str
    vbios: str
    inforom: str
    fb_total_mib: int
    fb_reserved_mib: int
    bar1_mib: int
    power_limit_w: float
    min_power_w: float
    max_graphics_mhz: int
    max_memory_mhz: int
    max_video_mhz: int
    pcie_gen: int
    remap_banks: int
    hopper: bool
    drivers: tuple[tuple[str, str], ...]  # (driver, CUDA)
    hca_type: str
    hca_fw: str
    link_rate: int


H100 = GpuModel(
    family="H100", product="NVIDIA H100 80GB HBM3", architecture="Hopper",
    bus_ids=("19", "3B", "4C", "5D", "9B", "BB", "CB", "DB"),
    device_id="0x233010DE", subsystem_id="0x16C110DE", board_part="692-2G520-0200-000",
    gpu_part="2330-885-A1", vbios="96.00.74.00.0D", inforom="G520.0200.00.05",
    fb_total_mib=81559, fb_reserved_mib=551, bar1_mib=131072, power_limit_w=700.0, min_power_w=200.0,
    max_graphics_mhz=1980, max_memory_mhz=2619, max_video_mhz=1545, pcie_gen=5, remap_banks=2560,
    hopper=True,
    drivers=(("535.161.08", "12.2"), ("535.183.01", "12.2"), ("550.90.07", "12.4"), ("550.127.05", "12.4")),
    hca_type="MT4129", hca_fw="28.39.1002", link_rate=400,
)
A100 = GpuModel(
    family="A100", product="NVIDIA A100-SXM4-80GB", architecture="Ampere",
    bus_ids=("07", "0F", "47", "4E", "87", "90", "B7", "BD"),
    device_id="0x20B210DE", subsystem_id="0x147F10DE", board_part="692-2G506-0210-002",
    gpu_part="20B2-895-A1", vbios="92.00.45.00.07", inforom="G506.0210.00.03",
    fb_total_mib=81920, fb_reserved_mib=605, bar1_mib=131072, power_limit_w=400.0, min_power_w=100.0,
    max_graphics_mhz=1410, max_memory_mhz=1593, max_video_mhz=1290, pcie_gen=4, remap_banks=640,
    hopper=False,
    drivers=(("525.125.06", "12.0"), ("535.129.03", "12.2"), ("535.161.08", "12.2")),
    hca_type="MT4123", hca_fw="20.38.1002", link_rate=200,
)

#: NCCL releases a job image may carry, with the CUDA they were built for.
NCCL_RELEASES: tuple[str, ...] = (
    "2.18.5+cuda12.2", "2.18.6+cuda12.2", "2.19.3+cuda12.3", "2.20.5+cuda12.4",
    "2.21.5+cuda12.4", "2.23.4+cuda12.6",
)
_FAMILIES = ("llama", "gpt", "llm", "moe", "mistral", "olmo", "falcon", "dense")
_SIZES = ("7b", "8b", "13b", "34b", "65b", "70b", "175b", "8x7b", "22b")


def _two_level(rng: random.Random, count: int, fmt: str, groups: int, per: int) -> list[str]:
    slots = rng.sample(range(groups * per), count)
    return [fmt.format(g=s // per + 1, n=s % per + 1, c=chr(ord("a") + s // per)) for s in sorted(slots)]


def node_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct host names in one of the naming styles clusters use, in the
    scheduler's (sorted) order; the numbers are sparse, never 1..count."""
    style = rng.randrange(7)
    span = max(count * 3, 48)
    if style == 0:
        width = 3 if span < 1000 else 4
        return [f"gpu-{n:0{width}d}" for n in sorted(rng.sample(range(1, span + 1), count))]
    if style == 1:
        return [f"dgx{n:04d}" for n in sorted(rng.sample(range(1, max(span, 100) + 1), count))]
    if style == 2:
        racks = max(4, math.ceil(count / 12) + 2)
        return _two_level(rng, count, "c{g:02d}-n{n:02d}", racks, 16)
    if style == 3:
        racks = min(26, max(3, math.ceil(count / 40) + 1))
        return _two_level(rng, count, "node-{c}{n:02d}", racks, 99) if count <= racks * 99 else [
            f"node-{n:05d}" for n in sorted(rng.sample(range(1, span + 1), count))
        ]
    if style == 4:
        subnet = rng.randrange(0, 200)
        hosts = rng.sample(range(1, 254 * 8), count)
        return [f"ip-10-{subnet}-{h // 254 + 1}-{h % 254 + 1}" for h in sorted(hosts)]
    if style == 5:
        site = rng.choice(("sjc", "iad", "ams", "hsv", "yul"))
        return [f"hgx-{site}-{n:04d}" for n in sorted(rng.sample(range(1, span + 1), count))]
    racks = max(4, math.ceil(count / 8) + 2)
    return _two_level(rng, count, "r{g:03d}u{n:02d}", racks, 40)


@dataclass
class Curve:
    """The healthy run's metric curves (see ``spikeops.sim.metrics``)."""

    loss_floor: float
    loss_start: float
    tau: float
    alpha: float
    noise: float
    grad_floor: float
    grad_start: float
    grad_noise: float
    peak_lr: float
    min_lr: float
    warmup: int
    total_steps: int
    schedule: str
    rank_noise: float
    rank_grad_scale: float
    mem_gb: float


@dataclass
class World:
    """One simulated job and its cluster, fixed by the seed before any cause is planted."""

    nodes: list[str]
    gpus_per_node: int
    gpu: GpuModel
    bus_ids: list[str]
    driver: str
    cuda: str
    ips: list[str]
    fabric: str  # "ib" or "roce"
    hcas: list[str]
    eth_hcas: list[str]
    ifaces: list[str]
    bootstrap_if: str
    nccl: str  # e.g. "2.18.5+cuda12.2"
    nccl_form: str  # how nccl-version.txt states it: tuple | dotted | banner | library
    node_version_lines: bool  # each node's local rank 0 prints NCCL's version banner
    rank_nodes: list[int]  # node index of each rank-block (rank // gpus_per_node)
    explicit_ranks: bool
    kernel_formats: list[str]
    tz_minutes: int
    job_id: str
    job_name: str
    scheduler: str
    max_length: int
    micro_batch: int
    precision: str  # "bf16" or "fp16"
    metrics_form: str  # "jsonl" or "megatron"
    time_form: str  # "iso", "iso-ms" or "unix"
    nan_form: str  # "bare" or "string"
    write_loss_scale: bool
    step_seconds: float
    step_jitter: float
    curve: Curve
    corpus: str
    shard_size: int
    corpus_size: int
    data_seed: int
    ckpt_root: str
    ckpt_style: str
    alert_source: str
    alert_name: str
    pid_bases: list[int]
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    def node_of_rank(self, rank: int) -> int:
        """The spec's rank placement: blocks of ``gpus_per_node`` ranks, in node order unless
        the job's explicit ``ranks`` map says otherwise (``rank_nodes``)."""
        return self.rank_nodes[rank // self.gpus_per_node]

    def ranks_of_node(self, node_index: int) -> list[int]:
        block = self.rank_nodes.index(node_index)
        return list(range(block * self.gpus_per_node, (block + 1) * self.gpus_per_node))

    def rank_of(self, node_index: int, gpu_index: int) -> int:
        return self.ranks_of_node(node_index)[gpu_index]


def _bus_ids(gpu: GpuModel, count: int) -> list[str]:
    if count <= len(gpu.bus_ids):
        return list(gpu.bus_ids[:count])
    extra = [f"{b:02X}" for b in range(0x10, 0xFF, 0x07) if f"{b:02X}" not in gpu.bus_ids]
    return sorted(list(gpu.bus_ids) + extra[: count - len(gpu.bus_ids)], key=lambda b: int(b, 16))


def _ips(rng: random.Random, count: int) -> list[str]:
    second = rng.randrange(0, 250)
    hosts = rng.sample(range(10, 250 * 64), count)
    return [f"10.{second}.{h // 250}.{h % 250 + 2}" for h in hosts]


def make_world(rng: random.Random, cause: str, nodes: int, gpus_per_node: int) -> World:
    """Draw every seed-dependent fact of a job; ``cause`` only forces what it must have."""
    names = node_names(rng, nodes)
    gpu = H100 if rng.random() < 0.7 else A100
    driver, cuda = rng.choice(gpu.drivers)
    fabric = "roce" if cause == "network_congestion" or rng.random() < 0.3 else "ib"
    n_hca = 8 if rng.random() < 0.6 else 4
    hcas = [f"mlx5_{i}" for i in range(n_hca)]
    eth_hcas = [] if fabric == "roce" else [f"mlx5_{n_hca + i}" for i in range(rng.choice((1, 2)))]
    if fabric == "roce":
        pool = ("ens{0}np0", "enp{1}s0np0", "eth{2}")
        pattern = rng.choice(pool)
        ifaces = [pattern.format(10 + i, 0x1A + 0x10 * i, 2 + i) for i in range(rng.choice((1, 2)))]
    else:
        pattern = rng.choice(("eth{0}", "ens{1}f{0}np{0}", "enp{2}s0f{0}np{0}"))
        base = rng.randrange(1, 9)
        ifaces = [pattern.format(i, base, 0x20 + base) for i in range(rng.choice((1, 2)))]
    bootstrap_if = rng.choice(("ib0", "bond0", "eth0", "ens8f0")) if fabric == "ib" else ifaces[0]
    nccl = rng.choice(NCCL_RELEASES)
    explicit = rng.random() < 0.3
    blocks = list(range(nodes))
    if explicit:
        rng.shuffle(blocks)
    tz = 0 if rng.random() < 0.8 else rng.choice((-480, -300, 60, 120, 480, 540))
    kernel_formats = []
    for _ in range(nodes):
        choices = ("iso", "iso-x", "journal") if tz else ("iso", "iso-x", "ctime", "journal")
        kernel_formats.append(rng.choice(choices))
    precision = "fp16" if cause == "loss_scale_collapse" or rng.random() < 0.3 else "bf16"
    max_length = rng.choice((2048, 4096, 4096, 8192, 16384))
    step_seconds = rng.uniform(2.0, 12.0)
    curve = Curve(
        loss_floor=rng.uniform(1.8, 2.6),
        loss_start=rng.uniform(10.3, 11.6),
        tau=rng.uniform(20.0, 80.0),
        alpha=rng.uniform(0.45, 0.6),
        noise=rng.uniform(0.005, 0.018),
        grad_floor=rng.uniform(0.2, 1.2),
        grad_start=rng.uniform(2.0, 8.0),
        grad_noise=rng.uniform(0.05, 0.15),
        peak_lr=rng.choice((1.0e-4, 1.5e-4, 2.0e-4, 3.0e-4, 4.0e-4, 6.0e-4)),
        min_lr=0.0,
        warmup=rng.choice((500, 1000, 2000, 2500, 4000, 8000)),
        total_steps=0,
        schedule=rng.choice(("cosine", "cosine", "linear")),
        rank_noise=rng.uniform(0.015, 0.04),
        rank_grad_scale=rng.uniform(1.3, 2.2),
        mem_gb=rng.uniform(38.0, 68.0) if gpu.family == "H100" else rng.uniform(30.0, 62.0),
    )
    curve.min_lr = curve.peak_lr * rng.choice((0.0, 0.1, 0.1))
    metrics_form = "megatron" if rng.random() < 0.15 else "jsonl"
    corpus = rng.choice((
        "s3://corpus-{h}/tokenized/shard-{{shard:05d}}", "/lustre/datasets/{h}/train/part-{{shard:05d}}.bin",
        "gs://pretrain-{h}/mix-v3/{{shard:06d}}.tfrecord", "/mnt/weka/tokens/{h}/chunk_{{shard:05d}}.npy",
    )).format(h=rand_hex(rng, 4))
    ckpt_style = rng.choice(("step-{step}", "iter_{step:07d}", "global_step{step}", "checkpoint-{step}"))
    job_name = f"{rng.choice(_FAMILIES)}-{rng.choice(_SIZES)}"
    ckpt_root = rng.choice((
        "/ckpt/{name}", "/lustre/checkpoints/{name}", "s3://ckpt-{h}/{name}", "/mnt/weka/ckpt/{name}",
    )).format(name=job_name, h=rand_hex(rng, 4))
    pid_bases = [rng.randrange(20000, 3000000) for _ in range(nodes)]
    return World(
        nodes=names,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        bus_ids=_bus_ids(gpu, gpus_per_node),
        driver=driver,
        cuda=cuda,
        ips=[n[3:].replace("-", ".") for n in names] if names[0].startswith("ip-") else _ips(rng, nodes),
        fabric=fabric,
        hcas=hcas,
        eth_hcas=eth_hcas,
        ifaces=ifaces,
        bootstrap_if=bootstrap_if,
        nccl=nccl,
        nccl_form=rng.choice(("tuple", "dotted", "banner", "library")),
        node_version_lines=cause == "nccl_version_mismatch" or rng.random() < 0.3,
        rank_nodes=blocks,
        explicit_ranks=explicit,
        kernel_formats=kernel_formats,
        tz_minutes=tz,
        job_id=str(rng.randrange(1000, 9999999)),
        job_name=job_name,
        scheduler="slurm" if rng.random() < 0.85 else "kubernetes",
        max_length=max_length,
        micro_batch=rng.choice((1, 1, 2, 2, 4)) if max_length < 8192 else rng.choice((1, 1, 2)),
        precision=precision,
        metrics_form=metrics_form,
        time_form=rng.choice(("iso", "iso-ms", "unix")),
        nan_form=rng.choice(("bare", "string")),
        write_loss_scale=precision == "fp16" or rng.random() < 0.5,
        step_seconds=step_seconds,
        step_jitter=rng.uniform(0.004, 0.025),
        curve=curve,
        corpus=corpus,
        shard_size=rng.choice((50000, 100000, 250000)),
        corpus_size=rng.choice((40_000_000, 120_000_000, 600_000_000)),
        data_seed=rng.randrange(1, 2**31),
        ckpt_root=ckpt_root,
        ckpt_style=ckpt_style,
        alert_source=rng.choice(("alertmanager", "grafana", "wandb-alerts")),
        alert_name=rng.choice(("TrainingLossAnomaly", "LossSpikeDetected", "TrainingMetricsAnomaly",
                               "TrainingHealthCheckFailed")),
        pid_bases=pid_bases,
    )
