"""The handoff wire protocol between a leaving rank and a survivor, over real TCP on 127.0.0.1 with
an in-process store: whole shards arrive checksummed; a stranger, a flood, a peer that dies
mid-stream or one that reports its own failure never yields a partial handoff, and nobody waits
for the deadline when the answer is already known."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from cloud_adapters.deadline import Deadline
from spotguard.checkpoint.moves.handoff import Receiver, send_shards
from spotguard.job.departure import Departure, HandoffError, SurvivorsOutcome
from spotguard.job.kvstore import Connection
from tests.ckpt_workers import ROOT
from tests.floods import failing_accepts, frame, wait_closed

STEP = 7


def shard(name: str, values: torch.Tensor, offset: int = 0, whole: int | None = None):
    item = WriteItem(
        index=MetadataIndex(name, torch.Size([offset])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([offset]), values.shape),
            properties=TensorProperties(dtype=values.dtype),
            size=torch.Size([whole or len(values)]),
        ),
    )
    return item, values


def shards():
    return [
        shard("w", torch.randn(3 << 20), offset=3 << 20, whole=6 << 20),  # 12 MB: several chunks
        shard("h", torch.arange(10, dtype=torch.bfloat16)),
        shard("empty", torch.empty(0)),
    ]


def cutoff(s: float = 20.0) -> Deadline:
    return Deadline.after(s)


class Survivor:
    """Rank 0 receiving from leaving rank 1 on a background thread."""

    def __init__(self, departure: Departure, senders=(1,), wait_s: float = 20.0) -> None:
        self.mailbox = departure.mailbox(0)
        self.receiver = Receiver(departure, 0, list(senders), STEP, self.mailbox)
        self.result: list | BaseException | None = None
        self.thread = threading.Thread(target=self._collect, args=(wait_s,))
        self.thread.start()

    def _collect(self, wait_s: float) -> None:
        try:
            self.result = self.receiver.collect(cutoff(wait_s))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.result = exc

    def join(self):
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.mailbox.close()
        return self.result


def address(departure: Departure) -> tuple[str, int, str]:
    host, port, token = departure.store.get(f"{departure.prefix}handoff/0").decode().split()
    return host, int(port), token


@pytest.fixture
def departure():
    return Departure(frozenset({1}), Connection.of(dist.HashStore()), "run/emergency/1/", world_size=2)


def test_whole_shards_arrive_bit_for_bit(departure):
    sent = shards()
    survivor = Survivor(departure)
    assert send_shards(departure, 1, 0, STEP, sent, cutoff()) == sum(t.numel() * t.element_size() for _, t in sent)
    got = survivor.join()
    assert [item.index for item, _ in got] == [item.index for item, _ in sent]
    for (item, tensor), (want_item, want) in zip(got, sent):
        assert tensor.dtype == want.dtype and torch.equal(tensor, want)
        assert item.tensor_data == want_item.tensor_data


def test_strangers_and_floods_are_dropped_and_the_real_sender_still_gets_through(departure):
    survivor = Survivor(departure)
    host, port, _ = address(departure)
    strangers = []
    for hello in ({"token": "guess", "rank": 1, "step": STEP}, "x" * 100_000):  # wrong token; an oversized frame
        s = socket.create_connection((host, port))
        body = json.dumps(hello).encode()
        s.sendall(struct.pack("!Q", len(body)) + body)
        strangers.append(s)
    flood = [socket.create_connection((host, port)) for _ in range(30)]  # silent connections
    sent = shards()
    send_shards(departure, 1, 0, STEP, sent, cutoff())
    got = survivor.join()
    assert len(got) == len(sent) and torch.equal(got[0][1], sent[0][1])
    for s in strangers + flood:
        s.close()


def test_a_sender_that_dies_mid_stream_is_a_failed_handoff_not_a_partial_one(departure):
    survivor = Survivor(departure)
    host, port, token = address(departure)
    item, tensor = shard("w", torch.randn(1 << 20))
    with socket.create_connection((host, port)) as s:
        for frame in ({"token": token, "rank": 1, "step": STEP},
                      {"shards": [{"fqn": "w", "offsets": [0], "sizes": [1 << 20], "size": [1 << 20],
                                   "dtype": "float32", "bytes": 4 << 20}]}):  # fmt: skip
            body = json.dumps(frame).encode()
            s.sendall(struct.pack("!Q", len(body)) + body)
        s.sendall(tensor.numpy().tobytes()[: 1 << 20])  # a quarter of the bytes, then the VM is gone
    started = time.monotonic()
    failure = survivor.join()
    assert isinstance(failure, HandoffError) and "from rank 1" in str(failure) and "closed after" in str(failure)
    assert time.monotonic() - started < 5  # learnt from the closed connection, not the deadline


def test_a_corrupted_byte_on_the_way_is_refused(departure, monkeypatch):
    """The trailer's CRC32C must match what arrived: a flipped byte means no handoff."""
    import spotguard.checkpoint.moves.handoff.send as handoff_send

    survivor = Survivor(departure)
    real_send_json = handoff_send.send_json

    def flip_a_checksum(sock, obj):
        if "crc32c" in obj:  # what a corrupted stream looks like to the survivor
            obj = {"crc32c": ["00000000"] + obj["crc32c"][1:]}
        real_send_json(sock, obj)

    monkeypatch.setattr(handoff_send, "send_json", flip_a_checksum)
    with pytest.raises(HandoffError, match="refused the handoff: .*CRC32C"):
        send_shards(departure, 1, 0, STEP, shards(), cutoff())
    assert isinstance(survivor.join(), HandoffError)


