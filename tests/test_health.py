"""Silent failures, piece by piece: the ring of heartbeats between real processes over real sockets
around a real TCPStore (a member frozen with SIGSTOP, one that ends, one excused, a stranger), the hang
timer on a clock the test turns, the culprits of a hang's report, the settings, and the report of a
ledger that holds such an end. The whole job under torchrun is in test_silent_failures.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

from cloud_adapters.storage import LocalStore
from spotguard.demo.processes import free_port
from spotguard.goodput.ledger import Ledger, read_ledger
from spotguard.goodput.records import Exit, Resume, SilentEnd, Start
from spotguard.goodput.report import format_text, summarize
from spotguard.health import monitor, stacks
from spotguard.health.beacon import BEAT, beat_interval
from spotguard.health.hangs import AUTO, AUTO_CEILING_S, AUTO_FLOOR_S, HangWatch
from spotguard.health.liveness import Liveness, PeerLoss
from spotguard.job.kvstore import Connection
from spotguard.job.topology import explicit
from spotguard.options import HealthOptions
from tests.counting import Counts, counting_store

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1.5
PREFIX = "job/"

MEMBER = textwrap.dedent(
    """
    import ctypes, sys, time, torch, torch.distributed as dist
    from pathlib import Path
    from spotguard.health.liveness import Liveness
    from spotguard.snapshots.shard_file import MappedShard
    port, index, count = map(int, sys.argv[1:4])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    ring = Liveness(store, "job/", index=index, count=count, node=f"node-{index}", timeout_s=%s,
                    on_lost=lambda loss: print("LOST", loss.node, flush=True))
    ring.start()
    print("READY", flush=True)
    for line in sys.stdin:
        what, *arg = line.split()
        if what == "stop":
            ring.stop()
            print("STOPPED", flush=True)
        elif what == "hold":  # one C call that keeps the GIL (PyDLL does not release it), for arg seconds
            ctypes.PyDLL(None).sleep(int(arg[0]))
            print("DONE", flush=True)
        elif what == "snapshot":  # this node's own snapshot of a shard of arg MiB, as the tier takes it
            path = Path(arg[1]) / "shard"
            MappedShard(path, {"w": torch.empty(int(arg[0]) << 20, dtype=torch.uint8)}).fill().discard()
            print("DONE", flush=True)
    time.sleep(3600)
    """
    % TIMEOUT_S
)


class Ring:
    """Members 0..count-1 of one ring around a TCPStore: `in_process` here (their losses recorded), the
    others in processes of their own (which a test can freeze, stop or kill)."""

    def __init__(self, count: int, in_process: list[int], excused: set[str] = frozenset(), start: bool = True) -> None:
        self.port = free_port()
        self.server = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False)
        self.count, self.excused = count, excused
        self.counts = Counts()
        self.losses: list[tuple[float, PeerLoss]] = []
        self.members: dict[int, Liveness] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        for i in range(count) if start else ():
            if i in in_process:
                self.add(i)
            else:
                proc = subprocess.Popen(
                    [sys.executable, "-c", MEMBER, str(self.port), str(i), str(count)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                )  # fmt: skip
                assert proc.stdout.readline().strip() == "READY"
                self.procs[i] = proc

    def add(self, i: int) -> Liveness:
        """Member `i`, in this process."""
        client = dist.TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False)
        self.members[i] = Liveness(
            counting_store(client, self.counts), PREFIX, index=i, count=self.count, node=f"node-{i}",
            timeout_s=TIMEOUT_S, on_lost=self._lost, excused=self.excused.__contains__,
        )  # fmt: skip
        self.members[i].start()
        return self.members[i]

    def signal(self, i: int, sig: signal.Signals) -> None:
        """To member `i`'s whole process group (its beacon too): a node frozen or thawed as a whole."""
        os.killpg(self.procs[i].pid, sig)

    def _lost(self, loss: PeerLoss) -> None:
        self.losses.append((time.monotonic(), loss))

    def watching(self, timeout: float = 10.0) -> None:
        """Until every in-process member watches its neighbour."""
        deadline = time.monotonic() + timeout
        while not all(m.watched for m in self.members.values()):
            assert time.monotonic() < deadline, "a member never found its neighbour"
            time.sleep(0.05)
        time.sleep(2 * beat_interval(TIMEOUT_S))

    def close(self) -> None:
        for member in self.members.values():
            member.stop()
        for proc in self.procs.values():
            os.killpg(proc.pid, signal.SIGKILL)  # its beacon too: one that is stopped never reads its parent's end
            proc.wait()


