"""The snapshot tier's parts: the file (complete or absent, CRC-checked), a node's directory, the
choice of the snapshot to resume from, the transfers between nodes (real sockets on 127.0.0.1), the
settings and the environment, and a single-process Guard resuming from its own node's memory.
The three-node losses are in test_snapshots_multinode.py."""

from __future__ import annotations

import json
import logging
import mmap
import os
import platform
import re
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard.checkpoint import list_checkpoints
from spotguard.checkpoint.state import load_from_dcp, state_digest, to_dcp
from spotguard.cli import main
from spotguard.job.departure import HandoffError
from spotguard.job.topology import node_count
from spotguard.options import SnapshotOptions
from spotguard.snapshots import shard_file
from spotguard.snapshots.items import LayoutError
from spotguard.snapshots.loading import load_shards
from spotguard.snapshots.node_dir import NodeDir, name_of
from spotguard.snapshots.peers import PeerRuns, PeerServer, fetch_info, push, receive_file
from spotguard.snapshots.reading import FileRuns, ShardUnusable
from spotguard.snapshots.recovery import Holding, Plan, choose, why_none
from spotguard.snapshots.shard_file import SnapshotError


def trained(seed: int = 0, steps: int = 3) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        sched.step()
    return {"model": model, "optim": optim, "sched": sched, "extra": {"epoch": 3, "bf16": torch.ones(3).bfloat16()}}


def digest(state: dict) -> str:
    return state_digest(state["model"].state_dict())


def write_shard(path, state_dict, step=5, rank=0, world=1):
    """A snapshot file made the way a rank makes one: laid out, filled, finished."""
    shard = shard_file.MappedShard(path, state_dict).fill()
    return shard.finish(run="r", job="j", attempt="a", step=step, rank=rank, world_size=world)


def load(path, state, info=None, source=None) -> dict:
    """Load the one-shard snapshot at `path` (or from `source`) into `state` through DCP's planner;
    the DCP state dict loaded."""
    info = info or shard_file.read_info(path)
    live = to_dcp(state)
    load_shards(live, {0: info}, lambda s: s, lambda shard, runs: source(runs) if source else FileRuns(path))
    load_from_dcp(state, live)
    return live


def write(tmp_path, state, step=5, rank=0, world=1):
    path = tmp_path / "shard.snap"
    info = write_shard(path, to_dcp(state), step, rank, world)
    return path, info


def test_a_snapshot_file_loads_back_bit_identical_into_the_live_tensors(tmp_path):
    saved = trained(0)
    path, info = write(tmp_path, saved)
    assert shard_file.read_info(path) == info
    assert not list(tmp_path.glob("*.part"))
    state = trained(1, steps=0)
    weight = state["model"][0].weight
    load(path, state)
    assert state["model"][0].weight is weight  # read into the parameter itself
    assert digest(state) == digest(saved)
    assert state["sched"].state_dict() == saved["sched"].state_dict()
    assert state["extra"]["epoch"] == 3 and state["extra"]["bf16"].dtype == torch.bfloat16
    for group in ("state", "param_groups"):
        assert str(state["optim"].state_dict()[group]) == str(saved["optim"].state_dict()[group])


