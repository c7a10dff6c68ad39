"""The snapshot tier's promises about failures, through real Guards: a snapshot that cannot be read
whole after a rank began reading it gives way to the durable checkpoint, loaded over the whole state
(one process with damaged files; two gloo ranks whose buddy's stream a TCP proxy cuts midway); a
failed snapshot on one rank is the same verdict on every rank, soon, with no training thread held; a
verdict that does not come in time is "failed" once for every rank, and a snapshot still replicating
when the next is due holds the training thread until it ends;
timed snapshots are agreed on one step by every rank; a snapshot that failed with every shard
written is kept, and resumed from where the nodes that survive hold it whole; and
`snapshot_interval_s="auto"` follows Young/Daly from the stall the tier measured and the ledger's
interruptions.

The ranks run this file's scenarios (`SCENARIOS`) through `tests.ckpt_workers.main`, each a process
of its own in one gloo group on 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import spotguard
from spotguard.checkpoint import CheckpointError, list_checkpoints
from spotguard.options import SNAPSHOT_MAX_S, SNAPSHOT_MIN_S
from spotguard.snapshots.tier import NOT_REPLICATED, TIMED_OUT
from spotguard.wiring.snapshots import SNAPSHOT
from tests.ckpt_workers import finish, launch_command
from tests.test_goodput import report_json
from tests.test_guard import train
from tests.test_snapshots import digest, resumes, run, trained

STEPS = 200  # of 10 ms at least, a snapshot asked every 0.3 s: 6 or more
VERDICT_BOUND_S = 20.0  # far below the 300 s a rank would wait for a verdict that never comes

# ---- launching ranks of this file's scenarios ---------------------------------------------------------------


def run_scenario(scenario: str, world: int, timeout: float = 90, **args: Any) -> list[dict]:
    """Run `scenario` in `world` ranks of one gloo group; each rank's JSON result (`out`/rank<r>.json)."""
    code = (
        "from tests import ckpt_workers as w; from tests.test_snapshot_promises import SCENARIOS; "
        "w.SCENARIOS.update(SCENARIOS); w.main()"
    )
    # one rank per node: each its node's leader, the next rank its buddy
    procs = launch_command(["-c", code, scenario, json.dumps(args)], world, local_rank=lambda rank: 0)
    finish(procs, timeout)
    return [json.loads((Path(args["out"]) / f"rank{r}.json").read_text()) for r in range(world)]


# ---- run inside a rank ---------------------------------------------------------------------------------------


def model_state(seed: int = 0) -> dict[str, Any]:
    """The same small model on every rank (replicated, as DDP keeps it, without DDP's reduction order)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def train_step(state: dict[str, Any], step: int) -> None:
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(step))
    state["model"](x).pow(2).mean().backward()
    state["optim"].step()
    state["optim"].zero_grad()


class Unreadable:
    """Stateful data-loader state whose `state_dict()` raises on its `fail_on`-th call (0: never) and the
    `times - 1` after it, as a user's object whose state cannot be read at one snapshot (or several)."""

    def __init__(self, fail_on: int, times: int = 1) -> None:
        self.calls, self.fail_on, self.times = 0, fail_on, times

    def state_dict(self) -> dict[str, int]:
        self.calls += 1
        if self.fail_on and self.fail_on <= self.calls < self.fail_on + self.times:
            raise RuntimeError("the data loader's position cannot be read")
        return {"position": self.calls}

    def load_state_dict(self, value: dict[str, int]) -> None:
        self.calls = value["position"]


