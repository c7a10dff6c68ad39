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
  one CRC per read, folded in file order (`shard_io.crc32c_combine`) once every unit is done, and compared
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
import functools
import io
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from spotguard.checkpoint.errors import CheckpointError, Damaged
from spotguard.checkpoint.format.manifest import FileRecord, mismatch
from spotguard.checkpoint.io.checksums import crc32c_combine, crc32c_extend

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
    planned: bool = True  # False: its units could not be planned, so it was not read

    def ok(self) -> bool:
        return self.damage is None and self.failure is None


@dataclasses.dataclass(eq=False)
class _Record:
    file: _File
    offset: int
    length: int
    items: list[ReadItem]
    target: torch.Tensor | None  # the tensor it may be read straight into
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
    failures: list[BaseException] = dataclasses.field(default_factory=list)  # errors of our own: raised as they are
    # torch's parse of a record read straight into a tensor, by its bytes around the tensor's and their length
    parsed: dict[tuple[bytes, bytes, int], _Stored | None] = dataclasses.field(default_factory=dict)
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
        claimed: set[int] = set()  # the storages read straight into: tied weights are read into a buffer
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
                units += _plan(file, items, storage_data, planner, claimed)
            except Exception as exc:  # a plan this file cannot serve: not read, raised after any damaged file's error
                file.failure = exc
                file.planned = False
        _read_all(units, load, threads)
        for file in files:
            if file.damage is None and file.planned and (wrong := mismatch(_as_read(file), file.record)):
                file.damage = Damaged(f"{file.path.parent}/{wrong}")
    finally:
        for file in files:
            if file.fd >= 0:
                os.close(file.fd)
    for file in files:
        if file.damage is not None:
            raise file.damage from file.failure
    if load.failures:
        raise load.failures[0]
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


def records_in(
    path: Path, size: int, items: list[ReadItem], storage_data: Mapping[Any, Any]
) -> list[tuple[int, int, list[ReadItem]]]:
    """The stored records that `items` need from the file at `path` of `size` bytes: (offset, length, items),
    in file order (the items of one record share its bytes). Raises for records that overlap or pass the end:
    never written by DCP, a .metadata that is not this file's."""
    by_range: dict[tuple[int, int], list[ReadItem]] = {}
    for item in items:
        info = storage_data[item.storage_index]
        by_range.setdefault((info.offset, info.length), []).append(item)
    records = []
    position = 0
    for (offset, length), record_items in sorted(by_range.items()):
        if offset < position:
            raise CheckpointError(f"{path}: records overlap at byte {offset}")
        if offset + length > size:
            raise CheckpointError(f"{path}: a record ends at byte {offset + length}, past the file's end ({size})")
        records.append((offset, length, record_items))
        position = offset + length
    return records


def _plan(
    file: _File, items: list[ReadItem], storage_data: Mapping[Any, Any], planner: LoadPlanner, claimed: set[int]
) -> list[Unit]:
    """The units that read `file` whole, in file order: its records and the bytes between and after them."""
    units: list[Unit] = []
    position = 0
    for offset, length, record_items in records_in(file.path, file.record.size, items, storage_data):
        units += _gaps(file, position, offset)
        record = _Record(file, offset, length, record_items, _direct_target(record_items, length, planner, claimed))
        if record.target is not None:
            record.data = _bytes_of(record.target)
        units.append((_Reader.read_head if record.target is not None else _Reader.read_whole, (record,)))
        position = offset + length
    return units + _gaps(file, position, file.record.size)


def _gaps(file: _File, start: int, end: int) -> list[Unit]:
    return [(_Reader.read_gap, (file, at, min(end, at + PIECE))) for at in range(start, end, PIECE)]


