"""Leaving ranks hand the shards that exist nowhere else to a survivor's memory, over TCP.

Each survivor that expects a handoff listens on the address it reaches the job's store
from, and publishes `host port token` in the store (`departure`). A leaving rank connects
and sends, in order: a JSON hello (token, rank, step), a JSON
header (one entry per shard: name, offsets, sizes, dtype, bytes), the bytes of each shard
in chunks, and a JSON trailer with each shard's CRC32C. The survivor checksums the bytes
as they arrive and answers `{"ok": true}` or why not; only then is the leaving rank free
to go. Nothing is pickled, and a connection without the token is dropped. Until its hello
proves it one of the expected senders, a connection costs the survivor no thread, a few
seconds at most and one of a few places; a failed accept() is survived.

The survivors' coordinator publishes the outcome of the save (`Departure.publish_outcome`), so
a leaving rank can tell the truth about a checkpoint it no longer takes part in.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard

from spotguard.checkpoint.departure import Departure, HandoffError, Mailbox
from spotguard.checkpoint.shard_io import crc32c_extend
from spotguard.checkpoint.transfer import Cutoff

log = logging.getLogger(__name__)

CHUNK = 4 << 20
IDLE_TIMEOUT_S = 10.0  # a peer silent this long is gone (a VM that vanished sends no FIN)
# A leaving rank sends its hello (a hundred bytes) as soon as it connects: this bounds the whole
# hello, whatever a peer's byte rate, so a stranger dripping bytes cannot keep a place.
HELLO_DEADLINE_S = 3.0
# Connections still owing their hello: a leaving rank needs one place for milliseconds, so a few
# per expected sender leave room for retries and probes; past the cap the oldest is dropped.
PENDING_HELLOS_MIN = 8
PENDING_HELLOS_PER_SENDER = 2
_POLL_S = 0.05  # how often the listener looks at the mailbox and the deadlines
# accept(2) out of descriptors or kernel memory: the connection stays queued and the listener
# readable, so pause rather than spin until some are given back.
_ACCEPT_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_EXHAUSTED_PAUSE_S = 0.05
# accept(2) errors of the one connection being taken (gone, refused by a filter), not of the listener.
_ACCEPT_CONNECTION_ERRORS = frozenset(
    {
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.EPERM,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENOPROTOOPT,
        errno.EOPNOTSUPP,
    }
)
# A live leaving rank reaches the agreed step with the survivors (the step's collectives keep them
# in lockstep) and connects within milliseconds of a survivor's address appearing; one that has not
# begun its handoff this long after the survivor started listening is gone (killed before its handoff).
START_GRACE_S = 15.0
_FRAME = struct.Struct("!Q")
_MAX_FRAME = 64 << 20  # a header for many thousands of shards, never an unbounded read
_MAX_HELLO = 4096
HOST_ENV = "SPOTGUARD_HANDOFF_HOST"


Shards = list[tuple[WriteItem, torch.Tensor]]


def advertised_host() -> str:
    """The address peers reach this host on: $SPOTGUARD_HANDOFF_HOST, else the local end of
    the route to the job's store host (a UDP connect sends nothing)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    peer = os.environ.get("MASTER_ADDR", "127.0.0.1")
    host = _route_to(peer)
    if ipaddress.ip_address(host).is_loopback and not _is_loopback(peer):
        # The store host is this very host (its name maps to 127.0.x.x in /etc/hosts): peers on
        # other hosts reach us on the default route's interface. TEST-NET: the probe sends nothing.
        host = _route_to("192.0.2.1")
    return host


def _route_to(peer: str) -> str:
    """The local address of the route to `peer` (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _is_loopback(host: str) -> bool:
    """A loopback address written as such (a host name that maps to 127.0.x.x here does not count)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# -- the sending side ---------------------------------------------------------------------


def send_shards(departure: Departure, rank: int, survivor: int, step: int, shards: Shards, cutoff: Cutoff) -> int:
    """Stream `shards` (on any device) to `survivor`; returns the bytes sent once the survivor vouched for them.

    A failure is also reported to the survivor through the store, so it stops waiting at once.
    """
    try:
        return _send(departure, rank, survivor, step, shards, cutoff)
    except Exception as exc:
        departure.report_failure(rank, f"{type(exc).__name__}: {exc}")
        raise


