#!/usr/bin/env python3
"""Build the example incident bundle shipped in examples/bundle-xid79 (deterministic).

The story: job 4412 (llm-70b, 4 nodes x 8 H100) trains quietly until 18:00:58 UTC, when the
GPU at PCI 0000:5d:00 on gpu-003 falls off the bus (Xid 79). The next step's loss is NaN on
every rank (one dead GPU poisons the AllReduce), NCCL's watchdog times out on the other
nodes, and monitoring fires. gpu-004 could not be reached by the collector. gpu-001 carries
an application Xid 13 from last week, outside the window: history, not a cause.

The bundle is written through spikeops's own BundleWriter, so it is also a check that the
writer produces what the reader and the spec expect. Run: python examples/build_example.py
"""

from __future__ import annotations

import hashlib
import math
import random
import shutil
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from spikeops.bundle import BundleWriter  # noqa: E402
from spikeops.probes.bundle_files import ProbeStatus  # noqa: E402

NODES = ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]
GPUS = 8
BUS_IDS = ["19", "3B", "4C", "5D", "9B", "BB", "CB", "DB"]
START = datetime(2026, 11, 29, 17, 50, 0, tzinfo=UTC)
FAULT = datetime(2026, 11, 29, 18, 0, 58, 123480, tzinfo=UTC)
FIRST_STEP = 12001
STEP_SECONDS = 6.0
RESUMED_STEP = 12000


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def step_time(step: int) -> datetime:
    return START + timedelta(seconds=(step - FIRST_STEP) * STEP_SECONDS)


def nan_from() -> int:
    """The first step logged at or after the fault is the first NaN step."""
    step = FIRST_STEP
    while step_time(step) < FAULT:
        step += 1
    return step


def metrics(rng: random.Random) -> list[dict]:
    rows = []
    bad = nan_from()
    for step in range(FIRST_STEP, bad + 6):
        t = step_time(step)
        loss = 2.31 - 0.00002 * (step - FIRST_STEP) + rng.gauss(0, 0.015)
        grad = 0.9 + rng.gauss(0, 0.05)
        row = {"step": step, "time": iso(t), "loss": round(loss, 5), "lr": 3e-4,
               "grad_norm": round(grad, 4), "loss_scale": 1.0, "tokens": 4194304,
               "throughput": round(1450 + rng.gauss(0, 8), 1)}
        if step >= bad:
            row["loss"] = math.nan
            row["grad_norm"] = math.nan
            row["throughput"] = round(row["throughput"] * 0.02, 1)
        rows.append(row)
    return rows


def ranks(rng: random.Random) -> list[dict]:
    rows = []
    bad = nan_from()
    for step in range(bad - 8, bad + 2):
        for rank in range(len(NODES) * GPUS):
            loss = 2.30 + rng.gauss(0, 0.02)
            row = {"step": step, "rank": rank, "loss": round(loss, 4),
                   "grad_norm": round(0.9 + rng.gauss(0, 0.05), 4),
                   "mem_allocated_gb": round(61.2 + rng.gauss(0, 0.1), 2)}
            if step >= bad:
                row["loss"] = math.nan
                row["grad_norm"] = math.nan
            rows.append(row)
    return rows


def batches(rng: random.Random) -> list[dict]:
    rows = []
    bad = nan_from()
    for step in range(bad - 3, bad + 1):
        for rank in range(len(NODES) * GPUS):
            shard = 40 + (step * 7 + rank) % 60
            ids = [f"shard-{shard:04d}:{(step * 131 + rank * 17 + i) % 100000}" for i in range(8)]
            rows.append({"step": step, "rank": rank,
                         "fingerprint": hashlib.sha256("|".join(ids).encode()).hexdigest()[:16],
                         "num_samples": 8, "max_tokens": 4096 - rng.randrange(0, 300),
                         "min_tokens": 180 + rng.randrange(0, 400), "num_empty": 0,
                         "sample_ids": ids, "source": f"s3://corpus/shard-{shard:04d}"})
    return rows


def ethtool_text(rng: random.Random) -> str:
    lines = ["NIC statistics:"]
    for name, value in (
        ("rx_packets", 91234567 + rng.randrange(1000)), ("tx_packets", 88123456 + rng.randrange(1000)),
        ("rx_bytes", 61234567890), ("tx_bytes", 59876543210), ("rx_out_of_buffer", 0),
        ("rx_discards_phy", 0), ("tx_pause_ctrl_phy", 0), ("rx_pause_ctrl_phy", 0),
    ):
        lines.append(f"     {name}: {value}")
    for queue in range(2):
        lines.append(f"     rx{queue}_packets: {45000000 + queue}")
        lines.append(f"     tx{queue}_packets: {44000000 + queue}")
    return "\n".join(lines) + "\n"