def _direct_target(items: list[ReadItem], length: int, planner: LoadPlanner, claimed: set[int]) -> torch.Tensor | None:
    """The tensor a record may be read straight into: the one item's, a whole contiguous CPU tensor whose
    memory no other record is read straight into; else None."""
    if len(items) != 1 or items[0].type != LoadItemType.TENSOR or length < DIRECT_MIN or any(items[0].storage_offsets):
        return None
    if not _offsets_known():
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
        and target.untyped_storage().data_ptr() not in claimed
    )
    if not usable:
        return None
    claimed.add(target.untyped_storage().data_ptr())
    return target


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
        self._buffer: memoryview | None = None  # grown to the largest record this thread read whole

    def run(self) -> None:
        while (unit := self._queue.take()) is not None:
            more: list[Unit] = []
            try:
                method, args = unit
                more = method(self, *args)
            except BaseException as exc:  # noqa: BLE001 - raised by read_in_pieces on the calling thread
                self._load.failures.append(exc)
            finally:
                self._queue.done(more)

    # ---- units -------------------------------------------------------------------------------
    def read_gap(self, file: _File, start: int, end: int) -> list[Unit]:
        self._read(file, start, [self._buffer_of(end - start)])
        return []

    def read_whole(self, record: _Record, head: bytearray | None = None) -> list[Unit]:
        """Read a record into this thread's buffer (after its first bytes, when they were read) and deliver it."""
        data = self._buffer_of(record.length)
        begin = 0
        if head is not None:
            begin = len(head)
            data[:begin] = head
        if self._read(record.file, record.offset + begin, [data[begin:]]):
            self._deliver(record, data)
        return []

    def read_head(self, record: _Record) -> list[Unit]:
        """Read a record's first bytes; then the rest in pieces, the tensor's bytes straight into it, when they
        tell where the tensor's bytes begin; else the whole record here."""
        assert record.data is not None
        head = bytearray(HEAD)
        if not self._read(record.file, record.offset, [head]):
            return []
        start = _data_start(head)
        size = len(record.data)
        after = record.length - start - size if start is not None else -1  # bytes after the tensor's
        if start is None or start + size < HEAD or not 0 <= after <= HEAD:
            return self.read_whole(record, head)
        record.head, record.tail = head[:start], bytearray(after)
        record.data[: HEAD - start] = memoryview(head)[start:]
        pieces = [(at, min(size, at + PIECE)) for at in range(HEAD - start, size, PIECE)] or [(size, size)]
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
        key = (bytes(record.head), bytes(record.tail), len(record.data))
        with self._load.parsing:  # records of one shape and dtype are parsed once
            if key not in self._load.parsed:
                self._load.parsed[key] = _stored(parts)
            stored = self._load.parsed[key]
        if stored is not None and stored.holds(record.target, len(record.head), len(record.data)):
            if record.file.ok():
                try:
                    with self._load.lock:
                        for item in record.items:
                            self._load.planner.commit_tensor(item, record.target)
                except Exception as exc:  # as _deliver: a damaged file explains it better
                    record.file.failure = record.file.failure or exc
            return
        whole = self._buffer_of(record.length)
        at = 0
        for part in parts:
            whole[at : at + len(part)] = part
            at += len(part)
        self._deliver(record, whole)

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
        if self._buffer is None or len(self._buffer) < length:
            self._buffer = memoryview(torch.empty(max(length, PIECE), dtype=torch.uint8).numpy())
        return self._buffer[:length]


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


def _data_start(head: bytearray) -> int | None:
    """Where the bytes of torch.save's one storage (zip entry `<archive>/data/0`) begin, judged from the
    record's first bytes: after the local header of that name. A guess, which `_stored` checks once the
    record is read; None when there is no such header in `head`."""
    if head[:4] != _LOCAL_HEADER:
        return None
    first = bytes(head[30 : 30 + int.from_bytes(head[26:28], "little")])
    if not first.endswith(b"/data.pkl"):
        return None
    wanted = first[: -len(b"data.pkl")] + b"data/0"
    at = 0
    while (at := head.find(_LOCAL_HEADER, at + 1)) >= 0 and at + 30 <= len(head):
        name_length = int.from_bytes(head[at + 26 : at + 28], "little")
        if head[at + 30 : at + 30 + name_length] == wanted:
            start = at + 30 + name_length + int.from_bytes(head[at + 28 : at + 30], "little")
            return start if start <= len(head) else None
    return None


