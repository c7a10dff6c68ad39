"""Snapshot files between nodes: every rank serves its node's directory; replicas go in, shards come out.

The wire is the handoff's (`spotguard.checkpoint.moves.handoff.wire`): a length-prefixed JSON frame,
then raw bytes. A request names its op (`put`: take a replica in; `info`: send a file's trailer;
`get`: send runs of a file's body) and carries the server's token, which only the job's store
hands out (`host port token` under the rank's key), so only the job's own ranks are served. Bytes
go out with sendfile (no copy through Python). A replica that comes in goes straight into the
mapped pages of a `.part` file (a freed snapshot's when there is one), its blocks' CRC32Cs computed
as it arrives, and the file takes its final name only once they match its trailer: a replica is
complete or absent. What a resuming rank reads (`PeerRuns`) is checked block by block by the reader.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
from pathlib import Path
from typing import Any, BinaryIO

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.moves.handoff.doorway import Doorway
from spotguard.checkpoint.moves.handoff.wire import (
    CHUNK,
    IDLE_TIMEOUT_S,
    advertised_host,
    recv_into,
    recv_json,
    send_json,
)
from spotguard.job.departure import HandoffError
from spotguard.snapshots import shard_file
from spotguard.snapshots.node_dir import NodeDir
from spotguard.snapshots.shard_file import ShardInfo, SnapshotError

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often the server looks whether it was closed
MAX_CONNECTIONS = 64  # transfers served at once; a node's peers are its buddies and a few fetching ranks
# Connections still owing their request (the doorway's cap, each HELLO_DEADLINE_S at most). The handoff
# knows its senders and keeps 2 places each; this server does not know who will fetch on resume, so it
# keeps as many as it serves. A real request comes with its connection and waits milliseconds: a flood
# would need this many new connections within them to push one out, and strangers hold no more descriptors.
_PENDING_REQUESTS = MAX_CONNECTIONS


class PeerServer:
    """A thread that takes replicas into `node_dir` and hands out the snapshot files there."""

    def __init__(self, node_dir: NodeDir) -> None:
        self.node_dir = node_dir
        self.token = secrets.token_hex(16)
        self._sock = socket.create_server((advertised_host(), 0))
        self._doorway = Doorway(self._sock, _PENDING_REQUESTS, "the snapshot peer server")
        self._stopped = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._handlers: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._serve, name="spotguard-snapshot-peers", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """`host port token`: what a peer needs (published in the job's store)."""
        host, port = self._sock.getsockname()[:2]
        return f"{host} {port} {self.token}"

    def close(self, wait: bool = True) -> None:
        """Stop taking connections; with `wait`, let the transfers under way end (each within the idle
        timeout) first."""
        self._stopped.set()
        self._thread.join(timeout=5)
        self._sock.close()
        for handler in list(self._handlers) if wait else ():
            handler.join(timeout=IDLE_TIMEOUT_S)

    def _serve(self) -> None:
        """The doorway's thread: a connection takes a place (a slot, a handler) only once its whole
        request is in, within HELLO_DEADLINE_S, and carries the token."""
        try:
            while not self._stopped.is_set():
                for conn, request in self._doorway.poll(_POLL_S):
                    self._admit(conn, request)
        except Exception:  # noqa: BLE001 - the listener itself broke: peers then fail over to other copies
            log.exception("the snapshot peer server stopped")
        finally:
            self._doorway.close()

    def _admit(self, conn: socket.socket, request: dict[str, Any]) -> None:
        token = request.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            self._refuse(conn, "HandoffError: a wrong token")
        elif not self._slots.acquire(blocking=False):  # a flood: the job's own peers are a handful
            self._refuse(conn, f"HandoffError: busy ({MAX_CONNECTIONS} transfers under way)")
        else:
            handler = threading.Thread(target=self._handle, args=(conn, request), daemon=True)
            self._handlers.add(handler)
            try:
                handler.start()
            except RuntimeError as exc:  # no thread to be had: the place is given back
                self._handlers.discard(handler)
                self._slots.release()
                self._refuse(conn, f"HandoffError: busy ({exc})")

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Say why without waiting (the socket is non-blocking, the answer fits its empty buffer), then close."""
        try:
            send_json(conn, {"ok": False, "error": why})
        except OSError:
            pass
        self._doorway.refuse(conn)

    def _handle(self, conn: socket.socket, request: dict[str, Any]) -> None:
        try:
            self._serve_one(conn, request)
        finally:
            self._slots.release()
            self._handlers.discard(threading.current_thread())

    def _serve_one(self, conn: socket.socket, request: dict[str, Any]) -> None:
        with conn:
            try:
                conn.settimeout(IDLE_TIMEOUT_S)  # the request was read without blocking
                if request.get("op") == "put":
                    self._take(conn, request)
                elif request.get("op") == "info":
                    self._give_trailer(conn, request)
                elif request.get("op") == "get":
                    self._give_runs(conn, request)
                else:
                    raise HandoffError(f"unknown op {request.get('op')!r}")
            except (OSError, ValueError, KeyError, TypeError, HandoffError, SnapshotError) as exc:
                log.warning("snapshot peer request refused: %s: %s", type(exc).__name__, exc)
                try:
                    send_json(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                except OSError:
                    pass

    def _take(self, conn: socket.socket, request: dict[str, Any]) -> None:
        path = self.node_dir.prepare(str(request["name"]))
        receive_file(conn, path, int(request["bytes"]), int(request["body_bytes"]), self.node_dir)
        send_json(conn, {"ok": True})

    def _give_trailer(self, conn: socket.socket, request: dict[str, Any]) -> None:
        with open(self.node_dir.file(str(request["name"])), "rb") as f:  # FileNotFoundError: refused
            size, info = _opened(f)
            send_json(conn, {"ok": True, "bytes": size - info.body_bytes})
            conn.sendfile(f, info.body_bytes)

    def _give_runs(self, conn: socket.socket, request: dict[str, Any]) -> None:
        """The runs come in a frame of their own, once the request is admitted: a resume at another world
        size can ask for thousands, more than an admission frame holds."""
        with open(self.node_dir.file(str(request["name"])), "rb") as f:
            _, info = _opened(f)
            runs = [(int(start), int(length)) for start, length in recv_json(conn, Deadline())["runs"]]
            if any(start < 0 or length < 0 or start + length > info.body_bytes for start, length in runs):
                raise SnapshotError(f"runs outside the body of {info.body_bytes} bytes")
            send_json(conn, {"ok": True})
            for start, length in runs:
                if length:
                    conn.sendfile(f, start, length)


def receive_file(sock: socket.socket, path: Path, size: int, body_bytes: int, node_dir: NodeDir) -> ShardInfo:
    """Write the `size` bytes that come on `sock` to `path`: straight into the file's mapped pages (a
    spare's when the node has one, reserved before the first byte is taken, and mapped at once: a
    fault per page cost about 0.3 s of CPU per GiB), renamed into place only once the body's block
    CRC32Cs, computed as it arrives, match the trailer's."""
    part = path.with_name(path.name + ".part")
    fd = shard_file.reserve(part, size, node_dir.take_spare)  # no room: refused now, never a SIGBUS
    try:
        crcs, got = shard_file.BlockCrcs(), 0
        with shard_file.map_populated(fd, size) as mapped:
            view = memoryview(mapped)
            try:
                while got < size:
                    n = sock.recv_into(view[got : min(size, got + CHUNK)])
                    if n == 0:
                        raise HandoffError(f"the connection closed after {got} of {size} bytes")
                    if got < body_bytes:
                        crcs.update(view[got : min(got + n, body_bytes)])
                    got += n
            finally:
                view.release()
        os.close(fd)
        fd = -1
        info = shard_file.read_info(part)
        if info.body_bytes != body_bytes or info.block_bytes != crcs.block_bytes or crcs.finish() != info.blocks:
            raise SnapshotError(f"{path.name}: the CRC32Cs of what arrived do not match its trailer's")
        os.replace(part, path)
        return info
    except BaseException:
        if fd >= 0:
            os.close(fd)
        part.unlink(missing_ok=True)
        raise