def test_a_flipped_byte_or_a_cut_file_fails_verification(tmp_path):
    path, info = write(tmp_path, trained())
    data = bytearray(path.read_bytes())
    data[info.body_bytes // 2] ^= 1
    path.write_bytes(data)
    with pytest.raises(ShardUnusable, match="CRC32C"):
        load(path, trained(1), info)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(SnapshotError):
        shard_file.read_info(path)
    with pytest.raises(ShardUnusable):
        load(path, trained(1), info)


def test_a_write_that_fails_leaves_nothing_under_the_final_name(tmp_path, monkeypatch):
    def full_disk(crc, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_file, "crc32c_extend", full_disk)
    with pytest.raises(OSError, match="No space"):
        write(tmp_path, trained())
    assert list(tmp_path.iterdir()) == []


def test_a_fill_that_fails_leaves_no_part_file(tmp_path):
    state = {"a": torch.ones(4), "b": torch.empty(2, device="meta")}  # a tensor with no data to copy
    shard = shard_file.MappedShard(tmp_path / "s.snap", state)
    with pytest.raises((RuntimeError, NotImplementedError)):
        shard.fill()
    assert list(tmp_path.iterdir()) == []


def test_the_node_dir_lists_complete_files_and_keeps_only_the_steps_asked(tmp_path):
    node = NodeDir(tmp_path, "run")
    for step in (3, 6, 9):
        node.prepare(name_of(step, 0, 2)).write_bytes(b"x")
    node.prepare(name_of(9, 1, 2)).with_suffix(".snap.part").write_bytes(b"half")
    assert [(h.step, h.rank) for h in node.held()] == [(9, 0), (6, 0), (3, 0)]
    node.keep_only({6, 9})
    assert [h.step for h in node.held()] == [9, 6]
    with pytest.raises(ValueError, match="not a snapshot file name"):
        node.file("../../etc/passwd")


def test_a_step_another_local_rank_sweeps_away_meanwhile_is_no_error(tmp_path, monkeypatch):
    """The local ranks of a node sweep its directory at the same moments: a step directory removed by
    another between this rank's listing of the steps and its listing of that step is skipped (an
    error there failed that rank's snapshot, so every node deleted the snapshot before it)."""
    node = NodeDir(tmp_path, "run")
    for step in (3, 6, 9):
        node.prepare(name_of(step, 0, 2)).write_bytes(b"x")
    scandir = os.scandir

    def swept_first(path="."):  # the other rank's rmtree lands just before this listing
        if isinstance(path, str | os.PathLike) and Path(path).name == "step-0000000003":
            shutil.rmtree(path, ignore_errors=True)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", swept_first)
    assert [h.step for h in node.held()] == [9, 6]
    node.prepare(name_of(3, 0, 2)).write_bytes(b"x")
    node.keep_only({9}, spares=1)
    assert [h.step for h in node.held()] == [9]


def test_a_freed_snapshot_file_is_written_over_by_the_next_one(tmp_path):
    node = NodeDir(tmp_path, "run")
    big, small = trained(0), {"t": torch.arange(10.0)}
    first = node.prepare(name_of(1, 0, 1))
    write_shard(first, to_dcp(big), step=1)
    inode = first.stat().st_ino
    node.keep_only({2}, spares=1)  # step 1 freed: its file set aside
    assert node.held() == [] and len(list((node.path / "spare").iterdir())) == 1
    second = node.prepare(name_of(2, 0, 1))
    shard = shard_file.MappedShard(second, small, node.take_spare)
    shard.fill()
    info = shard.finish(run="r", job="j", attempt="a", step=2, rank=0, world_size=1)
    assert second.stat().st_ino == inode  # the same file, its pages reused
    assert shard_file.read_info(second) == info  # a longer spare's tail cut off
    loaded = {"t": torch.zeros(10)}
    load(second, loaded)
    assert torch.equal(loaded["t"], small["t"])
    assert not node.take_spare(tmp_path / "none")  # taken: none left


@pytest.mark.parametrize(
    "local, nodes, world, count",
    [
        ("2", "2", 4, 2),
        ("1", None, 3, 3),  # no torchrun: one rank per node
        ("2", "2", 3, None),  # nodes of 2 and 1 ranks: the node of 2 ...
        ("1", "2", 3, None),  # ... and the node of 1 both see it
        ("2", None, 3, None),  # 2 does not divide 3
        ("2", "3", 6, 3),  # nodes of 1, 2 and 3 ranks: the node of 2 cannot tell (documented)
        ("2", "", 4, 2),  # an empty or odd GROUP_WORLD_SIZE is no count
    ],
)
def test_an_uneven_layout_is_seen_from_torchruns_counts(monkeypatch, local, nodes, world, count):
    """Buddies are the same local rank on the next nodes: only meaningful when every node runs as many ranks."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    if nodes is None:
        monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("GROUP_WORLD_SIZE", nodes)
    assert node_count(world) == count


def test_the_newest_whole_snapshot_is_chosen_at_any_world_size_from_one_attempt():
    # Taken by 4 ranks on 2 nodes; node 1 (ranks 2, 3) was lost: its shards only as replicas on node 0.
    # The job now runs 2 ranks, one per node.
    def h(step, shard, world=4, attempt="a"):
        return Holding(step, attempt, world, shard)

    held = [(0, [h(9, 0), h(9, 2), h(6, 0)]), (1, [h(9, 1), h(9, 3), h(6, 1)])]
    assert choose(held, 2, durable=None) == Plan(9, "a", 4, ((0,), (1,), (0,), (1,)))
    assert choose(held, 2, durable=9) == Plan(9, "a", 4, ((0,), (1,), (0,), (1,)))  # memory is faster
    assert choose(held, 2, durable=10) is None
    assert choose(held[:1], 2, durable=None) is None  # shards 1 and 3 are nowhere
    # Step 9 of another start of the job (a node that missed the restart kept it) is never mixed in.
    mixed = [(0, [h(9, 0), h(9, 2), h(6, 0), h(6, 2)]), (1, [h(9, 1, attempt="b"), h(9, 3), h(6, 1), h(6, 3)])]
    assert choose(mixed, 2, durable=None).step == 6
    # At one step, the snapshot at the present world size goes first; a copy struck off is not offered.
    both = [(0, [h(9, 0, 2), h(9, 0), h(9, 1), h(9, 2), h(9, 3)]), (1, [h(9, 1, 2), h(9, 0)])]
    assert choose(both, 2, durable=None) == Plan(9, "a", 2, ((0,), (1,)))
    assert choose(both, 2, None, {(9, "a", 2, 1, 1)}) == Plan(9, "a", 4, ((0, 1), (0,), (0,), (0,)))
    assert choose(both, 2, None, {(9, "a", 2, 1, 1), (9, "a", 4, None, None)}) is None
    # When none is whole, the log says what the newest ones lack.
    assert why_none(held[:1], 2, durable=None) == (
        "step 9 (world size 4) lacks shard(s) 1, 3; step 6 (world size 4) lacks shard(s) 1, 2, 3"
    )
    assert why_none(held, 2, durable=10) == "the surviving nodes hold none so new"


def test_replicas_go_to_a_peer_and_come_back_checked_straight_into_the_state(tmp_path):
    target = NodeDir(tmp_path / "b", "run")
    name = name_of(4, 1, 2)
    saved = trained()
    path, _ = write(tmp_path, saved)
    server = PeerServer(target)

    def from_peer(name):
        return lambda runs: PeerRuns(server.address, name, runs)

    try:
        push(server.address, path, name)
        assert shard_file.read_info(target.file(name)).step == 5
        state = trained(1, steps=0)
        weight = state["model"][0].weight
        info = fetch_info(server.address, name)
        assert info == shard_file.read_info(path)
        load(None, state, info, from_peer(name))
        assert state["model"][0].weight is weight and digest(state) == digest(saved)
        with pytest.raises(HandoffError, match="no step"):
            fetch_info(server.address, name_of(8, 1, 2))
        host, port, _ = server.address.split()
        with pytest.raises(HandoffError, match="wrong token"):
            push(f"{host} {port} not-the-token", path, name_of(7, 1, 2))
        assert not target.file(name_of(7, 1, 2)).exists()
        data = bytearray(target.file(name).read_bytes())
        data[len(data) // 2] ^= 0xFF  # a replica damaged where it is kept: found as it arrives
        target.file(name).write_bytes(data)
        with pytest.raises(ShardUnusable, match="CRC32C"):
            load(None, trained(1, steps=0), info, from_peer(name))
    finally:
        server.close()


def test_a_replica_damaged_on_the_way_is_refused_and_not_kept(tmp_path):
    target = NodeDir(tmp_path / "b", "run")
    path, info = write(tmp_path, trained())
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF  # as if flipped in transit: the trailer still says the original CRC32C
    server = PeerServer(target)
    try:
        host, port, token = server.address.split()
        with socket.create_connection((host, int(port))) as sock:
            head = json.dumps({"token": token, "op": "put", "name": name_of(1, 0, 1), "bytes": len(data),
                               "body_bytes": info.body_bytes}).encode()  # fmt: skip
            sock.sendall(len(head).to_bytes(8, "big") + head + bytes(data))
            length = int.from_bytes(sock.recv(8), "big")
            answer = json.loads(sock.recv(length))
        assert not answer["ok"] and "CRC32C" in answer["error"]
        assert target.held() == [] and not list(target.path.rglob("*.part"))
    finally:
        server.close()


def test_a_replica_comes_into_pages_mapped_up_front_not_one_fault_per_page(tmp_path, monkeypatch):
    """A page fault per 4 KiB of a replica cost the receiving node about 0.3 s of CPU per GiB: the
    pages (a freed replica's, as in every snapshot after the first two) are mapped at once, so the
    bytes received into them take faults for a small fraction of its pages."""
    path = tmp_path / "shard.snap"
    info = write_shard(path, {"w": torch.ones(8 << 20)})
    size = path.stat().st_size
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    mapped_at: list[int] = []  # the receiving thread's faults once its pages are mapped

    def map_and_count(fd: int, length: int) -> mmap.mmap:
        mapped = map_populated(fd, length)
        mapped_at.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
        return mapped

    map_populated = shard_file.map_populated
    monkeypatch.setattr(shard_file, "map_populated", map_and_count)
    with tempfile.TemporaryDirectory(dir=shm) as where:
        target = NodeDir(Path(where), "run")

        def take(step: int) -> int:
            """The receiving thread's page faults while the replica of `step` is received."""
            dest = target.prepare(name_of(step, 0, 1))
            receiver, sender = socket.socketpair()
            with receiver, sender, open(path, "rb") as f:
                feeding = threading.Thread(target=sender.sendfile, args=(f, 0))
                feeding.start()
                assert receive_file(receiver, dest, size, info.body_bytes, target) == info
                faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - mapped_at[-1]
                feeding.join()
            assert dest.read_bytes() == path.read_bytes()
            return faults

        take(1)
        target.keep_only({2}, spares=1)  # step 1's file becomes the spare step 2 writes over
        faults = take(2)
    assert faults < size // mmap.PAGESIZE // 4, faults


def test_the_pages_are_mapped_while_other_threads_of_the_process_run(tmp_path):
    """Populating a snapshot's or a replica's pages takes the kernel about 0.6 s per GiB of new memory:
    mmap's MAP_POPULATE holds the GIL all along (the training thread stood still behind a replica
    being received); the populate used releases it (kernels from 5.14: older ones refuse it)."""
    release = tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2])
    if sys.platform != "linux" or release < (5, 14):
        pytest.skip(f"MADV_POPULATE_WRITE needs Linux 5.14 ({platform.platform()})")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    size = 256 << 20
    with tempfile.TemporaryDirectory(dir=shm) as where:
        fd = shard_file.reserve(Path(where) / "big.part", size)  # new pages: the slowest to populate
        ran_at: list[float] = []  # each pass of another thread, which needs the GIL
        done = threading.Event()

        def other_thread() -> None:
            while not done.is_set():
                ran_at.append(time.monotonic())
                time.sleep(0.0005)

        thread = threading.Thread(target=other_thread)
        thread.start()
        while not ran_at:
            time.sleep(0.001)
        began = time.monotonic()
        with shard_file.map_populated(fd, size):
            mapped = time.monotonic()
        done.set()
        thread.join()
        os.close(fd)
    if mapped - began < 0.03:
        pytest.skip(f"the pages were mapped in {mapped - began:.3f} s: too fast to tell")
    assert len([t for t in ran_at if began < t < mapped]) >= 5, mapped - began


