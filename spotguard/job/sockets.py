"""The TCP sockets of this process's process groups, so that a collective waiting on a silent peer can be
left: gloo cannot abort an operation (torch 2.13: its `abort()` does nothing), but an operation whose
sockets are shut down fails at once, as if the peer had died ("Connection closed by peer").

The sockets are told apart by when they were made: those that appeared while a group was made (a gloo
group that connects every pair at once). Read from /proc (Linux); elsewhere nothing is recorded, and a
collective is left only when its own timeout ends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


LISTENING = "0A"  # a TCP socket's state in /proc/net/tcp: listening


def _connected_tcp_inodes() -> set[int]:
    """The inodes of the TCP sockets in this network namespace that are not listening: only a connection's
    shutdown fails the operations on it (gloo ends the process when its listener fails)."""
    inodes: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        rows = (line.split() for line in lines)
        inodes.update(int(f[9]) for f in rows if len(f) > 9 and f[3] != LISTENING)
    return inodes


def _socket_fds() -> dict[int, int]:
    """{inode: fd} of this process's sockets."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


class GroupSockets:
    """The TCP sockets of this process's groups that a lost node can hold up: the default group and the
    guard's own (one record per process: the groups are the process's)."""

    def __init__(self) -> None:
        self._inodes: set[int] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Around the making of a group: the TCP connections that appear meanwhile are its."""
        before = set(_socket_fds())
        yield
        made = set(_socket_fds()) - before
        with self._lock:
            self._inodes |= made & _connected_tcp_inodes()

    def forget(self) -> None:
        """The groups recorded so far are gone (a new generation's are recorded next)."""
        with self._lock:
            self._inodes = set()

    def shut_down(self) -> int:
        """Shut down every recorded socket still open (any thread): each operation on it fails at once. The
        sockets stay open (the group closes them when it is dropped). Returns how many were shut down."""
        with self._lock:
            inodes, self._inodes = self._inodes, set()
        done = 0
        for inode, fd in _socket_fds().items():
            if inode not in inodes:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: closing it leaves the group's fd
                    sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError as exc:  # closed meanwhile, or never connected
                log.debug("socket %d (fd %d) not shut down: %s", inode, fd, exc)
        return done


GROUP_SOCKETS = GroupSockets()
