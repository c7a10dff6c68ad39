"""Checkpoints in Google Cloud Storage through google-cloud-storage.

Credentials come from Application Default Credentials (the VM's service account,
`GOOGLE_APPLICATION_CREDENTIALS`, gcloud). With `STORAGE_EMULATOR_HOST` set the
store talks to that emulator anonymously (project from `GOOGLE_CLOUD_PROJECT`).

Large files go up as resumable uploads in `part_size` chunks, each verified with
CRC32C. GCS's parallel XML multipart API (transfer_manager.upload_chunks_concurrently)
is not used: gcp-storage-emulator does not implement it, so it could not be tested;
parallelism comes from uploading several files at once. A file still being written goes
up part by part (`start_parts`) as one resumable upload, its parts the chunks, in order.
"""

from __future__ import annotations

import base64
import contextvars
import io
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import requests
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.auth.exceptions import DefaultCredentialsError, TransportError
from google.cloud import storage
from google.resumable_media.common import DataCorruption, InvalidResponse

from cloud_adapters.retry import (
    CONNECT_TIMEOUT_S,
    DEFAULT_RETRY_DEADLINE_S,
    READ_TIMEOUT_S,
    RETRYABLE_STATUS,
    ProgressLedger,
    RetryingStore,
    one_line,
)
from cloud_adapters.storage import AlreadyExists, NotFound, ObjectInfo, Progress, StoreError

MiB = 1 << 20
DEFAULT_PART_SIZE = 64 * MiB
CHUNK_ALIGN = 256 * 1024  # resumable upload chunks must be multiples of 256 KiB
TIMEOUT = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)  # per request
CHECKSUM = "crc32c"