def test_the_environment_switches_snapshots_on(monkeypatch):
    assert not SnapshotOptions().enabled
    monkeypatch.setenv("SPOTGUARD_SNAPSHOT_EVERY", "50")
    assert SnapshotOptions().snapshot_every == 50
    assert SnapshotOptions(snapshot_interval_s=30).snapshot_every is None  # the code's choice wins
    monkeypatch.setenv("SPOTGUARD_SNAPSHOT_EVERY", "auto")
    assert SnapshotOptions().snapshot_interval_s == "auto"
    monkeypatch.setenv("SPOTGUARD_SNAPSHOT_EVERY", "often")
    with pytest.raises(ValueError, match="SPOTGUARD_SNAPSHOT_EVERY must be a number of steps"):
        SnapshotOptions()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"snapshot_every": 0}, "snapshot_every must be >= 1"),
        ({"snapshot_every": 5, "snapshot_interval_s": 60}, "not both"),
        ({"snapshot_interval_s": "often"}, 'snapshot_interval_s must be a number of seconds or "auto"'),
        ({"snapshot_replicas": 0}, "snapshot_replicas must be >= 1"),
    ],
)
def test_bad_snapshot_settings_are_one_line_errors(options, error):
    with pytest.raises((ValueError, TypeError), match=error):
        spotguard.Guard("/tmp/unused", cloud="none", **options)


