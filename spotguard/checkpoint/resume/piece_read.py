"""How a step's shard files get read into a CPU state: in pieces that any of the reading threads takes, large
tensors straight into their own memory, every byte checked as it is read.

`shard_read` gives each file to one thread, which reads each record into a buffer of its own and copies
it into the state from there. On CPU that costs a second pass over every byte (the copy), leaves that
file's disk reads waiting while its thread checksums and copies, and makes a step wait for its largest
file (one layer of 8192 x 8192 and its AdamW moments make a file of 537 MB beside one of 269 MB). Here:

- A tensor record that one plan item takes whole, into a contiguous CPU tensor, is read straight into
  that tensor. Its first `HEAD` bytes say where torch.save put the tensor's bytes (after the zip's local
  header of `data/0`); the rest of the record goes from the disk into the tensor, in pieces of at most
  `PIECE` bytes, the last piece with the few bytes after the tensor's. Once all of it is in, torch's own
  parse of the whole record (torch.load's weights-only unpickler, the tensor built on the meta device)
  must agree: a tensor of that dtype and shape, contiguous, all of its storage, its bytes where they
  were read. Where it does not (a layout with other strides), the record as read is delivered as any
  other. Every other record (bytes, small tensors, a record several items share or whose tensor in the
  state is not one contiguous CPU tensor of its size) is read whole into a thread's buffer and delivered
  as `shard_read` delivers it: parsed where it lies, copied into the state.
- The reads are units in one queue, in file order, that `reader_count(threads)` threads take from; a
  record's pieces go to the front as soon as its first bytes are read, so the threads read the pieces
  of one record at once and the disk has reads in flight while other threads checksum.
- Every byte of every file is still read once and its CRC32C computed from the bytes as they were read:
  one CRC per read, folded in file order (`checksums.crc32c_combine`) once every unit is done, and compared
  with the manifest then; the file's size is what it is when opened and once read. As before, a file that
  does not match raises `Damaged` after its records were copied into the state, and resume loads an older
  step over it (or refuses to start from a half-loaded state).

Only for a state on CPU and without a checkpoint key (a SHA-256 has to be computed in file order; with a
key, resume read every file for it before the load, so they are in the page cache): anything else takes
`shard_read`'s path.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from spotguard.checkpoint.errors import Damaged
from spotguard.checkpoint.format.manifest import FileRecord, mismatch
from spotguard.checkpoint.io.checksums import crc32c_combine, crc32c_extend
from spotguard.checkpoint.resume import records

PIECE = 4 << 20  # the most one read takes (on the 2-core VM, 4 threads reading 16 MiB each kept its disk less busy)
HEAD = 64 << 10  # bytes of a record read first, to find where its tensor's bytes begin
DIRECT_MIN = 1 << 20  # smaller records are read whole into a buffer (a copy of them costs little)
MIN_THREADS = 4  # reads wait on the disk: more threads than cores keep it busy

Deliver = Callable[[memoryview, list[ReadItem]], None]  # shard_read's delivery of a record read into a buffer


def reader_count(threads: int) -> int:
    """Threads reading a CPU load: at least MIN_THREADS (they wait on the disk more than they compute)."""
    return max(threads, MIN_THREADS)


@dataclasses.dataclass(eq=False)
class _File:
    path: Path
    record: FileRecord
    fd: int = -1
    crcs: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (offset, length, crc) per read
    damage: Exception | None = None  # the file does not match its manifest record (or cannot be read)
    failure: Exception | None = None  # the first error delivering one of its records
    complete: bool = True  # False: a part of it was not read (its plan or a read failed): not checked

    def fail(self, exc: BaseException) -> None:
        """An error of our own reading it (not damage): it is not checked, and its error is raised."""
        self.failure = self.failure or exc  # type: ignore[assignment]
        self.complete = False

    def ok(self) -> bool:
        return self.damage is None and self.failure is None


@dataclasses.dataclass(eq=False)
class _Record:
    file: _File
    offset: int
    length: int
    items: list[ReadItem]
    target: torch.Tensor | None  # the tensor its bytes may go into as they are (`_target`)
    # That tensor's memory, made before the threads start (a torch call that releases the GIL can wait
    # a whole switch interval to take it back while other threads read and checksum).
    data: memoryview | None = None
    head: bytearray | None = None  # its first bytes, up to where the tensor's begin
    tail: bytearray | None = None  # its bytes after the tensor's
    pieces_left: int = 0


Unit = tuple[Callable[..., list], tuple]  # a _Reader method and its arguments; it returns the units to do next


@dataclasses.dataclass
class _Load:
    """What every reading thread shares."""

    planner: LoadPlanner
    deliver: Deliver
    lock: threading.Lock  # around every call into the planner
    # torch's parse of a record read straight into a tensor, by its bytes around the tensor's and their length
    parsed: dict[tuple[bytes, bytes, int], records.Stored | None] = dataclasses.field(default_factory=dict)
    parsing: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def read_in_pieces(
    work: list[tuple[Path, FileRecord, list[ReadItem]]],
    storage_data: Mapping[Any, Any],
    planner: LoadPlanner,
    deliver: Deliver,
    lock: threading.Lock,
    *,
    threads: int,
) -> None:
    """Read `work` (each file, its manifest record and the plan items it holds) into the planner's state.

    `deliver` hands a record read into a buffer to the planner; `lock` is the one it takes (held here
    too around the planner's calls). Raises `Damaged` for the first file (in `work`'s order) that does
    not match its record, else the first error delivering a record. Every file is read to its end first.
    """
    load = _Load(planner, deliver, lock)
    files: list[_File] = []
    try:
        units: list[Unit] = []
        shared = _shared_storages(work, planner)
        for path, record, items in work:
            file = _File(path, record)
            files.append(file)
            try:
                file.fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except OSError as exc:  # unreadable is damaged: a local copy is then fetched again
                file.damage = Damaged(f"{path}: {exc}")
                continue
            with contextlib.suppress(AttributeError, OSError):  # a larger readahead
                os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            size = os.fstat(file.fd).st_size
            if size != record.size:
                file.damage = Damaged(f"{path.parent}/{record.name}: size {size} != {record.size} in the manifest")
                continue
            try:
                units += _plan(file, items, storage_data, planner, shared)
            except Exception as exc:  # a plan this file cannot serve: not read, raised after any damaged file's error
                file.fail(exc)
        _read_all(units, load, threads)
        for file in files:
            if file.damage is None and file.complete and (wrong := mismatch(_as_read(file), file.record)):
                file.damage = Damaged(f"{file.path.parent}/{wrong}")
    finally:
        for file in files:
            if file.fd >= 0:
                os.close(file.fd)
    for file in files:
        if file.damage is not None:
            raise file.damage from file.failure
    for file in files:
        if file.failure is not None:
            raise file.failure


def _read_all(units: list[Unit], load: _Load, threads: int) -> None:
    """Do `units` on `threads` threads; return once none of them runs (the caller closes the files next)."""
    queue = _Queue(units)
    readers: list[threading.Thread] = []
    try:
        for i in range(threads):  # not fewer: a file of one large record is one unit, then its pieces
            readers.append(threading.Thread(target=_Reader(queue, load).run, name=f"spotguard-read_{i}"))
            readers[-1].start()
        for reader in readers:
            reader.join()
    except BaseException:  # a thread that could not start, an interrupt: no reads into the state after this
        queue.stop()
        for reader in readers:
            if reader.ident is not None:
                reader.join()
        raise


def _shared_storages(work: list[tuple[Path, FileRecord, list[ReadItem]]], planner: LoadPlanner) -> set[int]:
    """The state's storages that more than one record goes into (tied weights, views of one storage): none of
    those records is read straight into it, where another's bytes could land while its checksum is taken."""
    seen: collections.Counter[int] = collections.Counter()
    for _, _, items in work:
        for item in items:
            if item.type == LoadItemType.TENSOR:
                with contextlib.suppress(Exception):  # a plan item the state cannot serve: its file's plan says so
                    seen[planner.resolve_tensor(item).untyped_storage().data_ptr()] += 1
    return {memory for memory, count in seen.items() if count > 1}