class Records(logging.Handler):
    """spotguard's log records in this process, kept to be asked about."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        logger = logging.getLogger("spotguard")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def args_of(self, message: str) -> list[tuple]:
        return [r.args for r in self.records if r.msg == message]

    def warnings(self) -> str:
        return "\n".join(r.getMessage() for r in self.records if r.levelno >= logging.WARNING)


def timed_snapshots(group, rank: int, ckpt: str, memory: list[str], out: str, steps: int, interval_s: float,
                    failing_rank: int) -> None:  # fmt: skip
    """Train under timed snapshots; rank `failing_rank`'s state cannot be read at its second snapshot.
    Writes what each rank agreed on, the snapshots it took, the verdicts it read and its longest step()."""
    seen = Records()
    state = {**model_state(), "loader": Unreadable(2 if rank == failing_rank else 0)}
    longest = 0.0
    with spotguard.Guard(ckpt, cloud="none", snapshot_interval_s=interval_s, snapshot_dir=memory[rank],
                         exit_code=None) as guard:  # fmt: skip
        guard.resume(state)
        for step in range(steps):
            train_step(state, step)
            time.sleep(0.01)
            started = time.monotonic()
            guard.step(step, state)
            longest = max(longest, time.monotonic() - started)
        guard.snapshots.wait()
        agreed = [[e.detail["on"], e.detail["step"]] for e in guard.timeline.entries if e.event == "agreed"]
        complete = guard.snapshots.complete
    done = {
        "longest_step_s": longest,
        "agreed": agreed,
        "taken": [[step, snapshot.ok] for step, snapshot in seen.args_of("snapshot of step %d: %s")],
        "not_complete": [list(a) for a in seen.args_of("the snapshot of step %d is not complete everywhere (%s)")],
        "complete": complete,
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(done))


class CuttingProxy:
    """A TCP relay on 127.0.0.1 to `upstream` that closes a connection once `cut_after` bytes of its
    answer have passed (a peer gone mid-stream); shorter answers pass whole."""

    def __init__(self, upstream: tuple[str, int], cut_after: int, connect: Callable[..., socket.socket]) -> None:
        self.upstream, self.cut_after, self._connect = upstream, cut_after, connect
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, self._connect(self.upstream) as upstream:
            requests = threading.Thread(target=_pump, args=(client, upstream), daemon=True)
            requests.start()  # what the client sends passes whole
            passed = 0
            while data := upstream.recv(1 << 16):
                client.sendall(data[: self.cut_after - passed])
                passed += len(data)
                if passed >= self.cut_after:
                    self.cuts += 1
                    break
            client.shutdown(socket.SHUT_RDWR)  # a FIN mid-answer; and the pump's recv returns
            requests.join()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass  # the relay closed the pair


def through_cutting_proxies(cut_after: int) -> dict[tuple[str, int], CuttingProxy]:
    """Route every TCP connection this process opens from Python (here: the snapshot peers') through a
    CuttingProxy of its destination (the library's boundary: the peers' code is left as it is); the
    proxies, by destination, as they are made."""
    connect, proxies = socket.create_connection, {}

    def create_connection(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        if address not in proxies:
            proxies[address] = CuttingProxy(address, cut_after, connect)
        return connect(proxies[address].address, *args, **kwargs)

    socket.create_connection = create_connection
    return proxies


def durable_over_a_cut_stream(group, rank: int, ckpt: str, memory: list[str], out: str) -> None:
    """Two starts of a 2-rank job (one rank a node). The first saves durably at step 5 and snapshots
    every 2 steps up to 8, each rank's shard replicated to the other. Rank 1's node is then replaced
    (its memory empty): the second start must read rank 1's shard from rank 0, over a connection cut
    after 64 KiB of the shard's body, while rank 0 reads its own shard whole."""
    import torch.distributed as dist

    from spotguard.checkpoint.state import state_digest

    # No liveness watch: its connections would go through the proxy too.
    options = {
        "cloud": "none",
        "snapshot_every": 2,
        "snapshot_dir": memory[rank],
        "exit_code": None,
        "peer_timeout_s": 0,
    }
    state = model_state()
    with spotguard.Guard(ckpt, save_every=5, **options) as guard:
        guard.resume(state)
        for step in range(9):
            train_step(state, step)
            guard.step(step, state)
            if step == 5:
                durable = state_digest(state["model"].state_dict())  # what the save of step 5 copied
        guard.snapshots.wait()  # both replicas of step 8 arrive before either peer server closes
        dist.barrier()
    if rank == 1:
        shutil.rmtree(memory[1])  # a replacement VM: nothing in its memory
        proxies = through_cutting_proxies(64 << 10)
    dist.barrier()
    seen = Records()
    state = model_state(seed=1)
    with spotguard.Guard(ckpt, **options) as guard:
        start = guard.resume(state)
        tier = [e.detail["tier"] for e in guard.timeline.entries if e.event == "resumed"]
    read = seen.args_of("snapshot of step %d: read %d bytes of rank %d's shard (of %d) from %s")
    done = {"start": start, "tier": tier, "digest": state_digest(state["model"].state_dict()), "durable": durable,
            "read": [[step, shard, where] for step, _, shard, _, where in read], "warnings": seen.warnings(),
            "cuts": sum(p.cuts for p in proxies.values()) if rank == 1 else None}  # fmt: skip
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(done))


