"""Checkpoints in Google Cloud Storage through google-cloud-storage.

Credentials come from Application Default Credentials (the VM's service account,
`GOOGLE_APPLICATION_CREDENTIALS`, gcloud). With `STORAGE_EMULATOR_HOST` set the
store talks to that emulator anonymously (project from `GOOGLE_CLOUD_PROJECT`).

Large files go up as resumable uploads in `part_size` chunks, each verified with
CRC32C. GCS's parallel XML multipart API (transfer_manager.upload_chunks_concurrently)
is not used: gcp-storage-emulator does not implement it, so it could not be tested;
parallelism comes from uploading several files at once. A file still being written goes
up part by part (`start_parts`) as objects of its own, composed into the file at the end.
"""

from __future__ import annotations

import contextvars
import io
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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

log = logging.getLogger(__name__)

MiB = 1 << 20
COMPOSE_SOURCES = 32  # the most objects one compose request takes
MAX_COMPONENTS = 1024  # the most parts a composite object may be made of (in Google's older documentation)
PART_NAME = re.compile(r"\.part-[0-9a-f]{8}-(\d{4}|c\d+-\d{2})$")  # GCSParts' part and composite objects
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
        part_size: int = 64 * MiB,
        max_concurrency: int = 8,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
    ) -> None:
        super().__init__(url, retry_deadline_s=retry_deadline_s)
        if part_size <= 0 or part_size % CHUNK_ALIGN:
            raise ValueError(f"GCS part_size must be a positive multiple of 256 KiB, got {part_size}")
        self.part_size = part_size
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
    min_part_size = 1  # parts are objects of their own: any size
    max_parts = MAX_COMPONENTS
    # Each part is an object write and a delete, and the compose is unmeasured on real GCS: opt-in.
    stream_by_default = False

    def start_parts(self, key: str) -> GCSParts:
        """Write `key` as part objects composed at the end (a PartsStore); nothing shows at `key` before."""
        return GCSParts(self, key)

    def compose(self, sources: list[str], key: str) -> None:
        """Make `key` the concatenation of `sources` (at most COMPOSE_SOURCES of them), server-side,
        deleting the sources for good (no soft-deleted copy billed)."""
        self._call(
            f"compose {key} in",
            lambda: self._blob(key).compose(
                [self._blob(s) for s in sources], delete_source_objects=True, timeout=TIMEOUT, retry=None
            ),
        )

    def abort_multipart_uploads(self, prefix: str = "", *, select: Callable[[str], bool] | None = None) -> int:
        """Delete the part objects of unfinished part uploads under `prefix` (a crash leaves them);
        returns how many. Only keys `select` (given the key relative to the store) accepts are touched."""
        parts = [o.key for o in self.list(prefix) if PART_NAME.search(o.key) and (select is None or select(o.key))]
        if parts:
            self.delete(parts)
            log.info("deleted %d part objects of unfinished uploads under %s/%s", len(parts), self.url, prefix)
        return len(parts)

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
    """One object written as parts in any order and in parallel (a PartUpload).

    A resumable upload takes its chunks one at a time and in order, so each part is an object of
    its own beside the target (`KEY.part-<token>-<n>`), sent with its CRC32C. `complete` composes
    them into KEY, in rounds of COMPOSE_SOURCES (the composes of a round in parallel) when there
    are more; each compose hard-deletes its sources (none kept by soft delete), and GCS computes
    the composite's CRC32C, which downloads check. KEY shows nothing before the last compose.
    Whatever is left of the parts (an abort, a failure, a server that keeps composed sources) is
    deleted on a thread of its own, off the save's critical path; what a crash leaves is removed
    by `abort_multipart_uploads`.
    """

    def __init__(self, store: GCSStore, key: str) -> None:
        self._store = store
        self.key = key
        self._prefix = f"{key}.part-{secrets.token_hex(4)}-"  # another attempt's parts never mix in
        self._numbers: set[int] = set()
        self._aborted = False
        self._lock = threading.Lock()

    def put_part(self, number: int, data: bytes) -> None:
        self._store.put_bytes(f"{self._prefix}{number:04d}", data)
        with self._lock:
            self._numbers.add(number)
            aborted = self._aborted
        if aborted:  # the abort ran while this part was on its way
            self._remove_soon()

    def complete(self) -> None:
        with self._lock:
            sources = [f"{self._prefix}{n:04d}" for n in sorted(self._numbers)]
        if not sources:
            self._store.put_bytes(self.key, b"")
            return
        context = contextvars.copy_context()  # the caller's store call limits hold in the compose pool
        level = 0
        while len(sources) > COMPOSE_SOURCES:  # composites of composites: still one object's components
            level += 1
            groups = [sources[i : i + COMPOSE_SOURCES] for i in range(0, len(sources), COMPOSE_SOURCES)]
            sources = [g[0] if len(g) == 1 else f"{self._prefix}c{level}-{i:02d}" for i, g in enumerate(groups)]
            jobs = [(g, into) for g, into in zip(groups, sources, strict=True) if len(g) > 1]
            with ThreadPoolExecutor(min(len(jobs), 8), thread_name_prefix="gcs-compose") as pool:
                list(pool.map(lambda job: context.copy().run(self._store.compose, *job), jobs))
        try:
            self._store.compose(sources, self.key)
        finally:
            self._remove_soon()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
        self._remove_soon()

    def _remove_soon(self) -> None:
        threading.Thread(target=self._remove, name="gcs-parts-cleanup", daemon=True).start()

    def _remove(self) -> None:
        try:
            left = [info.key for info in self._store.list(self._prefix)]
            if left:
                self._store.delete(left)
        except StoreError as exc:
            log.warning("could not delete the parts of %s (removed after a later commit): %s", self.key, exc)


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