def _send(departure: Departure, rank: int, survivor: int, step: int, shards: Shards, cutoff: Cutoff) -> int:
    host, port, token = departure.address_of(survivor, cutoff.left() or IDLE_TIMEOUT_S)
    total = sum(t.numel() * t.element_size() for _, t in shards)
    with socket.create_connection((host, port), timeout=_timeout(cutoff)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_json(sock, {"token": token, "rank": rank, "step": step})
        _send_json(sock, {"shards": [_describe(item, tensor) for item, tensor in shards]})
        crcs = []
        for _, tensor in shards:
            view = _bytes_of(tensor.detach().to("cpu").contiguous())  # one shard on the host at a time
            crc = 0
            for start in range(0, len(view), CHUNK):
                if cutoff.passed():
                    raise HandoffError("the deadline passed during the handoff")
                sock.settimeout(_timeout(cutoff))  # sendall's timeout bounds the whole chunk
                sock.sendall(view[start : start + CHUNK])
                crc = crc32c_extend(crc, view[start : start + CHUNK])  # while the survivor takes the chunk in
            crcs.append(f"{crc:08x}")
        _send_json(sock, {"crc32c": crcs})
        sock.settimeout(_timeout(cutoff))
        answer = _recv_json(sock, cutoff)
    if not answer.get("ok"):
        raise HandoffError(f"rank {survivor} refused the handoff: {answer.get('error')}")
    return total


def _describe(item: WriteItem, tensor: torch.Tensor) -> dict[str, Any]:
    data = item.tensor_data
    return {
        "fqn": item.index.fqn,
        "offsets": list(data.chunk.offsets),
        "sizes": list(data.chunk.sizes),
        "size": list(data.size),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "requires_grad": bool(data.properties.requires_grad),
        "bytes": tensor.numel() * tensor.element_size(),
    }


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


# -- the receiving side -------------------------------------------------------------------


def sharded_nbytes(state: Mapping[str, Any]) -> int:
    """Bytes of this rank's shards of sharded tensors (DTensors with a Shard placement) in a user
    state: about what a leaving rank of the same layout hands over. Reads only tensor metadata, so
    any thread may call it while training runs."""
    total = 0
    for tensor in _tensors(state):
        if isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements):
            local = tensor._local_tensor
            total += local.numel() * local.element_size()
    return total


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, torch.nn.Module):
        yield from tree.parameters()
        yield from tree.buffers()
    elif isinstance(tree, torch.optim.Optimizer):
        for per_param in list(tree.state.values()):
            yield from _tensors(per_param)
    elif isinstance(tree, Mapping):
        for value in list(tree.values()):
            yield from _tensors(value)


