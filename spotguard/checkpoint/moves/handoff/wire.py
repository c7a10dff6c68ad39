"""The handoff's wire: addresses, framing (a length, then JSON), shards as bytes, the idle timeout."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.io.checksums import crc32c_extend
from spotguard.job.departure import HandoffError

CHUNK = 4 << 20
IDLE_TIMEOUT_S = 10.0  # a peer silent this long is gone (a VM that vanished sends no FIN)
FRAME = struct.Struct("!Q")
MAX_FRAME = 64 << 20  # a header for many thousands of shards, never an unbounded read
MAX_HELLO = 4096
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


def describe(item: WriteItem, tensor: torch.Tensor) -> dict[str, Any]:
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


def bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def timeout_for(cutoff: Deadline) -> float:
    left = cutoff.left()
    return IDLE_TIMEOUT_S if left is None else max(0.01, min(IDLE_TIMEOUT_S, left))


def send_json(sock: socket.socket, obj: Any) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(FRAME.pack(len(body)) + body)


def recv_json(sock: socket.socket, cutoff: Deadline) -> dict[str, Any]:
    head = bytearray(FRAME.size)
    recv_into(sock, memoryview(head), cutoff)
    (length,) = FRAME.unpack(head)
    if length > MAX_FRAME:
        raise HandoffError(f"a {length}-byte frame is too large")
    body = bytearray(length)
    recv_into(sock, memoryview(body), cutoff)
    return json_object(body)


def json_object(body: bytes | bytearray) -> dict[str, Any]:
    value = json.loads(body)
    if not isinstance(value, dict):
        raise HandoffError("malformed frame")
    return value


def recv_into(sock: socket.socket, view: memoryview, cutoff: Deadline) -> str:
    """Fill `view` from `sock` by `cutoff`; returns the CRC32C of what arrived.

    The checksum runs once per CHUNK arrived (GB/s, in C), while the sender puts the next one on
    the wire: per-recv bookkeeping in Python would cost more than the bytes themselves, and one
    pass at the end would keep the sender waiting for it.
    """
    got = checked = crc = 0
    while got < len(view):
        if cutoff.passed():
            raise HandoffError("the deadline passed during the handoff")
        sock.settimeout(timeout_for(cutoff))  # a recv waits at most the idle time, never past the cutoff
        n = sock.recv_into(view[got : got + CHUNK])
        if n == 0:
            raise HandoffError(f"the connection closed after {got} of {len(view)} bytes")
        got += n
        if got - checked >= CHUNK or got == len(view):
            crc = crc32c_extend(crc, view[checked:got])
            checked = got
    return f"{crc:08x}"