SHORT_VERDICT_S = 2.0  # the verdict wait, down from 300 s for the test
HELD_AFTER_S = 2.0  # how long rank 1's replication is held after rank 0 gave up on its verdict
HELD_AT_MOST_S = 60.0


def a_report_that_never_comes_in_time(group, rank: int, ckpt: str, memory: list[str], out: str) -> None:
    """A snapshot at steps 0 and 1 on both ranks. Rank 1's replication of step 0 is held until HELD_AFTER_S
    after rank 0 gave up waiting for its verdict (SHORT_VERDICT_S) and ended step 1, so rank 1 reports
    step 0 after that. Writes the verdicts each rank read, how long its step 1 took, and which snapshot it had finished
    when step 1's began."""
    from spotguard.snapshots import tier

    tier.VERDICT_WAIT_S = SHORT_VERDICT_S
    given_up = Path(out) / "rank0-step1-done"
    if rank == 1:
        replicate = tier.push

        def held(*args: Any, **kwargs: Any) -> None:
            deadline = time.monotonic() + HELD_AT_MOST_S
            while not given_up.exists() and time.monotonic() < deadline:  # a buddy that answers slowly
                time.sleep(0.05)
            time.sleep(HELD_AFTER_S)
            replicate(*args, **kwargs)

        tier.push = held
    seen = Records()
    state = model_state()
    with spotguard.Guard(ckpt, cloud="none", snapshot_every=1, snapshot_dir=memory[rank], exit_code=None) as guard:
        guard.resume(state)
        train_step(state, 0)
        guard.step(0, state)
        train_step(state, 1)
        started = time.monotonic()
        guard.step(1, state)
        step_1_s = time.monotonic() - started
        if rank == 0:
            given_up.touch()
        finished_before = [a[0] for a in seen.args_of("snapshot of step %d: %s")]
        guard.snapshots.wait()
        complete = guard.snapshots.complete
        torch.distributed.barrier(group)  # rank 0 (the store's host, a buddy) stays until rank 1 is done
    done = {
        "step_1_s": step_1_s,
        "finished_before_step_1": finished_before,
        "not_complete": [list(a) for a in seen.args_of("the snapshot of step %d is not complete everywhere (%s)")],
        "complete": complete,
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(done))


REFUSED = 2  # the step whose replica of rank 0's shard its buddy never gets