class ReceivePool:
    """Memory for the shards a survivor is about to receive, touched before they arrive.

    Bytes received into fresh memory wait for the kernel to zero each page first (0.33 s per GB on
    the 2-core CI VM: a third of the handoff). A survivor learns at the agreement, while the training
    step in flight still runs, that shards will come; it touches this much memory then, on a thread
    of its own, and the handoff receives into it. Until the pool is ready, or once it is used up,
    the receiver allocates as before. A pool nothing takes from within `unused_s` (a handoff that
    began before it was ready) gives its memory back.
    """

    def __init__(self, nbytes: int, unused_s: float = 120.0) -> None:
        self.nbytes = nbytes
        self.used = 0
        self._memory: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._claimed = threading.Event()
        self._unused_s = unused_s
        threading.Thread(target=self._touch, name="spotguard-receive-pool", daemon=True).start()

    def _touch(self) -> None:
        try:
            memory = torch.zeros(self.nbytes, dtype=torch.uint8)  # every page written once
        except RuntimeError as exc:  # out of memory: the handoff allocates as it goes
            log.warning("could not set %.1f MB aside for the handoff: %s", self.nbytes / 1e6, exc)
            return
        with self._lock:
            self._memory = memory
        if not self._claimed.wait(self._unused_s):
            with self._lock:
                if not self._claimed.is_set():
                    self._memory = None

    def take(self, sizes: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor carved out of the pool, or None (not ready, or not enough left)."""
        nbytes = sizes.numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            if self._memory is None:
                return None
            self._claimed.set()
            start = -(-self.used // 64) * 64  # aligned for any dtype
            if start + nbytes > self.nbytes:
                return None
            self.used = start + nbytes
            return self._memory[start : start + nbytes].view(dtype).view(sizes)


class Receiver:
    """Takes the handoffs of `senders` on survivor `rank`: open it, then `collect()`. What the
    senders say through the store (`mailbox`) ends the wait for one that failed or holds nothing."""

    def __init__(
        self,
        departure: Departure,
        rank: int,
        senders: list[int],
        step: int,
        mailbox: Mailbox,
        pool: ReceivePool | None = None,
    ) -> None:
        self.departure = departure
        self.rank = rank
        self.senders = senders
        self.step = step
        self.mailbox = mailbox
        self.pool = pool
        self._token = secrets.token_hex(16)
        self._listener = socket.create_server((advertised_host(), 0))
        host, port = self._listener.getsockname()[:2]
        try:
            departure.publish_address(rank, host, port, self._token)
        except BaseException:
            self._listener.close()
            raise

    def collect(self, cutoff: Cutoff) -> Shards:
        """Every sender's shards, checksummed; HandoffError naming who failed and why."""
        results: dict[int, Shards | str] = {}
        started: set[int] = set()  # senders whose hello was good: from then on their connection tells
        lock = threading.Lock()
        give_up_at = time.monotonic() + START_GRACE_S

        def serve(conn: socket.socket, sender: int, step: Any) -> None:
            outcome = self._serve(conn, sender, step, cutoff)
            with lock:
                results.setdefault(sender, outcome)

        cap = max(PENDING_HELLOS_MIN, PENDING_HELLOS_PER_SENDER * len(self.senders))
        doorway = _Doorway(self._listener, cap)
        try:
            while len(results) < len(self.senders) and not cutoff.passed():
                for conn, hello in doorway.poll(min(_POLL_S, _timeout(cutoff))):
                    sender = self._sender_of(hello, started)
                    if sender is None:
                        doorway.refuse(conn)
                        continue
                    started.add(sender)
                    args = (conn, sender, hello.get("step"))
                    threading.Thread(target=serve, args=args, name="spotguard-handoff", daemon=True).start()
                with lock:  # every round: a flood of connections must not hide a sender's failure
                    self._note_failures(results, started, time.monotonic() > give_up_at)
        finally:
            doorway.close()
        with lock:
            outcomes = {r: results.get(r, "nothing arrived before the deadline") for r in self.senders}
        failed = {r: why for r, why in outcomes.items() if isinstance(why, str)}
        if failed:
            raise HandoffError("; ".join(f"from rank {r}: {why}" for r, why in sorted(failed.items())))
        return [shard for r in self.senders for shard in outcomes[r]]  # type: ignore[union-attr]

    def _sender_of(self, hello: dict[str, Any], started: set[int]) -> int | None:
        """The expected sender a hello proves itself to be, or None: no token, or one that is not
        expected or already connected (only the store's readers know the token: a bug, not a stranger)."""
        token, rank = hello.get("token"), hello.get("rank")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token.encode()):
            return None
        if type(rank) is not int or rank not in self.senders or rank in started:
            log.warning("refused a handoff from rank %r: expected once each from %s", rank, self.senders)
            return None
        return rank

    def _note_failures(self, results: dict[int, Shards | str], started: set[int], grace_over: bool) -> None:
        """Senders known to have failed without a word on the connection: they said so through the
        mailbox (a failure, or nothing to hand over), or never began within START_GRACE_S."""
        for sender in self.senders:
            if sender in results:
                continue
            if sender in self.mailbox.failed:
                results[sender] = f"it failed: {self.mailbox.failed[sender]}"
            elif self.mailbox.handing.get(sender) is False:
                results[sender] = "it says it holds nothing unique, but this survivor expected its shards"
            elif grace_over and sender not in started:
                results[sender] = f"it did not begin its handoff within {START_GRACE_S:.0f} s (gone before it?)"

    def _serve(self, conn: socket.socket, sender: int, step: Any, cutoff: Cutoff) -> Shards | str:
        """The rest of an admitted sender's handoff (header, shards, trailer), then the answer to it."""
        with conn:
            try:
                conn.settimeout(_timeout(cutoff))  # the hello was read without blocking
                if step != self.step:
                    raise HandoffError(f"it sent step {step}, not {self.step}")
                started = time.monotonic()
                shards = [_allocate(entry, self.pool) for entry in _recv_json(conn, cutoff)["shards"]]
                crcs = [_recv_into(conn, _bytes_of(tensor), cutoff) for _, tensor in shards]
                sent = _recv_json(conn, cutoff).get("crc32c")
                if sent != crcs:
                    raise HandoffError("the shards' CRC32C do not match what was sent")
                _send_json(conn, {"ok": True})
            except Exception as exc:  # noqa: BLE001 - reported per sender; the caller decides
                why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, HandoffError) else str(exc)
                try:
                    _send_json(conn, {"ok": False, "error": why})
                except OSError:
                    pass
                return why
        nbytes = sum(t.numel() * t.element_size() for _, t in shards)
        log.info(
            "received %d shards (%.1f MB) from leaving rank %d in %.2f s",
            len(shards),
            nbytes / 1e6,
            sender,
            time.monotonic() - started,
        )
        return shards


