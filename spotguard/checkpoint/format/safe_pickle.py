"""Read the pickles in a checkpoint without letting them run code.

DCP's `.metadata` is a pickle, and DCP's default planner loads every non-tensor value of
a state with `torch.load(weights_only=False)`: either would run whatever code the writer of
the checkpoint chose. Here `.metadata` goes through an unpickler that admits only the types
real DCP metadata holds and changes no object but those it creates, and non-tensor values
through `torch.load(weights_only=True)`. Both also admit what the user allowed with
`torch.serialization.add_safe_globals`. A `.metadata` whose chunks do not tile their tensors
(`untiled`) is refused too: DCP's load planner trusts them.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import pickletools
import re
from collections.abc import Callable
from typing import IO, Any, NoReturn

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from spotguard.checkpoint.format.chunk_grid import chunks_problem

_HINT = "to allow a type of your own: torch.serialization.add_safe_globals([...])"


class RefusedPickle(pickle.UnpicklingError):
    """A pickle in a checkpoint names a global that is not allowed, or is not what it should be."""


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _metadata_globals() -> dict[str, Any]:
    """Every global the `.metadata` of a real checkpoint refers to, by the name its pickle uses.

    Found by recording the globals in checkpoints of plain, DDP and FSDP2 (2 ranks) modules
    with Adam/AdamW/SGD state, an LR scheduler, and tensors and plain values of many kinds.
    A pickle may call any of them with arguments of its choosing, and no such call changes
    anything but the object it returns: the dataclasses' and torch.Size's constructors fill a
    new object, PosixPath's only parses its arguments, dtypes cannot be called, and the two
    lookups stand in for callables that can change more (see there).
    """
    dcp_types = (
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        _StorageInfo,
        torch.Size,
    )
    allowed = {_name(t): t for t in dcp_types}
    allowed.update({f"torch.{name}": v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})
    # How TensorProperties pickles its memory format: the Enum called with its value. Called with
    # more arguments, an Enum defines a new one; the lookup only finds a member.
    allowed[_name(_MEM_FORMAT_ENCODING)] = {m.value: m for m in _MEM_FORMAT_ENCODING}.__getitem__
    # How a torch.layout pickles. torch's _get_layout fills a cache kept on the function itself
    # (which torch.load reads too); the lookup gives the same layouts from a table of its own.
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    allowed["torch.serialization._get_layout"] = layouts.__getitem__
    # StorageMeta.checkpoint_id is the writer's path; Python 3.13 moved PosixPath to pathlib._local.
    allowed["pathlib.PosixPath"] = allowed["pathlib._local.PosixPath"] = pathlib.PosixPath
    return allowed


_METADATA_GLOBALS = _metadata_globals()


def _user_globals() -> dict[str, Any]:
    """What `torch.serialization.add_safe_globals` allowed (read on every use: it may grow).

    The user vouches for these: a pickle may call them as `torch.load(weights_only=True)` would.
    """
    allowed = {}
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, _name(entry))
        allowed[name] = obj
    return allowed


_Handler = Callable[["_MetadataUnpickler"], None]

_OPCODE_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}

# Opcodes that push a value, immutable or new, or move values between stack, memo and marks;
# GLOBAL and STACK_GLOBAL push what find_class gives.
_INERT = """
    PROTO FRAME STOP MARK POP POP_MARK MEMOIZE BINPUT LONG_BINPUT
    NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT
    STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8
    BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3
    GLOBAL STACK_GLOBAL