def test_a_leaving_rank_that_reports_its_failure_ends_the_survivor_s_wait_at_once(departure):
    survivor = Survivor(departure, wait_s=60)
    departure.report_failure(1, "MemoryError: copying the shards to CPU")
    started = time.monotonic()
    failure = survivor.join()
    assert isinstance(failure, HandoffError) and "MemoryError" in str(failure)
    assert time.monotonic() - started < 5


def test_a_leaving_rank_stops_waiting_once_the_survivors_gave_up(departure):
    departure.publish_outcome(SurvivorsOutcome(error="rank 0: cannot listen on 203.0.113.7"))
    started = time.monotonic()
    with pytest.raises(HandoffError, match="the survivors gave up: rank 0: cannot listen"):
        send_shards(departure, 1, 0, STEP, shards(), cutoff(60))
    assert time.monotonic() - started < 5


def test_declarations_are_waited_for_a_bounded_time():
    """Leaving ranks 1, 2 and 3 all hand to survivor 0 through its mailbox; rank 3 never says."""
    departure = Departure(frozenset({1, 2, 3}), Connection.of(dist.HashStore()), "run/emergency/1/", world_size=4)
    mailbox = departure.mailbox(0)
    departure.declare(1, True)
    departure.declare(2, False)
    started = time.monotonic()
    assert mailbox.declarations([1, 2, 3], timeout_s=1.0) == {1: True, 2: False}  # waited 1 s at most for 3
    assert time.monotonic() - started < 3
    mailbox.close()
    assert not mailbox._thread.is_alive()


def test_a_leaving_rank_gone_before_its_handoff_began_is_given_up_on_long_before_the_deadline(departure, monkeypatch):
    """Killed between the agreed step and its first byte: no connection ever closes to tell; the
    survivor stops waiting after START_GRACE_S, not at the (minutes away) deadline."""
    from spotguard.checkpoint.moves.handoff import receive

    monkeypatch.setattr(receive, "START_GRACE_S", 1.0)
    started = time.monotonic()
    failure = Survivor(departure, wait_s=60).join()
    assert isinstance(failure, HandoffError) and "did not begin its handoff" in str(failure)
    assert time.monotonic() - started < 10


