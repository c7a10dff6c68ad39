"""Faults never throw progress away: resume through a broken network fails loudly (never a silent
fresh start), retention keeps a run's newest checkpoint and stays bounded when the store is dead,
and cleanup in a shared bucket touches only our keys. Real servers and proxies on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cloud_adapters.storage import LocalStore, Unreachable
from spotguard.checkpoint import Checkpointer, list_checkpoints
from spotguard.checkpoint.errors import CheckpointUnavailable
from spotguard.checkpoint.resume import newest as resume
from spotguard.checkpoint.save import retention
from tests.conftest import Backend, backend_for, start_server
from tests.servers import Fault, FaultProxy

NUMEL = 1 << 20  # 4 MiB of float32 per step


def state(fill: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((NUMEL,), fill)}


def save_steps(url: str, local_dir, steps, keep_last: int | None = None) -> None:
    with Checkpointer(url, local_dir=str(local_dir), keep_last=keep_last) as ckpt:
        for step in steps:
            ckpt.save(step, state(step), reason="periodic")


def test_resume_through_a_network_that_resets_downloads_fails_loudly(cloud_backend: Backend, tmp_path, monkeypatch):
    save_steps(cloud_backend.url, tmp_path / "old-vm", (1, 2))
    proxy = FaultProxy(cloud_backend.server.url)
    proxy.reset_after = 1 << 20  # listings and manifests pass; every shard download is cut after 1 MiB
    cloud_backend.point_at(proxy.url)
    monkeypatch.setattr(resume, "RESUME_TIMEOUT_S", 6.0)
    restored = state()
    try:
        with Checkpointer(cloud_backend.url, local_dir=str(tmp_path / "new-vm")) as ckpt:
            ckpt.remote.retry_deadline_s = 2.0
            started = time.monotonic()
            with pytest.raises(CheckpointUnavailable, match="step-0000000002") as failure:
                ckpt.resume(restored)
            took = time.monotonic() - started
    finally:
        proxy.close()
        cloud_backend.point_at(cloud_backend.server.url)
    assert proxy.faulted >= 2  # it did retry
    assert took < 6.0 + 3.0, f"resume gave up after {took:.1f} s against a 6 s bound"
    assert "\n" not in str(failure.value)
    assert not restored["w"].any()  # nothing loaded, and no older step either


def test_resume_waits_out_a_short_outage_and_loads_the_newest_step(storage_servers, monkeypatch, tmp_path):
    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    save_steps(backend.url, tmp_path / "old-vm", (1, 2))
    proxy = FaultProxy(backend.server.url)
    proxy.arm(Fault(503, b"", count=None))
    recovery = threading.Timer(4.0, proxy.arm, args=(None,))
    backend.point_at(proxy.url)
    restored = state()
    try:
        with Checkpointer(backend.url, local_dir=str(tmp_path / "new-vm")) as ckpt:
            ckpt.remote.retry_deadline_s = 1.0  # each call gives up long before the outage ends
            recovery.start()
            assert ckpt.resume(restored) == 2
    finally:
        recovery.cancel()
        proxy.close()
        backend.point_at(backend.server.url)
    assert torch.equal(restored["w"], state(2)["w"])


def test_retention_keeps_the_highest_steps_and_never_the_save_it_follows(tmp_path):
    save_steps(str(tmp_path), tmp_path, (100, 200), keep_last=2)
    save_steps(str(tmp_path), tmp_path, (1, 2), keep_last=2)  # started again at 0 beside them
    # Resume loads 200: those stay; of the new run's steps only the one just saved is kept.
    assert [(c.step, c.committed) for c in list_checkpoints(str(tmp_path))] == [(2, True), (100, True), (200, True)]
    save_steps(str(tmp_path), tmp_path, (300,), keep_last=1)
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [300]


def test_retention_with_the_store_frozen_gives_up_in_bounded_time(monkeypatch, tmp_path):
    server = start_server("s3")
    try:
        backend = Backend("s3", server, monkeypatch, tmp_path)
        save_steps(backend.url, tmp_path / "vm", (1, 2))
        store = backend.store()  # its own retry deadline: 60 s
        server.freeze()
        for clean in (
            lambda: retention.keep_last(store, 1, timeout_s=3.0),
            lambda: retention.remove_abandoned(store, timeout_s=3.0),
        ):
            started = time.monotonic()
            with pytest.raises(Unreachable):
                clean()
            took = time.monotonic() - started
            assert took < 3.0 + 1.5, f"retention against a frozen store took {took:.1f} s"
    finally:
        server.stop()


def test_cleanup_in_a_bucket_without_a_prefix_touches_only_our_keys(storage_servers, monkeypatch, tmp_path):
    import boto3

    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    client = boto3.client("s3")
    theirs = ["other-app/upload.bin", "step-0000000005", "step-x/a", "step-000005/a"]
    for key in [*theirs, "step-0000000005/__1_0.distcp"]:  # the last: one of ours, killed mid-upload
        client.create_multipart_upload(Bucket=backend.bucket, Key=key)
    client.put_object(Bucket=backend.bucket, Key="step-x/b", Body=b"theirs")
    save_steps(f"s3://{backend.bucket}", tmp_path / "vm", (9,))
    left = client.list_multipart_uploads(Bucket=backend.bucket).get("Uploads", [])
    assert sorted(u["Key"] for u in left) == sorted(theirs)
    assert client.get_object(Bucket=backend.bucket, Key="step-x/b")["Body"].read() == b"theirs"


def test_a_step_without_a_manifest_is_uncommitted_for_verify(tmp_path):
    from spotguard.checkpoint import verify_checkpoint

    save_steps(str(tmp_path), tmp_path, (1, 2))
    LocalStore(tmp_path).delete(["step-0000000001/spotguard.json"])  # retention killed after the manifest
    results = {r.step: r for r in verify_checkpoint(str(tmp_path))}
    assert results[2].ok and results[2].committed
    assert not results[1].committed and not results[1].problems


GUARD_RESUMES = """
import sys, torch, spotguard
import spotguard.checkpoint.resume.newest as resume
resume.RESUME_TIMEOUT_S = 4.0
with spotguard.Guard(sys.argv[1], cloud="none", local_dir=sys.argv[2]) as guard:
    print("started at", guard.resume({"w": torch.zeros(1 << 20)}), flush=True)
