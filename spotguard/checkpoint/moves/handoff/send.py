"""The leaving rank's side: stream its shards to a survivor, and wait for the survivor to vouch for them."""

from __future__ import annotations

import socket

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.io.checksums import crc32c_extend
from spotguard.checkpoint.moves.handoff.wire import (
    CHUNK,
    IDLE_TIMEOUT_S,
    Shards,
    bytes_of,
    describe,
    recv_json,
    send_json,
    timeout_for,
)
from spotguard.job.departure import Departure, HandoffError


def send_shards(departure: Departure, rank: int, survivor: int, step: int, shards: Shards, cutoff: Deadline) -> int:
    """Stream `shards` (on any device) to `survivor`; returns the bytes sent once the survivor vouched for them.

    A failure is also reported to the survivor through the store, so it stops waiting at once.
    """
    try:
        return _send(departure, rank, survivor, step, shards, cutoff)
    except Exception as exc:
        departure.report_failure(rank, f"{type(exc).__name__}: {exc}")
        raise


def _send(departure: Departure, rank: int, survivor: int, step: int, shards: Shards, cutoff: Deadline) -> int:
    host, port, token = departure.address_of(survivor, cutoff.left() or IDLE_TIMEOUT_S)
    total = sum(t.numel() * t.element_size() for _, t in shards)
    with socket.create_connection((host, port), timeout=timeout_for(cutoff)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_json(sock, {"token": token, "rank": rank, "step": step})
        send_json(sock, {"shards": [describe(item, tensor) for item, tensor in shards]})
        crcs = []
        for _, tensor in shards:
            view = bytes_of(tensor.detach().to("cpu").contiguous())  # one shard on the host at a time
            crc = 0
            for start in range(0, len(view), CHUNK):
                if cutoff.passed():
                    raise HandoffError("the deadline passed during the handoff")
                sock.settimeout(timeout_for(cutoff))  # sendall's timeout bounds the whole chunk
                sock.sendall(view[start : start + CHUNK])
                crc = crc32c_extend(crc, view[start : start + CHUNK])  # while the survivor takes the chunk in
            crcs.append(f"{crc:08x}")
        send_json(sock, {"crc32c": crcs})
        sock.settimeout(timeout_for(cutoff))
        answer = recv_json(sock, cutoff)
    if not answer.get("ok"):
        raise HandoffError(f"rank {survivor} refused the handoff: {answer.get('error')}")
    return total