def a_replica_refused_then_a_node_lost(group, rank: int, ckpt: str, memory: list[str], out: str) -> None:
    """Two starts of a 2-rank job (one rank a node), snapshots every 2 steps, nothing durable. In the
    first, rank 0's replica of step REFUSED never reaches rank 1 (every shard was written, but that
    snapshot's verdict fails), and rank 1's state cannot be read at the two snapshots after it (they
    are never whole). Rank 1's node is then replaced (its memory empty), and the second start resumes
    from what rank 0's node holds."""
    import torch.distributed as dist

    from spotguard.checkpoint.state import state_digest
    from spotguard.snapshots import tier

    if rank == 0:
        replicate = tier.push

        def refused(address: str, path: Path, name: str) -> None:
            if name.startswith(f"step-{REFUSED:010d}/"):
                raise ConnectionResetError("the buddy's peer server dropped the replica")
            replicate(address, path, name)

        tier.push = refused
    seen = Records()
    options = {"cloud": "none", "snapshot_every": 2, "snapshot_dir": memory[rank], "exit_code": None}
    state = {**model_state(), "loader": Unreadable(3 if rank == 1 else 0, times=2)}  # its snapshots of 4 and 6
    with spotguard.Guard(ckpt, **options) as guard:
        guard.resume(state)
        for step in range(REFUSED + 5):
            train_step(state, step)
            guard.step(step, state)
            if step == REFUSED:
                digest = state_digest(state["model"].state_dict())
        guard.snapshots.wait()
        dist.barrier()
    not_complete = [list(a) for a in seen.args_of("the snapshot of step %d is not complete everywhere (%s)")]
    held = sorted({int(p.parent.name.removeprefix("step-")) for p in Path(memory[rank]).rglob("step-*/*.snap")})
    if rank == 1:
        shutil.rmtree(memory[1])  # a replacement VM: nothing in its memory
    dist.barrier()
    state = {**model_state(seed=1), "loader": Unreadable(0)}
    with spotguard.Guard(ckpt, **options) as guard:
        start = guard.resume(state)
        tier_of = [e.detail["tier"] for e in guard.timeline.entries if e.event == "resumed"]
    done = {"not_complete": not_complete, "held": held, "start": start, "tier": tier_of, "digest": digest,
            "resumed_digest": state_digest(state["model"].state_dict())}  # fmt: skip
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(done))


SCENARIOS = {
    f.__name__: f
    for f in (
        timed_snapshots,
        durable_over_a_cut_stream,
        a_report_that_never_comes_in_time,
        a_replica_refused_then_a_node_lost,
    )
}


# ---- a snapshot given up after reading began: the durable checkpoint over it ----------------------------------


def damage_every_snapshot(memory: Path) -> list[Path]:
    """Flip a byte in the body of every snapshot file under `memory`: each fails its block's CRC32C
    only once that block was read into the state."""
    damaged = sorted(memory.rglob("*.snap"))
    for path in damaged:
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(data)
    return damaged


def test_no_whole_snapshot_after_reading_began_loads_the_durable_checkpoint_over_the_state(tmp_path, caplog):
    _, durable, _ = run(tmp_path, 3, save_every=2)  # durable 0 and 2: the state as step 2 saved it
    run(tmp_path, 11)  # resumed from durable 2; snapshots 4 and 8, both newer
    assert [p.parent.name for p in damage_every_snapshot(tmp_path / "memory")] == ["step-0000000004", "step-0000000008"]
    with caplog.at_level(logging.INFO):
        start, state, _ = run(tmp_path, 3)
    assert "snapshot of step 8 (world size 1): rank 0 cannot use shard 0" in caplog.text  # read, then refused
    assert "snapshot of step 4 (world size 1): rank 0 cannot use shard 0" in caplog.text
    assert "no snapshot could be read whole after a rank began reading one; loading the durable checkpoint" in (
        caplog.text
    )
    assert start == 3
    assert digest(state) == digest(durable)  # nothing of the half-read snapshots left in the tensors
    assert resumes(tmp_path)[-1]["tier"] == "durable"
    assert not list((tmp_path / "memory").rglob("*.snap"))  # the damaged snapshots deleted


def test_no_whole_snapshot_after_reading_began_and_no_durable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    run(tmp_path, 11)  # snapshots 4 and 8, nothing durable
    damage_every_snapshot(tmp_path / "memory")
    with pytest.raises(CheckpointError, match="after a rank began reading one, and there is no durable checkpoint"):
        run(tmp_path, 12)  # training never starts from a state overwritten in part