def test_a_sender_that_began_is_not_cut_by_the_start_grace(departure, monkeypatch):
    """The grace is for beginning: a handoff under way runs on (bounded by its idle timeout and the deadline)."""
    from spotguard.checkpoint.moves.handoff import receive, wire

    monkeypatch.setattr(receive, "START_GRACE_S", 0.3)
    survivor = Survivor(departure)
    host, port, token = address(departure)
    item, tensor = shard("w", torch.arange(1 << 20, dtype=torch.float32))
    with socket.create_connection((host, port)) as s:
        frames = [{"token": token, "rank": 1, "step": STEP}, {"shards": [wire.describe(item, tensor)]}]
        for frame in frames:
            body = json.dumps(frame).encode()
            s.sendall(struct.pack("!Q", len(body)) + body)
        view = wire.bytes_of(tensor)
        s.sendall(view[: 1 << 20])
        time.sleep(1.0)  # a slow link: well past the start grace
        s.sendall(view[1 << 20 :])
        body = json.dumps({"crc32c": [f"{wire.crc32c_extend(0, view):08x}"]}).encode()
        s.sendall(struct.pack("!Q", len(body)) + body)
        got = survivor.join()
    assert not isinstance(got, BaseException), got
    assert torch.equal(got[0][1], tensor)


def test_a_leaving_rank_that_says_it_holds_nothing_fails_an_expected_handoff_at_once(departure):
    survivor = Survivor(departure, wait_s=60)
    started = time.monotonic()
    departure.declare(1, False)
    failure = survivor.join()
    assert isinstance(failure, HandoffError) and "holds nothing unique" in str(failure)
    assert time.monotonic() - started < 5


def test_a_shard_that_is_a_strided_view_is_sent_as_its_own_elements(departure):
    """The sender copies each shard to contiguous host memory as it sends it, one at a time."""
    every_other = torch.arange(40, dtype=torch.float32)[::2]  # a view: not contiguous
    survivor = Survivor(departure)
    send_shards(departure, 1, 0, STEP, [shard("v", every_other)], cutoff())
    got = survivor.join()
    assert torch.equal(got[0][1], every_other)


def test_a_receive_pool_hands_out_aligned_tensors_until_it_is_used_up():
    from spotguard.checkpoint.moves.handoff import ReceivePool

    pool = ReceivePool(1000)
    deadline = time.monotonic() + 30
    while pool.take(torch.Size([0]), torch.uint8) is None and time.monotonic() < deadline:
        time.sleep(0.01)  # touching happens on a thread of its own
    a = pool.take(torch.Size([3]), torch.uint8)
    b = pool.take(torch.Size([10, 5]), torch.float32)  # 200 bytes, at the next 64-byte boundary
    assert a.shape == (3,) and b.shape == (10, 5) and b.dtype == torch.float32
    assert b.data_ptr() - a.data_ptr() == 64 and pool.used == 264
    assert pool.take(torch.Size([200]), torch.float64) is None  # 1600 bytes: more than is left
    b.fill_(1.5)
    assert torch.equal(b, torch.full((10, 5), 1.5))


def test_a_receive_pool_nobody_takes_from_gives_its_memory_back():
    from spotguard.checkpoint.moves.handoff import ReceivePool

    pool = ReceivePool(1 << 20, unused_s=0.2)
    time.sleep(1.0)
    assert pool.take(torch.Size([4]), torch.uint8) is None


def test_sharded_nbytes_counts_the_local_shards_of_sharded_tensors_only():
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SHARDED_NBYTES], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "800"]


SHARDED_NBYTES = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from spotguard.checkpoint.moves.handoff import sharded_nbytes
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
mesh = init_device_mesh("cpu", (1,))
model = torch.nn.Linear(10, 10)
print(sharded_nbytes({"model": model, "w": DTensor.from_local(torch.zeros(10, 10), mesh, [Replicate()])}))
sharded = DTensor.from_local(torch.zeros(10, 10), mesh, [Shard(0)])
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
print(sharded_nbytes({"model": model, "opt": opt, "nested": {"w": sharded, "v": sharded}}))
"""


# -- the listener, bounded before the hello ---------------------------------------------------


def two_leaving() -> Departure:
    """Leaving ranks 1 and 2 both hand to survivor 0: it still listens after rank 1's handoff."""
    return Departure(frozenset({1, 2}), Connection.of(dist.HashStore()), "run/emergency/1/", world_size=3)


