"""Notice -> durable in a bucket: an emergency checkpoint of a ~1 GB state uploaded to S3
(or GCS) before GCP's 30 s deadline, against the classic save-then-upload pattern, and
spotguard's streaming upload against its upload after the local commit.

    python bench/notice_to_durable.py [--gb 1.0] [--repeat 1] [--store s3|gcs]

Two ranks (gloo, subprocesses) hold a replicated DDP state of --gb GB. A moto S3 server
(--store gcs: gcp-storage-emulator) and a GCP metadata emulator run on 127.0.0.1. In the
same run:

  classic       rank 0 torch.saves the full state to local disk (fsync), then uploads
                it with the cloud's SDK (boto3's upload_file with its default
                TransferConfig; google-cloud-storage's upload_from_filename); rank 1 waits
  then --repeat rounds of three Guards (order reversed every other round), each timed from
  a preemption raised on the emulator while the ranks loop to guard.step() returning True:
  local         checkpoint_dir is a local path: the local write and commit only
  after-commit  s3:// or gs://..., stream_uploads=False: the files go up after the local commit
  streaming     s3:// or gs://..., stream_uploads=True (the default): each shard file goes up
                part by part while it is written; the manifest still goes last

Prints the times, the ratios, the goal (streaming ~= the after-commit run with its write and
upload overlapped: its notice -> durable less the shorter of the two), the timeline of the
last streaming run and its margin to the 30 s deadline. The store's server runs on the same
cores as the ranks, so absolute speeds say more about this machine than about the cloud.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import Ranks, build_state, init_worker, report, table

GCP_DEADLINE_S = 30.0
BUCKET = "bench"
PHASES = ("local", "after-commit", "streaming")


def run(args: argparse.Namespace) -> None:
    from cloud_adapters.gcp.emulator import GCPMetadataEmulator
    from tests.servers import start_gcs_emulator, start_moto

    server = start_gcs_emulator() if args.store == "gcs" else start_moto()
    os.environ.update(  # inherited by the ranks
        AWS_ENDPOINT_URL=server.url,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        STORAGE_EMULATOR_HOST=server.url,
        GOOGLE_CLOUD_PROJECT="bench",
    )
    bucket = Bucket(args.store)
    try:
        bucket.create()
        with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as tmp, GCPMetadataEmulator() as emulator:
            results: dict[str, dict] = {}
            raised = 0.0
            worker_args = ["--metadata-url", emulator.url, "--dir", tmp, "--gb", str(args.gb)]
            worker_args += ["--repeat", str(args.repeat), "--store", args.store]
            runs: dict[str, list[dict]] = {phase: [] for phase in PHASES}
            with Ranks(__file__, 2, worker_args, Path(tmp)) as ranks:
                for msg in ranks.messages():
                    if msg.get("event") == "built":
                        print(f"state: {msg['bytes'] / 1e9:.2f} GB per rank, replicated on 2 ranks", flush=True)
                    elif msg.get("event") == "ready":  # a fresh Guard is next: no notice pending, an empty bucket
                        emulator.clear()
                        bucket.empty()
                        ranks.tell("go")
                    elif msg.get("event") == "looping":
                        time.sleep(0.3)
                        raised = time.time()
                        emulator.raise_notice(kind="preempt")
                    elif "phase" in msg:
                        msg["latency"] = msg["done_at"] - raised
                        msg["raised"] = raised
                        runs[msg["phase"]].append(msg)
                        print(f"  {msg['phase']}: {msg['latency']:.2f} s from the notice", flush=True)
                    elif "method" in msg:
                        results[msg["method"]] = msg
                        print(f"  {msg['method']}: {msg['seconds']:.2f} s", flush=True)
                ranks.wait(timeout_s=120 + 120 * args.repeat)
    finally:
        server.stop()
    summarize(results, runs)


class Bucket:
    """The benchmark's bucket through the cloud's own SDK (the classic upload's, and the emptying between Guards)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "gcs":
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self.client = storage.Client(project="bench", credentials=AnonymousCredentials())
        else:
            import boto3

            self.client = boto3.client("s3")

    def create(self) -> None:
        if self.kind == "gcs":
            self.client.create_bucket(BUCKET)
        else:
            self.client.create_bucket(Bucket=BUCKET)

    def upload(self, path: Path, key: str) -> None:
        if self.kind == "gcs":
            self.client.bucket(BUCKET).blob(key).upload_from_filename(str(path))
        else:
            self.client.upload_file(str(path), BUCKET, key)

    def empty(self) -> None:
        """The servers keep every object: each Guard's bytes are dropped before the next one saves."""
        if self.kind == "gcs":
            for blob in self.client.list_blobs(BUCKET):
                blob.delete()
            return
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


def summarize(results: dict[str, dict], runs: dict[str, list[dict]]) -> None:
    classic = results["classic"]
    ours = runs["streaming"][-1]
    raised = ours["raised"]
    latency = statistics.median(r["latency"] for r in runs["streaming"])
    print()
    print(
        table(
            ["method", "GB", "seconds", "vs classic"],
            [
                [
                    "rank-0 torch.save + the SDK's upload of the file",
                    f"{classic['bytes'] / 1e9:.2f}",
                    f"{classic['seconds']:.2f}",
                    "1.00x",
                ],
                [
                    "spotguard (streaming, median): notice -> manifest in the bucket",
                    f"{ours['bytes'] / 1e9:.2f}",
                    f"{latency:.2f}",
                    f"{classic['seconds'] / latency:.2f}x",
                ],
            ],
        )
    )
    print()
    print(streaming_table(runs))
    print(
        f"\nmargin to GCP's {GCP_DEADLINE_S:.0f} s deadline: {GCP_DEADLINE_S - latency:.1f} s "
        f"(spotguard's own report: {ours['margin_s']:.1f} s; durable={ours['durable']})"
    )
    print(
        "timeline, seconds after the raise: " + ", ".join(f"{event} {at - raised:+.2f}" for event, at in ours["events"])
    )


def streaming_table(runs: dict[str, list[dict]]) -> str:
    """Streaming against the upload after the commit, the local write alone and the goal (medians over rounds)."""

    def median(phase: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[phase])

    local, after, streamed = (median(p, "latency") for p in PHASES)
    written, uploaded = median("after-commit", "write_commit_s"), median("after-commit", "upload_s")
    goal = after - min(written, uploaded)  # the after-commit run with its write and upload overlapped
    rows = [
        ["local write only: notice -> committed (path checkpoint_dir)", f"{local:.2f}", "", ""],
        [
            f"after-commit upload (stream_uploads=False; write+commit {written:.2f} s, upload {uploaded:.2f} s)",
            f"{after:.2f}",
            "1.00x",
            f"{after / goal:.2f}",
        ],
        [
            f"streaming upload (stream_uploads=True; write+commit {median('streaming', 'write_commit_s'):.2f} s, "
            f"upload after it {median('streaming', 'upload_s'):.2f} s)",
            f"{streamed:.2f}",
            f"{after / streamed:.2f}x",
            f"{streamed / goal:.2f}",
        ],
    ]
    lines = table(["notice -> durable (2 ranks)", "seconds", "speed-up", "vs goal"], rows)
    return (
        f"{lines}\n\ngoal: {goal:.2f} s = after-commit - min(write+commit, upload), i.e. max(local write, upload) "
        f"(streaming / goal should be ~1.0); streaming / local write only: {streamed / local:.2f}; "
        f"medians of {len(runs['streaming'])} round(s): "
        + "; ".join(f"{p} " + " ".join(f"{r['latency']:.2f}" for r in runs[p]) for p in PHASES)
    )


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

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
        Bucket(args.store).upload(path, "classic/state.pt")
        report(method="classic", seconds=time.perf_counter() - started, bytes=path.stat().st_size)
        path.unlink()
    dist.barrier()

    for round_ in range(args.repeat):
        for phase in PHASES if round_ % 2 == 0 else reversed(PHASES):
            emergency(args, rank, state, phase, Path(args.dir) / f"{phase}-{round_}")
    dist.destroy_process_group()


def emergency(args: argparse.Namespace, rank: int, state: dict, phase: str, scratch: Path) -> None:
    """One Guard from a clean start to its emergency save (the parent raises the notice); rank 0 reports."""
    import torch
    import torch.distributed as dist

    import spotguard

    if rank == 0:
        report(event="ready", phase=phase)
        sys.stdin.readline()  # the parent has cleared the emulator and emptied the bucket
    dist.barrier()
    tick = torch.zeros(1)
    scheme = "gs" if args.store == "gcs" else "s3"
    where = str(scratch / "ckpt") if phase == "local" else f"{scheme}://{BUCKET}/{scratch.name}"
    with spotguard.Guard(
        where,
        cloud="gcp",
        metadata_url=args.metadata_url,
        local_dir=str(scratch / "local") if phase != "local" else None,
        exit_code=None,
        stream_uploads=phase == "streaming",
    ) as guard:
        for step in range(6000):
            time.sleep(0.01)
            dist.all_reduce(tick)  # keeps the ranks in step, as DDP's gradient all-reduce does
            if step == 20 and rank == 0:
                report(event="looping")
            if guard.step(step, state):
                done_at = time.time()  # durable (committed, for "local"): before the Guard's own exit
                break
        saved = guard.last_save
    dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        report(
            phase=phase,
            bytes=saved.bytes,
            done_at=done_at,
            write_commit_s=saved.write_s + saved.commit_s,
            upload_s=saved.upload_s,
            streamed_bytes=saved.streamed_bytes,
            durable=saved.durable,
            margin_s=saved.margin_s if saved.margin_s is not None else float("nan"),
            events=[(e.event, e.at.timestamp()) for e in guard.timeline.entries],
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state size per rank in GB (default 1.0)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the three Guards (default 1)")
    parser.add_argument("--store", choices=["s3", "gcs"], default="s3", help="moto (S3) or gcp-storage-emulator")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--metadata-url", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gb <= 0:
        parser.error("--gb must be positive")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.worker:
        worker(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
