"""Shard files stream to the bucket while they are written (S3 on moto's server, Azure on azurite, GCS on
gcp-storage-emulator, all on 127.0.0.1 behind a fault proxy): the bucket ends up with the local bytes, a
failed stream falls back to the after-commit upload, the local commit never waits for the streams, and the
manifest waits for all."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import boto3
import pytest
import torch

from cloud_adapters.gcp import gcs
from spotguard.checkpoint import Checkpointer
from spotguard.checkpoint.moves import streaming
from tests.conftest import Backend, backend_for
from tests.servers import Fault, FaultProxy, azurite_connection_string
from tests.test_stores import PROTOCOLS

STEP_DIR = "step-0000000001"
ACCESS_DENIED = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two 12 MiB tensors: with two write threads, two shard files of three 5 MiB parts each (the last short)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(3 << 20, generator=generator) for name in ("a", "b")}


@pytest.fixture(params=["s3", "azure", "gcs"])
def s3(request, storage_servers, monkeypatch, tmp_path) -> Backend:
    """A store that streams (the S3 one unless parametrized otherwise)."""
    monkeypatch.setattr(streaming, "PART_SIZE", 5 << 20)  # S3's smallest part: several parts per file
    monkeypatch.setattr(gcs, "DEFAULT_PART_SIZE", 5 << 20)  # GCS streams in its upload chunks
    return backend_for(request.param, storage_servers, monkeypatch, tmp_path)


@pytest.fixture
def proxy(s3: Backend):
    proxy = FaultProxy(s3.server.url)
    s3.point_at(proxy.url)
    yield proxy
    proxy.close()
    s3.point_at(s3.server.url)


def save(s3: Backend, local: Path, **options) -> tuple:
    with Checkpointer(s3.url, local_dir=str(local), write_threads=2, **options) as ckpt:
        report = ckpt.save(1, make_state(), reason="periodic")
    shards = sorted(p for p in (local / STEP_DIR).iterdir() if p.suffix == ".distcp")
    assert len(shards) == 2, shards
    return report, shards


def assert_bucket_matches(s3: Backend, local_step: Path) -> None:
    store = s3.store()
    for path in local_step.iterdir():
        assert store.get_bytes(f"{STEP_DIR}/{path.name}") == path.read_bytes(), path.name


def assert_resumes(s3: Backend, tmp_path: Path) -> None:
    restored = {name: torch.zeros(3 << 20) for name in ("a", "b")}
    with Checkpointer(s3.url, local_dir=str(tmp_path / "fresh-vm")) as ckpt:
        assert ckpt.resume(restored) == 1
    for name, tensor in make_state().items():
        assert torch.equal(restored[name], tensor), name


def gcs_sessions(seen: list) -> dict[str, list[str]]:
    """The Content-Range of every chunk, by resumable upload session (its upload_id)."""
    sessions: dict[str, list[str]] = {}
    for m, q, h in seen:
        if PROTOCOLS["gcs"].is_part(m, q):
            sessions.setdefault(q.split("upload_id=")[1], []).append(h["Content-Range"])
    return sessions


def part_puts(s3: Backend, seen: list) -> list[str]:
    if s3.kind == "gcs":  # the chunks of streamed sessions: their total unknown until the last
        return [r for ranges in gcs_sessions(seen).values() if any(r.endswith("/*") for r in ranges) for r in ranges]
    return [q for m, q, _ in seen if PROTOCOLS[s3.kind].is_part(m, q)]


def whole_puts(s3: Backend, seen: list) -> list[str]:
    """Shard files sent in one piece (S3's complete is a POST, Azure's a PUT of the block list; GCS
    sessions whose total size is known from their first chunk)."""
    if s3.kind == "gcs":
        return [ranges[0] for ranges in gcs_sessions(seen).values() if not any(r.endswith("/*") for r in ranges)]
    is_part = PROTOCOLS[s3.kind].is_part
    return [q for m, q, _ in seen if m == "PUT" and ".distcp" in q and not is_part(m, q) and "blocklist" not in q]


def is_manifest_upload(s3: Backend, method: str, path: str) -> bool:
    if s3.kind == "gcs":  # its name is in the body: the one create-only write of a save
        return method == "POST" and "ifGenerationMatch=0" in path
    return method == "PUT" and path.split("?")[0].endswith("/spotguard.json")


def bucket(s3: Backend) -> dict[str, int]:
    """The step's objects and their sizes, asked of the server itself (past the proxy)."""
    if s3.kind == "s3":
        listed = boto3.client("s3", endpoint_url=s3.server.url).list_objects_v2(
            Bucket=s3.bucket, Prefix=f"run-7/{STEP_DIR}/"
        )
        return {o["Key"].rsplit("/", 1)[1]: o["Size"] for o in listed.get("Contents", [])}
    if s3.kind == "gcs":
        return {o.key.rsplit("/", 1)[1]: o.size for o in s3.store().list(f"{STEP_DIR}/")}
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(azurite_connection_string(s3.server.url))
    blobs = service.get_container_client(s3.bucket).list_blobs(name_starts_with=f"run-7/{STEP_DIR}/")
    return {b.name.rsplit("/", 1)[1]: b.size for b in blobs}


