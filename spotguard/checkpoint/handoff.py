"""Leaving ranks hand the shards that exist nowhere else to a survivor's memory, over TCP.

Each survivor that expects a handoff listens on the address it reaches the job's store
from, and publishes `host port token` in the store (`departure`). A leaving rank connects
and sends, in order: a JSON hello (token, rank, step), a JSON
header (one entry per shard: name, offsets, sizes, dtype, bytes), the bytes of each shard
in chunks, and a JSON trailer with each shard's CRC32C. The survivor checksums the bytes
as they arrive and answers `{"ok": true}` or why not; only then is the leaving rank free
to go. Nothing is pickled, and a connection without the token is dropped.

The survivors' coordinator publishes the outcome of the save (`Departure.publish_outcome`), so
a leaving rank can tell the truth about a checkpoint it no longer takes part in.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
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
HELLO_TIMEOUT_S = 2.0
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

        def began(sender: int) -> None:
            with lock:
                started.add(sender)

        def serve(conn: socket.socket) -> None:
            sender, outcome = self._serve(conn, cutoff, began)
            if sender is not None:
                with lock:
                    results.setdefault(sender, outcome)

        try:
            while len(results) < len(self.senders) and not cutoff.passed():
                self._listener.settimeout(min(0.05, _timeout(cutoff)))
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    with lock:
                        self._note_failures(results, started, time.monotonic() > give_up_at)
                    continue
                threading.Thread(target=serve, args=(conn,), name="spotguard-handoff", daemon=True).start()
        finally:
            self._listener.close()
        with lock:
            outcomes = {r: results.get(r, "nothing arrived before the deadline") for r in self.senders}
        failed = {r: why for r, why in outcomes.items() if isinstance(why, str)}
        if failed:
            raise HandoffError("; ".join(f"from rank {r}: {why}" for r, why in sorted(failed.items())))
        return [shard for r in self.senders for shard in outcomes[r]]  # type: ignore[union-attr]

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

    def _serve(
        self, conn: socket.socket, cutoff: Cutoff, on_start: Callable[[int], None]
    ) -> tuple[int | None, Shards | str]:
        sender = None
        with conn:
            try:
                # Small and quick until the token is checked: strangers cost little and go soon.
                hello = _recv_json(conn, cutoff, limit=_MAX_HELLO, idle_s=HELLO_TIMEOUT_S)
                if hello.get("token") != self._token or hello.get("rank") not in self.senders:
                    return None, "a connection without the right token"
                sender = int(hello["rank"])
                on_start(sender)
                if hello.get("step") != self.step:
                    raise HandoffError(f"it sent step {hello.get('step')}, not {self.step}")
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
                return sender, why
        nbytes = sum(t.numel() * t.element_size() for _, t in shards)
        log.info(
            "received %d shards (%.1f MB) from leaving rank %d in %.2f s",
            len(shards),
            nbytes / 1e6,
            sender,
            time.monotonic() - started,
        )
        return sender, shards


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


def _timeout(cutoff: Cutoff, idle_s: float = IDLE_TIMEOUT_S) -> float:
    left = cutoff.left()
    return idle_s if left is None else max(0.01, min(idle_s, left))


def _send_json(sock: socket.socket, obj: Any) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(_FRAME.pack(len(body)) + body)


def _recv_json(
    sock: socket.socket, cutoff: Cutoff, limit: int = _MAX_FRAME, idle_s: float = IDLE_TIMEOUT_S
) -> dict[str, Any]:
    head = bytearray(_FRAME.size)
    _recv_into(sock, memoryview(head), cutoff, idle_s)
    (length,) = _FRAME.unpack(head)
    if length > limit:
        raise HandoffError(f"a {length}-byte frame is too large")
    body = bytearray(length)
    _recv_into(sock, memoryview(body), cutoff, idle_s)
    value = json.loads(body)
    if not isinstance(value, dict):
        raise HandoffError("malformed frame")
    return value


def _recv_into(sock: socket.socket, view: memoryview, cutoff: Cutoff, idle_s: float = IDLE_TIMEOUT_S) -> str:
    """Fill `view` from `sock` by `cutoff`; returns the CRC32C of what arrived.

    The checksum runs once per CHUNK arrived (GB/s, in C), while the sender puts the next one on
    the wire: per-recv bookkeeping in Python would cost more than the bytes themselves, and one
    pass at the end would keep the sender waiting for it.
    """
    got = checked = crc = 0
    while got < len(view):
        if cutoff.passed():
            raise HandoffError("the deadline passed during the handoff")
        sock.settimeout(_timeout(cutoff, idle_s))  # a recv waits at most the idle time, never past the cutoff
        n = sock.recv_into(view[got : got + CHUNK])
        if n == 0:
            raise HandoffError(f"the connection closed after {got} of {len(view)} bytes")
        got += n
        if got - checked >= CHUNK or got == len(view):
            crc = crc32c_extend(crc, view[checked:got])
            checked = got
    return f"{crc:08x}"
