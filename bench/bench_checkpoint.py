"""Benchmark: `spikeops checkpoint verify` against its own floor, the digest on bytes in memory.

Writes a checkpoint-like tree (a few large shards and many small files; 1.2 GB by default),
then measures in one run, warm (the tree in the page cache) and cold (its pages dropped with
``posix_fadvise(DONTNEED)`` before the command):

- the floor: BLAKE3 over the same bytes already in memory (read before the clock starts), on
  one core and with all threads: what the digest itself costs, nothing else;
- `cat` of every file to /dev/null: what reading alone costs;
- coreutils `sha256sum` of every file;
- `spikeops checkpoint verify` (BLAKE3; the whole command, start-up included), `manifest`,
  and `verify` of a SHA-256 manifest.

"share of floor" is the in-memory digest's time over the row's (1.0: as fast as the digest
alone). Throughput is the tree's bytes over wall time; peak RSS from wait4. Run by hand:
`python bench/bench_checkpoint.py [--gb 1.2] [--dir /tmp] [--repeat 3]` (best of the repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _tree(root: Path, total_gb: float) -> tuple[list[Path], int]:
    """75 % in 4 large shards, 25 % in 1 MiB files, filled from a random 1 MiB block."""
    block = os.urandom(1 << 20)
    total = int(total_gb * (1 << 30))
    large = [root / f"mp_rank_{i:02d}" / "model_optim_rng.pt" for i in range(4)]
    small_count = max(1, (total // 4) // (1 << 20))
    paths: list[Path] = []
    for path in large:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as handle:
            for _ in range(int(total * 0.75 / 4) >> 20):
                handle.write(block)
        paths.append(path)
    small_dir = root / "optim"
    small_dir.mkdir(parents=True, exist_ok=True)
    for index in range(small_count):
        path = small_dir / f"shard_{index:05d}.bin"
        path.write_bytes(block[index % 997:] + block[: index % 997])
        paths.append(path)
    return paths, sum(p.stat().st_size for p in paths)


def _run(argv: list[str], **kwargs) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)
    _, status, usage = os.wait4(process.pid, 0)
    return time.perf_counter() - t0, usage.ru_maxrss, os.waitstatus_to_exitcode(status)


def _in_memory_blake3(paths: list[Path], threads: bool) -> float:
    """The floor: BLAKE3 over the tree's bytes, read into memory before the clock starts (in a
    process of its own: a benchmark holding the tree would lend its size to every child's RSS)."""
    code = (
        "import blake3, sys, time\n"
        f"paths = open({{listing!r}}).read().split()\n"
        "data = [open(p, 'rb').read() for p in paths]\n"
        "t0 = time.perf_counter()\n"
        "for blob in data:\n"
        f"    h = blake3.blake3(max_threads={'blake3.blake3.AUTO' if threads else 1}); h.update(blob); h.hexdigest()\n"
        "print(time.perf_counter() - t0)\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write("\n".join(map(str, paths)))
    try:
        done = subprocess.run([sys.executable, "-c", code.format(listing=handle.name)], capture_output=True,
                              text=True, check=True)
    finally:
        os.unlink(handle.name)
    return float(done.stdout.strip())


def _drop(paths: list[Path]) -> None:
    """The tree's pages out of the page cache (clean pages: DONTNEED drops them)."""
    os.sync()
    for path in paths:
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _best(measure, repeat: int) -> tuple[float, int]:
    results = [measure() for _ in range(repeat)]
    seconds = min(r[0] for r in results)
    return seconds, max(r[1] for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.2, help="size of the tree (default 1.2)")
    parser.add_argument("--dir", default=None, help="where to write it (default: the system temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row; the best is kept (default 3)")
    args = parser.parse_args()
    spikeops = str(Path(sys.executable).with_name("spikeops"))
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="spikeops-bench-ckpt-", dir=args.dir) as tmp:
        root = Path(tmp) / "global_step1000"
        paths, total = _tree(root, args.gb)
        listing = Path(tmp) / "files.list"
        listing.write_bytes(b"\0".join(str(p).encode() for p in paths))
        cat = ["sh", "-c", f"xargs -0 cat < '{listing}' > /dev/null"]
        verify = [spikeops, "checkpoint", "verify", str(root)]
        _run(cat)  # into the page cache
        rows: list[tuple[str, float, int]] = []

        def warm(argv: list[str]) -> tuple[float, int]:
            seconds, rss, code = _run(argv)
            assert code == 0, f"failed: {argv}"
            return seconds, rss

        def cold(argv: list[str]) -> tuple[float, int]:
            _drop(paths)
            return warm(argv)

        rows.append(("floor: BLAKE3 on the bytes in memory, all threads",
                     min(_in_memory_blake3(paths, True) for _ in range(args.repeat)), 0))
        rows.append(("BLAKE3 on the bytes in memory, one thread",
                     min(_in_memory_blake3(paths, False) for _ in range(args.repeat)), 0))
        _run(cat)
        rows.append(("cat > /dev/null, warm", *_best(lambda: warm(cat), args.repeat)))
        _run([spikeops, "checkpoint", "manifest", str(root)])
        rows.append(("**spikeops checkpoint verify, warm** (start-up included)",
                     *_best(lambda: warm(verify), args.repeat)))
        rows.append(("sha256sum (coreutils), warm",
                     *_best(lambda: warm(["sh", "-c", f"xargs -0 sha256sum < '{listing}' > /dev/null"]), 1)))
        rows.append(("cat > /dev/null, cold", *_best(lambda: cold(cat), args.repeat)))
        rows.append(("**spikeops checkpoint verify, cold**", *_best(lambda: cold(verify), args.repeat)))
        _run(cat)
        rows.append(("spikeops checkpoint manifest (blake3), warm",
                     *_best(lambda: warm([spikeops, "checkpoint", "manifest", str(root)]), args.repeat)))
        _run([spikeops, "checkpoint", "manifest", str(root), "--algorithm", "sha256"])
        rows.append(("spikeops checkpoint verify (sha256 manifest), warm", *_best(lambda: warm(verify), 1)))
        shutil.rmtree(root, ignore_errors=True)
    floor = rows[0][1]
    print(f"tree: {total / 1e9:.2f} GB in {len(paths)} files ({os.cpu_count()} CPUs, load {load:.1f}); "
          f"best of {args.repeat}; {time.strftime('%Y-%m-%d')}")
    print("| what | seconds | GB/s | share of floor | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seconds, rss in rows:
        print(f"| {name} | {seconds:.3f} | {total / seconds / 1e9:.2f} | {floor / seconds:.2f} | "
              f"{rss / 1024:.0f} |" if rss else f"| {name} | {seconds:.3f} | {total / seconds / 1e9:.2f} | "
              f"{floor / seconds:.2f} | - |")
    print(json.dumps({"bytes": total, "files": len(paths), "seconds": {n: round(s, 3) for n, s, _ in rows}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
