"""Benchmark: `spikeops checkpoint verify` against `cat` (the read limit) and `sha256sum`.

Writes a checkpoint-like tree (a few large shards and many small files; 8 GB by default),
reads it once so it sits in the page cache, then measures in one run:

- `cat` of every file to /dev/null: what reading alone costs;
- coreutils `sha256sum` of every file;
- BLAKE3 with nothing around it (the `blake3` module over a memory map, on one core and on
  all): the digest's own limit, to show what the Python around it costs;
- `spikeops checkpoint manifest` (BLAKE3), `verify` with BLAKE3 and with SHA-256.

Throughput is the tree's bytes over wall time; peak RSS from wait4. Run by hand:
`python bench/bench_checkpoint.py [--gb 8] [--dir /tmp]`; the figures go in the README.
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


def _raw_blake3(paths: list[Path], threads: str) -> float:
    code = (
        "import blake3, sys\n"
        "for p in sys.argv[1:]:\n"
        f"    h = blake3.blake3(max_threads={threads}); h.update_mmap(p); h.hexdigest()\n"
    )
    listing = Path(tempfile.mktemp(suffix=".txt"))
    listing.write_text("\n".join(map(str, paths)))
    seconds, _, _ = _run([sys.executable, "-c", code.replace("sys.argv[1:]", f"open({str(listing)!r}).read().split()")])
    listing.unlink()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=8.0, help="size of the tree (default 8)")
    parser.add_argument("--dir", default=None, help="where to write it (default: the system temp dir)")
    args = parser.parse_args()
    spikeops = str(Path(sys.executable).with_name("spikeops"))
    with tempfile.TemporaryDirectory(prefix="spikeops-bench-ckpt-", dir=args.dir) as tmp:
        root = Path(tmp) / "global_step1000"
        paths, total = _tree(root, args.gb)
        listing = Path(tmp) / "files.list"
        listing.write_bytes(b"\0".join(str(p).encode() for p in paths))
        _run(["sh", "-c", f"xargs -0 cat < '{listing}' > /dev/null"])  # into the page cache
        rows = []
        seconds, rss, _ = _run(["sh", "-c", f"xargs -0 cat < '{listing}' > /dev/null"])
        rows.append(("cat > /dev/null (read limit)", seconds, rss))
        seconds, rss, _ = _run(["sh", "-c", f"xargs -0 sha256sum < '{listing}' > /dev/null"])
        rows.append(("sha256sum (coreutils)", seconds, rss))
        rows.append(("BLAKE3 alone (blake3 module, mmap, one core)", _raw_blake3(paths, "1"), 0))
        rows.append(("BLAKE3 alone (blake3 module, mmap, all threads)", _raw_blake3(paths, "blake3.blake3.AUTO"), 0))
        seconds, rss, code = _run([spikeops, "checkpoint", "manifest", str(root)])
        rows.append(("spikeops checkpoint manifest (blake3)", seconds, rss))
        seconds, rss, code = _run([spikeops, "checkpoint", "verify", str(root)])
        assert code == 0, "verify failed"
        rows.append(("spikeops checkpoint verify (blake3)", seconds, rss))
        seconds, rss, code = _run([spikeops, "checkpoint", "manifest", str(root), "--algorithm", "sha256"])
        seconds, rss, code = _run([spikeops, "checkpoint", "verify", str(root)])
        rows.append(("spikeops checkpoint verify (sha256)", seconds, rss))
        shutil.rmtree(root, ignore_errors=True)
    by_name = {name: seconds for name, seconds, _ in rows}
    sha = by_name["sha256sum (coreutils)"]
    cat = by_name["cat > /dev/null (read limit)"]
    raw = by_name["BLAKE3 alone (blake3 module, mmap, one core)"]
    print(f"tree: {total / 1e9:.2f} GB in {len(paths)} files ({os.cpu_count()} CPUs)")
    print("| what | seconds | GB/s | vs sha256sum | share of cat | share of BLAKE3 one core | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, seconds, rss in rows:
        print(f"| {name} | {seconds:.2f} | {total / seconds / 1e9:.2f} | {sha / seconds:.1f}x | "
              f"{cat / seconds:.2f} | {raw / seconds:.2f} | {rss / 1024:.0f} |")
    print(json.dumps({"bytes": total, "files": len(paths), "seconds": {n: round(s, 3) for n, s, _ in rows}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
