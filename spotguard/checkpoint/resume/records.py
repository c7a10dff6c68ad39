"""torch.save's records in a DCP shard file: which of them a load plan needs, where a tensor's bytes lie in
one, and torch's own parse of a record that confirms it (the readers trust no guess of their own)."""

from __future__ import annotations

import dataclasses
import functools
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from spotguard.checkpoint.errors import CheckpointError


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


def data_start(head: bytes | bytearray) -> int | None:
    """Where the bytes of torch.save's one storage (zip entry `<archive>/data/0`) begin, judged from the
    record's first bytes: after the local header of that name. A guess, which `stored` checks once the
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
class Stored:
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


def stored(parts: list[memoryview]) -> Stored | None:
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
    return Stored(stored.dtype, stored.size(), offset, storage.nbytes()) if plain else None


def _parsed_on_meta(parts: list[memoryview]) -> Any:
    """The object torch.save wrote in the record made of `parts`, parsed as torch.load (weights only) parses it,
    its tensors on the meta device (their storages say where their bytes are: `_checkpoint_offset`)."""
    reader = torch._C.PyTorchFileReader(RecordFile(parts))
    if not reader.has_record("byteorder") or reader.get_record("byteorder") != sys.byteorder.encode():
        raise ValueError("a record of another byte order")
    return torch.serialization._load(reader, "meta", torch._weights_only_unpickler, encoding="utf-8")


@functools.cache
def offsets_known() -> bool:
    """Whether this torch's loader says where a tensor's bytes lie in its record (a meta map_location sets
    `_checkpoint_offset` on the storage); without it no record is read straight into a tensor."""
    saved = io.BytesIO()
    torch.save(torch.arange(4.0), saved)
    try:
        stored = _parsed_on_meta([saved.getbuffer()])
    except Exception:  # noqa: BLE001 - an older torch's private loader: the copying path then
        return False
    return isinstance(stored, torch.Tensor) and hasattr(stored.untyped_storage(), "_checkpoint_offset")


def bytes_of(tensor: torch.Tensor) -> memoryview:
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
                copy_bytes(out[done : done + n], part[begin : begin + n])
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


def copy_bytes(out: memoryview, data: memoryview) -> None:
    """`data` into `out` (of its length)."""
    if len(data) >= _TORCH_COPY:  # a torch copy: several threads, and the GIL released
        torch.frombuffer(out, dtype=torch.uint8).copy_(torch.frombuffer(data, dtype=torch.uint8))
    else:  # the zip's directory and small entries: a torch copy's release of the GIL would cost more
        out[:] = data