def test_a_buddys_stream_cut_midway_loads_the_durable_checkpoint_over_every_rank(tmp_path):
    memory = [str(tmp_path / "node0-memory"), str(tmp_path / "node1-memory")]
    done = run_scenario("durable_over_a_cut_stream", 2, ckpt=str(tmp_path / "ckpt"), memory=memory, out=str(tmp_path))
    assert done[1]["cuts"] == 2  # shard 1 of step 8, then of step 6: each read from rank 0 and cut
    assert done[0]["read"] == [[8, 0, "this node"], [6, 0, "this node"]]  # rank 0 read its own shard whole, twice
    assert "cannot use shard 1 from rank 0 (HandoffError: the connection closed at byte 65" in done[0]["warnings"]
    for result in done:  # rank 0 had read its own shard whole: the durable step is loaded over it too
        assert "could be read whole after a rank began reading one; loading the durable" in result["warnings"]
        assert (result["start"], result["tier"]) == (6, ["durable"])
        assert result["digest"] == result["durable"]
    assert resumes(tmp_path)[-1]["tier"] == "durable"


# ---- a failed snapshot on one rank; timed snapshots agreed ------------------------------------------------------


def test_timed_snapshots_are_agreed_and_one_ranks_failure_is_every_ranks_verdict_at_once(tmp_path):
    """Two ranks, a snapshot every 0.3 s asked by rank 0's timer: each is taken at one agreed step by
    both ranks. Rank 1's state cannot be read at its second snapshot: that is rank 1's failed
    snapshot, reported at once, so both ranks read "failed" at the next one (not after the 300 s
    verdict wait), keep the one before as the newest complete, and go on."""
    memory = [str(tmp_path / "node0-memory"), str(tmp_path / "node1-memory")]
    where = {"ckpt": str(tmp_path / "ckpt"), "memory": memory, "out": str(tmp_path)}
    done = run_scenario("timed_snapshots", 2, **where, steps=STEPS, interval_s=0.3, failing_rank=1)
    taken = [[step for step, _ in result["taken"]] for result in done]
    assert len(taken[0]) >= 4, done[0]  # enough for a verdict after the failure and one after that
    assert taken[0] == taken[1]  # every snapshot at one step on every rank
    for result in done:  # agreed like an interval save, recorded on each rank: every agreed step reached, taken
        assert [[on, step] for on, step in result["agreed"] if step < STEPS] == [["checkpoint", s] for s in taken[0]]
    failed = taken[0][1]
    assert done[1]["taken"][1] == [failed, False] and done[0]["taken"][1] == [failed, True]
    for result in done:
        assert result["not_complete"] == [[failed, "failed"]]  # the same verdict, read by both
        assert result["longest_step_s"] < VERDICT_BOUND_S
    assert done[0]["complete"] == done[1]["complete"] == taken[0][-2]  # complete again after it
    assert len(list(Path(memory[0]).rglob(f"step-{failed:010d}/*.snap"))) == 0  # freed: it was never whole


def test_a_verdict_that_never_comes_is_timed_out_once_for_every_rank_and_a_snapshot_waits_for_the_one_before(
    tmp_path,
):
    """Rank 1's first snapshot is still replicating when its next is due: its training thread waits for it
    (a rank never has two snapshots in flight). Rank 0, waiting for the verdict of the first, stops after
    the verdict wait and writes "failed: not every rank reported in time"; rank 1's report, coming later,
    cannot turn it into "ok": both ranks read the same verdict and neither counts that snapshot complete."""
    memory = [str(tmp_path / "node0-memory"), str(tmp_path / "node1-memory")]
    done = run_scenario("a_report_that_never_comes_in_time", 2, ckpt=str(tmp_path / "ckpt"), memory=memory,
                        out=str(tmp_path))  # fmt: skip
    for result in done:
        assert result["not_complete"] == [[0, TIMED_OUT]], result
        assert result["complete"] is None, result
    assert done[1]["finished_before_step_1"] == [0]  # its step-0 snapshot, finished before step 1's began
    assert done[0]["step_1_s"] >= SHORT_VERDICT_S - 0.5, done[0]  # rank 0 waited out the verdict wait
    # rank 1 waited for its snapshot in flight, held beyond its own verdict wait
    assert done[1]["step_1_s"] >= SHORT_VERDICT_S + HELD_AFTER_S - 1.0, done[1]