@pytest.fixture
def ring_of():
    made: list[Ring] = []

    def make(*args, **kwargs) -> Ring:
        made.append(Ring(*args, **kwargs))
        return made[-1]

    yield make
    for ring in made:
        ring.close()


def test_a_frozen_node_is_declared_lost_by_its_watcher_within_the_timeout(ring_of):
    """Node 2 (its own process) is frozen with SIGSTOP: its connections stay open and silent. Node 0
    watches it and declares it lost once, after the timeout and well before twice it; node 1, which
    watches the live node 0, declares nothing."""
    ring = ring_of(3, in_process=[0, 1])
    ring.watching()
    assert ring.members[0].watched == "node-2" and ring.members[1].watched == "node-0"
    frozen_at = time.monotonic()
    ring.signal(2, signal.SIGSTOP)
    time.sleep(TIMEOUT_S * 3)
    assert [loss.node for _, loss in ring.losses] == ["node-2"]
    ((at, loss),) = ring.losses
    assert TIMEOUT_S - beat_interval(TIMEOUT_S) <= at - frozen_at <= 2 * TIMEOUT_S + 1
    assert loss.watcher == "node-0" and loss.silent_s >= TIMEOUT_S


@pytest.mark.parametrize("how", ["stops", "is killed"])
def test_a_node_whose_process_ends_is_not_lost(ring_of, how, caplog):
    """A member that leaves the ring (a guard closing: the end of the job, a node leaving after its
    notice) or whose process is killed (torchrun restarting its workers): the kernel closes the
    connection, which is an end, not a silence."""
    ring = ring_of(2, in_process=[0])
    ring.watching()
    if how == "stops":
        ring.procs[1].stdin.write("stop\n")
        ring.procs[1].stdin.flush()
        assert ring.procs[1].stdout.readline().strip() == "STOPPED"
    else:
        ring.procs[1].kill()
    time.sleep(TIMEOUT_S * 3)
    assert ring.losses == []
    assert "node node-1 closed its heartbeat: its guard or its process ended (not a loss)" in caplog.text


def test_a_silent_node_that_announced_its_interruption_is_excused_until_its_emergency_is_called_off(ring_of, caplog):
    excused = {"node-1"}
    ring = ring_of(2, in_process=[0], excused=excused)
    ring.watching()
    ring.signal(1, signal.SIGSTOP)
    time.sleep(TIMEOUT_S * 3)
    assert ring.losses == []
    assert "node node-1 is silent after its notice: leaving, not lost" in caplog.text
    excused.clear()  # its round aborted: the job trains on, and waits for it
    time.sleep(1.0)
    assert [loss.node for _, loss in ring.losses] == ["node-1"]


def test_watchers_held_up_together_with_the_node_they_watch_blame_nobody(ring_of):
    """Both nodes of a ring stop for three timeouts and go on together (a host paused whole; threads of one
    process held by the GIL): the silence each saw was its own, so neither declares the other lost."""
    ring = ring_of(2, in_process=[])
    time.sleep(1.0)  # they watch each other
    for i in ring.procs:
        ring.signal(i, signal.SIGSTOP)
    time.sleep(TIMEOUT_S * 3)
    for i in ring.procs:
        ring.signal(i, signal.SIGCONT)
    time.sleep(TIMEOUT_S * 3)
    for proc in ring.procs.values():
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "STOPPED"  # and never printed LOST before it


