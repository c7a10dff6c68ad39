"""A few reusable host buffers that GPU state crosses through, and the copy stream that fills and drains them.

A save of GPU state copies each piece into a pool buffer on a side stream while the piece before
it is written from another buffer; a resume reads the next piece into one buffer while the piece
before it is copied to the GPU from another. Either way the transfer runs at the slower of the
copy and the disk, not their sum, and the host memory it takes is the pool's: `count` buffers of
`buffer_bytes` (BUFFER_BYTES, 32 MiB), allocated as first needed, pinned for a GPU (a pinned copy
runs at the link's full speed, asynchronously), made once per process and device and kept, since
pinning costs about 0.4 s per GB. Never a pinned copy of the whole state; no GPU memory.

On CPU the same code runs with ordinary buffers and a copy stream that copies at once (its tickets
are done when issued): the CPU tests drive the pipeline that runs on a GPU.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Protocol

import torch

BUFFER_BYTES = 32 << 20
IN_FLIGHT = 2  # per thread: the piece being copied and the one being written (or read)


class Ticket(Protocol):
    def synchronize(self) -> None: ...


class _Done:
    """The ticket of a copy that finished when it was issued (on CPU)."""

    def synchronize(self) -> None:
        pass


class CopyStream:
    """Copies between host buffers and a device, asynchronously on a side stream (CUDA), or at once (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def follow(self) -> None:
        """Order later copies after the work queued so far on the calling thread's current stream (the
        training stream: the writing threads have streams of their own)."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """Start `dst.copy_(src)`; the ticket's synchronize() returns once it is done."""
        if self._stream is None:
            dst.copy_(src)
            return _Done()
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event


class BouncePool:
    """Up to `count` host buffers of `buffer_bytes`, lent to one thread at a time (thread-safe)."""

    def __init__(self, device: torch.device, buffer_bytes: int = BUFFER_BYTES, count: int = 8) -> None:
        self.device = device
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.stream = CopyStream(device)
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lent = 0
        self._changed = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        return self._made * self.buffer_bytes

    @property
    def lent(self) -> int:
        """Buffers out now."""
        return self._lent

    def grow(self, count: int) -> None:
        """Allow up to `count` buffers (never fewer than now)."""
        with self._changed:
            self.count = max(self.count, count)
            self._changed.notify_all()

    def acquire(self) -> torch.Tensor:
        """A buffer, waiting for one to come back when all are out. Only a thread that holds none may wait:
        one that holds some uses `try_acquire`, so that the pool never deadlocks."""
        with self._changed:
            while (buffer := self._take()) is None:
                self._changed.wait()
            return buffer

    def try_acquire(self) -> torch.Tensor | None:
        with self._changed:
            return self._take()

    def release(self, buffer: torch.Tensor) -> None:
        with self._changed:
            self._free.append(buffer)
            self._lent -= 1
            self._changed.notify()

    def _take(self) -> torch.Tensor | None:
        if self._free:
            buffer = self._free.pop()
        elif self._made < self.count:
            pinned = self.device.type == "cuda"
            buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=pinned)
            self._made += 1
        else:
            return None
        self._lent += 1
        return buffer


_pools: dict[str, BouncePool] = {}
_pools_lock = threading.Lock()


def shared_pool(device: torch.device, count: int) -> BouncePool:
    """This process's pool for `device`, allowed `count` buffers at least (made at the first call)."""
    with _pools_lock:
        pool = _pools.get(str(device))
        if pool is None:
            pool = _pools[str(device)] = BouncePool(device, BUFFER_BYTES, count)
    pool.grow(count)
    return pool


def bounced(tensor: torch.Tensor) -> bool:
    """Whether a tensor crosses through the pool: it is not in host memory."""
    return tensor.device.type != "cpu"


def pool_for(tensors: list[torch.Tensor], count: int) -> BouncePool | None:
    """The shared pool of the device that `tensors` (those that cross, `bounced`) live on; None when none
    crosses, or when they live on several devices (a copy stream orders the copies of its own device only:
    such a state takes the plain path, DCP's copies)."""
    devices = {t.device for t in tensors if bounced(t)}
    return shared_pool(devices.pop(), count) if len(devices) == 1 else None


class Lease:
    """A pool buffer lent to a `Pipeline`, and the copies issued from or into it."""

    def __init__(self, buffer: torch.Tensor, nbytes: int) -> None:
        self.buffer = buffer
        self.nbytes = nbytes
        self.tickets: list[Ticket] = []

    def typed(self, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The first bytes of the buffer as a contiguous tensor of `dtype` and `shape`, whose storage is
        exactly its own bytes (so that torch.save writes those and no more)."""
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        return torch.frombuffer(self.buffer.numpy()[:nbytes], dtype=dtype).view(shape)

    def bytes(self) -> memoryview:
        return memoryview(self.buffer.numpy()[: self.nbytes])


class Pipeline:
    """One thread's copies through a pool: at most IN_FLIGHT leases out, retired in the order they were
    submitted (each waits for its copies, runs its `then`, and gives the buffer back).

    A save: take a lease, start its device-to-host copy, submit it with the write as `then`; the
    next lease taken retires the oldest, so piece k+1 is copied while piece k is written. A resume:
    read into a lease, start its host-to-device copy, submit; piece k+1 is read while k is copied.
    """

    def __init__(self, pool: BouncePool) -> None:
        self.pool = pool
        self._queue: collections.deque[tuple[Lease, Callable[[], None] | None]] = collections.deque()

    def lease(self, nbytes: int) -> Lease:
        if nbytes > self.pool.buffer_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.pool.buffer_bytes}-byte buffer")
        if len(self._queue) >= IN_FLIGHT:
            self.retire()
        while (buffer := self.pool.try_acquire() if self._queue else self.pool.acquire()) is None:
            self.retire()  # every buffer is out: this thread's oldest comes back first
        return Lease(buffer, nbytes)

    def copy(self, lease: Lease, dst: torch.Tensor, src: torch.Tensor) -> None:
        lease.tickets.append(self.pool.stream.copy(dst, src))

    def submit(self, lease: Lease, then: Callable[[], None] | None = None) -> None:
        self._queue.append((lease, then))

    def retire(self) -> None:
        lease, then = self._queue.popleft()
        try:
            for ticket in lease.tickets:
                ticket.synchronize()
            if then is not None:
                then()
        finally:
            self.pool.release(lease.buffer)

    def drain(self) -> None:
        """Retire every lease (the last writes done, or the last copies to the device finished)."""
        while self._queue:
            self.retire()

    def abandon(self, lease: Lease | None = None) -> None:
        """After a failure: wait for the copies in flight, then give every buffer back (`lease` too, one
        taken but not submitted) without running their `then`."""
        held = [lease] if lease is not None else []
        held += [queued for queued, _ in self._queue]
        self._queue.clear()
        failure = None
        for each in held:
            try:
                for ticket in each.tickets:
                    ticket.synchronize()
            except BaseException as exc:  # noqa: BLE001 - every buffer goes back first
                failure = failure or exc
            finally:
                self.pool.release(each.buffer)
        if failure is not None:
            raise failure