def test_a_snapshot_whose_replication_failed_is_kept_and_resumed_from_when_the_survivors_hold_it_whole(tmp_path):
    """A failed verdict does not free a snapshot whose every shard was written: it may be whole on the
    nodes that survive, and it is the newest they can hold. Rank 0's replica of step 2 never reaches rank
    1's node, rank 1's snapshots of steps 4 and 6 fail (its state cannot be read), and rank 1's node is
    then lost. Step 4, never whole, is freed at step 6's snapshot; step 2 is kept. Rank 0's node holds it
    whole (its own shard, rank 1's replica): the job resumes from it, not from step 0."""
    memory = [str(tmp_path / "node0-memory"), str(tmp_path / "node1-memory")]
    done = run_scenario("a_replica_refused_then_a_node_lost", 2, ckpt=str(tmp_path / "ckpt"), memory=memory,
                        out=str(tmp_path))  # fmt: skip
    for result in done:
        assert (result["start"], result["tier"]) == (REFUSED + 1, ["snapshot"]), result
        assert result["resumed_digest"] == result["digest"], result
    assert done[0]["held"] == [0, REFUSED, REFUSED + 4]  # step 0 complete, step 2 kept, step 6 begun
    # Rank 1's node kept its own shard of step 2 too, and freed step 4 though its state could not be read
    # at step 6: a rank whose snapshot fails still clears its node (it goes on taking its buddy's replicas).
    assert done[1]["held"] == [0, REFUSED, REFUSED + 4]
    for result in done:  # the same verdicts on both ranks: step 2's shards were all written, one of step 4's not
        assert result["not_complete"] == [[REFUSED, NOT_REPLICATED], [REFUSED + 2, "failed"]], result


# ---- a step both an agreed round's and a step count's: both are made --------------------------------------------


def test_a_save_agreed_at_a_snapshot_step_takes_that_steps_snapshot_too(tmp_path):
    """snapshot_every=1 and a save asked at step 3, agreed at a step that is also a snapshot's: the agreed
    save is made, and the snapshot of that step too (it was dropped without a word: wait() went on
    returning the snapshot of the step before)."""
    state = {"w": torch.zeros(64)}
    options = {"snapshot_every": 1, "snapshot_dir": str(tmp_path / "memory"), "exit_code": None}
    with spotguard.Guard(str(tmp_path / "ckpt"), cloud="none", **options) as guard:
        for step in range(12):
            if step == 3:
                guard.request_checkpoint("manual")
            state["w"].fill_(step)
            guard.step(step, state)
            done = guard.snapshots.wait()
            assert done is not None and done.step == step and done.ok, (step, done)
            time.sleep(0.02)  # the listener's time to agree on the request
    assert [c.reason for c in list_checkpoints(str(tmp_path / "ckpt"))] == ["manual"]


def test_a_timed_snapshot_at_a_save_every_step_leaves_that_steps_save_made(tmp_path):
    """save_every=1 and a snapshot asked by the timer every 0.2 s: every step is saved, those the timer's
    snapshots were agreed at too (their save was dropped), and the snapshots are taken."""
    state = {"w": torch.zeros(64)}
    options = {"save_every": 1, "snapshot_interval_s": 0.2, "snapshot_dir": str(tmp_path / "memory"),
               "exit_code": None}  # fmt: skip
    snapshots = []
    with spotguard.Guard(str(tmp_path / "ckpt"), cloud="none", **options) as guard:
        for step in range(40):
            state["w"].fill_(step)
            guard.step(step, state)
            done = guard.snapshots.wait() if guard.snapshots is not None else None
            if done is not None and done.step == step:
                snapshots.append(step)
            time.sleep(0.02)
    assert len(snapshots) >= 2, snapshots  # 0.8 s of steps at the least
    saved = [(c.step, c.reason) for c in list_checkpoints(str(tmp_path / "ckpt"))]
    assert saved == [(s, "periodic") for s in range(40)]