"""


def test_the_guard_exits_69_rather_than_start_afresh(storage_servers, monkeypatch, tmp_path):
    import os
    import subprocess
    import sys

    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    save_steps(backend.url, tmp_path / "old-vm", (1, 2))
    proxy = FaultProxy(backend.server.url)
    proxy.reset_after = 1 << 20  # every shard download is cut
    backend.point_at(proxy.url)  # the child reads the endpoint from the environment
    try:
        done = subprocess.run(
            [sys.executable, "-c", GUARD_RESUMES, backend.url, str(tmp_path / "new-vm")],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ),
        )
    finally:
        proxy.close()
        backend.point_at(backend.server.url)
    assert done.returncode == 69, done.stderr[-2000:]
    assert "started at" not in done.stdout
    assert "exiting with code 69" in done.stderr


def test_a_resume_whose_deadline_cuts_a_listing_short_still_names_the_step_that_failed(tmp_path, monkeypatch):
    save_steps(str(tmp_path / "store"), tmp_path / "old-vm", (1, 2))
    monkeypatch.setattr(resume, "RESUME_TIMEOUT_S", 4.0)  # a listing after the first pass fails, then time runs out
    with Checkpointer(str(tmp_path / "store"), local_dir=str(tmp_path / "new-vm")) as ckpt:
        listed = ckpt.remote.list
        lists = []

        def list_once_then_fail(prefix: str = ""):
            lists.append(prefix)
            if len(lists) > 1:
                raise Unreachable("list: the network is gone")
            return listed(prefix)

        def no_download(key, local_path, **kwargs):
            raise Unreachable(f"download {key}: connection reset")

        monkeypatch.setattr(ckpt.remote, "list", list_once_then_fail)
        monkeypatch.setattr(ckpt.remote, "get_file", no_download)
        with pytest.raises(CheckpointUnavailable) as failure:
            ckpt.resume(state())
    message = str(failure.value)
    assert "listing checkpoints: list: the network is gone" in message
    assert "before that, step-0000000002" in message and "connection reset" in message