def ibstat_text(node_index: int) -> str:
    blocks = []
    for hca in range(4):
        blocks.append(
            f"CA 'mlx5_{hca}'\n\tCA type: MT4129\n\tNumber of ports: 1\n\tFirmware version: 28.39.1002\n"
            f"\tHardware version: 0\n\tNode GUID: 0xa088c20300{node_index:02x}{hca:02x}b8\n"
            f"\tSystem image GUID: 0xa088c20300{node_index:02x}{hca:02x}b8\n\tPort 1:\n"
            "\t\tState: Active\n\t\tPhysical state: LinkUp\n\t\tRate: 400\n"
            f"\t\tBase lid: {100 + node_index * 4 + hca}\n\t\tLMC: 0\n\t\tSM lid: 1\n"
            "\t\tCapability mask: 0xa651e848\n"
            f"\t\tPort GUID: 0xa088c20300{node_index:02x}{hca:02x}b8\n\t\tLink layer: InfiniBand\n"
        )
    return "".join(blocks)


def ib_counters_text(link_downed: int) -> str:
    lines = []
    for hca in range(4):
        base = f"/sys/class/infiniband/mlx5_{hca}/ports/1/counters"
        for name, value in (("link_downed", link_downed if hca == 0 else 0), ("link_error_recovery", 0),
                            ("port_rcv_errors", 0), ("symbol_error", 0), ("port_xmit_discards", 0),
                            ("port_xmit_wait", 1200345), ("port_rcv_data", 230539874932)):
            lines.append(f"{base}/{name}:{value}")
    return "\n".join(lines) + "\n"


def kernel_text(node: str) -> str:
    boot = datetime(2026, 11, 20, 6, 12, 3, tzinfo=UTC)

    def at(moment: datetime, msg: str) -> str:
        return f"{moment.strftime('%Y-%m-%dT%H:%M:%S')},{moment.microsecond:06d}+00:00 {msg}"

    lines = [at(boot, "Linux version 5.15.0-112-generic (buildd@lcy02-amd64-051)"),
             at(boot + timedelta(seconds=21), "nvidia-nvlink: Nvlink Core is being initialized, major device number 235"),
             at(boot + timedelta(seconds=23), "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.161.08  Thu Feb 22 2024")]
    if node == "gpu-001":
        old = datetime(2026, 11, 22, 3, 14, 7, 498559, tzinfo=UTC)
        lines.append(at(old, "NVRM: Xid (PCI:0000:19:00): 13, pid='<unknown>', name=<unknown>, "
                             "Graphics SM Warp Exception on (GPC 8, TPC 5, SM 0): Out Of Range Address"))
        lines.append(at(old + timedelta(microseconds=3719), "NVRM: Xid (PCI:0000:19:00): 43, pid=2815167, name=pt_main_thread, Ch 00000008"))
    if node == "gpu-003":
        lines += [
            at(FAULT - timedelta(microseconds=44), "NVRM: GPU at PCI:0000:5d:00: GPU-f1906b9b-557a-e961-045c-9fe4be3ce012"),
            at(FAULT - timedelta(microseconds=20), "NVRM: GPU Board Serial Number: 1653923026510"),
            at(FAULT, "NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."),
            at(FAULT + timedelta(microseconds=11), "NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus."),
            at(FAULT + timedelta(microseconds=53), "NVRM: A GPU crash dump has been created. If possible, please run"),
        ]
    return "\n".join(lines) + "\n"


def nccl_text(node: str, node_index: int) -> str:
    host = node
    lines = []
    for dev in range(GPUS):
        pid = 41000 + node_index * 100 + dev
        rank = node_index * GPUS + dev
        lines.append(f"{host}:{pid}:{pid} [{dev}] NCCL INFO Bootstrap : Using ib0:10.1.0.{node_index + 11}<0>")
        if rank == 0:
            lines.append(f"{host}:{pid}:{pid} [{dev}] NCCL INFO NCCL version 2.18.5+cuda12.2")
        lines.append(f"{host}:{pid}:{pid + 5} [{dev}] NCCL INFO comm 0x55d0c{rank:04x}0 rank {rank} "
                     f"nranks {len(NODES) * GPUS} cudaDev {dev} busId {BUS_IDS[dev].lower()}000 - Init COMPLETE")
    if node != "gpu-003":
        stamp = (FAULT + timedelta(minutes=10)).strftime("%m%d %H:%M:%S.%f")
        rank = node_index * GPUS
        lines.append(f"[rank{rank}]:[E{stamp} {41000 + node_index * 100} ProcessGroupNCCL.cpp:616] [Rank {rank}] "
                     "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=240117, OpType=ALLREDUCE, "
                     "NumelIn=262144000, NumelOut=262144000, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.")
    return "\n".join(lines) + "\n"