def test_shards_stream_part_by_part_and_the_bucket_holds_the_local_bytes(s3, proxy, tmp_path):
    report, shards = save(s3, tmp_path / "vm")
    assert report.durable, report.error
    assert report.streamed_bytes == sum(p.stat().st_size for p in shards)
    assert len(part_puts(s3, proxy.seen)) == 6  # 3 parts per file
    assert not whole_puts(s3, proxy.seen)  # no shard sent again after the commit
    assert_bucket_matches(s3, tmp_path / "vm" / STEP_DIR)
    assert_resumes(s3, tmp_path)

    # Switched off, the same save uploads after the commit only.
    store = s3.store()
    store.delete(i.key for i in store.list())
    s3.point_at(proxy.url)  # store() pointed the SDK at the server itself
    before = len(proxy.seen)
    report, _ = save(s3, tmp_path / "vm2", stream_uploads=False)
    assert report.durable and report.streamed_bytes == 0
    assert not part_puts(s3, proxy.seen[before:]) and len(whole_puts(s3, proxy.seen[before:])) == 2


@pytest.mark.parametrize("s3", ["gcs"], indirect=True)
def test_a_gcs_chunk_refused_falls_back_to_the_upload_after_the_commit(s3, proxy, tmp_path):
    # The emulator's session ids name the object: the first chunk of one file's stream is refused for good.
    proxy.arm(Fault(403, b'{"error": {"code": 403, "message": "denied"}}', match=r"upload_id=[^&]*__0_1\.distcp"))
    report, shards = save(s3, tmp_path / "vm")
    assert proxy.faulted == 1
    assert report.durable, report.error
    assert report.streamed_bytes == shards[0].stat().st_size  # the other file streamed
    assert len(whole_puts(s3, proxy.seen)) == 1
    assert_bucket_matches(s3, tmp_path / "vm" / STEP_DIR)
    assert_resumes(s3, tmp_path)


@pytest.mark.parametrize("s3", ["s3"], indirect=True)
def test_a_store_failure_mid_stream_falls_back_to_the_upload_after_the_commit(s3, proxy, tmp_path):
    # Part 2 of one file is refused for good: that file goes up again after the commit, the other streamed.
    proxy.arm(Fault(403, ACCESS_DENIED, count=None, match=r"/__0_1\.distcp\?.*partNumber=2\b"))
    report, shards = save(s3, tmp_path / "vm")
    assert proxy.faulted == 1
    assert report.durable, report.error
    assert report.streamed_bytes == shards[0].stat().st_size
    assert_bucket_matches(s3, tmp_path / "vm" / STEP_DIR)
    client = boto3.client("s3", endpoint_url=s3.server.url)
    deadline = time.monotonic() + 30  # the failed stream's upload is aborted on an upload thread
    while client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
    assert_resumes(s3, tmp_path)


def test_the_commit_does_not_wait_for_streams_and_the_manifest_waits_for_all(s3, proxy, tmp_path):
    committed = threading.Event()
    seen: dict[str, object] = {"held": 0, "late": 0}

    def on_request(method: str, path: str) -> None:
        if PROTOCOLS[s3.kind].is_part(method, path):  # every part is held until the step is committed locally
            seen["held"] += 1
            if not committed.wait(60):  # a hang bound: the commit waited for the streams
                seen["late"] += 1
        elif is_manifest_upload(s3, method, path):
            seen["at_manifest"] = bucket(s3)

    def on_event(event: str, **detail) -> None:
        if event == "committed":
            seen["at_commit"] = bucket(s3)
            committed.set()

    proxy.on_request = on_request
    report, shards = save(s3, tmp_path / "vm", on_event=on_event)
    assert report.durable, report.error
    assert seen["held"] == 6 and seen["late"] == 0
    assert seen["at_commit"] == {}  # committed locally with no shard in the bucket yet
    # Every shard was complete, at its full size, when the manifest went up.
    assert {p.name: p.stat().st_size for p in shards}.items() <= seen["at_manifest"].items()