def test_an_address_that_drops_connections_never_delays_the_beats(ring_of):
    """Node 0's neighbour publishes an address whose SYNs go unanswered (a full accept queue): node 0
    keeps trying in the background, and its own watcher gets a beat every interval all the while."""
    import socket

    ring = ring_of(2, in_process=[], start=False)
    clogged = socket.socket()
    clogged.bind(("127.0.0.1", 0))
    clogged.listen(0)
    fillers = [socket.socket() for _ in range(4)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(clogged.getsockname())
    port = clogged.getsockname()[1]
    ring.server.set(f"{PREFIX}health/node/1", f"127.0.0.1 {port} token node-1")
    member = ring.add(0)
    host, port0, token, _ = ring.server.get(f"{PREFIX}health/node/0").decode().split(" ", 3)
    with socket.create_connection((host, int(port0)), timeout=5) as watcher:
        watcher.sendall(token.encode() + b"\n")
        arrivals = []
        until = time.monotonic() + 8
        while time.monotonic() < until:
            assert watcher.recv(1) == BEAT
            arrivals.append(time.monotonic())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) >= 20 and max(gaps) < 1.0, gaps  # beats every 0.3 s; a blocking connect took 3 s
    assert member.watched == "node-1" and ring.losses == []
    clogged.close()
    for filler in fillers:
        filler.close()


def test_beats_go_only_to_a_watcher_that_says_the_token(ring_of):
    import socket

    ring = ring_of(2, in_process=[0, 1])
    ring.watching()
    host, port, token, _ = ring.server.get(f"{PREFIX}health/node/0").decode().split(" ", 3)
    with socket.create_connection((host, int(port)), timeout=5) as stranger:
        stranger.sendall(b"not-the-token\n")
        assert stranger.recv(16) == b""  # dropped, never beaten to
    with socket.create_connection((host, int(port)), timeout=5) as second:
        second.sendall(token.encode() + b"\n")
        assert second.recv(1) == BEAT
    assert ring.losses == []


def _ask(proc: subprocess.Popen, command: str) -> None:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()


def _beat_gaps(ring: Ring, member: int, while_: Callable[[], None]) -> list[float]:
    """The gaps between the beats a watcher of `member` hears while `while_()` runs."""
    import socket

    host, port, token, _ = ring.server.get(f"{PREFIX}health/node/{member}").decode().split(" ", 3)
    arrivals: list[float] = []
    with socket.create_connection((host, int(port)), timeout=10) as watcher:
        watcher.sendall(token.encode() + b"\n")
        done = threading.Event()

        def hear() -> None:
            while not done.is_set() and watcher.recv(1) == BEAT:
                arrivals.append(time.monotonic())

        hearing = threading.Thread(target=hear, daemon=True)
        hearing.start()
        time.sleep(1.0)
        while_()
        time.sleep(1.0)
        done.set()
        hearing.join(timeout=5)
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def test_a_node_whose_training_process_holds_its_gil_is_not_lost(ring_of):
    """Node 1's process keeps its GIL for four timeouts in one C call (a backtracking regex, a sort of tens
    of millions of floats, an extension that never lets go): its beats come from a process of its own, so
    node 0 hears them all along and declares nothing."""
    ring = ring_of(2, in_process=[0])
    ring.watching()
    held = int(4 * TIMEOUT_S)
    gaps = _beat_gaps(ring, 1, lambda: (_ask(ring.procs[1], f"hold {held}"), ring.procs[1].stdout.readline()))
    assert sum(gaps) > held and max(gaps) < TIMEOUT_S, gaps
    assert ring.losses == []


def test_a_node_taking_its_own_snapshot_beats_on(ring_of, tmp_path):
    """A snapshot's file is mapped with every page populated, which keeps the GIL on a kernel before 5.14:
    node 1 snapshots a shard of 2 GiB into tmpfs, and its beats never pause for more than a beat or two."""
    ring = ring_of(2, in_process=[0])
    ring.watching()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    with tempfile.TemporaryDirectory(dir=shm) as where:
        gaps = _beat_gaps(ring, 1, lambda: (_ask(ring.procs[1], f"snapshot 2048 {where}"),
                                            ring.procs[1].stdout.readline()))  # fmt: skip
    assert max(gaps) < 2.5 * beat_interval(TIMEOUT_S), gaps
    assert ring.losses == []


