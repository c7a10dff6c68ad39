"""The survivor's side: memory set aside for what comes, and the receiver that admits the expected
senders, takes their shards in and checks them."""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.moves.handoff.doorway import PENDING_HELLOS_MIN, PENDING_HELLOS_PER_SENDER, Doorway
from spotguard.checkpoint.moves.handoff.wire import (
    Shards,
    advertised_host,
    bytes_of,
    recv_into,
    recv_json,
    send_json,
    timeout_for,
)
from spotguard.job.departure import Departure, HandoffError, Mailbox

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often the listener looks at the mailbox and the deadlines
# A live leaving rank reaches the agreed step with the survivors (the step's collectives keep them
# in lockstep) and connects within milliseconds of a survivor's address appearing; one that has not
# begun its handoff this long after the survivor started listening is gone (killed before its handoff).
START_GRACE_S = 15.0


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

    Bytes received into fresh memory wait for the kernel to zero each page first (about a third
    of the handoff's time on the 2-core CI VM before this pool; docs/benchmarks.md, survivors). A
    survivor learns at the agreement, while the training step in flight still runs, that shards
    will come; it touches this much memory then, on a thread of its own, and the handoff receives
    into it. Until the pool is ready, or once it is used up,
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

    def collect(self, cutoff: Deadline) -> Shards:
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
        doorway = Doorway(self._listener, cap)
        try:
            while len(results) < len(self.senders) and not cutoff.passed():
                for conn, hello in doorway.poll(min(_POLL_S, timeout_for(cutoff))):
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

    def _serve(self, conn: socket.socket, sender: int, step: Any, cutoff: Deadline) -> Shards | str:
        """The rest of an admitted sender's handoff (header, shards, trailer), then the answer to it."""
        with conn:
            try:
                conn.settimeout(timeout_for(cutoff))  # the hello was read without blocking
                if step != self.step:
                    raise HandoffError(f"it sent step {step}, not {self.step}")
                started = time.monotonic()
                shards = [_allocate(entry, self.pool) for entry in recv_json(conn, cutoff)["shards"]]
                crcs = [recv_into(conn, bytes_of(tensor), cutoff) for _, tensor in shards]
                sent = recv_json(conn, cutoff).get("crc32c")
                if sent != crcs:
                    raise HandoffError("the shards' CRC32C do not match what was sent")
                send_json(conn, {"ok": True})
            except Exception as exc:  # noqa: BLE001 - reported per sender; the caller decides
                why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, HandoffError) else str(exc)
                try:
                    send_json(conn, {"ok": False, "error": why})
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