""".split()
# Opcodes that push a new list, dict or set, which later opcodes may fill (DICT: see the table).
_CONTAINERS = "EMPTY_LIST LIST EMPTY_DICT EMPTY_SET".split()
# Opcodes that push again a value pushed before (GET: see the table).
_REUSING = "DUP BINGET LONG_BINGET".split()

# The memo lets a pickle put one value in many others, and C code walks a value down every
# reference anew (hash, ==, repr, a copy): 60 tuples that each hold the one before twice take 120 to
# 240 bytes and expand to 2**60 nodes, and hashing the last (a dict key) runs in C, holding the GIL,
# for ever. Real DCP metadata reuses only strings, globals, dtypes, layouts and Enum members. So
# each reuse (GET, DUP) is charged what its value expands to beyond the one node the opcode pays
# for (a node per value, plus one per 8 bytes of a str or bytes and per 64 bits of an int), a value
# once reused may not change (a pickler fills a value before anything holds it), and a load is
# refused once its charges pass _REUSE_PER_BYTE per byte of pickle (plus _REUSE_BASE). What a load
# builds then expands to at most that much beyond its own opcodes, which bounds every walk of it, in
# the load and after. A value that is hashed (a dict key, a set member, what a function such as the
# lookups is called with) may expand to _HASHED_SIZE at most: hash() recurses in C with no depth
# check, and a million nested tuples crash the process.
_REUSE_PER_BYTE = 4
_REUSE_BASE = 1 << 16
_HASHED_SIZE = 1 << 12
# Keys of one hash make a dict or set compare each new one with all before it: k of them cost k**2/2
# comparisons (ints hash to themselves modulo 2**61 - 1, a MetadataIndex to its fqn's and offsets'
# hash: either can be chosen to collide). Real metadata has distinct hashes, so a dict or set may
# hold _KEYS_PER_HASH keys of one hash at most. The memo's keys are ints too: the index a PUT or GET
# names in decimal must be below _MEMO_INDICES, as BINPUT's 4 bytes are, where ints hash apart.
_KEYS_PER_HASH = 8
_MEMO_INDICES = 1 << 32
_LEAVES = {type, bool, float, type(None), torch.dtype, torch.layout, _MEM_FORMAT_ENCODING}  # hold nothing
# Refused, as DCP never writes them: INST and OBJ (calls of their own kind), PERSID and BINPERSID,
# EXT1/2/4 (copyreg's registry), NEXT_BUFFER and READONLY_BUFFER (out-of-band data).

_ABSENT = object()


def _code(opcode: str) -> int:
    return getattr(pickle, opcode)[0]


def _reusing(load: _Handler) -> _Handler:
    """`load`, which pushes again a value pushed before: charged what it expands to."""

    def reuse(self: _MetadataUnpickler) -> None:
        load(self)
        value = self.stack[-1]
        kind = type(value)
        if (kind is str and len(value) < 8) or kind in _LEAVES:  # most reuses (no more than their node)
            return
        self._left -= self._expanded(value, self._left + 1, reused=True) - 1
        if self._left < 0:
            raise RefusedPickle(
                f"refused to unpickle: values reused from the memo expand to more than {_REUSE_PER_BYTE} nodes a byte"
            )

    return reuse


def _hashing(load: _Handler, opcode: str, hashed: slice) -> _Handler:
    """`load`, which builds a new dict or frozenset of the items above the mark and hashes those in `hashed`."""

    def build(self: _MetadataUnpickler) -> None:
        self._hashed(self.stack[hashed], opcode)
        load(self)

    return build


def _creating(load: _Handler) -> _Handler:
    """`load`, which pushes a container, and that container counts as one this load created."""

    def create(self: _MetadataUnpickler) -> None:
        load(self)
        self._created(self.stack[-1])

    return create


class _OpcodeTable(dict[int, _Handler]):
    def __missing__(self, code: int) -> NoReturn:
        name = _OPCODE_NAMES.get(code, repr(bytes([code])))
        raise RefusedPickle(f"refused to unpickle: opcode {name} is not one DCP metadata is written with")


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles with nothing but the allowed globals, and changes no object it did not create.

    Allowing only some globals is not enough. BUILD sets attributes on whatever lies under its
    state: an allowed class or function itself (BUILD on `pathlib.PosixPath` can replace
    `PosixPath.parent` in the whole process) or a shared object a call returned (an Enum member);
    SETITEM(S), APPEND(S) and ADDITEMS change whatever they are given just the same, and all
    of it stays changed when the load is refused afterwards. The C unpickler cannot be told to
    check any of that, so this is the pure-Python one with an opcode table of its own: opcodes
    that change an object accept only one this load created (a container an opcode pushed, or
    an instance `object.__new__` allocated), opcodes that call accept only what find_class
    gave, and opcodes DCP never writes are refused. Values reused from the memo are charged what
    they expand to, so that no walk of what it builds can take long (see _REUSE_PER_BYTE).
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        # By id, holding each object: no id is reused by a new object while the load runs.
        self._found: dict[int, tuple[Any, str]] = {}
        self._made: dict[int, Any] = {}
        self._done: set[int] = set()  # of those made, the ones that may not change any more
        self._left = _REUSE_PER_BYTE * len(data) + _REUSE_BASE  # what reuses may still add
        self._keys: dict[int, dict[int, int]] = {}  # id of a dict or set filled -> its keys by hash

    def find_class(self, module: str, name: str) -> Any:
        # Looked up by name, never imported: importing a module can run code too.
        full = f"{module}.{name}"
        allowed = {**_user_globals(), **_METADATA_GLOBALS}.get(full)
        if allowed is None:
            raise RefusedPickle(f"refused to unpickle global {full} (not a DCP metadata type; {_HINT})")
        self._found[id(allowed)] = (allowed, full)
        return allowed

    def _created(self, obj: Any) -> None:
        self._made[id(obj)] = obj

    def _is_found(self, obj: Any) -> bool:
        found = self._found.get(id(obj))
        return found is not None and found[0] is obj

    def _describe(self, obj: Any) -> str:
        return self._found[id(obj)][1] if self._is_found(obj) else f"a {_name(type(obj))}"

    def _may_change(self, obj: Any, opcode: str) -> None:
        if self._made.get(id(obj), _ABSENT) is not obj:
            raise RefusedPickle(
                f"refused to unpickle: {opcode} would change {self._describe(obj)}, which this pickle did not create"
            )
        if id(obj) in self._done:
            raise RefusedPickle(
                f"refused to unpickle: {opcode} would change {self._describe(obj)} once reused or built"
            )

    def _expanded(self, value: Any, limit: int, *, reused: bool = False) -> int:
        """What `value` expands to (see _REUSE_PER_BYTE), counted until it passes `limit`. When it is
        `reused`, what it holds may not change any more: the change would not be charged."""
        size, pending = 0, [value]
        while pending and size <= limit:
            obj = pending.pop()
            size += 1
            if isinstance(obj, (str, bytes, bytearray)):
                size += len(obj) >> 3
            elif isinstance(obj, int):
                size += obj.bit_length() >> 6
            elif isinstance(obj, pathlib.PurePath):
                size += len(str(obj)) >> 3
            elif type(obj) not in _LEAVES and not self._is_found(obj):
                if isinstance(obj, dict):
                    pending += obj.keys()
                    pending += obj.values()
                elif isinstance(obj, (tuple, list, set, frozenset)):
                    pending += obj
                elif hasattr(obj, "__dict__"):  # an instance this load made or called into being
                    pending += vars(obj).values()
                if reused and self._made.get(id(obj), _ABSENT) is obj:
                    self._done.add(id(obj))
        return size

    def _hashed(self, values: list[Any], opcode: str, into: Any = None) -> None:
        """Check `values` before `opcode` hashes them as keys of the dict or set `into` (None: a new one)."""
        keys = {} if into is None else self._keys.setdefault(id(into), {})
        for value in values:  # a str caches its hash, and holds nothing
            if type(value) is not str and self._expanded(value, _HASHED_SIZE) > _HASHED_SIZE:
                raise RefusedPickle(
                    f"refused to unpickle: {opcode} would hash a value that expands to more than {_HASHED_SIZE} nodes"
                )
            h = hash(value)  # counted by it (hashes that collide in `keys` differ by 2**61 - 1: a few at most)
            keys[h] = keys.get(h, 0) + 1
            if keys[h] > _KEYS_PER_HASH:
                raise RefusedPickle(
                    f"refused to unpickle: {opcode} would put more than {_KEYS_PER_HASH} keys of one hash"
                    " in a dict or set"
                )

    def _may_call(self, obj: Any, opcode: str) -> Any:
        if not self._is_found(obj):
            raise RefusedPickle(
                f"refused to unpickle: {opcode} would call {self._describe(obj)}, not an allowed global"
            )
        return obj

    def load_build(self) -> None:
        inst = self.stack[-2]
        self._may_change(inst, "BUILD")
        super().load_build()
        # A pickler writes an object's BUILD last; after it, an attribute it set could stand in for a
        # method that a later BUILD or APPEND would call (a lookup as __setstate__ or append, hashing).
        self._done.add(id(inst))

    def load_append(self) -> None:
        self._may_change(self.stack[-2], "APPEND")
        super().load_append()

    def load_setitem(self) -> None:
        self._hashed(self.stack[-2:-1], "SETITEM", self.stack[-3])
        self._may_change(self.stack[-3], "SETITEM")
        super().load_setitem()

    # These three change the object under their mark.
    def load_appends(self) -> None:
        self._may_change(self.metastack[-1][-1], "APPENDS")
        super().load_appends()

    def load_setitems(self) -> None:
        self._hashed(self.stack[::2], "SETITEMS", self.metastack[-1][-1])
        self._may_change(self.metastack[-1][-1], "SETITEMS")
        super().load_setitems()

    def load_additems(self) -> None:
        self._hashed(self.stack, "ADDITEMS", self.metastack[-1][-1])
        self._may_change(self.metastack[-1][-1], "ADDITEMS")
        super().load_additems()

    def load_reduce(self) -> None:
        if not isinstance(self._may_call(self.stack[-2], "REDUCE"), type):
            self._hashed(self.stack[-1:], "REDUCE")  # a function may hash its arguments (the lookups do)
        super().load_reduce()  # what it returns may be shared (an Enum member): not created here

    def load_newobj(self) -> None:
        self._new(self._may_call(self.stack[-2], "NEWOBJ"), super().load_newobj)

    def load_newobj_ex(self) -> None:
        self._new(self._may_call(self.stack[-3], "NEWOBJ_EX"), super().load_newobj_ex)

    def load_put(self) -> None:
        self.memo[self._memo_index()] = self.stack[-1]

    def load_get(self) -> None:
        self.append(self.memo[self._memo_index()])

    def _memo_index(self) -> int:
        index = int(self.readline()[:-1])
        if not 0 <= index < _MEMO_INDICES:
            raise RefusedPickle(f"refused to unpickle: a memo index not below {_MEMO_INDICES} (PUT or GET)")
        return index

    def _new(self, cls: Any, load: Callable[[], None]) -> None:
        load()
        # object.__new__ always allocates; any other __new__ may return a shared object (an Enum's does).
        if isinstance(cls, type) and cls.__new__ is object.__new__:
            self._created(self.stack[-1])

    dispatch = _OpcodeTable(
        {_code(op): pickle._Unpickler.dispatch[_code(op)] for op in _INERT}
        | {_code(op): _creating(pickle._Unpickler.dispatch[_code(op)]) for op in _CONTAINERS}
        | {_code(op): _reusing(pickle._Unpickler.dispatch[_code(op)]) for op in _REUSING}
        | {
            pickle.DICT[0]: _creating(_hashing(pickle._Unpickler.load_dict, "DICT", slice(0, None, 2))),
            pickle.FROZENSET[0]: _hashing(pickle._Unpickler.load_frozenset, "FROZENSET", slice(None)),
            pickle.BUILD[0]: load_build,
            pickle.APPEND[0]: load_append,
            pickle.SETITEM[0]: load_setitem,
            pickle.APPENDS[0]: load_appends,
            pickle.SETITEMS[0]: load_setitems,
            pickle.ADDITEMS[0]: load_additems,
            pickle.REDUCE[0]: load_reduce,
            pickle.NEWOBJ[0]: load_newobj,
            pickle.NEWOBJ_EX[0]: load_newobj_ex,
            pickle.PUT[0]: load_put,
            pickle.GET[0]: _reusing(load_get),
        }
    )


def load_metadata(data: bytes) -> Metadata:
    """DCP's `.metadata` from its bytes, unpickled with nothing but the allowed globals, its chunks
    tiling each tensor (`untiled`)."""
    try:
        metadata = _MetadataUnpickler(data).load()
        if not isinstance(metadata, Metadata):
            raise RefusedPickle(f"DCP metadata unpickles to a {type(metadata).__name__}, not a Metadata")
        why = untiled(metadata)
    except RefusedPickle:
        raise
    except Exception as exc:  # a pickle that only uses allowed globals can still be garbage (chunks of strs)
        raise RefusedPickle(f"unreadable DCP metadata: {type(exc).__name__}: {exc}") from None
    if why:
        raise RefusedPickle(f"DCP metadata refused: {why}")
    return metadata


def untiled(metadata: Metadata, *, whole: bool = True) -> str | None:
    """Why the chunks of a tensor of `metadata` do not tile it ("fqn: why"); None when they do.

    Each chunk must lie inside its tensor and overlap no other; with `whole` (the chunks of every
    rank) they must also cover it. DCP's save planner checks the same of what it writes; its load
    planner reads the chunks as they are, so that overlapping ones would load shifted data and leave
    what they miss as it was.
    """
    for fqn, value in metadata.state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            why = chunks_problem(value.size, value.chunks, whole=whole)
            if why:
                return f"{fqn}: {why}"
    return None


def load_value(stream: IO[bytes], fqn: str) -> Any:
    """A non-tensor value DCP stored with torch.save, loaded with torch's weights-only unpickler."""
    try:
        return torch.load(stream, weights_only=True)
    except Exception as exc:
        stream.seek(0)
        try:
            refused = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
        except Exception:  # not even a torch.save file: the load's own error says enough
            refused = []
        if refused:
            raise RefusedPickle(f"{fqn}: refused to unpickle global {', '.join(refused)} ({_HINT})") from None
        raise RefusedPickle(f"{fqn}: not loadable with weights_only=True: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    """The gist of torch's several-paragraph weights-only error (the whole message otherwise)."""
    text = str(exc)
    gist = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?:\n\n|$)", text, re.DOTALL)
    return " ".join((gist.group(1) if gist else text).split())


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are loaded with `load_value`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_value(value, fqn)
        # Where DefaultLoadPlanner.load_bytes puts the value it loads with weights_only=False.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