class GCSStore(RetryingStore):
    """`gs://BUCKET[/PREFIX]`: keys are relative to PREFIX."""

    scheme = "gs"

    def __init__(
        self,
        url: str,
        *,
        part_size: int | None = None,
        max_concurrency: int = 8,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
    ) -> None:
        super().__init__(url, retry_deadline_s=retry_deadline_s)
        part_size = DEFAULT_PART_SIZE if part_size is None else part_size
        if part_size <= 0 or part_size % CHUNK_ALIGN:
            raise ValueError(f"GCS part_size must be a positive multiple of 256 KiB, got {part_size}")
        self.part_size = part_size
        # A stream's chunks are as large as the upload's after the commit: the emulator rewrites the
        # whole upload at every chunk, and fewer, larger requests suit a resumable upload anyway.
        self.min_part_size = part_size
        self.max_concurrency = max_concurrency
        self._emulated = bool(os.environ.get("STORAGE_EMULATOR_HOST"))
        if self._emulated:  # the library reads the variable itself; an emulator needs no credentials
            project = os.environ.get("GOOGLE_CLOUD_PROJECT", "emulator")
            self.client = storage.Client(project=project, credentials=AnonymousCredentials())
        else:
            try:
                self.client = storage.Client()  # Application Default Credentials
            except DefaultCredentialsError as exc:
                raise StoreError(f"{self.url}: no Google credentials found ({one_line(exc)})") from exc
        self._bucket = self.client.bucket(self.bucket)

    def _blob(self, key: str, *, chunked: bool = False) -> storage.Blob:
        # Only uploads are chunked: a chunked download cannot verify CRC32C, a single-stream one does.
        return self._bucket.blob(self._name(key), chunk_size=self.part_size if chunked else None)

    # ---- ObjectStore ----------------------------------------------------------------
    def put_file(self, local_path: str | Path, key: str, *, progress: Progress | None = None) -> None:
        ledger = ProgressLedger(progress)

        def upload() -> None:
            with _CountingFile(local_path, "rb", ledger) as f:
                size = os.fstat(f.fileno()).st_size
                self._blob(key, chunked=True).upload_from_file(
                    f,
                    size=size,
                    checksum=CHECKSUM,
                    timeout=TIMEOUT,
                    retry=None,  # retries are ours, bounded
                )

        self._call(f"upload {key} to", upload, progress=ledger)

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        # if_generation_match=0: GCS creates the object only if no live generation exists (412 otherwise).
        # gcp-storage-emulator ignores preconditions, so there a lookup first keeps the contract (racy,
        # but the emulator is single-user); real GCS enforces it atomically on the write itself.
        def write() -> None:
            blob = self._blob(key)
            if create_only and self._emulated and blob.exists(timeout=TIMEOUT, retry=None):
                raise AlreadyExists(f"write {key} to {self.url}: the key already exists")
            blob.upload_from_string(
                data, if_generation_match=0 if create_only else None, checksum=CHECKSUM, timeout=TIMEOUT, retry=None
            )

        self._call(f"write {key} to", write)

    def get_file(self, key: str, local_path: str | Path, *, progress: Progress | None = None) -> None:
        ledger = ProgressLedger(progress)

        def download(tmp: str) -> None:
            with _CountingFile(tmp, "wb", ledger) as f:
                self._blob(key).download_to_file(f, checksum=CHECKSUM, timeout=TIMEOUT, retry=None)

        self._call(f"download {key} from", lambda: self._download_into(local_path, download), progress=ledger)

    def get_bytes(self, key: str) -> bytes:
        return self._call(
            f"read {key} from",
            lambda: self._blob(key).download_as_bytes(checksum=CHECKSUM, timeout=TIMEOUT, retry=None),
        )

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        def listing() -> list[ObjectInfo]:
            blobs = self.client.list_blobs(self.bucket, prefix=self._list_prefix(prefix), timeout=TIMEOUT, retry=None)
            return [ObjectInfo(self._key(b.name), int(b.size or 0)) for b in blobs]

        return sorted(self._call(f"list {prefix!r} in", listing), key=lambda o: o.key)

    def exists(self, key: str) -> bool:
        return self._call(f"look up {key} in", lambda: self._blob(key).exists(timeout=TIMEOUT, retry=None))

    def delete(self, keys: Iterable[str]) -> None:
        def delete_one(key: str) -> None:
            try:
                self._call(f"delete {key} from", lambda: self._blob(key).delete(timeout=TIMEOUT, retry=None))
            except NotFound:
                pass  # already gone is what we wanted

        with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="gcs-delete") as pool:
            # Each in a copy of the caller's context (taken here, not in the pool's thread): a
            # `calls_until` around delete() holds in the pool too.
            context = contextvars.copy_context()
            list(pool.map(lambda key: context.copy().run(delete_one, key), keys))

    # ---- GCS specifics --------------------------------------------------------------
    max_parts = 1 << 40  # no limit of the store's own

    def start_parts(self, key: str) -> GCSParts:
        """Write `key` as one resumable upload fed part by part (a PartsStore); nothing shows at `key` before."""
        return GCSParts(self, key)

    # ---- errors ---------------------------------------------------------------------
    def _bucket_exists(self) -> bool:
        try:
            return self._bucket.exists(timeout=TIMEOUT, retry=None)
        except Exception:  # noqa: BLE001 - cannot tell; report the key as missing
            return True

    def _is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, gexc.GoogleAPICallError):
            return exc.code in RETRYABLE_STATUS
        if isinstance(exc, InvalidResponse):
            return getattr(exc.response, "status_code", 0) in RETRYABLE_STATUS
        # ChunkedEncodingError: the connection broke mid-body (a reset during a download).
        transient = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)
        return isinstance(exc, (*transient, TransportError, DataCorruption))

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        if isinstance(exc, gexc.NotFound):
            # A 404 does not say whether the object or the bucket is missing; a missing bucket must not
            # read as "no checkpoint yet", so ask (only on this error path).
            if not self._bucket_exists():
                return StoreError(f"{what}: bucket {self.bucket!r} does not exist")
            return NotFound(f"{what}: no such key")
        if isinstance(exc, gexc.PreconditionFailed):
            return AlreadyExists(f"{what}: the key already exists")
        return StoreError(f"{what}: {one_line(exc)}")


