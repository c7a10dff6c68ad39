"""Checkpoints in Amazon S3 (or any S3-compatible server) through boto3.

Credentials, region and endpoint are resolved the boto3 way: environment
(`AWS_ACCESS_KEY_ID`, `AWS_PROFILE`, `AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`, ...),
config files, or the instance profile. Large files go up as multipart uploads
whose parts travel in parallel; every request carries a CRC32 checksum.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import boto3
from boto3.s3.transfer import (
    ProgressCallbackInvoker,
    TransferConfig,
    create_transfer_manager,
)
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    ReadTimeoutError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3transfer.exceptions import CancelledError, RetriesExceededError
from s3transfer.futures import TransferFuture
from s3transfer.manager import TransferManager

from cloud_adapters.retry import (
    CONNECT_TIMEOUT_S,
    DEFAULT_RETRY_DEADLINE_S,
    READ_TIMEOUT_S,
    RETRYABLE_STATUS,
    ProgressLedger,
    RetryingStore,
    one_line,
)
from cloud_adapters.storage import (
    Abandoned,
    AlreadyExists,
    NotFound,
    ObjectInfo,
    Progress,
    StoreError,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
CHECKSUM = "CRC32"  # CRC32C needs awscrt; CRC32 is computed by botocore itself
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
     "InternalError", "ServiceUnavailable", "BadDigest",
     "ConditionalRequestConflict"}  # a concurrent conditional write was in flight: S3 asks to retry
)  # fmt: skip
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class S3Store(RetryingStore):
    """`s3://BUCKET[/PREFIX]`: keys are relative to PREFIX."""

    scheme = "s3"
    min_part_size = 5 * MiB  # S3's smallest part (but the last)
    max_parts = 10_000

    def __init__(
        self,
        url: str,
        *,
        part_size: int = 64 * MiB,
        max_concurrency: int = 10,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
    ) -> None:
        super().__init__(url, retry_deadline_s=retry_deadline_s)
        self.part_size = part_size
        # Endpoint (AWS_ENDPOINT_URL[_S3]), region and credentials: botocore resolves them itself.
        self.client = boto3.session.Session().client(
            "s3",
            config=Config(
                retries={"mode": "standard", "max_attempts": 3},  # per request, parts included
                connect_timeout=CONNECT_TIMEOUT_S,
                read_timeout=READ_TIMEOUT_S,
                max_pool_connections=max_concurrency + 4,
                tcp_keepalive=True,
            ),
        )
        self.transfer_config = TransferConfig(
            multipart_threshold=part_size,
            multipart_chunksize=part_size,
            max_concurrency=max_concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )
        self._manager = None
        self._manager_lock = threading.Lock()
        # Transfers being waited for, by the thread waiting: cancelled when abandoned.
        self._in_flight: dict[TransferFuture, int] = {}

    # ---- ObjectStore ----------------------------------------------------------------
    def put_file(self, local_path: str | Path, key: str, *, progress: Progress | None = None) -> None:
        ledger = ProgressLedger(progress)
        self._call(
            f"upload {key} to",
            lambda: self._run(lambda manager: manager.upload(
                str(local_path), self.bucket, self._name(key),
                extra_args={"ChecksumAlgorithm": CHECKSUM},
                subscribers=[ProgressCallbackInvoker(ledger)],
            )),
            progress=ledger,
        )  # fmt: skip

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if create_only else {}  # S3 conditional write: 412 if the key exists
        self._call(
            f"write {key} to",
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self._name(key), Body=data, ChecksumAlgorithm=CHECKSUM, **extra
            ),
        )

    def get_file(self, key: str, local_path: str | Path, *, progress: Progress | None = None) -> None:
        ledger = ProgressLedger(progress)
        self._call(
            f"download {key} from",
            lambda: self._run(lambda manager: manager.download(
                self.bucket, self._name(key), str(local_path),
                extra_args={"ChecksumMode": "ENABLED"},
                subscribers=[ProgressCallbackInvoker(ledger)],
            )),
            progress=ledger,
        )  # fmt: skip

    def get_bytes(self, key: str) -> bytes:
        def get() -> bytes:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._name(key), ChecksumMode="ENABLED")
            return answer["Body"].read()

        return self._call(f"read {key} from", get)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        def listing() -> list[ObjectInfo]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._list_prefix(prefix)
            )
            return [ObjectInfo(self._key(o["Key"]), o["Size"]) for page in pages for o in page.get("Contents", [])]

        return sorted(self._call(f"list {prefix!r} in", listing), key=lambda o: o.key)

    def exists(self, key: str) -> bool:
        try:
            self._call(f"look up {key} in", lambda: self.client.head_object(Bucket=self.bucket, Key=self._name(key)))
        except NotFound:
            return False
        return True

    def delete(self, keys: Iterable[str]) -> None:
        names = [self._name(k) for k in keys]
        for start in range(0, len(names), DELETE_BATCH):
            batch = names[start : start + DELETE_BATCH]
            answer = self._call(
                f"delete {len(batch)} objects from",
                lambda batch=batch: self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": n} for n in batch], "Quiet": True}
                ),
            )
            if errors := answer.get("Errors"):
                first = errors[0]
                raise StoreError(
                    f"delete from {self.url}: {len(errors)} objects not deleted, "
                    f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message', '')}".rstrip()
                )

    # ---- S3 specifics ---------------------------------------------------------------
    def start_parts(self, key: str) -> S3Parts:
        """Begin a multipart upload of `key` (a PartsStore): its parts can go up while the file is written."""
        answer = self._call(
            f"start a multipart upload of {key} to",
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=self._name(key), ChecksumAlgorithm=CHECKSUM
            ),
        )
        return S3Parts(self, key, answer["UploadId"])

    def abort_multipart_uploads(self, prefix: str = "", *, select: Callable[[str], bool] | None = None) -> int:
        """Abort unfinished multipart uploads under `prefix` (their parts cost storage); returns how many.

        Only keys under the store's own prefix are touched, and of those only the ones `select`
        (given the key relative to the store) accepts: a bucket may hold other applications' uploads.
        """

        def abort() -> int:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._list_prefix(prefix)
            )
            count = 0
            for page in pages:
                for upload in page.get("Uploads", []):
                    if select is not None and not select(self._key(upload["Key"])):
                        continue
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    count += 1
            return count

        count = self._call(f"abort multipart uploads under {prefix!r} in", abort)
        if count:
            log.info("aborted %d unfinished multipart uploads under %s/%s", count, self.url, prefix)
        return count

    def cancel_transfers(self) -> int:
        """Cancel the uploads and downloads in flight (abandoned at a deadline); returns how many.

        No new part of them starts; a part already on the wire ends on its own.
        """
        with self._manager_lock:
            futures = list(self._in_flight)
        for future in futures:
            future.cancel()
        if futures:
            log.info("cancelled %d transfers in flight to %s", len(futures), self.url)
        return len(futures)

    def close(self) -> None:
        """Stop the transfer threads; never waits for transfers abandoned at a deadline.

        Those are cancelled and the transfer manager shuts down behind them on a daemon
        thread (its shutdown waits for parts already on the wire).
        """
        with self._manager_lock:
            manager, self._manager = self._manager, None
        if manager is None:
            return
        if self.cancel_transfers():
            threading.Thread(target=manager.shutdown, name="spotguard-s3-close", daemon=True).start()
        else:
            manager.shutdown()

    def _run(self, start: Callable[[TransferManager], TransferFuture]) -> None:
        """Start a transfer on the shared manager and wait for it, tracked so that it can be cancelled."""
        future = start(self._transfer())
        with self._manager_lock:
            self._in_flight[future] = threading.get_ident()
        try:
            future.result()
        finally:
            with self._manager_lock:
                self._in_flight.pop(future, None)

    def _abandon(self, worker: threading.Thread) -> None:
        """Cancel the transfer of an attempt given up at its deadline: it would hold the manager's threads."""
        with self._manager_lock:
            futures = [f for f, ident in self._in_flight.items() if ident == worker.ident]
        for future in futures:
            future.cancel()

    def _transfer(self) -> TransferManager:
        """One transfer manager per store: parts of all concurrent files share its thread pool."""
        with self._manager_lock:
            if self._manager is None:
                self._manager = create_transfer_manager(self.client, self.transfer_config)
            return self._manager

    # ---- errors ---------------------------------------------------------------------
    def _is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return code in _TRANSIENT_CODES or status in RETRYABLE_STATUS
        # RetriesExceededError: s3transfer's own retries of a download whose connection kept breaking.
        return isinstance(exc, (BotoConnectionError, HTTPClientError, ReadTimeoutError, RetriesExceededError))

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in _NOT_FOUND_CODES:
                return NotFound(f"{what}: no such key")
            if code == "PreconditionFailed" or status == 412:
                return AlreadyExists(f"{what}: the key already exists")
            if code == "NoSuchBucket":
                return StoreError(f"{what}: bucket {self.bucket!r} does not exist")
        if isinstance(exc, CancelledError):
            return Abandoned(f"{what}: cancelled (abandoned at a deadline)")
        if isinstance(exc, (ClientError, BotoCoreError)):
            return StoreError(f"{what}: {one_line(exc)}")
        return StoreError(f"{what}: unexpected {one_line(exc)}")