# ---- the auto snapshot interval ---------------------------------------------------------------------------------


def test_auto_snapshot_interval_follows_young_daly_from_the_measured_stall_and_the_ledgers_interruptions(
    tmp_path, capsys, caplog
):
    ckpt = tmp_path / "ckpt"
    state = {**trained(1, steps=0), "buffer": torch.ones(4 << 20)}  # 16 MiB: a stall of milliseconds at least
    with spotguard.Guard(str(ckpt), cloud="none", exit_code=None) as guard:  # a segment a spot notice ends
        assert train(guard, state, on_step=lambda s: s == 1 and os.kill(os.getpid(), signal.SIGTERM)) is not None
    history = report_json(ckpt, capsys)
    assert history["interruptions"] == 1
    hours = sum(s["wall_s"] for s in history["segment_details"]) / 3600
    with spotguard.Guard(str(ckpt), cloud="none", snapshot_interval_s="auto", snapshot_dir=str(tmp_path / "memory"),
                         exit_code=None) as guard:  # fmt: skip
        next_wait = guard._rounds.snapshot_timer._interval  # what rank 0's snapshot timer waits next
        start = guard.resume(state)
        assert next_wait() == SNAPSHOT_MIN_S  # nothing measured yet: the lower bound, to measure one soon
        guard._rounds.request(SNAPSHOT)  # what the timer asks when it fires (request_checkpoint refuses the reason)
        step = start
        while guard.snapshots is None or guard.snapshots.last is None:
            assert step < start + 1000, "no snapshot taken"
            time.sleep(0.01)
            guard.step(step, state)
            step += 1
        stall = guard.snapshots.last.stall_s  # the tier's own measurement
        waits = next_wait()
    rate = (1 + 1 / 24 * 4) / (hours + 4)  # the gamma-Poisson rate: 1 interruption in `hours`, the prior as 4 h

    def young_daly(rate_per_h: float) -> float:
        return min(SNAPSHOT_MAX_S, max(SNAPSHOT_MIN_S, math.sqrt(2 * stall * 3600 / rate_per_h)))

    assert waits == pytest.approx(young_daly(rate), rel=1e-3)
    assert young_daly(1 / 24) > 1.05 * waits  # the prior alone would wait longer: the ledger was read
    said = [r.getMessage() for r in caplog.records if "interval (auto)" in r.getMessage()]
    assert said and all(m.startswith("snapshot interval (auto): ") for m in said), said  # not called a save's
    assert "snapshot stall" in said[-1] and "save" not in said[-1], said[-1]


def test_a_snapshot_whose_thread_cannot_start_is_a_failed_snapshot_voted_at_once(tmp_path, monkeypatch):
    """The background part of a snapshot could not start (the process is out of threads): its failure is
    voted at once, so the next snapshot finds its verdict instead of waiting VERDICT_WAIT_S for it."""
    from spotguard.snapshots import tier

    monkeypatch.setattr(tier, "VERDICT_WAIT_S", 30.0)
    real_start = threading.Thread.start
    refused = []

    def start(self) -> None:
        if self.name == "spotguard-snapshot" and not refused:
            refused.append(self)
            raise RuntimeError("can't start new thread")
        real_start(self)

    state = {"w": torch.zeros(1 << 16)}
    options = {"snapshot_every": 1, "snapshot_dir": str(tmp_path / "memory"), "exit_code": None}
    with spotguard.Guard(str(tmp_path / "ckpt"), cloud="none", **options) as guard:
        guard.step(0, state)
        assert guard.snapshots.wait().ok
        monkeypatch.setattr(threading.Thread, "start", start)
        guard.step(1, state)
        failed = guard.snapshots.wait(5)
        assert failed is not None and failed.step == 1 and not failed.ok and "can't start" in failed.error
        began = time.monotonic()
        guard.step(2, state)
        assert time.monotonic() - began < 15  # not VERDICT_WAIT_S
        done = guard.snapshots.wait()
        assert done.step == 2 and done.ok
        assert guard.snapshots.complete == 0
