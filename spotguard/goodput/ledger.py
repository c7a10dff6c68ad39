"""The goodput ledger: what each run segment of a job did, appended next to its checkpoints.

A run segment is one start of a Guard (one launch of the job). Global rank 0 writes one JSON
object per line, one of the typed records of `spotguard.goodput.records` (`start`, `resume`, `save`,
`notice`, `cadence`, `progress`: a heartbeat with the last step trained, `exit`). Where it goes:

  a filesystem checkpoint_dir   <checkpoint_dir>/spotguard-ledger.jsonl, every segment appending
                                to the one file (O_APPEND, one write per line);
  an object store               <prefix>/spotguard-ledger/<segment>.jsonl, then <segment>.2.jsonl...:
                                a segment's objects, each rewritten whole as it grows until it
                                holds OBJECT_LINES lines or a few more (a batch of lines, or lines
                                kept from a refused write, is never split), so a long segment does
                                not upload its whole history at every heartbeat; no object is
                                shared between writers, so there is no read-modify-write race.

Records are queued by the caller and written by a thread of the ledger's own: the training thread
never waits on storage, and a failure to write is logged, never raised. A writer killed mid-line
leaves a torn last line: `read_ledger` skips it and counts it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from cloud_adapters.notice import isoformat_z, parse_iso8601, utc_now
from cloud_adapters.storage import LocalStore, NotFound, ObjectStore
from spotguard.goodput.records import Progress, Record, Resume, parse

log = logging.getLogger(__name__)

LEDGER_NAME = "spotguard-ledger.jsonl"
LEDGER_PREFIX = "spotguard-ledger/"
HEARTBEAT_S = 60.0  # how often a `progress` record notes the last step trained (bounds what a hard kill hides)
OBJECT_LINES = 500  # a bucket ledger object holding this many lines (~60 kB: ~8 h of heartbeats) is left for the next
TAIL_SEQ = 1 << 40  # where the records of a segment's end written in its writer's place are numbered from
_STOP = object()


_R = TypeVar("_R", bound=Record)


@dataclasses.dataclass(frozen=True)
class LedgerContents:
    records: list[Record]  # every segment's records, oldest segment first, in written order
    torn: int  # lines that could not be read (a writer killed mid-line) and were skipped
    unknown: int = 0  # records of a newer version or an event this version does not know: skipped


def new_segment_id() -> str:
    """Sorts by start time (to the millisecond): `20261123T041550123Z-1a2b3c`."""
    now = utc_now()
    return f"{now:%Y%m%dT%H%M%S}{now.microsecond // 1000:03d}Z-{secrets.token_hex(3)}"


class Ledger:
    """Rank 0's ledger writer for one run segment; or, `tail_of` a segment, the writer of that segment's end
    in rank 0's place (rank 0 is stuck): no history read, its records numbered after any of rank 0's, in an
    object of its own (`<segment>.end.jsonl`) on an object store.

    `record()` stamps and queues a record and returns at once. The writer thread first reads the
    ledger's earlier segments (`history()`), then writes; `progress()` (the last step trained) is
    asked for every `heartbeat_s`. `close()` writes what is queued, waiting at most its timeout.
    """

    def __init__(
        self,
        store: ObjectStore,
        progress: Callable[[], int | None] = lambda: None,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        object_lines: int = OBJECT_LINES,
        tail_of: str | None = None,
    ) -> None:
        self.store = store
        self.segment = tail_of or new_segment_id()
        self._tail = tail_of is not None
        self._progress = progress
        self._heartbeat_s = heartbeat_s
        self._queue: queue.Queue = queue.Queue()
        self._lines: list[str] = []  # the segment's current object (object stores are rewritten whole)
        self._object = 1  # its number within the segment
        self._object_lines = object_lines
        self._seq = TAIL_SEQ if self._tail else 0
        self._lock = threading.Lock()
        self._history: list[Record] | None = None
        self._history_ready = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="spotguard-ledger", daemon=True)
        self._thread.start()

    def record(self, record: Record) -> None:
        """Queue one record, stamped now (any thread; never blocks, never raises)."""
        self._queue.put(self._stamp(record))

    def _stamp(self, record: _R) -> _R:
        with self._lock:
            self._seq += 1
            return dataclasses.replace(record, segment=self.segment, seq=self._seq, at=isoformat_z(utc_now()))

    def history(self, timeout: float | None = 0.0) -> list[Record] | None:
        """The earlier segments' records, once the writer has read them (None until then, or if unreadable)."""
        self._history_ready.wait(timeout)
        return self._history

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (waiting at most `timeout_s`) and stop the writer."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the goodput ledger in %s was not written to the end within %.0f s", self.store.url, timeout_s)

    # -- the writer thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._history = [] if self._tail else read_ledger(self.store).records  # an end writes at once
        except Exception as exc:  # noqa: BLE001 - the ledger is never fatal
            log.warning("could not read the goodput ledger in %s: %s", self.store.url, exc)
        self._history_ready.set()
        if isinstance(self.store, LocalStore) and not self._tail:
            self._end_torn_line()
        next_beat = time.monotonic() + self._heartbeat_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                item = None
            batch = [] if item is None else [item]
            while True:  # write everything queued at once: one object rewrite per batch
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(i is _STOP for i in batch)
            batch = [i for i in batch if i is not _STOP]
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self._heartbeat_s
                step = self._progress()
                if step is not None and not stop:
                    batch.append(self._stamp(Progress(last_step=step)))
            if self._history:
                batch = [self._since_previous(r) if isinstance(r, Resume) else r for r in batch]
            if batch:
                self._write(batch)
            if stop:
                return

    def _since_previous(self, resume: Resume) -> Resume:
        gap = parse_iso8601(resume.at) - parse_iso8601(self._history[-1].at)  # type: ignore[index]
        return dataclasses.replace(resume, since_previous_s=gap.total_seconds())

    def _write(self, batch: list[Record]) -> None:
        lines = [json.dumps(record.to_json(), separators=(",", ":")) + "\n" for record in batch]
        try:
            if isinstance(self.store, LocalStore):
                lead = "\n" if self._tail else ""  # ends a line its stuck writer may have torn (read: blank, skipped)
                self.store.append_bytes(LEDGER_NAME, (lead + "".join(lines)).encode())
            else:
                self._lines += lines
                part = ("" if self._object == 1 else f".{self._object}") + (".end" if self._tail else "")
                self.store.put_bytes(f"{LEDGER_PREFIX}{self.segment}{part}.jsonl", "".join(self._lines).encode())
                if len(self._lines) >= self._object_lines:  # stored: the next lines start the next object
                    self._object += 1
                    self._lines = []
        except Exception as exc:  # noqa: BLE001 - never fatal; said once, then quietly retried with the next record
            (log.debug if self._failed else log.warning)(
                "could not write the goodput ledger in %s: %s", self.store.url, exc
            )
            self._failed = True
            if isinstance(self.store, LocalStore):
                return  # these lines are lost; the next append may work
        else:
            if self._failed:
                log.info("the goodput ledger in %s is written again", self.store.url)
            self._failed = False

    def _end_torn_line(self) -> None:
        """A writer killed mid-line left no newline: end that line, so our first record starts a line of its own."""
        try:
            data = self.store.get_bytes(LEDGER_NAME)
        except NotFound:
            return
        except Exception as exc:  # noqa: BLE001
            log.warning("could not read the goodput ledger in %s: %s", self.store.url, exc)
            return
        if data and not data.endswith(b"\n"):
            try:
                self.store.append_bytes(LEDGER_NAME, b"\n")  # type: ignore[attr-defined]
            except OSError as exc:
                log.warning("could not write the goodput ledger in %s: %s", self.store.url, exc)


def read_ledger(store: ObjectStore) -> LedgerContents:
    """Every segment's records in `store` (the file and the per-segment objects), oldest first.

    A line that is not a ledger record (a torn write) is skipped and counted in `torn`; a record
    of a newer version or an unknown event is skipped and counted in `unknown`.
    """
    blobs: list[bytes] = []
    for info in store.list(LEDGER_PREFIX):
        if info.key.endswith(".jsonl"):
            blobs.append(store.get_bytes(info.key))
    try:
        blobs.append(store.get_bytes(LEDGER_NAME))
    except NotFound:
        pass
    records: list[Record] = []
    torn = unknown = 0
    for blob in blobs:
        for line in blob.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                record = parse(json.loads(line))
            except Exception:  # noqa: BLE001 - a torn or foreign line: skipped, counted
                torn += 1
                continue
            if record is None:
                unknown += 1
            else:
                records.append(record)
    records.sort(key=lambda r: (r.segment, r.seq))
    return LedgerContents(records, torn, unknown)