def test_a_flood_of_connections_that_never_say_the_token_costs_the_training_process_nothing(ring_of):
    """A local stranger opens 600 connections to node 1's liveness port and says nothing, then closes them
    all: the training process holds none of them (its descriptors are its saves' and its ledger's), the
    beacon at most a few (the oldest waiting are dropped), node 1's watcher hears every beat all the
    while, and the beacon beats on after the closes."""
    import socket

    ring = ring_of(2, in_process=[0])
    ring.watching()
    host, port, _, _ = ring.server.get(f"{PREFIX}health/node/1").decode().split(" ", 3)
    member = ring.procs[1].pid
    before = len(os.listdir(f"/proc/{member}/fd"))
    flood: list[socket.socket] = []
    try:
        for i in range(600):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((host, int(port)))
            flood.append(sock)
            if i % 2 and i >= 20:  # a scanner's close, as the beacon drops the oldest waiting for a new one
                flood[i - 16].close()
        time.sleep(1.0)
        held = len(os.listdir(f"/proc/{member}/fd")) - before
        beacons = [int(p) for p in Path(f"/proc/{member}/task/{member}/children").read_text().split()]
        in_beacon = len(os.listdir(f"/proc/{beacons[0]}/fd"))
        time.sleep(2 * TIMEOUT_S)
    finally:
        for sock in flood:
            sock.close()  # all at once: the closes of dropped and waiting connections come in one batch
    assert held <= 2, held
    assert in_beacon < 40, in_beacon
    gaps = _beat_gaps(ring, 1, lambda: time.sleep(1.0))  # the beacon outlived the flood, and beats on
    assert len(gaps) >= 5 and max(gaps) < TIMEOUT_S, gaps
    assert ring.losses == []


def test_the_ring_costs_the_store_three_requests_per_node_and_nothing_after(ring_of):
    """The address set, and the neighbour's address read (a wait and the read on the server): O(1) per
    node, once; beats never touch the store."""
    ring = ring_of(4, in_process=[0, 1, 2, 3])
    ring.watching()
    first = ring.counts.snapshot()
    time.sleep(TIMEOUT_S * 2)
    assert ring.counts.snapshot() == first
    assert first == {"set": 4, "get": 4}  # 3 requests per node on the server
    assert ring.losses == []


# ---- the hang timer --------------------------------------------------------------------------------
class Loop:
    """A training loop on a clock the test turns: `step(s)` is a step that took s seconds."""

    def __init__(self, timeout) -> None:
        self.now = 1000.0
        self.beats = 0
        self.seen: list = []
        self.watch = HangWatch(timeout, beats=lambda: self.beats, last_step=lambda: self.beats - 1,
                               on_hang=self.seen.append, clock=lambda: self.now)  # fmt: skip

    def wait(self, seconds: float, looks: int = 10):
        """`seconds` pass with no step; the watch looks `looks` times; the first hang seen, if any."""
        for _ in range(looks):
            self.now += seconds / looks
            seen = self.watch.check()
            if seen is not None:
                return seen
        return None

    def step(self, seconds: float = 1.0) -> None:
        assert self.wait(seconds) is None
        self.beats += 1
        assert self.watch.check() is None


def test_a_fixed_hang_timeout_ends_a_loop_that_stopped_stepping():
    loop = Loop(60.0)
    for _ in range(5):
        loop.step(1.0)
    assert loop.wait(59.0) is None
    seen = loop.wait(2.0)
    assert seen is not None and seen.last_step == 4 and seen.timeout_s == 60.0 and seen.stalled_s >= 60.0


def test_the_clock_starts_at_the_first_step():
    """A resume, or a first step that compiles for half an hour, is never timed."""
    loop = Loop(60.0)
    assert loop.wait(1800.0) is None
    loop.step(1.0)
    assert loop.wait(61.0) is not None


def test_auto_never_ends_a_90_s_step_or_a_5_minute_evaluation_and_always_a_hang_within_10_minutes():
    loop = Loop(AUTO)
    assert loop.watch.timeout_s == AUTO_FLOOR_S
    loop.step(1.0)
    for _ in range(3):
        loop.step(90.0)  # 90 s steps: five times that
    assert loop.watch.timeout_s == 450.0
    loop.step(300.0 + 90.0)  # an evaluation of 5 minutes between two steps, not declared
    assert loop.watch.timeout_s == AUTO_CEILING_S  # five times that is past the ceiling
    seen = loop.wait(600.0, looks=120)
    assert seen is not None and AUTO_CEILING_S <= seen.stalled_s <= AUTO_CEILING_S + 5 < 600


