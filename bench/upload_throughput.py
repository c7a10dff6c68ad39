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

    python bench/upload_throughput.py --local [--mb 1024] [--files 3]

A checkpoint dir on a filesystem instead (LocalStore, what an emergency's upload into a local or shared
dir does): `put_file` for all files at once, copied in the kernel (copy_file_range), against the same
with the kernel's copy unavailable (reads and writes through the process, as before it), each fsynced.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
from _common import start_s3  # also puts the checkout on sys.path

from cloud_adapters.aws.s3 import S3Store
from cloud_adapters.storage import LocalStore

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


def compare(runs: dict[str, Callable[[int], None]], total_mb: float, repeat: int) -> dict[str, float]:
    """Each of `runs` (name -> run(r)) `repeat` times, alternating: the best MB/s of each."""
    best = dict.fromkeys(runs, 0.0)
    for r in range(repeat):
        for name, run in runs.items():
            started = time.perf_counter()
            run(r)
            rate = total_mb / (time.perf_counter() - started)
            best[name] = max(best[name], rate)
            print(f"  run {r + 1}: {name:32s} {rate:8.1f} MB/s")
    return best


def local(total_mb: int, files: int, repeat: int) -> int:
    kernel_copy = os.copy_file_range

    def by_reads_and_writes(*_: object) -> int:
        raise OSError(18, "Invalid cross-device link")  # EXDEV: the store copies through the process

    def put_all(store: LocalStore, paths: list[Path], prefix: str, in_kernel: bool) -> None:
        os.copy_file_range = kernel_copy if in_kernel else by_reads_and_writes  # type: ignore[assignment]
        with ThreadPoolExecutor(len(paths)) as pool:
            list(pool.map(lambda p: store.put_file(p, f"{prefix}/{p.name}"), paths))
        os.copy_file_range = kernel_copy

    with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as tmp:
        (Path(tmp) / "stage").mkdir()
        paths = make_checkpoint(Path(tmp) / "stage", total_mb, files)
        store = LocalStore(Path(tmp) / "ckpt")
        total = sum(p.stat().st_size for p in paths) / MiB
        best = compare({"reads and writes (before)": lambda r: put_all(store, paths, f"rw-{r}", False),
                        "copy_file_range": lambda r: put_all(store, paths, f"kernel-{r}", True)},
                       total, repeat)  # fmt: skip
    (base_name, base), (ours_name, ours) = best.items()
    print(f"checkpoint: {total:.0f} MiB in {files} files, into a dir on the same filesystem, fsynced")
    print(f"{base_name:32s} {base:8.1f} MB/s")
    print(f"{ours_name:32s} {ours:8.1f} MB/s")
    print(f"ratio (copy_file_range / before) {ours / base:8.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="checkpoint size in MiB (default 256)")
    parser.add_argument("--files", type=int, default=4, help="number of shard files (default 4)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per side; the best counts (default 2)")
    parser.add_argument("--local", action="store_true", help="a checkpoint dir on a filesystem, not S3")
    args = parser.parse_args(argv)
    if args.mb < 1 or args.files < 1 or args.repeat < 1:
        parser.error("--mb, --files and --repeat must be positive")
    if args.local:
        return local(args.mb, args.files, args.repeat)

    server = start_s3()
    try:
        store = S3Store("s3://bench/store")
        with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as tmp:
            paths = make_checkpoint(Path(tmp), args.mb, args.files)
            total = sum(p.stat().st_size for p in paths) / MiB
            best = compare({"boto3 upload_file, sequential": lambda r: baseline(paths, "bench", f"base-{r}"),
                            "S3Store, parallel files+parts": lambda r: with_store(store, paths, f"run-{r}")},
                           total, args.repeat)  # fmt: skip
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