def test_slow_drip_hellos_are_cut_at_the_hello_deadline_and_the_real_senders_get_through(monkeypatch):
    """A byte every 0.5 s on 100 connections: no single read waits long, the whole hello does."""
    from spotguard.checkpoint.moves.handoff import doorway

    monkeypatch.setattr(doorway, "HELLO_DEADLINE_S", 1.0)
    departure = two_leaving()
    survivor = Survivor(departure, senders=(1, 2))
    host, port, _ = address(departure)
    opened = time.monotonic()
    drips = [socket.create_connection((host, port)) for _ in range(100)]
    stop = threading.Event()

    def drip() -> None:
        hello = frame({"token": "x" * 1000})
        for i in range(len(hello)):
            for s in drips:
                try:
                    s.send(hello[i : i + 1])
                except OSError:  # closed by the survivor
                    pass
            if stop.wait(0.5):
                return

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        sent = shards()
        send_shards(departure, 1, 0, STEP, sent, cutoff())
        assert all(wait_closed(drips, within_s=doorway.HELLO_DEADLINE_S + 1.0 - (time.monotonic() - opened)))
        send_shards(departure, 2, 0, STEP, sent, cutoff())
    finally:
        stop.set()
        dripper.join()
        for s in drips:
            s.close()
    got = survivor.join()
    assert not isinstance(got, BaseException), got
    assert len(got) == 2 * len(sent) and torch.equal(got[0][1], sent[0][1])


def test_connections_past_the_cap_are_closed_at_once_and_the_real_sender_gets_through(departure, monkeypatch):
    """Idle connections past PENDING_HELLOS_MIN: the oldest go at once (the deadline is far away),
    the newest keep their places, and the real sender, later still, takes one."""
    from spotguard.checkpoint.moves.handoff import doorway

    monkeypatch.setattr(doorway, "HELLO_DEADLINE_S", 60.0)  # only the cap closes anything here
    survivor = Survivor(departure)
    host, port, _ = address(departure)
    cap, extra = doorway.PENDING_HELLOS_MIN, 20
    idle = [socket.create_connection((host, port)) for _ in range(cap + extra)]
    try:
        assert wait_closed(idle, within_s=1.5) == [True] * extra + [False] * cap
        sent = shards()
        send_shards(departure, 1, 0, STEP, sent, cutoff())
        got = survivor.join()
    finally:
        for s in idle:
            s.close()
    assert not isinstance(got, BaseException), got
    assert torch.equal(got[0][1], sent[0][1])


def test_a_hello_from_an_unexpected_or_already_connected_rank_is_closed():
    """Even with the token: rank 1 a second time, or rank 5 that nobody expects, is not served."""
    departure = two_leaving()
    survivor = Survivor(departure, senders=(1, 2))
    host, port, token = address(departure)
    send_shards(departure, 1, 0, STEP, shards(), cutoff())
    for rank in (1, 5):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(frame({"token": token, "rank": rank, "step": STEP}))
            assert s.recv(1) == b""  # closed without a word
    send_shards(departure, 2, 0, STEP, shards(), cutoff())
    got = survivor.join()
    assert not isinstance(got, BaseException), got
    assert len(got) == 2 * len(shards())


def test_failed_accepts_are_logged_once_each_and_survived(departure, monkeypatch, caplog):
    """Out of descriptors (EMFILE, ENFILE) or a connection aborted before it was taken: the
    listener pauses and goes on, and the real sender's handoff then goes through."""
    # only the survivor accepts here
    failures = failing_accepts(monkeypatch, [errno.EMFILE] * 3 + [errno.ECONNABORTED] * 2 + [errno.ENFILE])
    survivor = Survivor(departure)
    sent = shards()
    with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint.moves.handoff"):
        send_shards(departure, 1, 0, STEP, sent, cutoff())
        got = survivor.join()
    assert not isinstance(got, BaseException), got
    assert torch.equal(got[0][1], sent[0][1])
    assert next(failures, None) is None
    logged = [r.getMessage() for r in caplog.records if "could not accept" in r.getMessage()]
    assert len(logged) == 3, logged  # one per kind
