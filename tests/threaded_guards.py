"""Many real Guards in one process, as threads around one real TCPStore: each with a stated topology
(`store=`, `rank=`, `world_size=`, `local_rank=`, `node=`) and a training loop of its own. Each node's
leader watches its own AWS metadata emulator. There is no process group, so a save at the agreed
step fails at once (and is told so); the coordination before it is the real one."""

from __future__ import annotations

import threading
import time
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import spotguard
from cloud_adapters.aws.emulator import AWSMetadataEmulator
from tests.counting import Counts, counting_store

# These guards share one process: a silent end of one (os._exit) would end the test run. Their tests are
# about coordination; the silent-failure watches have tests of their own (test_health.py).
NO_HEALTH = {"peer_timeout_s": 0, "hang_timeout_s": 0}


def tcp_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


class Job:
    """`world` ranks, `per_node` to a node; `nodes_watched` node leaders poll an emulator each."""

    def __init__(
        self,
        checkpoint_dir: str,
        world: int,
        *,
        per_node: int = 2,
        store: dist.Store | None = None,
        step_s: float = 0.01,
        nodes_watched: tuple[int, ...] = (),
        absent: tuple[int, ...] = (),
        **guard_options: Any,
    ) -> None:
        self.server = store if store is not None else tcp_server()
        self.counts = [Counts() for _ in range(world)]
        self.emulators = {node: AWSMetadataEmulator() for node in nodes_watched}
        for emulator in self.emulators.values():
            emulator.start()
        self.step_s = step_s
        self.acted: dict[int, int] = {}  # rank -> the step at which guard.step() returned True
        self._stop = threading.Event()
        self.guards: dict[int, spotguard.Guard] = {}
        for rank in range(world):
            if rank in absent:  # a rank that died before it could enter
                continue
            node, emulator = rank // per_node, self.emulators.get(rank // per_node)
            leader = rank % per_node == 0
            own = self.server.clone() if isinstance(self.server, dist.TCPStore) else self.server
            self.guards[rank] = spotguard.Guard(
                checkpoint_dir,
                cloud="aws" if emulator is not None and leader else "none",
                metadata_url=emulator.url if emulator is not None and leader else None,
                poll_interval_s=0.1,
                store=counting_store(own, self.counts[rank]),
                rank=rank,
                world_size=world,
                local_rank=rank % per_node,
                node=f"node-{node}",
                exit_code=None,
                **{**NO_HEALTH, **guard_options},
            )
        self._threads = [threading.Thread(target=self._train, args=(r,), daemon=True) for r in self.guards]

    def __enter__(self) -> Job:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # entered off the main thread: signals are not watched
            entering = threading.Thread(target=lambda: [g.__enter__() for g in self.guards.values()])
            entering.start()  # off the main thread, as in a worker: no signal handlers are installed
            entering.join()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        for g in self.guards.values():
            g.__exit__(None, None, None)
        for emulator in self.emulators.values():
            emulator.stop()

    def _train(self, rank: int) -> None:
        guard, step = self.guards[rank], 0
        while not self._stop.is_set():
            time.sleep(self.step_s)
            if guard.step(step, {}):
                self.acted[rank] = step
                return
            step += 1

    def wait_acted(self, timeout_s: float = 30.0) -> dict[int, int]:
        until = time.monotonic() + timeout_s
        while len(self.acted) < len(self.guards) and time.monotonic() < until:
            time.sleep(0.02)
        return dict(self.acted)

    def agreed(self, rank: int) -> list[tuple[str, int, set[int]]]:
        """The rounds rank `rank` agreed on, in order: (event type, step, leaving ranks)."""
        return [
            (e.detail["on"], e.detail["step"], {int(r) for r in e.detail.get("leaving", "").split(",") if r})
            for e in self.guards[rank].timeline.entries
            if e.event == "agreed"
        ]

    def requests(self, rank: int) -> int:
        return self.counts[rank].total()
