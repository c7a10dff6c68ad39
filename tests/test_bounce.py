"""The pipeline that GPU state crosses to and from the host through, run on CPU tensors.

`bounce.bounced` is switched to say yes for CPU tensors, so every tensor takes the path a GPU's
takes: sliced to the pool's buffer size, copied into a pool buffer on the copy stream (a plain copy
on CPU) while the buffer before is written, read back into pool buffers and copied into the state.
tests/test_cuda.py runs the same paths on a GPU.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cloud_adapters.notice import utc_now
from spotguard.checkpoint import Checkpointer, CheckpointError
from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.io import bounce
from spotguard.checkpoint.io.bounce import BouncePool
from spotguard.checkpoint.save import pipelined_write
from spotguard.checkpoint.save.pipelined_write import PipelinedWriter
from spotguard.checkpoint.save.shard_io import ChecksummingFileSystem
from spotguard.snapshots.reading import ShardUnusable
from tests.test_checkpoint import flip_byte
from tests.test_snapshots import digest, load, trained, write

BUFFER = 4096


@pytest.fixture
def pooled(monkeypatch):
    """Every tensor crosses through a fresh shared pool of BUFFER-byte buffers; the pools made."""
    monkeypatch.setattr(bounce, "bounced", lambda tensor: True)
    monkeypatch.setattr(bounce, "BUFFER_BYTES", BUFFER)
    monkeypatch.setattr(bounce, "_pools", {})
    return bounce._pools


def watch(monkeypatch, pool: BouncePool) -> dict:
    """Counts the most buffers `pool` ever lent at once."""
    seen = {"most": 0}
    real = pool._take

    def take():
        buffer = real()
        seen["most"] = max(seen["most"], pool.lent)
        return buffer

    monkeypatch.setattr(pool, "_take", take)
    return seen


def save(path, state_dict, pool, threads):
    writer = PipelinedWriter(path, threads=threads, pool=pool)
    writer.fs = ChecksummingFileSystem()
    dcp.save(state_dict, storage_writer=writer, no_dist=True)


def test_the_next_slice_is_copied_before_the_one_before_is_written(tmp_path, pooled, monkeypatch):
    trace = []
    real_copy, real_record = bounce.CopyStream.copy, pipelined_write._record
    monkeypatch.setattr(
        bounce.CopyStream,
        "copy",
        lambda self, dst, src: trace.append(("fill", int(src[0, 0]))) or real_copy(self, dst, src),
    )

    def record(stream, name, results, item, data):
        trace.append(("write", int(data[0, 0])))
        real_record(stream, name, results, item, data)

    monkeypatch.setattr(pipelined_write, "_record", record)
    # rows of 1 KiB; a slice leaves half of a 4 KiB buffer for torch.save's own bytes: 2 rows, 12 slices
    rows = torch.arange(24 * 256, dtype=torch.float32).view(24, 256)
    pool = BouncePool(torch.device("cpu"), BUFFER, count=3)
    save(tmp_path, {"w": rows}, pool, threads=1)
    slices = [k * 2 * 256 for k in range(12)]
    expected = [("fill", slices[0])]
    for k in range(1, 12):
        expected += [("fill", slices[k]), ("write", slices[k - 1])]
    assert trace == [*expected, ("write", slices[11])]
    assert pool.lent == 0
    loaded = {"w": torch.zeros(24, 256)}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)  # DCP's own reader takes the slices
    assert torch.equal(loaded["w"], rows)


def test_more_writing_threads_than_buffers_finish_within_the_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(bounce, "bounced", lambda tensor: True)
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(40 + i, 256) for i in range(6)}  # 40 KiB and more: 20+ slices each
    state["odd"] = torch.randn(3, 2000)  # a row larger than a buffer: copied whole, as DCP does
    state["view"] = torch.randn(64, 8).t()  # not contiguous
    pool = BouncePool(torch.device("cpu"), BUFFER, count=2)
    seen = watch(monkeypatch, pool)
    save(tmp_path, state, pool, threads=4)
    assert seen["most"] <= 2 and pool.allocated_bytes <= 2 * BUFFER and pool.lent == 0
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    assert len(metadata.state_dict_metadata["t0"].chunks) == 20  # 40 rows of 1 KiB, 2 rows a slice
    assert len(metadata.state_dict_metadata["odd"].chunks) == 1


def test_a_failure_in_the_middle_commits_nothing_and_gives_every_buffer_back(tmp_path, pooled, monkeypatch):
    saved = trained(0)
    with Checkpointer(str(tmp_path), write_threads=2) as ckpt:
        ckpt.save(1, saved, reason="periodic")
        writes, real = [], pipelined_write._record

        def failing(stream, name, results, item, data):
            writes.append(1)
            if len(writes) == 5:
                raise OSError(28, "No space left on device")
            real(stream, name, results, item, data)

        monkeypatch.setattr(pipelined_write, "_record", failing)
        with pytest.raises(CheckpointError, match="nothing committed.*No space left"):
            ckpt.save(2, saved, reason="emergency")
        assert ckpt.newest_committed() == 1
    assert not (tmp_path / step_dir_name(2)).exists()
    assert [pool.lent for pool in pooled.values()] == [0]


def test_an_emergency_write_stops_at_its_deadline(tmp_path, pooled, monkeypatch):
    real = pipelined_write._record
    monkeypatch.setattr(pipelined_write, "_record", lambda *a: time.sleep(0.2) or real(*a))
    saved = trained(0)
    with Checkpointer(str(tmp_path), write_threads=2) as ckpt:
        deadline = utc_now() + timedelta(seconds=4)  # the write has 1 s: the last 3 are kept for the exit
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="stopped at the save's deadline"):
            ckpt.save(1, saved, reason="emergency", deadline=deadline)
        assert time.monotonic() - started < 3  # every record written would take 5 s and more
        assert ckpt.newest_committed() is None
    assert [pool.lent for pool in pooled.values()] == [0]


def test_a_resume_through_the_pool_is_bit_identical_and_a_damaged_file_falls_back(tmp_path, pooled):
    held = {}
    state = trained(0)
    with Checkpointer(str(tmp_path), write_threads=3) as ckpt:
        for step in (1, 2):
            state["model"](torch.randn(4, 8)).sum().backward()
            state["optim"].step()
            ckpt.save(step, state, reason="manual")
            held[step] = digest(state), str(state["optim"].state_dict()["state"])
    fresh = trained(1)
    assert Checkpointer(str(tmp_path)).resume(fresh) == 2
    assert (digest(fresh), str(fresh["optim"].state_dict()["state"])) == held[2]
    flip_byte(sorted((tmp_path / step_dir_name(2)).glob("*.distcp"))[-1])
    assert Checkpointer(str(tmp_path)).resume(fresh) == 1
    assert (digest(fresh), str(fresh["optim"].state_dict()["state"])) == held[1]
    assert [pool.lent for pool in pooled.values()] == [0]


def test_a_snapshot_loads_into_device_tensors_through_the_pool(tmp_path, pooled, monkeypatch):
    torch.manual_seed(0)
    saved = {"w": torch.randn(3000, 8), "b": torch.randn(3000), "epoch": 3}  # 96 KB: 24 buffers' worth
    path, _ = write(tmp_path, saved)
    state = {"w": torch.zeros(3000, 8), "b": torch.zeros(3000), "epoch": 0}
    weight = state["w"]
    copies = []
    real = bounce.CopyStream.copy
    monkeypatch.setattr(bounce.CopyStream, "copy", lambda self, dst, src: copies.append(1) or real(self, dst, src))
    load(path, state)
    assert state["w"] is weight and torch.equal(weight, saved["w"]) and torch.equal(state["b"], saved["b"])
    assert state["epoch"] == 3
    assert len(copies) == 24 + 3  # piece by piece through the buffers
    assert [pool.lent for pool in pooled.values()] == [0]


def test_a_snapshot_that_fails_its_check_mid_piece_gives_every_buffer_back(tmp_path, pooled):
    path, info = write(tmp_path, {"w": torch.randn(3000, 8)})  # the body ends with the weight's last piece
    data = bytearray(path.read_bytes())
    data[info.body_bytes // 2] ^= 1  # found when the block's last byte arrives: inside a buffer being filled
    path.write_bytes(data)
    with pytest.raises(ShardUnusable, match="CRC32C"):
        load(path, {"w": torch.zeros(3000, 8)})
    assert [pool.lent for pool in pooled.values()] == [0]


def test_records_of_a_sliced_tensor_come_back_through_the_pool(tmp_path, pooled, monkeypatch):
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 256), "step": 3}  # 64 KiB: slices of 2 rows, each record within a buffer
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state, reason="manual")
    copies = []
    real = bounce.CopyStream.copy
    monkeypatch.setattr(bounce.CopyStream, "copy", lambda self, dst, src: copies.append(1) or real(self, dst, src))
    fresh = {"w": torch.zeros(64, 256), "step": 0}
    assert Checkpointer(str(tmp_path)).resume(fresh) == 1
    assert torch.equal(fresh["w"], state["w"]) and fresh["step"] == 3
    assert len(copies) == 32  # every slice's record, none too large for a buffer


def test_one_pool_per_device_and_a_thread_that_holds_none_waits_for_a_buffer(pooled):
    pool = bounce.shared_pool(torch.device("cpu"), 2)
    assert bounce.shared_pool(torch.device("cpu"), 3) is pool and pool.count == 3
    assert bounce.pool_for([torch.zeros(1)], 1) is pool
    assert bounce.pool_for([torch.zeros(1), torch.zeros(1, device="meta")], 1) is None  # one stream, one device
    first = bounce.Pipeline(pool)
    leases = [first.lease(BUFFER) for _ in range(3)]  # a thread may hold several: none waits on itself
    assert pool.try_acquire() is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(bounce.Pipeline(pool).lease(10)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # a thread holding nothing waits for a buffer to come back
    pool.release(leases[0].buffer)
    waiter.join(5)
    assert len(got) == 1 and got[0].nbytes == 10
    with pytest.raises(ValueError, match="do not fit"):
        first.lease(BUFFER + 1)