def nvidia_smi_failed() -> tuple[bytes, bytes]:
    stderr = b"Unable to determine the device handle for GPU0000:5D:00.0: Unknown Error\n"
    return b"", stderr


def build(target: Path) -> Path:
    rng = random.Random(4412)
    if target.exists():
        shutil.rmtree(target)
    writer = BundleWriter(target)
    created = datetime(2026, 11, 29, 18, 3, 12, tzinfo=UTC)
    writer.write_incident({
        "format": "spikeops-bundle/1",
        "incident_id": "inc-20261129T180312Z-4412",
        "created": iso(created),
        "alert": {"source": "alertmanager", "received": iso(created - timedelta(seconds=4)),
                  "payload": {"alertname": "TrainingLossNaN", "job": "4412", "severity": "page"}},
        "job": {"id": "4412", "scheduler": "slurm", "name": "llm-70b", "nodes": NODES,
                "gpus_per_node": GPUS, "ranks": {}, "max_length": 4096,
                "started": "2026-11-29T09:00:00Z",
                "resumed_from": {"step": RESUMED_STEP, "path": f"/ckpt/llm-70b/step-{RESUMED_STEP}"}},
        "window": {"start": "2026-11-29T17:55:00Z", "end": iso(created)},
    })
    writer.write_jsonl("metrics.jsonl", metrics(rng))
    writer.write_jsonl("ranks.jsonl", ranks(rng))
    writer.write_jsonl("batches.jsonl", batches(rng))
    writer.write_checkpoints([
        {"step": 11500, "path": "/ckpt/llm-70b/step-11500", "time": "2026-11-29T16:40:00Z",
         "manifest": "/ckpt/llm-70b/step-11500/MANIFEST.json", "verified": True, "problem": None},
        {"step": 12000, "path": "/ckpt/llm-70b/step-12000", "time": "2026-11-29T17:49:40Z",
         "manifest": "/ckpt/llm-70b/step-12000/MANIFEST.json", "verified": True, "problem": None},
    ])
    started = created + timedelta(seconds=20)
    for index, node in enumerate(NODES):
        commands = {
            "nvidia-smi-q": "nvidia-smi -q",
            "kernel": "dmesg --time-format iso",
            "ethtool-eth0": "ethtool -S eth0",
            "ibstat": "ibstat",
            "ib-counters": "grep -H . /sys/class/infiniband/*/ports/*/counters/*",
            "nccl": "cat /shared/logs/4412/*.out (NCCL lines of this node)",
            "nccl-version": "python3 -c 'import torch; print(torch.cuda.nccl.version())'",
        }
        if node == "gpu-004":
            writer.write_unreachable(node, commands, seconds=10.0)
            continue
        statuses = []
        if node == "gpu-003":
            out, err = nvidia_smi_failed()
            writer.write_probe_output(node, "nvidia-smi-q.txt", out, err)
            statuses.append(ProbeStatus("nvidia-smi-q", commands["nvidia-smi-q"], 255, started, 2.31, "command-failed"))
        else:
            smi = (ROOT / "nvidia-smi-q-h100x8.txt").read_bytes()
            writer.write_probe_output(node, "nvidia-smi-q.txt", smi)
            statuses.append(ProbeStatus("nvidia-smi-q", commands["nvidia-smi-q"], 0, started, 0.41, None))
        writer.write_probe_output(node, "kernel.log", kernel_text(node).encode())
        writer.write_probe_output(node, "ethtool-eth0.txt", ethtool_text(rng).encode())
        writer.write_probe_output(node, "ibstat.txt", ibstat_text(index).encode())
        writer.write_probe_output(node, "ib-counters.txt", ib_counters_text(0).encode())
        writer.write_probe_output(node, "ib-counters.txt", ib_counters_text(0).encode(), baseline=True)
        writer.write_probe_output(node, "nccl.log", nccl_text(node, index).encode())
        writer.write_probe_output(node, "nccl-version.txt", b"(2, 18, 5)\n")
        for name in ("kernel", "ethtool-eth0", "ibstat", "ib-counters", "nccl", "nccl-version"):
            statuses.append(ProbeStatus(name, commands[name], 0, started, 0.05, None))
        writer.write_probes_json(node, statuses)
    return target


if __name__ == "__main__":
    out = build(ROOT / "bundle-xid79")
    print(f"wrote {out}")
