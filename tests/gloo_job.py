"""A real multi-process torch.distributed job on CPU (gloo) whose collectives go wrong.

One process per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` as torchrun
sets them), flight recorder on (``TORCH_FR_BUFFER_SIZE``), dumps written by
``spikeops.train.FlightRecorderDump`` to ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` once no step
completes for ``--dump-after`` seconds. Each "step" is an all-reduce of a gradient-sized
tensor and of the loss, as a data-parallel loop does. At ``--at``:

- ``hang``: rank ``--rank`` stays in its data loader (``load_next_batch`` never returns) and
  never enters the step's all-reduce; every other rank waits in it;
- ``mismatch``: rank ``--rank`` broadcasts where the others all-reduce (another operation at
  the same collective sequence number);
- ``clean``: nothing happens; the job finishes, each rank dumping its recorder at the end
  (``spikeops.train.flight_recorder.dump_now``, the on-demand dump).

The processes stay alive after dumping (a hung job's do) until the caller stops them.
``spawn(...)`` starts the job from a test and returns the processes.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_next_batch(step: int) -> None:
    """A data loader whose storage stopped answering: it never returns."""
    while True:
        time.sleep(0.5)


def run(mode: str, rank_at_fault: int, at: int, steps: int, dump_after: float, as_json: bool) -> None:
    import torch
    import torch.distributed as dist

    from spikeops.train.flight_recorder import FlightRecorderDump

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    recorder = FlightRecorderDump(rank, after_s=dump_after, as_json=as_json, poll_s=0.2)
    grads = torch.ones(4096)
    for step in range(1, steps + 1):
        if step == at and rank == rank_at_fault and mode == "hang":
            load_next_batch(step)
        if step == at and rank == rank_at_fault and mode == "mismatch":
            dist.broadcast(grads, src=0)
        else:
            dist.all_reduce(grads)
        loss = torch.tensor([float(step)])
        dist.all_reduce(loss)
        recorder.progress(step)
    recorder.close()
    if mode == "clean":
        from spikeops.train.flight_recorder import dump_now

        dump_now(rank, as_json=as_json)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def spawn(mode: str, prefix: Path, *, world: int = 3, rank: int = 2, at: int = 4, steps: int = 8,
          dump_after: float = 1.5, as_json: bool = False, env: dict[str, str] | None = None,
          nodes: list[str] | None = None) -> list[subprocess.Popen]:
    """Start the job's ranks (``nodes[r]`` in rank r's ``SPIKEOPS_NODE``, as a launcher per
    node would set it); the caller stops them."""
    port = _free_port()
    processes = []
    for r in range(world):
        child = {**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": str(prefix),
                 "PYTHONPATH": str(HERE.parent)}
        if nodes:
            child["SPIKEOPS_NODE"] = nodes[r]
        argv = [sys.executable, str(HERE / "gloo_job.py"), mode, "--rank", str(rank), "--at", str(at),
                "--steps", str(steps), "--dump-after", str(dump_after)] + (["--json"] if as_json else [])
        processes.append(subprocess.Popen(argv, env=child, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return processes


def wait_for_dumps(prefix: Path, world: int, processes: list[subprocess.Popen], timeout: float = 120.0) -> list[Path]:
    """The ranks' dump files once all exist (written whole: renamed into place)."""
    deadline = time.monotonic() + timeout
    wanted = [Path(f"{prefix}{r}") for r in range(world)]
    while time.monotonic() < deadline:
        if all(path.is_file() for path in wanted):
            return wanted
        dead = [p for p in processes if p.poll() not in (None, 0)]
        if dead:
            raise RuntimeError(f"a rank died: {dead[0].stderr.read().decode()[-2000:] if dead[0].stderr else ''}")
        time.sleep(0.2)
    raise TimeoutError(f"no dumps at {prefix}<rank> after {timeout} s")


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("hang", "mismatch", "clean"))
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--at", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dump-after", type=float, default=1.5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run(args.mode, args.rank, args.at, args.steps, args.dump_after, args.json)
    if args.mode != "clean":
        while True:  # never reached by the ranks that wait; the faulty one waits too
            time.sleep(1)


if __name__ == "__main__":
    main()