class _Hello:
    """A connection whose hello is still on its way, read as its bytes arrive, never blocking."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        conn.setblocking(False)
        self.conn = conn
        self.fd = conn.fileno()  # its key while it waits (a closed socket's fileno() is -1)
        self.deadline = deadline
        self._buf = bytearray()
        self._size = _FRAME.size  # the length prefix, then the whole frame

    def read(self) -> dict[str, Any] | None:
        """The hello once it is all in, None until then; raises on a closed connection or a
        malformed or oversized hello."""
        while len(self._buf) < self._size:
            try:
                data = self.conn.recv(self._size - len(self._buf))  # never past the hello
            except BlockingIOError:
                return None
            if not data:
                raise HandoffError("the connection closed before its hello")
            self._buf += data
            if len(self._buf) == _FRAME.size:
                (length,) = _FRAME.unpack(self._buf)
                if length > _MAX_HELLO:
                    raise HandoffError(f"a {length}-byte hello is too large")
                self._size += length
        return _json_object(self._buf[_FRAME.size :])


class _Doorway:
    """The listener and the connections still owing their hello, on one thread: at most `cap` wait,
    each HELLO_DEADLINE_S in all. Past the cap the oldest goes: whoever took the places first cannot
    lock out a sender that comes later (its hello arrives with its connection). A failed accept()
    (out of descriptors, a connection aborted before it was taken) is logged once per kind and survived.
    """

    def __init__(self, listener: socket.socket, cap: int) -> None:
        listener.setblocking(False)
        self._listener = listener
        self._cap = cap
        self._waiting: dict[int, _Hello] = {}  # by descriptor, oldest first: the deadlines come in this order
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._accept_errors: set[int | None] = set()  # the kinds already logged
        self._dropped = 0

    def poll(self, timeout_s: float) -> list[tuple[socket.socket, dict[str, Any]]]:
        """The connections whose hello came in within `timeout_s`, with it (yet to be checked)."""
        arrived = []
        for key, _ in self._selector.select(timeout_s):
            waiting = self._accept() if key.fileobj is self._listener else self._waiting.get(key.fd)
            if waiting is not None and (hello := self._read(waiting)) is not None:
                arrived.append((waiting.conn, hello))
        self._expire()
        return arrived

    def refuse(self, conn: socket.socket) -> None:
        """Close a connection whose hello was complete but not good."""
        conn.close()
        self._dropped += 1

    def close(self) -> None:
        for waiting in list(self._waiting.values()):
            self._drop(waiting)
        self._selector.close()
        self._listener.close()
        if self._dropped:
            log.warning("the handoff listener dropped %d connections without a good hello", self._dropped)

    def _accept(self) -> _Hello | None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:  # the connection went (reset) before it was taken
            return None
        except OSError as exc:
            if exc.errno not in _ACCEPT_EXHAUSTED | _ACCEPT_CONNECTION_ERRORS:
                raise  # the listener itself is broken
            self._survive(exc)
            return None
        if len(self._waiting) >= self._cap:
            self._drop(next(iter(self._waiting.values())))
        waiting = _Hello(conn, time.monotonic() + HELLO_DEADLINE_S)
        self._waiting[waiting.fd] = waiting
        self._selector.register(conn, selectors.EVENT_READ)
        return waiting  # read at once: a sender's hello usually came with its connection

    def _survive(self, exc: OSError) -> None:
        if exc.errno not in self._accept_errors:
            self._accept_errors.add(exc.errno)
            log.warning("the handoff listener could not accept a connection (%s); it goes on listening", exc)
        if exc.errno in _ACCEPT_EXHAUSTED:
            time.sleep(_ACCEPT_EXHAUSTED_PAUSE_S)

    def _read(self, waiting: _Hello) -> dict[str, Any] | None:
        try:
            hello = waiting.read()
        except Exception as exc:  # noqa: BLE001 - whatever a stranger sends, the listener goes on
            log.debug("dropped a handoff connection: %s", exc)
            self._drop(waiting)
            return None
        if hello is not None:
            self._release(waiting)
        return hello

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting and (oldest := next(iter(self._waiting.values()))).deadline <= now:
            self._drop(oldest)

    def _drop(self, waiting: _Hello) -> None:
        self._release(waiting)
        self.refuse(waiting.conn)

    def _release(self, waiting: _Hello) -> None:
        self._selector.unregister(waiting.conn)
        del self._waiting[waiting.fd]


def _allocate(entry: dict[str, Any], pool: ReceivePool | None) -> tuple[WriteItem, torch.Tensor]:
    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise HandoffError(f"unknown dtype {entry['dtype']!r}")
    offsets, sizes = torch.Size(entry["offsets"]), torch.Size(entry["sizes"])
    tensor = pool.take(sizes, dtype) if pool is not None else None
    if tensor is None:
        tensor = torch.empty(sizes, dtype=dtype)
    if tensor.numel() * tensor.element_size() != entry["bytes"]:
        raise HandoffError(f"{entry['fqn']}: {entry['bytes']} bytes do not make a {dtype} tensor of {list(sizes)}")
    item = WriteItem(
        index=MetadataIndex(str(entry["fqn"]), offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype, requires_grad=bool(entry.get("requires_grad"))),
            size=torch.Size(entry["size"]),
        ),
    )
    return item, tensor


# -- framing ---------------------------------------------------------------------------------


def _timeout(cutoff: Cutoff) -> float:
    left = cutoff.left()
    return IDLE_TIMEOUT_S if left is None else max(0.01, min(IDLE_TIMEOUT_S, left))


def _send_json(sock: socket.socket, obj: Any) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(_FRAME.pack(len(body)) + body)


def _recv_json(sock: socket.socket, cutoff: Cutoff) -> dict[str, Any]:
    head = bytearray(_FRAME.size)
    _recv_into(sock, memoryview(head), cutoff)
    (length,) = _FRAME.unpack(head)
    if length > _MAX_FRAME:
        raise HandoffError(f"a {length}-byte frame is too large")
    body = bytearray(length)
    _recv_into(sock, memoryview(body), cutoff)
    return _json_object(body)


def _json_object(body: bytes | bytearray) -> dict[str, Any]:
    value = json.loads(body)
    if not isinstance(value, dict):
        raise HandoffError("malformed frame")
    return value


def _recv_into(sock: socket.socket, view: memoryview, cutoff: Cutoff) -> str:
    """Fill `view` from `sock` by `cutoff`; returns the CRC32C of what arrived.

    The checksum runs once per CHUNK arrived (GB/s, in C), while the sender puts the next one on
    the wire: per-recv bookkeeping in Python would cost more than the bytes themselves, and one
    pass at the end would keep the sender waiting for it.
    """
    got = checked = crc = 0
    while got < len(view):
        if cutoff.passed():
            raise HandoffError("the deadline passed during the handoff")
        sock.settimeout(_timeout(cutoff))  # a recv waits at most the idle time, never past the cutoff
        n = sock.recv_into(view[got : got + CHUNK])
        if n == 0:
            raise HandoffError(f"the connection closed after {got} of {len(view)} bytes")
        got += n
        if got - checked >= CHUNK or got == len(view):
            crc = crc32c_extend(crc, view[checked:got])
            checked = got
    return f"{crc:08x}"