def test_auto_with_short_steps_ends_a_hang_after_its_floor():
    loop = Loop(AUTO)
    for _ in range(50):
        loop.step(0.2)
    assert loop.watch.timeout_s == AUTO_FLOOR_S
    assert loop.wait(AUTO_FLOOR_S - 5, looks=100) is None
    assert loop.wait(10.0) is not None


def test_spotguards_own_work_and_declared_phases_are_not_timed_nor_learned():
    loop = Loop(60.0)
    loop.step()
    with loop.watch.busy():  # a save of ten minutes
        assert loop.wait(600.0) is None
    assert loop.wait(58.0) is None  # the clock restarted when the save ended
    loop.step()
    loop.watch.allow(300.0)  # "the next 300 s are an evaluation"
    assert loop.wait(300.0 + 59.0) is None
    assert loop.wait(2.0) is not None

    auto = Loop(AUTO)
    auto.step()
    auto.watch.allow(3000.0)
    with auto.watch.phase():
        assert auto.wait(2000.0) is None
    assert auto.wait(AUTO_FLOOR_S - 5) is None  # leaving the phase counted as a step
    auto.step(1.0)
    assert auto.watch.longest_gap_s < 500  # the phase's gap was not learned from


# ---- a hang's report -------------------------------------------------------------------------------
def report(rank: int, step: int, in_torch: bool = True) -> stacks.RankReport:
    return stacks.RankReport(rank=rank, last_step=step, in_torch=in_torch, where="x.py:1 in f")


@pytest.mark.parametrize(
    ("reports", "world", "expected"),
    [
        ([report(0, 9), report(1, 9, in_torch=False), report(2, 9)], 3, (1,)),  # stuck in its data loader
        ([report(0, 9), report(1, 8), report(2, 9)], 3, (1,)),  # behind the others
        ([report(0, 9), report(2, 9)], 3, (1,)),  # never answered: every thread stuck
        ([report(1, 9), report(2, 9)], 3, (0,)),  # rank 0 frozen: another rank judges, and names it
        ([report(0, 9), report(1, 9), report(3, 9, in_torch=False)], 4, (3,)),  # rank 2's line late: rank 3 named
        ([report(0, 9), report(1, 8), report(3, 9)], 4, (1,)),  # the lines that came name rank 1 behind
        ([report(0, 9), report(1, 9)], 2, ()),  # all in torch: nobody to blame
    ],
)
def test_the_culprits_of_a_hang(reports, world, expected):
    assert stacks.culprits(reports, world)[0] == expected


def test_a_ranks_line_says_where_its_main_thread_is_and_round_trips():
    """Taken from another thread (the listener's) while the main thread waits in the training's own code."""
    lines: list[stacks.RankReport] = []
    done = threading.Event()

    def look() -> None:
        time.sleep(0.2)
        lines.append(stacks.report(3, 41))
        done.set()

    def stuck_in_the_data_loader() -> None:
        done.wait(10)

    threading.Thread(target=look).start()
    stuck_in_the_data_loader()
    (mine,) = lines
    assert mine.rank == 3 and mine.last_step == 41 and not mine.in_torch
    assert "threading.py" in mine.where and "test_health.py" in mine.where
    assert mine.where.endswith("in stuck_in_the_data_loader")  # its own innermost frame
    assert stacks.RankReport.from_json(mine.to_json()) == mine