def _plan(
    file: _File, items: list[ReadItem], storage_data: Mapping[Any, Any], planner: LoadPlanner, shared: set[int]
) -> list[Unit]:
    """The units that read `file` whole, in file order: its records and the bytes between and after them."""
    units: list[Unit] = []
    position = 0
    for offset, length, record_items in records.records_in(file.path, file.record.size, items, storage_data):
        units += _gaps(file, position, offset)
        record = _Record(file, offset, length, record_items, _target(record_items, planner))
        memory = record.target.untyped_storage().data_ptr() if record.target is not None else None
        direct = length >= DIRECT_MIN and memory is not None and memory not in shared
        if direct:
            record.data = records.bytes_of(record.target)
        units.append((_Reader.read_head if direct else _Reader.read_whole, (record,)))
        position = offset + length
    return units + _gaps(file, position, file.record.size)


def _gaps(file: _File, start: int, end: int) -> list[Unit]:
    return [(_Reader.read_gap, (file, at, min(end, at + PIECE))) for at in range(start, end, PIECE)]


def _target(items: list[ReadItem], planner: LoadPlanner) -> torch.Tensor | None:
    """The tensor a record's bytes may go into as they are (read straight into it, or copied from a buffer without
    torch's parse of the record): the one item's, a whole contiguous CPU tensor; else None."""
    if len(items) != 1 or items[0].type != LoadItemType.TENSOR or any(items[0].storage_offsets):
        return None
    if not records.offsets_known():
        return None
    target = planner.resolve_tensor(items[0]).detach()
    usable = (
        target.device.type == "cpu"
        and target.layout == torch.strided
        and not target.is_quantized
        and not target.is_conj()
        and not target.is_neg()
        and target.is_contiguous()
        and target.numel() > 0
        and tuple(target.size()) == tuple(items[0].lengths)
    )
    return target if usable else None