def _opened(f: BinaryIO) -> tuple[int, ShardInfo]:
    """The size and trailer of the open snapshot file `f` (the very file then sent)."""
    size = os.fstat(f.fileno()).st_size
    return size, shard_file.trailer_of(f, size)


def _connect(address: str) -> tuple[socket.socket, str]:
    host, port, token = address.split()
    sock = socket.create_connection((host, int(port)), timeout=IDLE_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, token


def push(address: str, path: Path, name: str) -> None:
    """Send the snapshot file at `path` to the peer at `address`, to keep as `name`; returns once it has it whole."""
    sock, token = _connect(address)
    with sock, open(path, "rb") as f:
        size, info = _opened(f)
        send_json(sock, {"token": token, "op": "put", "name": name, "bytes": size, "body_bytes": info.body_bytes})
        sock.sendfile(f, 0)
        answer = recv_json(sock, Deadline())
    if not answer.get("ok"):
        raise HandoffError(f"the peer refused the replica: {answer.get('error')}")


def fetch_info(address: str, name: str) -> ShardInfo:
    """The trailer of the peer's file `name`."""
    sock, token = _connect(address)
    with sock:
        send_json(sock, {"token": token, "op": "info", "name": name})
        answer = _answer(sock, name)
        trailer = bytearray(int(answer["bytes"]))
        recv_into(sock, memoryview(trailer), Deadline())
    return shard_file.parse_trailer(bytes(trailer))


class PeerRuns:
    """Runs of the body of the peer's file `name`, asked for in one request (the runs in a second
    frame) and read in order (a `reading.Source`; the reader checks their blocks)."""

    def __init__(self, address: str, name: str, runs: list[tuple[int, int]]) -> None:
        self._sock, token = _connect(address)
        try:
            send_json(self._sock, {"token": token, "op": "get", "name": name})
            send_json(self._sock, {"runs": runs})
            _answer(self._sock, name)
        except BaseException:
            self._sock.close()
            raise

    def read_into(self, offset: int, view: memoryview) -> None:
        """The next `len(view)` bytes of the runs (`offset` is where they lie in the file: the peer
        sends the runs in the order they were asked for). A peer silent for IDLE_TIMEOUT_S is gone."""
        got = 0
        while got < len(view):
            n = self._sock.recv_into(view[got : got + CHUNK])
            if n == 0:
                raise HandoffError(f"the connection closed at byte {offset + got} of the file")
            got += n

    def __enter__(self) -> PeerRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


def _answer(sock: socket.socket, name: str) -> dict[str, Any]:
    answer = recv_json(sock, Deadline())
    if not answer.get("ok"):
        raise HandoffError(f"the peer has no {name}: {answer.get('error')}")
    return answer
