"""Which guard a rank is in, with a stated topology (`store=`, `rank=`, `world_size=`) on a store that
outlives an attempt, as torchrun's agent store lives across worker restarts: the ranks of one attempt
meet although a rank never entered the last attempt, a split they cannot mend is a one-line error when
the guards start (never silence: no save, ever), and two jobs sharing one store never disturb each
other. A real TCPStore on 127.0.0.1; ranks as threads, one node each, rank 0 watching an AWS emulator."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch.distributed as dist

import spotguard
from cloud_adapters.aws.emulator import AWSMetadataEmulator
from spotguard.job import topology
from tests.threaded_guards import tcp_server

WORLD = 4


class Attempt:
    """The guards of ranks `ranks` of one job attempt; `start` enters them and runs a training loop
    (a sleep and `guard.step`) for each guard that started; leaving stops the loops and the guards."""

    def __init__(self, server: dist.TCPStore, checkpoint_dir: str, ranks: tuple[int, ...], world: int = WORLD) -> None:
        self.emulator = AWSMetadataEmulator()
        self.emulator.start()
        self.guards = {
            rank: spotguard.Guard(
                checkpoint_dir,
                cloud="aws" if rank == 0 else "none",
                metadata_url=self.emulator.url if rank == 0 else None,
                poll_interval_s=0.1,
                store=server.clone(),
                rank=rank,
                world_size=world,
                local_rank=0,
                node=f"node-{rank}",
                exit_code=None,
                agreement_timeout_s=5.0,
            )
            for rank in ranks
        }
        self.errors: dict[int, Exception] = {}
        self.acted: dict[int, int] = {}  # rank -> the step at which guard.step() returned True
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, order: tuple[int, ...] | None = None) -> dict[int, Exception]:
        """Start every guard, each on a thread of its own (as the ranks of an attempt do), or one by one
        in `order`; what each start raised."""

        def enter(rank: int) -> None:
            try:
                self.guards[rank].start()
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                self.errors[rank] = exc

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # started off the main thread: signals are not watched
            if order is None:
                entering = [threading.Thread(target=enter, args=(rank,)) for rank in self.guards]
            else:
                entering = [threading.Thread(target=lambda: [enter(rank) for rank in order])]
            for thread in entering:
                thread.start()
            for thread in entering:
                thread.join(120)
        for rank in set(self.guards if order is None else order) - self.errors.keys():
            self._threads.append(threading.Thread(target=self._train, args=(rank,), daemon=True))
            self._threads[-1].start()
        return self.errors

    def _train(self, rank: int) -> None:
        step = 0
        while not self._stop.is_set():
            time.sleep(0.01)
            if self.guards[rank].step(step, {}):
                self.acted[rank] = step
                return
            step += 1

    def interrupt(self, timeout_s: float = 30.0) -> dict[int, int]:
        """A spot interruption of rank 0's node: the step each rank stopped at."""
        self.emulator.raise_notice(kind="interruption")
        until = time.monotonic() + timeout_s
        while len(self.acted) < len(self._threads) and time.monotonic() < until:
            time.sleep(0.02)
        return dict(self.acted)

    def agreed(self) -> dict[int, list[int]]:
        guards = self.guards.items()
        return {r: [e.detail["step"] for e in g.timeline.entries if e.event == "agreed"] for r, g in guards}

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        for guard in self.guards.values():
            guard.close()
        self.emulator.stop()


@pytest.fixture
def short_meeting(monkeypatch):
    """A rank waits this long for the rank before it to enter (300 s in use)."""
    monkeypatch.setattr(topology, "MEET_TIMEOUT_S", 1.0)


def test_the_next_attempt_meets_although_a_rank_never_entered_the_last_one(tmp_path, monkeypatch, short_meeting):
    """The reported case: attempt 0's rank 1 died before it entered. Its rank 2 says so at start; attempt 1,
    on the same store (torchrun's agent store), meets: every rank stops at one emergency step. Counting
    guards on the store alone put rank 1 in guard 1 and the others in guard 2, silently, for good."""
    server, checkpoint_dir = tcp_server(), str(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with Attempt(server, checkpoint_dir, (0, 2, 3)) as first:
        errors = first.start()
    assert list(errors) == [2] and "but rank 1 has entered 0 and no other in 1 s" in str(errors[2])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with Attempt(server, checkpoint_dir, tuple(range(WORLD))) as second:
        assert second.start() == {}
        time.sleep(0.3)
        acted = second.interrupt()
    assert len(acted) == WORLD and len(set(acted.values())) == 1, acted


@pytest.mark.parametrize("order", [None, (0, 1, 2, 3), (3, 2, 1, 0), (1, 0, 2, 3)], ids=str)
def test_without_a_restart_count_a_split_is_a_one_line_error_at_start(tmp_path, monkeypatch, short_meeting, order):
    """The same without TORCHELASTIC_RESTART_COUNT (a store the caller keeps across attempts): the ranks
    cannot meet, and start() says so in one line, with what to do, on at least one rank, whatever the
    order the ranks start in, within the meeting's timeout."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    server, checkpoint_dir = tcp_server(), str(tmp_path)
    with Attempt(server, checkpoint_dir, (0, 2, 3)) as first:
        first.start()
    started = time.monotonic()
    with Attempt(server, checkpoint_dir, tuple(range(WORLD))) as second:
        errors = second.start(order)
    assert errors, "silence: the ranks would never agree on a save"
    assert time.monotonic() - started < 20
    for error in errors.values():
        message = str(error)
        assert isinstance(error, RuntimeError) and "\n" not in message, message
        assert " enters its guard no. " in message and "give each attempt a store of its own" in message, message


def test_two_jobs_sharing_a_store_do_not_disturb_each_other(tmp_path):
    """Two jobs (their own checkpoint_dir each) on one store, their ranks starting interleaved: each
    job's ranks meet, and one job's interruption is not the other's."""
    server = tcp_server()
    a, b = (Attempt(server, str(tmp_path / name), (0, 1), world=2) for name in "ab")
    with a, b:
        for job, rank in ((a, 0), (b, 0), (b, 1), (a, 1)):  # counted on the store alone: a's ranks 1, 2; b's 2, 1
            assert job.start((rank,)) == {}
        time.sleep(0.3)
        acted_a = a.interrupt()
        time.sleep(1.0)
        assert b.acted == {} and all(steps == [] for steps in b.agreed().values())
        acted_b = b.interrupt()
    assert len(acted_a) == 2 and len(set(acted_a.values())) == 1, acted_a
    assert len(acted_b) == 2 and len(set(acted_b.values())) == 1, acted_b


def test_ranks_on_several_nodes_meet_whatever_each_agent_s_restart_count(tmp_path, monkeypatch, short_meeting):
    """torchrun's agents count restarts apart (the one whose workers failed counts one, the others
    restart theirs without counting): on several nodes the restart count is no part of the key."""
    server, prefixes = tcp_server(), []
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    for rank in range(WORLD):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1" if rank < 2 else "0")
        stated = topology.Topology(rank, WORLD, rank % 2, True, f"node-{rank // 2}")
        prefixes.append(topology.run_prefix(server.clone(), None, stated, str(tmp_path)))
    assert len(set(prefixes)) == 1, prefixes