class GCSParts:
    """One object written as a resumable upload whose chunks are the parts (a PartUpload).

    A resumable upload takes its chunks one at a time and in order, so `put_part(n)` waits until
    part n - 1 is up (the streaming threads queue a file's parts in order: the part waited for is
    always on its way). Every part but the last must be a multiple of CHUNK_ALIGN; the last one
    is held and sent by `complete` as the final chunk, so the object appears only then. A retry
    first asks the server how much it holds and sends the rest. The object's CRC32C, computed as
    the parts go, must be the one GCS reports at the end. `abort` cancels the session.
    """

    def __init__(self, store: GCSStore, key: str) -> None:
        self._store = store
        self.key = key
        self._session: str | None = None
        self._held = 0  # bytes the server holds
        self._turn = 1  # the part whose turn it is
        self._tail = b""  # the last part, sent with the completion
        self._crc32c = 0
        self._failed: str | None = None
        self._turns = threading.Condition()

    def put_part(self, number: int, data: bytes) -> None:
        with self._turns:
            while self._turn != number and self._failed is None:
                self._turns.wait()
            if self._failed is not None:
                raise StoreError(f"upload of {self.key} to {self._store.url} failed earlier: {self._failed}")
        try:
            if self._tail:
                raise StoreError(f"upload of {self.key}: part {number} after a last part")
            self._crc32c = google_crc32c.extend(self._crc32c, data)
            if len(data) % CHUNK_ALIGN:
                self._tail = data  # only the last part may be: it goes with the completion
            else:
                self._send(data, final=False)
        except BaseException as exc:
            with self._turns:
                self._failed = f"{type(exc).__name__}: {exc}"
                self._turns.notify_all()
            raise
        with self._turns:
            self._turn += 1
            self._turns.notify_all()

    def complete(self) -> None:
        if self._failed is not None:
            raise StoreError(f"upload of {self.key} to {self._store.url} failed earlier: {self._failed}")
        answer = self._send(self._tail, final=True)
        expected = base64.b64encode(self._crc32c.to_bytes(4, "big")).decode()
        if answer.get("crc32c") != expected:
            raise StoreError(f"upload of {self.key}: GCS holds CRC32C {answer.get('crc32c')}, the parts {expected}")

    def abort(self) -> None:
        with self._turns:
            self._failed = self._failed or "aborted"
            self._turns.notify_all()
        if self._session is not None:  # unfinished sessions expire by themselves: this is a courtesy
            session = self._session
            self._store._call(f"cancel the upload of {self.key} to", lambda: self._store.client._http.delete(session))

    def _send(self, data: bytes, *, final: bool) -> dict:
        """Send `data` as the next chunk (the final one: the object then exists); GCS's answer."""
        start, end = self._held, self._held + len(data)
        total = str(end) if final else "*"
        retry = False

        def put() -> dict:
            nonlocal retry
            http = self._store.client._http
            if self._session is None:
                self._session = self._store._blob(self.key).create_resumable_upload_session(timeout=TIMEOUT, retry=None)
            offset = start
            if retry:  # the server may hold part of the chunk, or all of it (the answer was lost)
                answer = http.put(self._session, data=b"", headers={"Content-Range": "bytes */*"}, timeout=TIMEOUT)
                if final and answer.status_code in (200, 201):
                    return answer.json()
                offset = self._held_by(answer, start)
            retry = True
            while True:  # until the server holds the whole chunk: a 308 may say it kept less
                body = data[offset - start :]
                span = f"{offset}-{end - 1}" if body else "*"
                answer = http.put(
                    self._session, data=body, headers={"Content-Range": f"bytes {span}/{total}"}, timeout=TIMEOUT
                )
                if final and answer.status_code in (200, 201):
                    return answer.json()
                sent, offset = offset, self._held_by(answer, start)
                if offset == end and not final:
                    return {}
                if offset <= sent and body:
                    raise StoreError(f"upload of {self.key}: the server kept none of bytes {sent}-{end}")

        result = self._store._call(f"upload bytes {start}-{end} of {self.key} to", put)
        self._held = end
        return result

    def _held_by(self, answer: requests.Response, start: int) -> int:
        """The bytes a 308 answer says the server holds, at least `start` (what it acknowledged before)."""
        if answer.status_code != 308:
            raise InvalidResponse(answer, f"upload of {self.key}: HTTP {answer.status_code}")
        held = answer.headers.get("Range")  # "bytes=0-N", absent when it holds nothing
        offset = int(held.rsplit("-", 1)[1]) + 1 if held else 0
        if offset < start:
            raise StoreError(f"upload of {self.key}: the server holds {offset} bytes, after acknowledging {start}")
        return offset


class _CountingFile(io.FileIO):
    """A file that reports every byte read or written to a progress callback."""

    def __init__(self, path: str | Path, mode: str, progress: Callable[[int], None]) -> None:
        super().__init__(path, mode)
        self._progress = progress

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        self._progress(len(data))
        return data

    def write(self, data) -> int:
        n = super().write(data)
        self._progress(n)
        return n