def test_a_hangs_report_opens_no_connection_and_a_slow_one_blames_nobody():
    """Two ranks (threads around one TCPStore) report a hang; rank 1's store makes every connection opened
    after the start take 6 s (a server whose reverse lookup of the peer's name times out). The report goes
    over the connection each rank made at the start: rank 1's line is in, so it is not named as a rank that
    did not answer, and no rank opens a connection on the way to its end."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    slow: set[int] = set()
    clones = Counts()

    class SlowToConnect(dist.Store):
        def __init__(self, inner: dist.Store, rank: int) -> None:
            super().__init__()
            self.inner, self.rank = inner, rank

        def clone(self) -> dist.Store:
            clones.add(f"rank {self.rank}")
            if self.rank in slow:
                time.sleep(6)
            return self.inner.clone()

    ended: dict[int, monitor.SilentFailure] = {}
    ranks = []
    for rank in range(2):
        store = SlowToConnect(server.clone(), rank)
        health = monitor.Health(
            explicit(rank, 2, local=0, node=f"node-{rank}"), peer_timeout_s=0, hang_timeout_s=0, beats=lambda: 10,
            last_step=lambda: 9, record=lambda ending: None,
            end=lambda ending, rank=rank: ended.setdefault(rank, ending.failure), end_now=lambda ending: None,
        )  # fmt: skip
        health.start(store, PREFIX, connections=(Connection.of(store), Connection.of(store)),
                     publish=lambda event: True, listening=lambda: True, excused=lambda node: False)  # fmt: skip
        ranks.append(health)
    started = clones.snapshot()
    slow.add(1)
    event = {"cause": monitor.HANG, "culprit": "", "noticed_after_s": 5.0, "seen_by": "rank 1"}
    threads = [threading.Thread(target=h.on_event, args=(event,), daemon=True) for h in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(ended) == [0, 1]
    assert ended[0].culprit == ended[1].culprit == ""  # both in the same place (one process): nobody to blame
    assert clones.snapshot() == started


def test_a_phase_declared_on_one_rank_holds_the_others_until_it_ends_and_no_longer():
    """Two ranks (threads around one TCPStore), hang_timeout_s=1. Rank 0 declares a phase of 30 s after
    step 5 and rank 1, waiting for it one step further on, stops stepping too: no hang while the phase
    runs. The phase ends with its `with` block; another one, declared without `with` as the framework
    callbacks do, ends when rank 0 steps on; then both stop: no phase holds anybody, so both see the
    hang within seconds (not after 30 s: a framework declares an hour around each of its saves)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    beats, hung = [6, 6], []
    ranks = []
    for rank in range(2):
        store = server.clone()
        health = monitor.Health(
            explicit(rank, 2, local=0, node=f"node-{rank}"), peer_timeout_s=0, hang_timeout_s=1,
            beats=lambda rank=rank: beats[rank], last_step=lambda rank=rank: beats[rank] - 1,
            record=lambda ending: None, end=lambda ending: None, end_now=lambda ending: None,
        )  # fmt: skip
        health.start(store, PREFIX, connections=(Connection.of(store), Connection.of(store)),
                     publish=lambda event: hung.append((event["seen_by"], time.monotonic())) or True,
                     listening=lambda: True, excused=lambda node: False)  # fmt: skip
        ranks.append(health)
    try:
        ranks[0].allow(30)
        with ranks[0].phase():
            beats[1] = 7  # rank 1 reported one step more before it waits (an asynchronous backend)
            time.sleep(4)
            assert hung == []  # rank 1 waits for rank 0's phase: it is the job's
        ranks[0].allow(30)  # declared without `with` (as the framework callbacks do): the next step ends it
        time.sleep(2)
        assert hung == []
        beats[0] = 7  # rank 0 steps past its phase; rank 1, already there, waits on
        stopped = time.monotonic()
        time.sleep(6)
        assert sorted(who for who, _ in hung) == ["rank 0", "rank 1"]
        assert all(at - stopped < 5 for _, at in hung), hung
    finally:
        for health in ranks:
            health.stop()


def test_every_threads_stack_goes_to_the_log(caplog):
    stuck = threading.Event()
    thread = threading.Thread(target=stuck.wait, name="data-loader", daemon=True)
    thread.start()
    try:
        with caplog.at_level("ERROR", logger="spotguard.health.stacks"):
            stacks.log_all_stacks("a test")
    finally:
        stuck.set()
    text = caplog.text
    assert 'thread "data-loader"' in text and "in wait" in text and 'thread "MainThread"' in text


