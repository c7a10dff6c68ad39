"""Shared by the multi-rank benchmarks: launching ranks as subprocesses, the JSON-lines
channel from rank 0 back to the parent, and table printing.

A benchmark script is both the parent and the worker: the parent starts the metadata
emulator and `world_size` copies of itself with `--worker` and the torch.distributed
environment (gloo on 127.0.0.1), the way torchrun would. Rank 0 reports on stdout,
one JSON object per line; the parent can answer on rank 0's stdin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere in the checkout

from spotguard.demo.processes import free_port, rank_env  # noqa: E402 - after the sys.path line above


class Ranks:
    """`world_size` worker processes of `script`, started with `--worker` and `args`.

    Rank 0's stdout is the report channel (`messages()`), its stdin the parent's answers
    (`tell()`); other ranks' stdout is discarded. Every rank's stderr goes to `log_dir`.
    Leaving the block kills whatever is still running.
    """

    def __init__(self, script: str, world_size: int, args: Sequence[str], log_dir: Path) -> None:
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs = [log_dir / f"rank{rank}.log" for rank in range(world_size)]
        for rank in range(world_size):
            env = rank_env(rank, world_size, port)
            with open(self.logs[rank], "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, script, "--worker", *args], env=env, text=True, stderr=log,
                    stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                ))  # fmt: skip

    def messages(self) -> Iterator[dict[str, Any]]:
        """Rank 0's reports, in order, until it exits."""
        for line in self.procs[0].stdout:
            if line.startswith("{"):
                yield json.loads(line)

    def tell(self, text: str) -> None:
        self.procs[0].stdin.write(text + "\n")
        self.procs[0].stdin.flush()

    def wait(self, timeout_s: float) -> None:
        """Wait for every rank; a failure raises with the tail of the failing rank's log."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs):
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            if code != 0:
                tail = "\n".join(self.logs[rank].read_text().splitlines()[-15:])
                raise RuntimeError(f"rank {rank} exited with {code}; last lines of {self.logs[rank]}:\n{tail}")

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_s3(bucket: str = "bench") -> Any:
    """A moto S3 server on 127.0.0.1 holding `bucket`, with the AWS SDK of this process and of the ranks
    it starts pointed at it through the environment; the caller stops it (`.stop()`)."""
    import boto3

    from tests.servers import start_moto

    server = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=server.url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    try:
        boto3.client("s3").create_bucket(Bucket=bucket)
    except BaseException:
        server.stop()
        raise
    return server


def report(**fields: Any) -> None:
    """Worker side: one message to the parent (rank 0 only)."""
    print(json.dumps(fields), flush=True)


def init_worker() -> tuple[int, int]:
    """Join the gloo group of the launch; one compute thread per rank (two ranks share two cores)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


WIDTH = 4096  # one layer: a 4096x4096 weight + bias, times 3 with AdamW's two moments


def build_state(gb: float) -> tuple[Any, Any, int, int]:
    """A replicated DDP model of `gb` GB with AdamW state (after one real step, so the moments
    exist): (model, optimizer, layers, bytes)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    layers = max(1, round(gb * 1e9 / (3 * 4 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
    return model, optimizer, layers, nbytes


BLOCK = 16 << 20


def write_file(path: Path, size: int, block: bytes) -> None:
    """`size` bytes of `block` (incompressible, e.g. os.urandom: disks do not deduplicate) into `path`,
    in BLOCK-sized writes whose writeback starts at once (the disk busy from the first block on), then
    fsync: the disk's write limit, as a save's files would meet it."""
    from spotguard.checkpoint.save.shard_io import start_writeback

    with open(path, "wb", buffering=0) as f:
        for offset in range(0, size, BLOCK):
            f.write(block[: min(BLOCK, size - offset)])
            start_writeback(f.fileno(), offset, BLOCK)
        os.fsync(f.fileno())


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (pastes into docs/benchmarks.md as is)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