class S3Parts:
    """One multipart upload (a PartUpload): parts carry a CRC32 each, and each call is bounded like every other."""

    def __init__(self, store: S3Store, key: str, upload_id: str) -> None:
        self._store = store
        self.key = key
        self._upload = {"Bucket": store.bucket, "Key": store._name(key), "UploadId": upload_id}
        self._parts: dict[int, dict[str, object]] = {}
        self._lock = threading.Lock()

    def put_part(self, number: int, data: bytes) -> None:
        answer = self._store._call(
            f"upload part {number} of {self.key} to",
            lambda: self._store.client.upload_part(
                **self._upload, PartNumber=number, Body=data, ChecksumAlgorithm=CHECKSUM
            ),
        )
        with self._lock:
            self._parts[number] = {
                "PartNumber": number,
                "ETag": answer["ETag"],
                "ChecksumCRC32": answer["ChecksumCRC32"],
            }

    def complete(self) -> None:
        with self._lock:
            parts = [self._parts[n] for n in sorted(self._parts)]
        self._store._call(
            f"complete the upload of {self.key} to",
            lambda: self._store.client.complete_multipart_upload(**self._upload, MultipartUpload={"Parts": parts}),
        )

    def abort(self) -> None:
        self._store._call(
            f"abort the upload of {self.key} to", lambda: self._store.client.abort_multipart_upload(**self._upload)
        )
