"""Shard files go up to an object store while DCP is still writing them.

With a store that takes an object part by part (`PartsStore`: S3, Azure, GCS), each `.distcp` file this
rank writes becomes an upload in parts. The checksumming stream (`shard_io`) flushes at every part
boundary and hands over the range just written; `threads` upload threads read each range back with
pread (from the page cache: the bytes were just written) and send it as a part. So the local write
never waits for the network: the queue holds (offset, length) ranges, not bytes, and the memory this
costs is one part per upload thread. A file's upload is completed (the object appears) only in
`finish`, after the local commit and only when the committed copy is this save's own: an emergency
that finds its step already committed aborts its streams, so no object of the copy not committed
lands beside the committed one's.

Nothing here can hold back or fail the local commit: a stream that fails (or is cut off at the
save's cutoff) only leaves its file to the after-commit upload, as if it had never streamed. The
manifest is still uploaded last by the caller, after every rank has waited for its streams
(`finish`). A step whose manifest is already in the store is never streamed into.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import cast

from cloud_adapters.deadline import Deadline
from cloud_adapters.storage import ObjectStore, PartsStore, PartUpload, Progress

log = logging.getLogger(__name__)

MiB = 1 << 20
PART_SIZE = 16 * MiB  # per part: S3 allows 10,000 parts, so files up to 160 GB stream
_CHECK_EVERY_S = 0.2  # how often a waiting caller looks at its cutoff


class ShardStreams:
    """One save's streaming uploads on one rank: `open` is the tee `ChecksummingFileSystem` calls per file."""

    def __init__(
        self, store: ObjectStore, step_dir: str, committed_key: str, *, threads: int, cutoff: Deadline
    ) -> None:
        self.store = store
        self.parts = cast(PartsStore, store)
        self.step_dir = step_dir
        self.part_size = max(PART_SIZE, self.parts.min_part_size)
        self.cutoff = cutoff
        self._committed_key = committed_key
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._files: list[StreamedFile] = []
        self._lock = threading.Lock()
        self._gate = threading.Lock()  # held for a store lookup: never taken by the writer
        self._may_stream: bool | None = None  # None: not looked up yet; False: the step is already in the store
        self._stopped = False
        self._progress: Progress | None = None
        self._sent_bytes = 0
        self.streamed_bytes = 0  # of the files up whole, once `finish` returns
        self._threads = threads
        for _ in range(threads):
            context = contextvars.copy_context()  # store call limits set by the caller hold here too
            threading.Thread(target=context.run, args=(self._work,), name="spotguard-stream", daemon=True).start()

    def open(self, path: Path) -> StreamedFile | None:
        """The stream of a file DCP starts writing (None: not streamed, e.g. the `.metadata`)."""
        if not path.name.endswith(".distcp"):
            return None
        with self._lock:
            if self._stopped:
                return None
            try:
                file = StreamedFile(self, path, f"{self.step_dir}/{path.name}")
            except OSError as exc:  # never the local write's failure: this file goes up after the commit
                log.warning("not streaming %s: %s", path.name, exc)
                return None
            self._files.append(file)
        return file

    def finish(self, progress: Progress | None = None, *, complete: bool = True) -> set[str]:
        """Complete every stream whose parts are all up, waiting until the cutoff; the names of the
        files that are up whole.

        `progress` hears of the bytes already up, then of every part as it goes. Streams still
        running at the cutoff are abandoned. Without `complete` (the step's committed copy is not
        this save's), every stream is aborted and nothing is up.
        """
        if not complete:
            self.close()
            return set()
        with self._lock:
            self._progress = progress
            already = self._sent_bytes
        if progress is not None and already:
            progress(already)
        files = list(self._files)
        if self._wait_all(f.settled for f in files):
            for file in files:
                file.complete()
            self._wait_all(f.done for f in files)
        with self._lock:
            self._progress = None
            whole = [f for f in self._files if f.error is None and f.done.is_set()]
            self.streamed_bytes = sum(f.sent_bytes for f in whole)
            redo = self._sent_bytes - self.streamed_bytes
        if progress is not None and redo:  # those files go up again, counted afresh
            progress(-redo)
        return {f.path.name for f in whole}

    def close(self) -> None:
        """Stop streaming: unfinished uploads are aborted (on the upload threads, never waited for)."""
        with self._lock:
            self._stopped = True
            files = list(self._files)
        for file in files:
            file.fail("streaming stopped")
        for _ in range(self._threads):
            self._jobs.put(None)

    def _wait_all(self, events: Iterable[threading.Event]) -> bool:
        """Wait for every event until the cutoff; past it, every stream is abandoned and False returned."""
        for event in events:
            while not event.wait(self.cutoff.check_within(_CHECK_EVERY_S)):
                if self.cutoff.passed():
                    self.close()
                    return False
        return True

    def _allowed(self) -> bool:
        """Whether parts may go up: once per save, the step must not be committed in the store already."""
        with self._gate:
            if self._may_stream is None:
                try:
                    self._may_stream = not self.store.exists(self._committed_key)
                except Exception as exc:  # noqa: BLE001 - the after-commit upload will tell whether the store works
                    log.warning("not streaming %s: %s", self.step_dir, exc)
                    self._may_stream = False
            return self._may_stream and not self._stopped

    def _moved(self, nbytes: int) -> None:
        with self._lock:
            self._sent_bytes += nbytes
            progress = self._progress
        if progress is not None:
            progress(nbytes)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            file, number, offset, length = job
            file.run(number, offset, length)


