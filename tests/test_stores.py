"""Object stores against real protocol servers on 127.0.0.1 (moto, gcp-storage-emulator, azurite).

The same tests run over every store kind; fault tests put a fault-injecting reverse
proxy between the store and its server, or kill the server mid-upload.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from cloud_adapters.storage import (
    AlreadyExists,
    LocalStore,
    NotFound,
    ObjectInfo,
    ObjectStore,
    StoreError,
)
from cloud_adapters.stores import canonical_location, check_location, open_store
from spotguard.job.topology import location_key
from tests.conftest import SCHEMES, Backend, backend_for, start_server
from tests.servers import ROOT, Fault, FaultProxy

MiB = 1 << 20
PART = 5 * MiB  # the smallest part S3 accepts; a multiple of GCS's 256 KiB
BIG = 3 * PART + 12345  # four parts


@dataclass(frozen=True)
class Protocol:
    """How each cloud says "slow down", and how its requests look on the wire."""

    busy: Fault  # a throttling / overload answer in the cloud's own format
    is_part: Callable[[str, str], bool]  # (method, path?query) uploads one part of a large file
    is_conditional_create: Callable[[str, str, dict], bool]  # the create-only write carries its precondition


PROTOCOLS = {
    "s3": Protocol(
        busy=Fault(503, b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
                   {"Content-Type": "application/xml"}),
        is_part=lambda m, q: m == "PUT" and "partNumber=" in q,
        is_conditional_create=lambda m, q, h: m == "PUT" and h.get("If-None-Match") == "*",
    ),
    "gcs": Protocol(
        busy=Fault(429, b'{"error": {"code": 429, "message": "rate limit exceeded"}}',
                   {"Content-Type": "application/json"}),
        is_part=lambda m, q: m == "PUT" and "upload_id=" in q,
        is_conditional_create=lambda m, q, h: m == "POST" and "ifGenerationMatch=0" in q,
    ),
    "azure": Protocol(
        busy=Fault(503, b"<?xml version='1.0' encoding='utf-8'?><Error><Code>ServerBusy</Code>"
                   b"<Message>The server is busy.</Message></Error>",
                   {"Content-Type": "application/xml", "x-ms-error-code": "ServerBusy"}),
        is_part=lambda m, q: m == "PUT" and "comp=block" in q and "blocklist" not in q,
        is_conditional_create=lambda m, q, h: m == "PUT" and h.get("If-None-Match") == "*",
    ),
}  # fmt: skip


def write_random(path, size: int):
    path.write_bytes(os.urandom(size))
    return path


class Tally:
    """A progress callback that sums what it is told (deltas may come from several threads)."""

    def __init__(self) -> None:
        self.total = 0
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, delta: int) -> None:
        with self._lock:
            self.total += delta
            self.calls += 1


@pytest.fixture
def proxied(cloud_backend: Backend):
    """A cloud store that talks to its server through a fault-injecting proxy, and the proxy."""
    proxy = FaultProxy(cloud_backend.server.url)
    store = cloud_backend.store(endpoint=proxy.url, part_size=PART, retry_deadline_s=20)
    yield cloud_backend.kind, store, proxy
    proxy.close()


# ---- behaviour every store shares -------------------------------------------------------
def test_round_trip_small_and_multipart_files_with_progress(backend: Backend, tmp_path):
    store = backend.store(**({} if backend.kind == "local" else {"part_size": PART}))
    assert isinstance(store, ObjectStore)
    small, big = write_random(tmp_path / "small", 1000), write_random(tmp_path / "big", BIG)

    up = Tally()
    store.put_file(small, "step-1/small.distcp")
    store.put_file(big, "step-1/big.distcp", progress=up)
    assert up.total == BIG and up.calls > 1

    down = Tally()
    store.get_file("step-1/big.distcp", tmp_path / "big.back", progress=down)
    assert down.total == BIG
    assert (tmp_path / "big.back").read_bytes() == big.read_bytes()
    store.get_file("step-1/small.distcp", tmp_path / "small.back")
    assert (tmp_path / "small.back").read_bytes() == small.read_bytes()
    assert store.get_bytes("step-1/small.distcp") == small.read_bytes()


def test_list_exists_delete(backend: Backend):
    store = backend.store()
    for key in ("step-1/a", "step-1/b/c", "step-2/a"):
        store.put_bytes(key, key.encode())

    assert store.list("step-1/") == [ObjectInfo("step-1/a", 8), ObjectInfo("step-1/b/c", 10)]
    assert [o.key for o in store.list()] == ["step-1/a", "step-1/b/c", "step-2/a"]
    assert store.exists("step-2/a") and not store.exists("step-3/a")

    store.delete(["step-1/a", "step-1/b/c", "never-written"])
    assert [o.key for o in store.list()] == ["step-2/a"]
    assert store.list("step-1/") == []


def test_missing_key_is_not_found(backend: Backend, tmp_path):
    store = backend.store()
    with pytest.raises(NotFound):
        store.get_bytes("step-9/spotguard.json")
    with pytest.raises(NotFound):
        store.get_file("step-9/shard.distcp", tmp_path / "shard")
    assert not (tmp_path / "shard").exists()  # no empty file left behind


def test_create_only_refuses_an_existing_key(backend: Backend):
    store = backend.store()
    store.put_bytes("step-1/spotguard.json", b"first", create_only=True)
    with pytest.raises(AlreadyExists):
        store.put_bytes("step-1/spotguard.json", b"second", create_only=True)
    assert store.get_bytes("step-1/spotguard.json") == b"first"
    store.put_bytes("step-1/spotguard.json", b"third")  # a plain write replaces
    assert store.get_bytes("step-1/spotguard.json") == b"third"


def test_open_store_dispatches_on_the_url(backend: Backend):
    store = open_store(backend.url)
    assert type(store) is type(backend.store())
    assert store.url.rstrip("/").endswith(backend.url.split("://")[-1])


@pytest.mark.parametrize("form", ["file://{path}", "file://localhost{path}"])
def test_file_urls_name_absolute_paths(tmp_path, form):
    store = open_store(form.format(path=tmp_path / "ckpt"))
    assert isinstance(store, LocalStore) and store.url == str(tmp_path / "ckpt")


@pytest.mark.parametrize("url", ["file://ckpt", "file://./ckpt", "file://host/ckpt", "file://"])
def test_file_urls_that_would_be_misread_are_refused(url):
    with pytest.raises(ValueError, match=r"write file:///ABSOLUTE/PATH") as refused:
        open_store(url)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "url,message",
    [
        ("s3://", "names no bucket"),
        ("gs:///run-7", "names no bucket"),
        ("az://", "names no bucket"),
        ("ftp://x", "unsupported checkpoint location"),
        ("file://ckpt", "write file:///ABSOLUTE/PATH"),
        (" ", "empty location"),
    ],
)
def test_check_location_refuses_a_bad_location_in_one_line_naming_the_argument(url, message):
    with pytest.raises(ValueError) as refused:
        check_location(url)
    text = str(refused.value)
    assert text.startswith("checkpoint_dir: ") and message in text and "\n" not in text


@pytest.mark.parametrize(
    "url", ["s3://bucket", "gs://bucket/run-7", "az://container/a/b", "file:///abs/ckpt", "rel/ckpt", Path("/abs")]
)
def test_check_location_passes_what_open_store_takes(url):
    assert check_location(url) == str(url)


@pytest.mark.parametrize(
    "spellings,canonical",
    [
        (["s3://b/run", "s3://b//run", "s3://b/run/", "s3://b///run//"], "s3://b/run"),
        (["gs://b", "gs://b/", "gs://b//"], "gs://b"),
        (["az://c/a//run", "az://c//a//run/"], "az://c/a//run"),  # an inner // names other objects: kept
        (["/abs//ckpt/", "file:///abs/ckpt", "file://localhost//abs/./ckpt", "/abs/x/../ckpt"], "/abs/ckpt"),
    ],
)
def test_every_spelling_of_a_location_has_one_name_and_one_key(spellings, canonical):
    assert {canonical_location(s) for s in spellings} == {canonical}
    assert {location_key(s) for s in spellings} == {location_key(canonical)}
    assert location_key("s3://b/a//run") != location_key("s3://b/a/run")


def test_a_location_is_named_as_its_store_names_it(backend):
    if backend.kind == "local":
        spelled = f"{backend.tmp}//ckpt/"
    else:
        spelled = f"{SCHEMES[backend.kind]}://{backend.bucket}//run//"
    assert canonical_location(spelled) == open_store(spelled).url


class Interrupted(Exception):
    pass


def test_an_interrupted_local_copy_leaves_nothing_partial(tmp_path):
    store = LocalStore(tmp_path / "store")
    source = write_random(tmp_path / "source", 9 * MiB)

    def fail_after_one_chunk(_: int) -> None:
        raise Interrupted

    store.put_file(source, "k")
    target = tmp_path / "vm" / "k"
    target.parent.mkdir()
    target.write_bytes(b"the previous copy")
    with pytest.raises(Interrupted):
        store.get_file("k", target, progress=fail_after_one_chunk)
    assert target.read_bytes() == b"the previous copy" and os.listdir(target.parent) == ["k"]
    with pytest.raises(Interrupted):
        store.put_file(source, "k2", progress=fail_after_one_chunk)
    assert store.list() == [ObjectInfo("k", 9 * MiB)] and os.listdir(store.root) == ["k"]


@pytest.mark.parametrize("kernel", ["copies", "refuses", "copies nothing"])
def test_a_local_copy_is_made_in_the_kernel_and_by_reads_and_writes_where_the_kernel_cannot(
    tmp_path, monkeypatch, kernel
):
    """copy_file_range (a reflink, a server-side NFS copy, or at least no pass through this process); where it
    cannot begin (another filesystem on an older kernel: an error, or 0 bytes as if at the end), the same bytes
    by reads and writes."""
    kernel_copy = os.copy_file_range
    calls = []

    def copy_file_range(source: int, target: int, count: int) -> int:
        calls.append(count)
        if kernel == "refuses":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return kernel_copy(source, target, count) if kernel == "copies" else 0

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    source = write_random(tmp_path / "source", 9 * MiB)
    store, seen = LocalStore(tmp_path / "store"), []
    store.put_file(source, "k", progress=seen.append)
    assert (store.root / "k").read_bytes() == source.read_bytes() and sum(seen) == 9 * MiB
    assert calls  # the kernel was asked first, either way
    store.get_file("k", tmp_path / "back", progress=seen.append)
    assert (tmp_path / "back").read_bytes() == source.read_bytes() and sum(seen) == 18 * MiB


def test_a_kernel_copy_that_stops_short_fails_and_leaves_nothing(tmp_path, monkeypatch):
    kernel_copy = os.copy_file_range
    calls = []

    def stops_after_one_chunk(source: int, target: int, count: int) -> int:
        calls.append(count)
        return kernel_copy(source, target, count) if len(calls) == 1 else 0

    monkeypatch.setattr(os, "copy_file_range", stops_after_one_chunk)
    store = LocalStore(tmp_path / "store")
    with pytest.raises(OSError, match="stopped after 8388608 of 9437184 bytes"):
        store.put_file(write_random(tmp_path / "source", 9 * MiB), "k")
    assert store.list() == [] and os.listdir(store.root) == []


# ---- wire-level behaviour of the cloud stores ---------------------------------------------
def test_a_missing_bucket_is_an_error_not_an_empty_store(cloud_backend: Backend):
    cloud_backend.bucket = "t-never-created"
    store = cloud_backend.store()
    for call in (lambda: store.get_bytes("spotguard.json"), lambda: store.list()):
        with pytest.raises(StoreError, match="does not exist") as failure:
            call()
        assert not isinstance(failure.value, NotFound)


def test_large_files_go_up_in_parts(proxied, tmp_path):
    kind, store, proxy = proxied
    store.put_file(write_random(tmp_path / "big", BIG), "big")
    parts = [q for m, q, _ in proxy.seen if PROTOCOLS[kind].is_part(m, q)]
    assert len(parts) == 4, parts


def test_create_only_uses_the_server_precondition_and_is_not_retried(proxied):
    kind, store, proxy = proxied
    store.put_bytes("spotguard.json", b"{}", create_only=True)
    assert any(PROTOCOLS[kind].is_conditional_create(m, q, h) for m, q, h in proxy.seen)

    before = len(proxy.seen)
    with pytest.raises(AlreadyExists):
        store.put_bytes("spotguard.json", b"{}", create_only=True)
    assert len(proxy.seen) - before == 1  # one answer, no retries


def test_not_found_is_not_retried(proxied):
    _, store, proxy = proxied
    with pytest.raises(NotFound):
        store.get_bytes("missing")
    assert len([q for _, q, _ in proxy.seen if "missing" in q]) == 1


def test_s3_deletes_in_batches_of_1000_and_aborts_abandoned_uploads(storage_servers, monkeypatch, tmp_path):
    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    store = backend.store()
    keys = [f"step-1/{i:04d}" for i in range(1001)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: store.client.put_object(Bucket=backend.bucket, Key=f"run-7/{k}", Body=b""), keys))
    proxy = FaultProxy(backend.server.url)
    try:
        backend.store(endpoint=proxy.url).delete(keys)
        assert [m for m, q, _ in proxy.seen if m == "POST" and "delete" in q] == ["POST", "POST"]
    finally:
        proxy.close()
    assert store.list() == []

    for key in ("run-7/step-2/a", "run-7/step-2/b", "elsewhere/c"):
        store.client.create_multipart_upload(Bucket=backend.bucket, Key=key)
    assert store.abort_multipart_uploads("step-2/") == 2
    left = store.client.list_multipart_uploads(Bucket=backend.bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == ["elsewhere/c"]


def test_gcs_parts_from_many_threads_go_up_in_order_as_one_resumable_upload(storage_servers, monkeypatch, tmp_path):
    backend = backend_for("gcs", storage_servers, monkeypatch, tmp_path)
    store = backend.store()
    chunk = 256 * 1024  # every part but the last a multiple of it
    parts = {n: os.urandom(chunk) for n in range(1, 12)} | {12: os.urandom(1000)}
    upload = store.start_parts("step-1/a.distcp")
    with ThreadPoolExecutor(4) as pool:  # queued in order, as the streaming threads take them
        list(pool.map(lambda n: upload.put_part(n, parts[n]), sorted(parts)))
    assert not store.exists("step-1/a.distcp")  # the last part goes with the completion
    upload.complete()
    assert store.get_bytes("step-1/a.distcp") == b"".join(parts[n] for n in sorted(parts))

    aborted = store.start_parts("step-1/b.distcp")
    aborted.put_part(1, parts[1])
    aborted.abort()
    with pytest.raises(StoreError, match="aborted"):
        aborted.put_part(2, parts[2])
    proxy = FaultProxy(backend.server.url)  # a chunk answered 503 once: the retry asks what the session holds
    try:
        retried = backend.store(endpoint=proxy.url).start_parts("step-1/retried.distcp")
        retried.put_part(1, parts[1])
        proxy.arm(Fault(503, count=1, match=r"upload_id="))
        retried.put_part(2, parts[2])
        retried.put_part(3, parts[12])
        retried.complete()
        assert proxy.faulted == 1
        assert [h["Content-Range"] for m, _, h in proxy.seen if m == "PUT"] == [
            f"bytes 0-{chunk - 1}/*",
            f"bytes {chunk}-{2 * chunk - 1}/*",  # refused
            "bytes */*",  # the server holds the first chunk
            f"bytes {chunk}-{2 * chunk - 1}/*",
            f"bytes {2 * chunk}-{2 * chunk + 999}/{2 * chunk + 1000}",
        ]
    finally:
        proxy.close()
        backend.point_at(backend.server.url)
    assert store.get_bytes("step-1/retried.distcp") == parts[1] + parts[2] + parts[12]

    misplaced = store.start_parts("step-1/c.distcp")
    misplaced.put_part(1, b"short")
    with pytest.raises(StoreError, match="after a last part"):
        misplaced.put_part(2, parts[2])
    assert [o.key for o in store.list()] == ["step-1/a.distcp", "step-1/retried.distcp"]


# ---- faults -------------------------------------------------------------------------------
def test_throttling_and_5xx_are_retried_until_success(proxied, tmp_path):
    kind, store, proxy = proxied
    busy = PROTOCOLS[kind].busy
    # As many failures in a row as the SDK's own per-request tries (3), so ours must take over.
    proxy.arm(Fault(busy.status, busy.body, busy.headers, count=3))
    big = write_random(tmp_path / "big", BIG)
    progress = Tally()
    store.put_file(big, "big", progress=progress)
    assert proxy.faulted == 3
    assert progress.total == BIG  # a restarted transfer takes its reported bytes back

    proxy.arm(Fault(500, b"", count=3))
    store.get_file("big", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == big.read_bytes()
    assert proxy.faulted == 6


def test_persistent_errors_give_up_within_the_deadline(proxied):
    _, store, proxy = proxied
    store.retry_deadline_s = 1.5
    proxy.arm(Fault(503, b"", count=None))
    started = time.monotonic()
    with pytest.raises(StoreError) as failure:
        store.put_bytes("spotguard.json", b"{}")
    elapsed = time.monotonic() - started
    assert not isinstance(failure.value, (NotFound, AlreadyExists))
    assert proxy.faulted >= 2  # it did retry
    assert elapsed < 10, f"gave up after {elapsed:.1f} s"


@pytest.mark.parametrize("kind", ["s3", "gcs", "azure"])
def test_server_killed_mid_upload_fails_cleanly(kind, monkeypatch, tmp_path):
    server = start_server(kind)
    try:
        backend = Backend(kind, server, monkeypatch, tmp_path)
        store = backend.store(part_size=PART, retry_deadline_s=2)
        big = write_random(tmp_path / "big", 8 * PART)

        def kill_once_moving(delta: int) -> None:
            if server.proc.poll() is None:
                server.kill()  # in the transfer's own thread: the server is gone before the next byte

        started = time.monotonic()
        with pytest.raises(StoreError):
            store.put_file(big, "big", progress=kill_once_moving)
        assert time.monotonic() - started < 30
    finally:
        server.stop()


# ---- packaging ----------------------------------------------------------------------------
def test_blob_store_without_the_azure_extra_says_how_to_install_it():
    code = "import sys; sys.modules['azure.storage.blob'] = None; import cloud_adapters.azure.blob"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: az:// checkpoints need azure-storage-blob: pip install spotguard[azure]"
    )
