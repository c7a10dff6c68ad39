"""Checkpoints in Azure Blob Storage through azure-storage-blob (the `azure` extra).

`az://CONTAINER[/PREFIX]`. The account comes from `AZURE_STORAGE_CONNECTION_STRING`
(keys, SAS, or an emulator such as azurite), else from `AZURE_STORAGE_ACCOUNT` with
DefaultAzureCredential (managed identity, workload identity, az login; needs
azure-identity). Large files go up as blocks of `part_size` in parallel, each block
verified with a transactional MD5 (CRC64 would need azure-storage-extensions). A file
can also go up block by block while it is written (`start_parts`: Put Block, then Put
Block List).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path

import requests

try:
    from azure.core.exceptions import (
        HttpResponseError,
        IncompleteReadError,
        ResourceExistsError,
        ResourceNotFoundError,
        ServiceRequestError,
        ServiceResponseError,
    )
    from azure.storage.blob import BlobBlock, BlobServiceClient, LinearRetry
except ImportError as exc:  # an optional extra: say how to get it, in one line
    raise ImportError("az:// checkpoints need azure-storage-blob: pip install spotguard[azure]") from exc

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
DELETE_BATCH = 256  # a blob batch request takes at most 256 sub-requests
CHECKSUM = "md5"
CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT"


class BlobStore(RetryingStore):
    """`az://CONTAINER[/PREFIX]`: keys are relative to PREFIX."""

    scheme = "az"
    min_part_size = 1  # a block may have any size (up to 4000 MiB)
    max_parts = 50_000  # committed blocks per blob

    def __init__(
        self,
        url: str,
        *,
        part_size: int = 64 * MiB,
        max_concurrency: int = 8,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
    ) -> None:
        super().__init__(url, retry_deadline_s=retry_deadline_s)
        self.max_concurrency = max_concurrency
        options = dict(
            max_block_size=part_size,
            max_single_put_size=part_size,
            # The SDK's default waits 15 s between tries; a short linear backoff per request, and
            # our own deadline-bounded retries around whole calls.
            retry_policy=LinearRetry(backoff=0.5, random_jitter_range=0.25, retry_total=2),
            connection_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
        )
        if conn := os.environ.get(CONNECTION_STRING_ENV):
            service = BlobServiceClient.from_connection_string(conn, **options)
        elif account := os.environ.get(ACCOUNT_ENV):
            service = BlobServiceClient(f"https://{account}.blob.core.windows.net", _default_credential(), **options)
        else:
            raise StoreError(f"{self.url}: set {CONNECTION_STRING_ENV}, or {ACCOUNT_ENV} with an Azure identity")
        self.container = service.get_container_client(self.bucket)

    # ---- ObjectStore ----------------------------------------------------------------
    def put_file(self, local_path: str | Path, key: str, *, progress: Progress | None = None) -> None:
        ledger = ProgressLedger(progress)

        def upload() -> None:
            with open(local_path, "rb") as f:
                self.container.get_blob_client(self._name(key)).upload_blob(
                    f, length=os.fstat(f.fileno()).st_size, overwrite=True, max_concurrency=self.max_concurrency,
                    validate_content=CHECKSUM, progress_hook=_Deltas(ledger),
                )  # fmt: skip

        self._call(f"upload {key} to", upload, progress=ledger)

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        # overwrite=False sends If-None-Match: * — the service refuses atomically if the blob exists.
        self._call(
            f"write {key} to",
            lambda: self.container.get_blob_client(self._name(key)).upload_blob(
                data, overwrite=not create_only, validate_content=CHECKSUM
            ),
        )

    def get_file(self, key: str, local_path: str | Path, *, progress: Progress | None = None) -> None:
        ledger = ProgressLedger(progress)

        def download(tmp: str) -> None:
            stream = self.container.get_blob_client(self._name(key)).download_blob(
                max_concurrency=self.max_concurrency, validate_content=CHECKSUM, progress_hook=_Deltas(ledger)
            )
            with open(tmp, "wb") as f:
                stream.readinto(f)

        self._call(f"download {key} from", lambda: self._download_into(local_path, download), progress=ledger)

    def get_bytes(self, key: str) -> bytes:
        return self._call(
            f"read {key} from",
            lambda: self.container.get_blob_client(self._name(key)).download_blob(validate_content=CHECKSUM).readall(),
        )

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        def listing() -> list[ObjectInfo]:
            blobs = self.container.list_blobs(name_starts_with=self._list_prefix(prefix))
            return [ObjectInfo(self._key(b.name), b.size) for b in blobs]

        return sorted(self._call(f"list {prefix!r} in", listing), key=lambda o: o.key)

    def exists(self, key: str) -> bool:
        return self._call(f"look up {key} in", lambda: self.container.get_blob_client(self._name(key)).exists())

    def delete(self, keys: Iterable[str]) -> None:
        names = [self._name(k) for k in keys]
        for start in range(0, len(names), DELETE_BATCH):
            batch = names[start : start + DELETE_BATCH]
            answers = self._call(
                f"delete {len(batch)} objects from",
                lambda batch=batch: list(self.container.delete_blobs(*batch, raise_on_any_failure=False)),
            )
            failed = [a for a in answers if a.status_code not in (200, 202, 404)]  # 404: already gone
            if failed:
                raise StoreError(f"delete from {self.url}: {len(failed)} objects not deleted ({failed[0].reason})")

    def start_parts(self, key: str) -> BlobParts:
        """Write `key` as staged blocks (a PartsStore); nothing shows until the block list is committed."""
        return BlobParts(self, key)

    # ---- errors ---------------------------------------------------------------------
    def _is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, IncompleteReadError):  # the connection broke mid-body
            return True
        if isinstance(exc, HttpResponseError):
            return exc.status_code in RETRYABLE_STATUS
        # requests' ChunkedEncodingError reaches us unwrapped when a download stream is reset.
        return isinstance(exc, (ServiceRequestError, ServiceResponseError, requests.exceptions.ChunkedEncodingError))

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        code = getattr(exc, "error_code", None) or ""
        if code == "ContainerNotFound":
            return StoreError(f"{what}: container {self.bucket!r} does not exist")
        if isinstance(exc, ResourceNotFoundError):
            return NotFound(f"{what}: no such key")
        if isinstance(exc, ResourceExistsError) or getattr(exc, "status_code", None) == 412:
            return AlreadyExists(f"{what}: the key already exists")
        return StoreError(f"{what}: {one_line(exc)}")


class BlobParts:
    """One block blob written as staged blocks (a PartUpload), each with a transactional MD5."""

    def __init__(self, store: BlobStore, key: str) -> None:
        self._store = store
        self.key = key
        self._blob = store.container.get_blob_client(store._name(key))
        # Block ids of one upload share a random prefix, so blocks another attempt staged never mix in.
        self._prefix = secrets.token_hex(8)
        self._numbers: set[int] = set()
        self._lock = threading.Lock()

    def _block_id(self, number: int) -> str:
        return f"{self._prefix}-{number:05d}"  # every id of a blob must have the same length

    def put_part(self, number: int, data: bytes) -> None:
        self._store._call(
            f"upload block {number} of {self.key} to",
            lambda: self._blob.stage_block(self._block_id(number), data, validate_content=CHECKSUM),
        )
        with self._lock:
            self._numbers.add(number)

    def complete(self) -> None:
        with self._lock:
            blocks = [BlobBlock(block_id=self._block_id(n)) for n in sorted(self._numbers)]
        self._store._call(f"commit the blocks of {self.key} to", lambda: self._blob.commit_block_list(blocks))

    def abort(self) -> None:
        """Nothing to remove: the service drops uncommitted blocks (at the blob's next commit, or after a week)."""


class _Deltas:
    """Turns the SDK's cumulative progress_hook(current, total) into Progress deltas (called from threads)."""

    def __init__(self, ledger: ProgressLedger) -> None:
        self._ledger = ledger
        self._seen = 0
        self._lock = threading.Lock()

    def __call__(self, current: int, total: int | None) -> None:
        with self._lock:
            delta, self._seen = current - self._seen, max(current, self._seen)
        if delta > 0:
            self._ledger(delta)


def _default_credential():
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:
        raise StoreError(f"{ACCOUNT_ENV} without a connection string needs azure-identity: "
                         "pip install spotguard[azure]") from exc  # fmt: skip
    return DefaultAzureCredential()