class StreamedFile:
    """One shard file's multipart upload. The writer calls `written` and `closed`; the upload
    threads run its jobs: parts (number >= 1), then completion (0, queued by `complete` once the
    step is committed) or an abort (-1)."""

    def __init__(self, streams: ShardStreams, path: Path, key: str) -> None:
        self.streams = streams
        self.path = path
        self.key = key
        self.done = threading.Event()  # complete or failed
        self.settled = threading.Event()  # every part up, or failed
        self.error: str | None = None
        self.next_boundary = streams.part_size  # the writer flushes and calls `written` once past it
        self._fd: int | None = os.open(path, os.O_RDONLY)
        self._lock = threading.Lock()  # never held across a store call: the writer takes it
        self._start_lock = threading.Lock()  # held while the upload is being started
        self._upload: PartUpload | None = None
        self._queued = 0  # bytes handed to the upload threads
        self._parts = 0  # parts handed over
        self._sent = 0  # parts up
        self._total: int | None = None  # parts, once the file is closed
        self.sent_bytes = 0

    def written(self, size: int) -> None:
        """The first `size` bytes are in the file: queue each whole part among them."""
        part = self.streams.part_size
        while size - self._queued >= part:
            self._queue(part)
        # A failed stream costs the writer nothing more (no more flushes).
        self.next_boundary = self._queued + part if not self.done.is_set() else 1 << 62

    def closed(self, size: int) -> None:
        """The file is complete (and fsynced) at `size` bytes: queue its last part."""
        if size == 0:  # no part to send: the after-commit upload writes an empty object
            self.fail("empty file")
            return
        self.written(size)
        if size > self._queued:
            self._queue(size - self._queued)
        with self._lock:
            self._total = self._parts
            if self._sent == self._total and self.error is None:
                self.settled.set()

    def complete(self) -> None:
        """Queue the completion of an upload whose parts are all up (the object then appears)."""
        if self.settled.is_set() and not self.done.is_set():
            self._push(0)

    def fail(self, why: str) -> None:
        """Give up on this file (the after-commit upload sends it); aborts the upload if one was started."""
        with self._lock:
            if self.done.is_set():
                return
            self.error = why
            self.done.set()
            self.settled.set()
            started = self._upload is not None
            self._close_fd()
        if started:
            self._push(-1)

    def run(self, number: int, offset: int, length: int) -> None:
        try:
            if number == -1:
                self._upload.abort()  # type: ignore[union-attr]
            elif number == 0:
                if not self.done.is_set():
                    self._upload.complete()  # type: ignore[union-attr]
                    self._succeed()
            else:
                self._send(number, offset, length)
        except Exception as exc:  # noqa: BLE001 - the file goes up after the commit instead
            if number == -1:
                log.info("could not abort the streamed upload of %s: %s", self.key, exc)
            else:
                log.warning("streaming %s failed (it is uploaded after the commit instead): %s", self.key, exc)
                self.fail(f"{type(exc).__name__}: {exc}")

    def _send(self, number: int, offset: int, length: int) -> None:
        if self.done.is_set():
            return
        if self.streams.cutoff.passed():
            self.fail("cut off at the deadline")
            return
        if not self.streams._allowed():
            self.fail("not streamed")
            return
        with self._start_lock:
            if self._upload is None:
                upload = self.streams.parts.start_parts(self.key)
                with self._lock:
                    self._upload = upload
                    failed = self.done.is_set()
                if failed:  # `fail` did not see it started: abort it here
                    self._push(-1)
                    return
        with self._lock:
            if self._fd is None:  # failed meanwhile
                return
            data = os.pread(self._fd, length, offset)
        if len(data) != length:
            raise OSError(f"read {len(data)} of {length} bytes at {offset} of {self.path}")
        self._upload.put_part(number, data)
        with self._lock:
            self.sent_bytes += length
            self._sent += 1
            if self._sent == self._total and self.error is None:
                self.settled.set()
        self.streams._moved(length)

    def _queue(self, length: int) -> None:
        self._parts += 1
        if self._parts > self.streams.parts.max_parts:
            self.fail(f"more than {self.streams.parts.max_parts} parts")
        elif not self.done.is_set():
            self._push(self._parts, self._queued, length)
        self._queued += length

    def _push(self, number: int, offset: int = 0, length: int = 0) -> None:
        self.streams._jobs.put((self, number, offset, length))

    def _succeed(self) -> None:
        with self._lock:
            if self.done.is_set():  # failed meanwhile: it is uploaded again after the commit
                return
            self.done.set()
            self._close_fd()

    def _close_fd(self) -> None:
        """With the lock held."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