# ---- settings --------------------------------------------------------------------------------------
def test_the_settings_and_their_environment(monkeypatch):
    assert dataclasses.astuple(HealthOptions()) == (20.0, "auto")
    monkeypatch.setenv("SPOTGUARD_PEER_TIMEOUT", "5")
    monkeypatch.setenv("SPOTGUARD_HANG_TIMEOUT", "60")
    assert dataclasses.astuple(HealthOptions()) == (5.0, 60.0)
    assert dataclasses.astuple(HealthOptions(peer_timeout_s=7, hang_timeout_s="auto")) == (7.0, "auto")  # code wins
    monkeypatch.setenv("SPOTGUARD_PEER_TIMEOUT", "off")
    monkeypatch.setenv("SPOTGUARD_HANG_TIMEOUT", "0")
    assert dataclasses.astuple(HealthOptions()) == (0.0, 0.0)
    monkeypatch.delenv("SPOTGUARD_PEER_TIMEOUT")
    off = HealthOptions(peer_timeout_s=0, hang_timeout_s=0)
    assert dataclasses.astuple(off) == (0.0, 0.0)
    assert dataclasses.astuple(dataclasses.replace(off, hang_timeout_s=60)) == (0.0, 60.0)  # off stays off


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"peer_timeout_s": 0.5}, {}, "peer_timeout_s must be at least 1 s"),
        ({"peer_timeout_s": "auto"}, {}, "peer_timeout_s .* must be a number of seconds"),
        ({"hang_timeout_s": "soon"}, {}, "hang_timeout_s must be a number of seconds"),
        ({"hang_timeout_s": float("inf")}, {}, "hang_timeout_s must be a finite"),
        ({}, {"SPOTGUARD_HANG_TIMEOUT": "ten"}, r"\$SPOTGUARD_HANG_TIMEOUT must be"),
        ({}, {"SPOTGUARD_PEER_TIMEOUT": "-3"}, "peer_timeout_s must be a finite"),
    ],
)
def test_bad_settings_are_refused_at_guard(tmp_path, monkeypatch, kwargs, env, message):
    import spotguard

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        spotguard.Guard(str(tmp_path), cloud="none", **kwargs)


# ---- the report ------------------------------------------------------------------------------------
def test_the_report_shows_a_silent_end_its_cause_culprit_notice_time_and_work_lost(tmp_path):
    store = LocalStore(tmp_path)
    first = Ledger(store)
    for record in (
        Start(world_size=3),
        Resume(step=None, next_step=0, resume_s=0.1),
        SilentEnd(cause="peer-lost", culprit="vm/node-2", noticed_after_s=20.3, seen_by="vm/node-0", last_step=57),
        Exit(code=75, why="peer-lost", committed=False, last_step=57),
    ):
        first.record(record)
    first.close()
    time.sleep(0.01)
    second = Ledger(store)
    second.record(Start(world_size=3))
    second.record(Resume(step=54, next_step=55, resume_s=0.5, tier="snapshot"))
    second.close()
    summary = summarize(read_ledger(store))
    (lost,) = summary["interruption_details"]
    assert (lost["cause"], lost["culprit"], lost["noticed_after_s"], lost["steps_lost"]) == (
        "peer-lost", "vm/node-2", 20.3, 3,
    )  # fmt: skip
    text = format_text(summary, str(tmp_path))
    assert "peer-lost" in text and "20.3 s, vm/node-2" in text and "1 interruption(s)" in text


def test_a_phase_declared_right_after_a_step_outlives_that_step_and_ends_at_the_next():
    """The watch may see the step only after the phase was declared (it looks every few seconds): that
    step does not end the phase; the next one does."""
    loop = Loop(3.0)
    loop.step()
    loop.beats += 1  # guard.step(), then at once guard.long_phase(13): the watch has not looked yet
    loop.watch.allow(13.0)
    assert loop.wait(8.0) is None  # the evaluation
    loop.step()  # the next step: the phase is over, the timeout alone counts again
    assert loop.wait(3.5) is not None


def test_a_heartbeat_restarts_the_clock_but_arms_nothing_before_the_first_step():
    loop = Loop(60.0)
    loop.watch.alive()  # a sanity check's validation before training
    assert loop.wait(600.0) is None
    loop.step()
    for _ in range(10):  # an evaluation of 10 batches of 50 s
        assert loop.wait(50.0) is None
        loop.watch.alive()
    assert loop.wait(61.0) is not None
