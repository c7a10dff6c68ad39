"""Notice -> durable in a bucket: an emergency checkpoint of a ~1 GB state uploaded to S3
before GCP's 30 s deadline, against the classic save-then-upload pattern.

    python bench/notice_to_durable.py [--gb 1.0]

Two ranks (gloo, subprocesses) hold a replicated DDP state of --gb GB. A moto S3
server and a GCP metadata emulator run on 127.0.0.1. In the same run:

  classic     rank 0 torch.saves the full state to local disk (fsync), then uploads
              it with boto3's upload_file (default TransferConfig); rank 1 waits
  spotguard   a preemption is raised on the emulator while the ranks loop; timed
              from the raise to guard.step() returning True, when the manifest is in
              the bucket (Guard(checkpoint_dir="s3://...", local_dir=...))

Prints both times, the ratio, the timeline of the spotguard run and its margin to
the 30 s deadline. moto runs on the same 2 cores as the ranks, so absolute speeds
say more about this machine than about S3.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import Ranks, build_state, init_worker, report, table

GCP_DEADLINE_S = 30.0
BUCKET = "bench"


def run(args: argparse.Namespace) -> None:
    import boto3

    from cloud_adapters.gcp.emulator import GCPMetadataEmulator
    from tests.servers import start_moto

    server = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=server.url,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as tmp, GCPMetadataEmulator() as emulator:
            results: dict[str, dict] = {}
            raised = 0.0
            worker_args = ["--metadata-url", emulator.url, "--dir", tmp, "--gb", str(args.gb)]
            with Ranks(__file__, 2, worker_args, Path(tmp)) as ranks:
                for msg in ranks.messages():
                    if msg.get("event") == "built":
                        print(f"state: {msg['bytes'] / 1e9:.2f} GB per rank, replicated on 2 ranks", flush=True)
                    elif msg.get("event") == "looping":
                        time.sleep(0.3)
                        raised = time.time()
                        emulator.raise_notice(kind="preempt")
                    elif "method" in msg:
                        results[msg["method"]] = msg
                        print(f"  {msg['method']}: {msg['seconds']:.2f} s", flush=True)
                ranks.wait(timeout_s=120)
    finally:
        server.stop()
    summarize(results, raised)


def summarize(results: dict[str, dict], raised: float) -> None:
    classic, ours = results["classic"], results["spotguard"]
    latency = ours["done_at"] - raised
    print()
    print(
        table(
            ["method", "GB", "seconds", "vs classic"],
            [
                [
                    "rank-0 torch.save + boto3 upload_file",
                    f"{classic['bytes'] / 1e9:.2f}",
                    f"{classic['seconds']:.2f}",
                    "1.00x",
                ],
                [
                    "spotguard: notice -> manifest in the bucket",
                    f"{ours['bytes'] / 1e9:.2f}",
                    f"{latency:.2f}",
                    f"{classic['seconds'] / latency:.2f}x",
                ],
            ],
        )
    )
    print(
        f"\nmargin to GCP's {GCP_DEADLINE_S:.0f} s deadline: {GCP_DEADLINE_S - latency:.1f} s "
        f"(spotguard's own report: {ours['margin_s']:.1f} s; durable={ours['durable']})"
    )
    print(
        "timeline, seconds after the raise: " + ", ".join(f"{event} {at - raised:+.2f}" for event, at in ours["events"])
    )


def worker(args: argparse.Namespace) -> None:
    import boto3
    import torch
    import torch.distributed as dist

    import spotguard

    rank, _ = init_worker()
    model, optimizer, _, nbytes = build_state(args.gb)
    state = {"model": model, "optim": optimizer}
    if rank == 0:
        report(event="built", bytes=nbytes)

    dist.barrier()
    started = time.perf_counter()
    if rank == 0:
        path = Path(args.dir) / "classic.pt"
        with open(path, "wb") as f:
            torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        boto3.client("s3").upload_file(str(path), BUCKET, "classic/state.pt")
        report(method="classic", seconds=time.perf_counter() - started, bytes=path.stat().st_size)
        path.unlink()
    dist.barrier()

    tick = torch.zeros(1)
    with spotguard.Guard(
        f"s3://{BUCKET}/run",
        cloud="gcp",
        metadata_url=args.metadata_url,
        local_dir=str(Path(args.dir) / "local"),
        exit_code=None,
    ) as guard:
        for step in range(6000):
            time.sleep(0.01)
            dist.all_reduce(tick)  # keeps the ranks in step, as DDP's gradient all-reduce does
            if step == 20 and rank == 0:
                report(event="looping")
            if guard.step(step, state):
                break
        saved = guard.last_save
    if rank == 0:
        report(
            method="spotguard",
            seconds=saved.write_s + saved.commit_s + saved.upload_s,
            bytes=saved.bytes,
            done_at=time.time(),
            durable=saved.durable,
            margin_s=saved.margin_s,
            events=[(e.event, e.at.timestamp()) for e in guard.timeline.entries],
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state size per rank in GB (default 1.0)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--metadata-url", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gb <= 0:
        parser.error("--gb must be positive")
    if args.worker:
        worker(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
