"""A node leader's heartbeat, in a process of its own: what the training process cannot silence.

The training process holds its GIL for as long as one C call runs (a backtracking regex, a big
`sorted()`, mapping its own snapshot, a long GC pass) and blocks on a full output pipe; a thread of it
that beats would stop with it, and its watcher would take a busy node for a lost one. So the beats, the
listener and the watching of the neighbour live here, a child of the node leader that starts in
milliseconds (the standard library only, run as a script: no torch, no spotguard import) and writes
nothing but to its parent. It is in its parent's process group: a frozen node (every process of it
stopped) or a dead one falls silent as a whole; its parent's end closes its stdin (or, where a fork of
the parent still holds it, makes it an orphan), and it ends too, closing its connections, which its
watcher takes for an end, not a loss.

Talk with the parent, one line each (`Liveness` is the other end):
  stdin, parent -> beacon:   <token>               (the first line; never on the command line, which `ps` shows)
                             watch <host> <port> <token> <node>
                             (end of file: the parent is gone or leaves the ring; the beacon ends)
  stdout, beacon -> parent:  port <n>              (listening)
                             watching <node> | unreachable <node> <why> | ended <node> <why>
                             silent <node> <seconds>   (every beat interval while the node is silent past
                                                        the timeout; the parent judges: excused or lost)
                             error <what>          (one connection's trouble; the beats go on)
A parent too busy to read loses reports, never its beats: stdout is written without blocking.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import threading
import time

BEAT = b"."
HELLO_TIMEOUT_S = 3.0  # a connection that has not said the token by then is dropped
CONNECT_RETRY_S = 5.0  # an address that does not answer (dropped SYNs) is tried again this often
MAX_WAITING = 16  # connections yet to say the token: past it the oldest is dropped (a flood costs nothing)
MAX_WATCHERS = 4  # connections beaten to (the neighbour, and its restarts): past it the oldest is dropped
ACCEPTS_PER_LOOK = 64  # accepted at one look, so that a flood never delays a beat


def beat_interval(timeout_s: float) -> float:
    """Beats come often enough that a few lost to scheduling never add up to the timeout."""
    return min(1.0, timeout_s / 5)


class Beacon:
    def __init__(self, listener: socket.socket, token: str, timeout_s: float, *, pending: bytes = b"") -> None:
        self.listener = listener
        self.token = token.encode()
        self.timeout_s = timeout_s
        self.interval_s = beat_interval(timeout_s)
        self.sel = selectors.DefaultSelector()
        self.waiting: dict[socket.socket, tuple[float, bytearray]] = {}  # yet to say the token: by when, what came
        self.watchers: list[socket.socket] = []
        self.upstream: socket.socket | None = None  # the watched node's beats
        self.node = ""  # the watched node
        self.heard = 0.0
        self.ready: socket.socket | None = None  # connected by the connecting thread, taken by the loop
        self.stopping = threading.Event()
        self._commands = bytearray(pending)  # the parent's lines not read to their end yet
        self._said_silent = 0.0

    def run(self) -> None:
        parent = os.getppid()
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
        self._obey()
        next_beat = last_look = time.monotonic()
        while not self.stopping.is_set():
            if os.getppid() != parent:  # its parent ended, though a child of the parent's (a fork) keeps stdin open
                return
            self._take_connection()
            for key, _ in self.sel.select(timeout=min(self.interval_s, max(0.0, next_beat - time.monotonic()))):
                try:
                    self._ready_to_read(key.data, key.fileobj)  # type: ignore[arg-type]
                except Exception as exc:  # noqa: BLE001 - one bad connection never ends the beats
                    report(f"error {type(exc).__name__}: {exc}")
            now = time.monotonic()
            if now - last_look > 2 * self.interval_s + 0.5:  # this process itself was held up: it heard nothing
                self.heard = max(self.heard, now)
            last_look = now
            for conn in [c for c, (until, _) in self.waiting.items() if until < now]:
                self._drop(conn)
            if now >= next_beat:
                next_beat = now + self.interval_s
                self.watchers[:] = [c for c in self.watchers if _send(c)]
            self._judge(now)

    def _ready_to_read(self, what: str, fileobj: socket.socket) -> None:
        if what == "accept":
            self._accept()
        elif what == "parent":
            self._command()
        elif what == "hello":
            self._hello(fileobj)
        else:
            self._beats()

    # ---- the parent ----------------------------------------------------------------------------
    def _command(self) -> None:
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk:  # the parent ended, or leaves the ring
            self.stopping.set()
            return
        self._commands += chunk
        self._obey()

    def _obey(self) -> None:
        while b"\n" in self._commands:
            line, _, rest = bytes(self._commands).partition(b"\n")
            self._commands = bytearray(rest)
            words = line.decode().split(" ")
            if words[0] == "watch" and len(words) == 5 and self.node == "":
                self.node = words[4]
                threading.Thread(target=self._connect, args=(words[1], int(words[2]), words[3]), daemon=True).start()

    # ---- the watched node ----------------------------------------------------------------------
    def _connect(self, host: str, port: int, token: str) -> None:
        told = False
        while not self.stopping.is_set():
            try:
                sock = socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S)
                sock.sendall(token.encode() + b"\n")
            except ConnectionRefusedError:  # its kernel answered: the process has ended
                report(f"ended {self.node} refused")
                return
            except OSError as exc:  # no answer at all (dropped, filtered): try again, say so once
                if not told:
                    report(f"unreachable {self.node} {exc}")
                    told = True
                self.stopping.wait(CONNECT_RETRY_S)
                continue
            sock.setblocking(False)
            self.ready = sock
            report(f"watching {self.node}")
            return

    def _take_connection(self) -> None:
        if self.upstream is None and self.ready is not None:
            self.upstream, self.ready = self.ready, None
            self.heard = time.monotonic()
            self.sel.register(self.upstream, selectors.EVENT_READ, "beats")

    def _beats(self) -> None:
        if self.upstream is None:  # closed earlier in the same batch of events
            return
        try:
            data = self.upstream.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.heard = time.monotonic()
            return
        report(f"ended {self.node} closed")
        self.sel.unregister(self.upstream)
        self.upstream.close()
        self.upstream = None

    def _judge(self, now: float) -> None:
        """Tell the parent, every beat interval, while the watched node is silent past the timeout."""
        if self.upstream is None or now - self.heard < self.timeout_s or now - self._said_silent < self.interval_s:
            return
        try:  # a beat (or an end) that came while this loop was not scheduled: `_beats` takes it
            self.upstream.recv(1, socket.MSG_PEEK)
            return
        except (BlockingIOError, InterruptedError):
            pass  # nothing there: silent
        except OSError:
            return  # reset: the node's kernel answered, so it is not silent
        self._said_silent = now
        report(f"silent {self.node} {now - self.heard:.3f}")

    # ---- the watchers --------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_LOOK):
            try:
                conn, _ = self.listener.accept()
            except OSError:  # none left (or no descriptor: the waiting ones are capped, it passes)
                return
            if len(self.waiting) >= MAX_WAITING:
                self._drop(min(self.waiting, key=lambda c: self.waiting[c][0]))
            conn.setblocking(False)
            self.waiting[conn] = (time.monotonic() + HELLO_TIMEOUT_S, bytearray())
            self.sel.register(conn, selectors.EVENT_READ, "hello")

    def _hello(self, conn: socket.socket) -> None:
        if conn not in self.waiting:  # dropped earlier in the same batch of events (the cap, a flood)
            return
        said = self.waiting[conn][1]
        try:
            chunk = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        said += chunk
        if chunk and b"\n" not in said and len(said) <= 2 * len(self.token):
            return  # the rest of the line is still on its way
        if not chunk or said.strip() != self.token:
            self._drop(conn)  # not our watcher (a wrong token, a port scan): never beaten to
            return
        self.sel.unregister(conn)
        del self.waiting[conn]
        if len(self.watchers) >= MAX_WATCHERS:
            self.watchers.pop(0).close()
        self.watchers.append(conn)

    def _drop(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        self.waiting.pop(conn, None)
        conn.close()


def _send(conn: socket.socket) -> bool:
    """One beat; False once the watcher's end is gone (it is dropped)."""
    try:
        conn.send(BEAT)
        return True
    except BlockingIOError:
        return True  # the watcher's buffer is full: it is not reading, which is its own watcher's business
    except OSError:
        conn.close()
        return False


def report(line: str) -> None:
    """One line to the parent, never blocking: a parent that does not read loses it."""
    try:
        os.write(sys.stdout.fileno(), (line + "\n").encode())
    except (BlockingIOError, BrokenPipeError):
        pass


def main(argv: list[str]) -> None:
    host, timeout_s = argv[1], float(argv[2])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it ends with its parent, never before it
        signal.signal(sig, signal.SIG_IGN)
    token, rest = _first_line()
    try:
        listener = socket.create_server((host, 0))
    except OSError:  # an address peers reach this host on that is not its own (a NAT): listen on all
        listener = socket.create_server(("", 0))
    os.set_blocking(sys.stdout.fileno(), False)
    report(f"port {listener.getsockname()[1]}")
    Beacon(listener, token, timeout_s, pending=rest).run()


def _first_line() -> tuple[str, bytes]:
    """The token, read straight from the descriptor (a buffered read could take the next command too)."""
    got = b""
    while b"\n" not in got:
        chunk = os.read(sys.stdin.fileno(), 256)
        if not chunk:
            sys.exit(0)
        got += chunk
    line, _, rest = got.partition(b"\n")
    return line.decode().strip(), rest


if __name__ == "__main__":
    main(sys.argv)