class ReadBuffer:
    """One thread's read buffer, grown to the largest length asked of it (at least `minimum` bytes)."""

    def __init__(self, minimum: int) -> None:
        self._minimum = minimum
        self._view: memoryview | None = None  # the view keeps the memory alive

    def get(self, length: int) -> memoryview:
        if self._view is None or len(self._view) < length:
            self._view = memoryview(torch.empty(max(length, self._minimum), dtype=torch.uint8).numpy())
        return self._view[:length]


class _Queue:
    """Units in order; a unit may put more in front. A thread waits while the queue is empty and another's
    unit may still add some."""

    def __init__(self, units: list[Unit]) -> None:
        self._units = collections.deque(units)
        self._busy = 0
        self._stopped = False
        self._changed = threading.Condition()

    def take(self) -> Unit | None:
        with self._changed:
            while not self._units and self._busy and not self._stopped:
                self._changed.wait()
            if not self._units or self._stopped:
                return None
            self._busy += 1
            return self._units.popleft()

    def stop(self) -> None:
        """No unit is taken any more; the threads end after the ones they are doing."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def done(self, more: list[Unit]) -> None:
        with self._changed:
            self._units.extendleft(reversed(more))
            self._busy -= 1
            self._changed.notify_all()


class _Reader:
    """One reading thread: does units until none is left."""

    def __init__(self, queue: _Queue, load: _Load) -> None:
        self._queue = queue
        self._load = load
        self._buffer = ReadBuffer(PIECE)  # grown to the largest record this thread read whole

    def run(self) -> None:
        while (unit := self._queue.take()) is not None:
            more: list[Unit] = []
            method, args = unit
            try:
                more = method(self, *args)
            except BaseException as exc:  # noqa: BLE001 - raised by read_in_pieces on the calling thread
                (args[0] if isinstance(args[0], _File) else args[0].file).fail(exc)
            finally:
                self._queue.done(more)

    # ---- units -------------------------------------------------------------------------------
    def read_gap(self, file: _File, start: int, end: int) -> list[Unit]:
        self._read(file, start, [self._buffer_of(end - start)])
        return []

    def read_whole(self, record: _Record, head: bytearray | None = None) -> list[Unit]:
        """Read a record into this thread's buffer (after its first bytes, when they were read); copy its
        tensor's bytes into the state when a record of the same bytes around them was parsed already, else
        deliver it (parsed and copied)."""
        data = self._buffer_of(record.length)
        begin = 0
        if head is not None:
            begin = len(head)
            data[:begin] = head
        if self._read(record.file, record.offset + begin, [data[begin:]]) and not self._copied_in(record, data):
            self._deliver(record, data)
        return []

    def read_head(self, record: _Record) -> list[Unit]:
        """Read a record's first bytes; then the rest in pieces, the tensor's bytes straight into it, when they
        tell where the tensor's bytes begin; else the whole record here."""
        assert record.data is not None
        head = bytearray(min(HEAD, record.length))
        if not self._read(record.file, record.offset, [head]):
            return []
        start = records.data_start(head)
        size = len(record.data)
        after = record.length - start - size if start is not None else -1  # bytes after the tensor's
        if start is None or start + size < len(head) or not 0 <= after <= HEAD:
            return self.read_whole(record, head)
        record.head, record.tail = head[:start], bytearray(after)
        record.data[: len(head) - start] = memoryview(head)[start:]
        pieces = [(at, min(size, at + PIECE)) for at in range(len(head) - start, size, PIECE)] or [(size, size)]
        record.pieces_left = len(pieces)
        return [(_Reader.read_piece, (record, begin, end)) for begin, end in pieces]

    def read_piece(self, record: _Record, begin: int, end: int) -> list[Unit]:
        """Bytes `begin`..`end` of the tensor's, read into it; the last piece reads the record's tail too."""
        assert record.data is not None and record.head is not None and record.tail is not None
        views = [record.data[begin:end]]
        if end == len(record.data):
            views.append(memoryview(record.tail))
        if self._read(record.file, record.offset + len(record.head) + begin, views):
            with self._load.lock:
                record.pieces_left -= 1
                last = record.pieces_left == 0
            if last:
                self._finish(record)
        return []

    # ---- helpers -----------------------------------------------------------------------------
    def _finish(self, record: _Record) -> None:
        """A record read straight into its tensor: commit it when torch's own parse of the whole record agrees
        that those were the tensor's bytes; else deliver the record as read (a copy, or the error it raises)."""
        assert record.data is not None and record.head is not None and record.tail is not None
        assert record.target is not None
        parts = [memoryview(record.head), record.data, memoryview(record.tail)]
        if self._holds(parts, record.target):
            self._commit(record)
            return
        whole = self._buffer_of(record.length)
        at = 0
        for part in parts:
            whole[at : at + len(part)] = part
            at += len(part)
        self._deliver(record, whole)

    def _copied_in(self, record: _Record, data: memoryview) -> bool:
        """Copy the tensor's bytes of a record read whole into its tensor, and commit it, when torch's parse
        agrees where they are (the parse of another record of the same bytes around them will do)."""
        if record.target is None or (start := records.data_start(bytes(data[:HEAD]))) is None:
            return False
        end = start + record.target.nbytes
        parts = [data[:start], data[start:end], data[end:]]
        if end > len(data) or not self._holds(parts, record.target):
            return False
        records.copy_bytes(records.bytes_of(record.target), parts[1])
        self._commit(record)
        return True

    def _holds(self, parts: list[memoryview], target: torch.Tensor) -> bool:
        """Whether the record made of `parts` holds `target`'s tensor, its bytes `parts[1]`."""
        key = (bytes(parts[0]), bytes(parts[2]), len(parts[1]))
        with self._load.parsing:  # records of one shape and dtype are parsed once
            if key not in self._load.parsed:
                self._load.parsed[key] = records.stored(parts)
            stored = self._load.parsed[key]
        return stored is not None and stored.holds(target, len(parts[0]), len(parts[1]))

    def _commit(self, record: _Record) -> None:
        if record.file.ok():
            try:
                with self._load.lock:
                    for item in record.items:
                        self._load.planner.commit_tensor(item, record.target)
            except Exception as exc:  # as _deliver: a damaged file explains it better
                record.file.failure = record.file.failure or exc

    def _deliver(self, record: _Record, data: memoryview) -> None:
        if record.file.ok():
            try:
                self._load.deliver(data, record.items)
            except Exception as exc:  # a damaged file explains it better: the file is still read to its end
                record.file.failure = record.file.failure or exc

    def _read(self, file: _File, offset: int, views: Sequence[memoryview | bytearray]) -> bool:
        """Read `file` from `offset` into `views`, one after the other, and note the bytes' CRC32C; False when
        the file is damaged (a read error, or it ended early) or already known to be."""
        if file.damage is not None:
            return False
        views = [memoryview(v).cast("B") for v in views]
        wanted = sum(len(v) for v in views)
        got = 0
        try:
            while got < wanted and (n := os.preadv(file.fd, _after(views, got), offset + got)):
                got += n
        except OSError as exc:  # EIO from a bad sector: the way a local copy usually goes bad
            file.damage = Damaged(f"{file.path}: {exc}")
            return False
        crc = 0
        for view in _until(views, got):
            crc = crc32c_extend(crc, view)
        file.crcs.append((offset, got, crc))  # a list's append is atomic
        if got < wanted:  # shorter than when it was opened
            file.damage = Damaged(f"{file.path}: ended at byte {offset + got} while it was read")
            return False
        return True

    def _buffer_of(self, length: int) -> memoryview:
        return self._buffer.get(length)


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """`views` less their first `skip` bytes."""
    out = []
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        out.append(view[skip:])
        skip = 0
    return out


def _until(views: list[memoryview], count: int) -> list[memoryview]:
    """The first `count` bytes of `views`."""
    out = []
    for view in views:
        out.append(view[: max(0, min(len(view), count))])
        count -= len(view)
    return out


def _as_read(file: _File) -> FileRecord:
    """The file's record from what was read: its size now (when every byte was read) and the CRCs folded."""
    crc = position = 0
    for offset, length, piece_crc in sorted(file.crcs):
        if offset != position:  # a unit was not read: cannot happen without damage noted
            break
        crc = crc32c_combine(crc, piece_crc, length)
        position += length
    if position == file.record.size:
        position = os.fstat(file.fd).st_size  # grown since it was opened: not the manifest's file
    return FileRecord(file.record.name, position, f"{crc:08x}")