def run(tmp_path, stop: int, *, start_state_seed: int = 1, **options) -> tuple[int, dict, spotguard.Guard]:
    """Train a small model from steps `resume` to `stop` under a single-process guard."""
    state = trained(start_state_seed, steps=0)
    options = {"snapshot_every": 4, "snapshot_dir": str(tmp_path / "memory"), "exit_code": None, **options}
    with spotguard.Guard(str(tmp_path / "ckpt"), cloud="none", **options) as guard:
        start = guard.resume(state)
        for step in range(start, stop):
            torch.manual_seed(step)
            state["model"](torch.randn(4, 8)).sum().backward()
            state["optim"].step()
            state["optim"].zero_grad()
            guard.step(step, state)
    return start, state, guard


def resumes(tmp_path) -> list[dict]:
    lines = (tmp_path / "ckpt" / "spotguard-ledger.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "resume"]


def test_a_restarted_process_resumes_from_its_nodes_memory_then_saves_durably(tmp_path, caplog, capsys):
    _, reference, _ = run(tmp_path / "ref", 15)
    run(tmp_path, 11)  # snapshots of steps 4 and 8 stay in the node's memory; no durable save
    assert not list((tmp_path / "ckpt").glob("step-*"))
    with caplog.at_level(logging.INFO):
        start, state, _ = run(tmp_path, 15)
    assert start == 9
    assert "resumed from the snapshot of step 8 in the nodes' memory" in caplog.text
    assert digest(state) == digest(reference)
    assert [r["tier"] for r in resumes(tmp_path)] == [None, "snapshot"]
    # at once after it: the first step every rank agrees on once the listener has the request (the loop
    # does not wait for it, so on a loaded machine that can be a step or two later than step 9)
    saved = [(c.step, c.reason) for c in list_checkpoints(str(tmp_path / "ckpt"))]
    assert len(saved) == 1 and start <= saved[0][0] < 15 and saved[0][1] == "snapshot-resume", saved
    assert main(["report", str(tmp_path / "ckpt"), "--json"]) == 0
    segments = json.loads(capsys.readouterr().out)["segment_details"]
    assert [s["resumed_tier"] for s in segments] == [None, "snapshot"]


def test_a_corrupted_snapshot_is_struck_off_for_the_one_before(tmp_path, caplog):
    run(tmp_path, 11)  # snapshots 4 and 8
    (newest,) = (tmp_path / "memory").rglob("step-0000000008/*.snap")
    data = bytearray(newest.read_bytes())
    data[100] ^= 0xFF
    newest.write_bytes(data)
    with caplog.at_level(logging.INFO):
        start, _, _ = run(tmp_path, 7)
    assert "snapshot of step 8 (world size 1): rank 0 cannot use shard 0 from rank 0 (SnapshotError: " in caplog.text
    assert "CRC32C" in caplog.text
    assert start == 5
    assert not newest.exists()


def test_a_durable_checkpoint_newer_than_every_snapshot_wins(tmp_path):
    run(tmp_path, 11, save_every=10)  # durable 10, snapshot 8
    start, _, _ = run(tmp_path, 12, save_every=10)
    assert start == 11
    assert resumes(tmp_path)[-1]["tier"] == "durable"


def test_a_snapshot_of_the_newest_durable_step_itself_is_resumed_from_memory(tmp_path, caplog):
    run(tmp_path, 9, save_every=8)  # durable 0 and 8; snapshots 4 and 8
    with caplog.at_level(logging.INFO):
        start, _, _ = run(tmp_path, 12, save_every=8)
    assert start == 9
    assert "resumed from the snapshot of step 8 in the nodes' memory (durable: 8)" in caplog.text  # memory is faster
    assert resumes(tmp_path)[-1]["tier"] == "snapshot"
    # The bucket holds that step already: no durable save is asked for after it.
    assert [p.name for p in sorted((tmp_path / "ckpt").glob("step-*"))] == ["step-0000000000", "step-0000000008"]


def test_the_auto_snapshot_interval_is_held_between_10_s_and_900_s():
    """The bounds alone (the wiring, from a Guard's own snapshot and ledger: test_snapshot_promises.py)."""
    cadence = SnapshotOptions(snapshot_interval_s="auto").cadence()
    assert cadence.interval(0.0) == 10.0  # until a snapshot is measured
    cadence.observe_save(0.0001)
    assert cadence.interval(0.0) == 10.0  # sqrt(2 x 0.1 ms x 24 h) = 4.2 s
    cadence.observe_save(20.0)
    cadence.observe_save(20.0)
    assert cadence.interval(0.0) == 900.0  # sqrt(2 x 20 s x 24 h) = 1,859 s


def test_a_snapshot_that_does_not_fit_the_state_is_dropped_before_a_byte_is_read(tmp_path, caplog):
    run(tmp_path, 11)  # snapshots 4 and 8, nothing durable
    state = trained(1, steps=0)
    state["model"][0], state["model"][2] = torch.nn.Linear(8, 32), torch.nn.Linear(32, 2)  # wider since
    state["optim"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-2)
    before = digest(state)
    with spotguard.Guard(
        str(tmp_path / "ckpt"), cloud="none", snapshot_every=4, snapshot_dir=str(tmp_path / "memory"), exit_code=None
    ) as guard:  # fmt: skip
        assert guard.resume(state) == 0  # DCP's planner refuses both before reading: a fresh start
    assert digest(state) == before
    assert "snapshot of step 8 (world size 1): rank 0 cannot use the snapshot (ValueError: Size mismatch" in caplog.text
    assert not list((tmp_path / "memory").rglob("*.snap"))  # a fresh start: they belong to a past that is gone


def test_no_snapshot_is_loaded_while_the_committed_steps_cannot_be_listed(tmp_path, monkeypatch, caplog):
    run(tmp_path, 11)

    def unlistable(self):
        raise OSError("the bucket does not answer")

    monkeypatch.setattr(spotguard.Checkpointer, "newest_committed", unlistable)
    with caplog.at_level(logging.WARNING):
        start, _, _ = run(tmp_path, 12)
    assert start == 0  # here the durable path could list: nothing committed, a fresh start
    assert "the committed steps cannot be listed (OSError: the bucket does not answer)" in caplog.text


def chunked(tmp_path, whole: torch.Tensor, parts: int) -> dict:
    """`whole` saved as `parts` shards of rows, as FSDP shards a parameter over `parts` ranks: each
    file's index says where its rows sit in the global tensor."""
    import dataclasses

    infos, rows = {}, whole.shape[0] // parts
    for shard in range(parts):
        path = tmp_path / f"shard-{shard}.snap"
        info = write_shard(path, {"w": whole[shard * rows : (shard + 1) * rows].clone()}, rank=shard, world=parts)
        (item,) = info.items
        item = dataclasses.replace(item, chunk_offsets=(shard * rows, 0), size=tuple(whole.shape))
        infos[shard] = (path, dataclasses.replace(info, items=(item,)))
    return infos


def test_the_chunks_of_several_shards_are_read_into_one_tensor_and_a_missing_one_fails_the_load(tmp_path):
    whole = torch.arange(16.0).reshape(8, 2)
    shards = chunked(tmp_path, whole, 4)
    indexes = {shard: info for shard, (_, info) in shards.items()}

    def open_shard(shard, runs):
        return FileRuns(shards[shard][0])

    live = {"w": torch.zeros(8, 2)}
    read = load_shards(live, indexes, lambda s: s, open_shard)
    assert torch.equal(live["w"], whole) and sorted(read) == [0, 1, 2, 3]
    del indexes[2]  # a shard nowhere: DCP's planner alone would leave its rows as they were
    with pytest.raises(LayoutError, match="holds 12 of its 16 elements"):
        load_shards({"w": torch.zeros(8, 2)}, indexes, lambda s: s, open_shard)


def test_a_job_at_a_new_size_keeps_the_snapshot_it_resumed_from_until_one_of_its_own_is_complete(tmp_path, capsys):
    """The retention rules across a change of shape, on one node: a job of 2 ranks (replicated, as DDP)
    left step 8 in this node's memory; the job now runs 1 rank. It resumes from it (resharded 2 -> 1),
    keeps it while its own first snapshot is not known complete, and frees it after that."""
    run(tmp_path, 11)  # snapshots of steps 4 and 8 at world size 1
    (newest,) = [p for p in snaps(tmp_path) if p.parent.name == "step-0000000008"]
    info, saved = shard_file.read_info(newest), trained(5, steps=0)
    load(newest, saved)
    for rank in (0, 1):  # what two ranks of an earlier start of the job took
        shard = shard_file.MappedShard(newest.parent / name_of(8, rank, 2).split("/")[1], to_dcp(saved)).fill()
        shard.finish(run=info.run, job=info.job, attempt="earlier", step=8, rank=rank, world_size=2)
    newest.unlink()
    state = trained(1, steps=0)
    options = {"snapshot_every": 4, "snapshot_dir": str(tmp_path / "memory"), "exit_code": None}
    with spotguard.Guard(str(tmp_path / "ckpt"), cloud="none", **options) as guard:
        assert guard.resume(state) == 9
        assert digest(state) == digest(saved)
        shapes = []
        for step in range(9, 17):
            guard.step(step, state)
            guard.snapshots.wait()
            shapes.append(sorted({(p.parent.name[-2:], p.name[-10:-5]) for p in snaps(tmp_path)}))
    assert resumes(tmp_path)[-1]["resharded"] == [2, 1]
    capsys.readouterr()
    assert main(["report", str(tmp_path / "ckpt")]) == 0
    assert "snapshot, resharded 2 -> 1" in capsys.readouterr().out
    assert shapes[3] == [("08", "00002"), ("12", "00001")]  # step 12 taken, not yet known complete
    assert shapes[7] == [("12", "00001"), ("16", "00001")]  # 12 complete: the former shape's files freed


def snaps(tmp_path) -> list:
    return sorted((tmp_path / "memory").rglob("*.snap"))


def test_a_thousand_runs_come_back_from_a_peer_in_one_request(tmp_path):
    """A resume at another world size can ask one holder for thousands of runs (a slice of every
    parameter): more than a request's admission frame holds."""
    target = NodeDir(tmp_path / "b", "run")
    name = name_of(4, 1, 2)
    path = target.prepare(name)
    body = torch.arange(1_000_000, dtype=torch.int64)  # 8 MB: two blocks
    write_shard(path, {"t": body})
    server = PeerServer(target)
    try:
        runs = [(offset, 64) for offset in range(0, 1_900 * 4096, 4096)]
        with PeerRuns(server.address, name, runs) as source:
            for offset, length in runs:
                got = bytearray(length)
                source.read_into(offset, memoryview(got))
                assert bytes(got) == body.numpy().tobytes()[offset : offset + length]
    finally:
        server.close()


def test_a_flipped_byte_in_the_index_is_found_before_any_byte_is_read(tmp_path):
    path, info = write(tmp_path, trained())
    data = bytearray(path.read_bytes())
    data[info.body_bytes + 40] ^= 1  # in the trailer: an offset or a size of the index, say
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match="the trailer does not match its CRC32C"):
        shard_file.read_info(path)


def test_without_madvise_populate_the_pages_are_mapped_at_once_all_the_same(tmp_path, monkeypatch):
    """A kernel before 5.14 refuses MADV_POPULATE_WRITE: the file is mapped with MAP_POPULATE then, as before,
    and writing into it takes faults for a small fraction of its pages."""
    monkeypatch.setattr(shard_file, "_madvise", lambda address, size, advice: -1)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    size = 32 << 20
    with tempfile.TemporaryDirectory(dir=shm) as where:
        fd = shard_file.reserve(Path(where) / "f.part", size)
        with shard_file.map_populated(fd, size) as mapped:
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            view = memoryview(mapped)
            for at in range(0, size, mmap.PAGESIZE):
                view[at] = 1
            view.release()
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        os.close(fd)
    assert faults < size // mmap.PAGESIZE // 4, faults