_LOCAL_HEADER = b"PK\x03\x04"


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A record's one plain tensor, as torch's parse of the record describes it."""

    dtype: torch.dtype
    size: torch.Size
    offset: int  # where its bytes begin in the record
    nbytes: int

    def holds(self, target: torch.Tensor, start: int, length: int) -> bool:
        """Whether these are `target`'s dtype and shape, its bytes the `length` read from `start`."""
        return (
            self.dtype == target.dtype
            and self.size == target.size()
            and self.offset == start
            and self.nbytes == target.nbytes == length
        )


def _stored(parts: list[memoryview]) -> _Stored | None:
    """The tensor in the record made of `parts`, parsed as torch.load parses it (its weights-only unpickler)
    on the meta device: None unless it is one plain tensor, contiguous and all of its storage. The parse reads
    the record's zip headers and pickle, never the tensor's bytes: its answer is the same for any record of
    the same bytes around the tensor's."""
    try:
        stored = _parsed_on_meta(parts)
        storage = stored.untyped_storage()
    except Exception:  # noqa: BLE001 - delivered as any other record then, which tells its own errors
        return None
    plain = (
        type(stored) in (torch.Tensor, torch.nn.Parameter)
        and stored.layout == torch.strided
        and not stored.is_conj()  # torch.save keeps these bits: the bytes are not the values
        and not stored.is_neg()
        and stored.is_contiguous()
        and stored.storage_offset() == 0
        and storage.nbytes() == stored.nbytes
        and isinstance(offset := getattr(storage, "_checkpoint_offset", None), int)  # set for a meta map_location
    )
    return _Stored(stored.dtype, stored.size(), offset, storage.nbytes()) if plain else None


def _parsed_on_meta(parts: list[memoryview]) -> Any:
    """The object torch.save wrote in the record made of `parts`, parsed as torch.load (weights only) parses it,
    its tensors on the meta device (their storages say where their bytes are: `_checkpoint_offset`)."""
    reader = torch._C.PyTorchFileReader(RecordFile(parts))
    if not reader.has_record("byteorder") or reader.get_record("byteorder") != sys.byteorder.encode():
        raise ValueError("a record of another byte order")
    return torch.serialization._load(reader, "meta", torch._weights_only_unpickler, encoding="utf-8")


@functools.cache
def _offsets_known() -> bool:
    """Whether this torch's loader says where a tensor's bytes lie in its record (a meta map_location sets
    `_checkpoint_offset` on the storage); without it no record is read straight into a tensor."""
    saved = io.BytesIO()
    torch.save(torch.arange(4.0), saved)
    try:
        stored = _parsed_on_meta([saved.getbuffer()])
    except Exception:  # noqa: BLE001 - an older torch's private loader: the copying path then
        return False
    return isinstance(stored, torch.Tensor) and hasattr(stored.untyped_storage(), "_checkpoint_offset")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, writable."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class RecordFile(io.RawIOBase):
    """A seekable file whose bytes are `parts` one after the other, so that torch's loader reads a record from
    the memory it is already in."""

    def __init__(self, parts: list[memoryview]) -> None:
        super().__init__()
        self._parts = parts
        self._length = sum(len(p) for p in parts)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done, at = 0, 0
        for part in self._parts:
            if done == len(out):
                break
            if self._pos + done < at + len(part):
                begin = self._pos + done - at
                n = min(len(part) - begin, len(out) - done)
                _copy(out[done : done + n], part[begin : begin + n])
                done += n
            at += len(part)
        self._pos += done
        return done

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


_TORCH_COPY = 1 << 20


def _copy(out: memoryview, data: memoryview) -> None:
    if len(data) >= _TORCH_COPY:  # a torch copy: several threads, and the GIL released
        torch.frombuffer(out, dtype=torch.uint8).copy_(torch.frombuffer(data, dtype=torch.uint8))
    else:  # the zip's directory and small entries: a torch copy's release of the GIL would cost more
        out[:] = data
