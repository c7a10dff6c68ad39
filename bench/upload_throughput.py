"""Upload throughput of S3Store against a plain boto3 baseline, on a local moto S3 server.

    python bench/upload_throughput.py [--mb 256] [--files 4] [--repeat 2]

Builds a checkpoint-like directory (a few shard files of uneven size), starts
moto's S3 server on 127.0.0.1, then uploads the same bytes

  * baseline: `boto3 client.upload_file`, default TransferConfig, one file after another;
  * S3Store: `put_file` for all files at once (threads across files, parallel parts, CRC32).

and prints MB/s for both and their ratio (higher is better; goal >= 1.0). The server
runs on the same machine, so absolute numbers say more about the CPU than about
S3; the ratio is what matters. Each side runs --repeat times, alternating; the
best run counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
from _common import start_s3  # also puts the checkout on sys.path

from cloud_adapters.aws.s3 import S3Store

MiB = 1 << 20


def make_checkpoint(folder: Path, total_mb: int, files: int) -> list[Path]:
    """`files` shards whose sizes fall from 1.5x to 0.5x the mean, like uneven DCP shards."""
    weights = [1.5 - i / max(files - 1, 1) for i in range(files)]
    sizes = [int(total_mb * MiB * w / sum(weights)) for w in weights]
    block = os.urandom(8 * MiB)  # random once, repeated: the bytes need not be unique, just incompressible
    paths = []
    for i, size in enumerate(sizes):
        path = folder / f"__{i}_0.distcp"
        with open(path, "wb") as f:
            for offset in range(0, size, len(block)):
                f.write(block[: min(len(block), size - offset)])
        paths.append(path)
    return paths


def baseline(paths: list[Path], bucket: str, prefix: str) -> None:
    client = boto3.client("s3")
    for path in paths:
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


def with_store(store: S3Store, paths: list[Path], prefix: str) -> None:
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(lambda p: store.put_file(p, f"{prefix}/{p.name}"), paths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="checkpoint size in MiB (default 256)")
    parser.add_argument("--files", type=int, default=4, help="number of shard files (default 4)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per side; the best counts (default 2)")
    args = parser.parse_args(argv)
    if args.mb < 1 or args.files < 1 or args.repeat < 1:
        parser.error("--mb, --files and --repeat must be positive")

    server = start_s3()
    try:
        store = S3Store("s3://bench/store")
        with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as tmp:
            paths = make_checkpoint(Path(tmp), args.mb, args.files)
            total = sum(p.stat().st_size for p in paths) / MiB
            best = {"boto3 upload_file, sequential": 0.0, "S3Store, parallel files+parts": 0.0}
            runs = [("boto3 upload_file, sequential", lambda r: baseline(paths, "bench", f"base-{r}")),
                    ("S3Store, parallel files+parts", lambda r: with_store(store, paths, f"run-{r}"))]  # fmt: skip
            for r in range(args.repeat):
                for name, run in runs:
                    started = time.perf_counter()
                    run(r)
                    rate = total / (time.perf_counter() - started)
                    best[name] = max(best[name], rate)
                    print(f"  run {r + 1}: {name:32s} {rate:8.1f} MB/s")
            store.close()
        (base_name, base), (ours_name, ours) = best.items()
        print(f"checkpoint: {total:.0f} MiB in {args.files} files; S3 server: moto on 127.0.0.1")
        print(f"{base_name:32s} {base:8.1f} MB/s")
        print(f"{ours_name:32s} {ours:8.1f} MB/s")
        print(f"ratio (S3Store / baseline)       {ours / base:8.2f}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
