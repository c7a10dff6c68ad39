"""One-pass resume: every file is read once, checked as it is read, and a damaged byte anywhere means falling back."""

from __future__ import annotations

import os

import pytest
import torch

from spotguard.checkpoint import Checkpointer, CheckpointError
from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.resume import records, shard_read
from tests.ckpt_workers import assert_same
from tests.test_checkpoint import bytes_read, flip_byte, resume_fresh, save_steps, three_files

WRITE_THREADS = 3  # three shard files per step, and .metadata (three_files() fills them)


class NotAllowed:
    """A global no weights-only unpickler allows."""


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return root, save_steps(root, [1, 2], write_threads=WRITE_THREADS)


def step_files(root, step) -> list:
    return sorted(p for p in (root / step_dir_name(step)).iterdir() if p.name != "spotguard.json")


def copy_of(root, tmp_path):
    import shutil

    shutil.copytree(root, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_each_shard_file_is_read_once_and_checked_as_it_is_read(tmp_path):
    """Every byte of the step's files is read and none twice, however it would be read (counted by
    the kernel): no separate checking pass. That the reads are checked: the flipped bytes below."""
    state = three_files()
    with Checkpointer(str(tmp_path), write_threads=WRITE_THREADS) as ck:
        ck.save(1, state, reason="manual")
    sizes = {p.name: p.stat().st_size for p in step_files(tmp_path, 1)}  # the shards and .metadata
    smallest_shard = min(size for name, size in sizes.items() if name.endswith(".distcp"))
    assert len(sizes) == WRITE_THREADS + 1
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    resumer = Checkpointer(str(tmp_path), write_threads=WRITE_THREADS)
    before = bytes_read()
    assert resumer.resume(loaded) == 1
    read = bytes_read() - before
    assert all(torch.equal(loaded[name], t) for name, t in state.items())
    assert sum(sizes.values()) <= read < sum(sizes.values()) + smallest_shard  # (+ the manifest, a few KB)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("which", range(WRITE_THREADS + 1))
def test_a_flipped_byte_in_any_file_falls_back_to_the_step_before(two_steps, tmp_path, caplog, which, where):
    ckpt = copy_of(two_steps[0], tmp_path)
    victim = step_files(ckpt, 2)[which]
    size = victim.stat().st_size
    flip_byte(victim, {"first": 0, "middle": size // 2, "last": size - 1}[where])
    step, state, loaded = resume_fresh(ckpt)
    assert step == 1 and state["step"] == 1
    assert_same(loaded, two_steps[1][0])  # every tensor the damaged step had overwritten is step 1's again
    assert "skipping step-0000000002" in caplog.text and victim.name in caplog.text


def test_a_damaged_only_step_stops_resume_instead_of_a_fresh_start_from_half_loaded_weights(two_steps, tmp_path):
    ckpt = copy_of(two_steps[0], tmp_path)
    (ckpt / step_dir_name(1) / "spotguard.json").unlink()  # step 1 is no checkpoint any more
    victim = step_files(ckpt, 2)[-1]
    flip_byte(victim)
    with pytest.raises(CheckpointError, match=f"no checkpoint could be loaded: .*{victim.name}: crc32c"):
        resume_fresh(ckpt)


def test_a_load_of_some_records_still_checks_every_byte_of_the_files_it_reads(tmp_path):
    """A byte flipped in a record the load does not need, in a file it reads, is still caught."""
    from spotguard.checkpoint.format.safe_pickle import load_metadata

    with Checkpointer(str(tmp_path), write_threads=2) as ck:
        ck.save(1, {f"t{i}": torch.arange(1000.0) + i for i in range(6)}, reason="manual")
    step_dir = tmp_path / step_dir_name(1)
    by_file: dict[str, list] = {}
    for index, info in load_metadata((step_dir / ".metadata").read_bytes()).storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index.fqn, info))
    name, records = next((n, r) for n, r in sorted(by_file.items()) if len(r) >= 2)
    (needed, _), (_, other) = records[:2]
    flip_byte(step_dir / name, other.offset + other.length // 2)
    with pytest.raises(CheckpointError, match=f"{name}: crc32c"):
        Checkpointer(str(tmp_path)).resume({needed: torch.zeros(1000)})


def local_and_remote(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    remote.mkdir()
    held = save_steps(remote, [1], local_dir=str(local))
    return remote, local, held


def test_a_damaged_local_copy_the_store_does_not_hold_stops_resume_instead_of_a_fresh_start(tmp_path):
    """The emergency's step committed locally but never uploaded, then damaged on disk."""
    import shutil

    remote, local, _ = local_and_remote(tmp_path)
    shutil.rmtree(remote / step_dir_name(1))
    victim = step_files(local, 1)[-1]
    flip_byte(victim)
    with pytest.raises(CheckpointError, match=f"{victim.name}: crc32c"):
        resume_fresh(remote, local_dir=str(local))


def test_a_read_error_on_a_local_copy_fetches_the_step_again(tmp_path, monkeypatch, caplog):
    import errno
    import os

    remote, local, held = local_and_remote(tmp_path)
    failed = []

    def failing_once(read):
        def first_fails(fd, *args):
            if not failed:
                failed.append(fd)
                raise OSError(errno.EIO, "Input/output error")
            return read(fd, *args)

        return first_fails

    for name in ("readv", "preadv"):  # the read of a CPU state's pieces, and of records bound for a GPU
        monkeypatch.setattr(os, name, failing_once(getattr(os, name)))
    step, _, loaded = resume_fresh(remote, local_dir=str(local))
    assert step == 1 and failed
    assert_same(loaded, held[0])
    assert "local copy is damaged" in caplog.text and "Input/output error" in caplog.text


def test_a_tensor_record_is_read_with_the_weights_only_unpickler():
    import io
    import pickle

    buffer = io.BytesIO()
    torch.save({"x": NotAllowed()}, buffer)
    with pytest.raises(pickle.UnpicklingError):
        shard_read._stored_tensor(memoryview(bytearray(buffer.getvalue())))
    buffer = io.BytesIO()
    torch.save(torch.arange(10.0)[2:8], buffer)  # a view: the whole storage is saved, with its offset
    assert torch.equal(shard_read._stored_tensor(memoryview(bytearray(buffer.getvalue()))), torch.arange(2.0, 8.0))


# ---- a CPU state: read in pieces, large tensors straight into their memory (piece_read) -------------------


def large_state(seed: int) -> dict[str, torch.Tensor]:
    """Records of 1 MiB and more (read straight into their tensors) of several dtypes, and a small one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(1 << 19, generator=g),  # 2 MiB
        "m": torch.randn(512, 2048, generator=g).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 40, (300_000,), generator=g),
        "t": torch.randn(512, 1024, generator=g),  # resumed below into a transposed view: read into a buffer
        "small": torch.arange(100.0) + seed,
    }


def save_large(root, steps) -> list[dict[str, torch.Tensor]]:
    held = []
    with Checkpointer(str(root), write_threads=2) as ck:
        for step in steps:
            held.append(large_state(step))
            ck.save(step, held[-1], reason="manual")
    return held


def blank(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {name: torch.zeros_like(t) for name, t in like.items()}
    out["t"] = torch.zeros(1024, 512).t()  # the same shape, not contiguous
    return out


def record_of(step_dir, fqn: str):
    from spotguard.checkpoint.format.safe_pickle import load_metadata

    storage = load_metadata((step_dir / ".metadata").read_bytes()).storage_data
    return next(info for index, info in storage.items() if index.fqn == fqn)


def test_a_large_tensor_is_read_into_its_own_memory_by_several_threads_at_once(tmp_path, monkeypatch):
    """No read buffer and no copy between the disk and the state's tensor, and its pieces read in parallel:
    two threads are inside reads into the same tensor at the same time."""
    import threading

    import numpy

    from spotguard.checkpoint.resume import piece_read

    held = save_large(tmp_path, [1])[0]
    monkeypatch.setattr(piece_read, "PIECE", 256 << 10)  # 2 MiB in 8 pieces
    loaded = blank(held)
    w = loaded["w"]
    inside = range(w.data_ptr(), w.data_ptr() + w.nbytes)
    into_w: list[tuple[str, int]] = []  # (thread, bytes) of each read whose buffer lies in w's memory
    two_at_once = threading.Barrier(2)
    real = {name: getattr(os, name) for name in ("readv", "preadv")}

    def spying(name):
        def read(fd, buffers, *args):
            address = numpy.frombuffer(buffers[0], dtype=numpy.uint8).ctypes.data
            if address in inside:
                if not into_w:
                    two_at_once.wait(timeout=10)  # until another thread starts reading into w too
                elif two_at_once.n_waiting:
                    two_at_once.wait(timeout=10)
                into_w.append((threading.current_thread().name, len(buffers[0])))
            return real[name](fd, buffers, *args)

        return read

    for name in real:
        monkeypatch.setattr(os, name, spying(name))
    parsed = []  # the records parsed into tensors in memory (then copied into the state)
    stored_tensor = shard_read._stored_tensor
    monkeypatch.setattr(shard_read, "_stored_tensor", lambda data: parsed.append(len(data)) or stored_tensor(data))
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert_same(loaded, held)
    assert sum(n for _, n in into_w) >= w.nbytes - piece_read.HEAD  # all but what came with the record's first bytes
    assert len({thread for thread, _ in into_w}) >= 2
    # only the record bound for a transposed view is parsed and copied as torch.load would: the small one's
    # bytes are copied in as they are, where the parse of the records around said they lie
    assert parsed == [record_of(tmp_path / step_dir_name(1), "t").length]


def test_a_large_state_is_read_once_and_lands_whole(tmp_path):
    held = save_large(tmp_path, [1])[0]
    sizes = sum(p.stat().st_size for p in step_files(tmp_path, 1))
    loaded = blank(held)
    resumer = Checkpointer(str(tmp_path))
    before = bytes_read()
    assert resumer.resume(loaded) == 1
    read = bytes_read() - before
    assert_same(loaded, held)
    assert sizes <= read < sizes + (256 << 10)  # the ends of each record are read once too (+ the manifest)


def test_a_large_state_resumes_into_another_dtype_as_a_copy_would(tmp_path):
    """A record whose tensor has another dtype in the state is converted, as DCP's copy converts it."""
    held = save_large(tmp_path, [1])[0]
    loaded = blank(held)
    loaded["w"] = torch.zeros(1 << 19, dtype=torch.float64)
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert torch.equal(loaded["w"], held["w"].double())
    assert torch.equal(loaded["m"], held["m"]) and torch.equal(loaded["t"], held["t"])


def test_a_large_tensor_saved_with_other_strides_is_copied_as_torch_load_would(tmp_path, monkeypatch):
    """Read into the state's tensor, its bytes are not that tensor's (a transposed layout): torch's parse of the
    whole record says so, and the record is then delivered as any other (copied with its strides)."""
    saved = torch.randn(1024, 512).t()  # its storage is its own: saved with these strides
    with Checkpointer(str(tmp_path), write_threads=1) as ck:
        ck.save(1, {"x": saved}, reason="manual")
    parsed = []
    stored_tensor = shard_read._stored_tensor
    monkeypatch.setattr(shard_read, "_stored_tensor", lambda data: parsed.append(len(data)) or stored_tensor(data))
    loaded = {"x": torch.zeros(512, 1024)}
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert torch.equal(loaded["x"], saved)
    assert parsed == [record_of(tmp_path / step_dir_name(1), "x").length]


@pytest.mark.parametrize("where", ["pickle", "data start", "data middle", "data end", "zip directory"])
def test_a_flipped_byte_in_a_large_record_falls_back_to_the_step_before(tmp_path, caplog, where):
    held = save_large(tmp_path, [1, 2])
    step_dir = tmp_path / step_dir_name(2)
    info = record_of(step_dir, "w")
    at = {
        "pickle": 100,  # data.pkl, the first entry of torch.save's zip
        "data start": 1024,
        "data middle": info.length // 2,
        "data end": info.length - 1024,
        "zip directory": info.length - 100,
    }[where]
    flip_byte(step_dir / info.relative_path, info.offset + at)
    loaded = blank(held[0])
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert_same(loaded, held[0])  # whatever step 2 had written is step 1's again
    assert "skipping step-0000000002" in caplog.text and info.relative_path in caplog.text


def test_crc32c_of_pieces_folds_into_the_files():
    import random

    import google_crc32c

    from spotguard.checkpoint.io.checksums import crc32c_combine

    data = random.Random(0).randbytes(100_000)
    for cuts in ([], [0], [1], [99_999], [3, 70_000], [5, 6, 7, 50_000, 99_000]):
        crc, edges = 0, [0, *cuts, len(data)]
        for a, b in zip(edges, edges[1:]):
            crc = crc32c_combine(crc, google_crc32c.value(data[a:b]), b - a)
        assert crc == google_crc32c.value(data), cuts


def test_tensors_saved_with_a_conjugate_or_negative_bit_resume_with_their_values(tmp_path):
    """torch.save keeps these bits and writes the storage as it is: its bytes are not the tensor's values, so
    such a record is never taken as read straight into its tensor."""
    g = torch.Generator().manual_seed(3)
    saved = {
        "c": torch.randn(1 << 18, dtype=torch.complex64, generator=g).conj(),  # 2 MiB
        "n": torch.randn(1 << 19, generator=g)._neg_view(),
    }
    with Checkpointer(str(tmp_path), write_threads=1) as ck:
        ck.save(1, saved, reason="manual")
    loaded = {"c": torch.zeros(1 << 18, dtype=torch.complex64), "n": torch.zeros(1 << 19)}
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert torch.equal(loaded["c"], saved["c"].resolve_conj()) and torch.equal(loaded["n"], saved["n"].resolve_neg())


def test_one_large_record_is_read_by_several_threads(tmp_path, monkeypatch):
    """A file of one record is one unit at first: the threads are started for its pieces all the same."""
    import threading

    from spotguard.checkpoint.resume import piece_read

    saved = {"w": torch.randn(1 << 22)}  # 16 MiB
    with Checkpointer(str(tmp_path), write_threads=1) as ck:
        ck.save(1, saved, reason="manual")
    readers: set[str] = set()
    real = os.preadv

    def spying(fd, buffers, offset):
        readers.add(threading.current_thread().name)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spying)
    monkeypatch.setattr(piece_read, "PIECE", 1 << 20)
    loaded = {"w": torch.zeros(1 << 22)}
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert torch.equal(loaded["w"], saved["w"])
    assert len({name for name in readers if name.startswith("spotguard-read")}) >= 2


def test_no_read_into_the_state_after_a_reading_thread_could_not_start(tmp_path, monkeypatch):
    """The threads that did start stop before the call returns (and closes the files, whose numbers the next
    open may reuse): none reads on after it."""
    import threading
    import time

    from spotguard.checkpoint.resume import piece_read

    saved = {f"w{i}": torch.randn(1 << 20) for i in range(4)}  # 16 MiB in 256 KiB pieces
    with Checkpointer(str(tmp_path), write_threads=1) as ck:
        ck.save(1, saved, reason="manual")
    monkeypatch.setattr(piece_read, "PIECE", 256 << 10)
    reads_after: list[int] = []
    returned = threading.Event()
    real = os.preadv

    def slow(fd, buffers, offset):
        time.sleep(0.01)
        if returned.is_set():
            reads_after.append(offset)
        return real(fd, buffers, offset)

    class Unstartable(threading.Thread):
        def start(self):
            if self.name == "spotguard-read_1":
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(os, "preadv", slow)
    monkeypatch.setattr(piece_read.threading, "Thread", Unstartable)
    with pytest.raises(CheckpointError, match="can't start new thread"):
        Checkpointer(str(tmp_path)).resume({name: torch.zeros_like(t) for name, t in saved.items()})
    returned.set()
    time.sleep(0.5)
    assert reads_after == []


def test_tied_tensors_are_not_read_straight_into_their_memory(tmp_path, monkeypatch):
    """Two records bound for one tensor (tied weights): neither is read straight into it, where the other's
    bytes could land while its checksum is taken; both are read into buffers and copied."""
    from spotguard.checkpoint.resume import piece_read

    saved = torch.randn(1 << 19)
    with Checkpointer(str(tmp_path), write_threads=1) as ck:
        ck.save(1, {"a": saved, "b": saved.clone()}, reason="manual")
    straight = []  # the records read straight into their tensor
    read_head = piece_read._Reader.read_head
    monkeypatch.setattr(piece_read._Reader, "read_head", lambda self, r: straight.append(r) or read_head(self, r))
    tied = torch.zeros(1 << 19)
    assert Checkpointer(str(tmp_path)).resume({"a": tied, "b": tied}) == 1
    assert torch.equal(tied, saved)
    assert straight == []


def test_without_torch_saying_where_a_tensor_lies_every_record_is_copied(tmp_path, monkeypatch):
    """An older torch's loader may not mark a storage's offset in its record: nothing is then read straight
    into a tensor, and the state still resumes whole."""

    assert records.offsets_known()  # this torch marks it
    held = save_large(tmp_path, [1])[0]
    monkeypatch.setattr(records, "offsets_known", lambda: False)
    parsed = []
    stored_tensor = shard_read._stored_tensor
    monkeypatch.setattr(shard_read, "_stored_tensor", lambda data: parsed.append(len(data)) or stored_tensor(data))
    loaded = blank(held)
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert_same(loaded, held)
    assert len(parsed) == len(held)


def test_a_record_past_its_files_end_is_an_error_not_a_skipped_tensor(tmp_path):
    from types import SimpleNamespace

    from spotguard.checkpoint.resume.records import records_in

    storage = {"a": SimpleNamespace(offset=0, length=10), "b": SimpleNamespace(offset=10, length=10)}
    items = [SimpleNamespace(storage_index="a"), SimpleNamespace(storage_index="b")]
    assert [(o, n) for o, n, _ in records_in(tmp_path / "f", 20, items, storage)] == [(0, 10), (10, 10)]
    with pytest.raises(CheckpointError, match="past the file's end"):
        records_in(tmp_path / "f", 19, items, storage)
    storage["b"] = SimpleNamespace(offset=5, length=10)
    with pytest.raises(CheckpointError, match="overlap"):
        records_in(tmp_path / "f", 20, items, storage)


def test_records_of_one_shape_and_dtype_are_parsed_once(tmp_path, monkeypatch):
    """torch's parse of a record read straight into a tensor reads only the bytes around the tensor's: records
    with the same such bytes (one shape and dtype) share its answer; one that differs is parsed on its own."""

    g = torch.Generator().manual_seed(5)
    saved = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(4)}
    saved["b"] = torch.randn(1024, 512, generator=g)
    with Checkpointer(str(tmp_path), write_threads=1) as ck:
        ck.save(1, saved, reason="manual")
    parses = []
    real = records.stored
    monkeypatch.setattr(records, "stored", lambda parts: parses.append(len(parts[1])) or real(parts))
    loaded = {name: torch.zeros_like(t) for name, t in saved.items()}
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert_same(loaded, saved)
    assert len(parses) == 2


def test_small_tensor_records_are_copied_in_without_a_parse_each(tmp_path, monkeypatch):
    """Records too small to be read straight into their tensors are read into a buffer; their tensors' bytes
    are copied from there where torch's parse of a record of the same bytes around them said they lie (one
    parse for the lot), and a record bound for a tensor of another dtype is parsed and converted."""

    saved = {f"s{i}": torch.arange(100.0) * i for i in range(40)}
    saved["step"] = torch.tensor(7.0)
    saved["other"] = torch.arange(100.0)
    with Checkpointer(str(tmp_path), write_threads=1) as ck:
        ck.save(1, saved, reason="manual")
    parses = []
    real = records.stored
    monkeypatch.setattr(records, "stored", lambda parts: parses.append(len(parts[1])) or real(parts))
    delivered = []
    stored_tensor = shard_read._stored_tensor
    monkeypatch.setattr(shard_read, "_stored_tensor", lambda data: delivered.append(len(data)) or stored_tensor(data))
    loaded = {name: torch.zeros_like(t) for name, t in saved.items()}
    loaded["other"] = torch.zeros(100, dtype=torch.float64)
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert all(torch.equal(loaded[n], saved[n]) for n in saved if n != "other")
    assert torch.equal(loaded["other"], saved["other"].double())
    assert sorted(parses) == [4, 400, 800]  # the 0-dim step, the 100-float records at once, "other" as a float64
    assert delivered == [record_of(tmp_path / step_dir_name(1), "other").length]


def test_an_error_of_the_readers_own_is_raised_as_itself_not_as_damage(tmp_path, caplog, monkeypatch):
    """A read that fails for a reason of its own (not the file's bytes) leaves the file's checksum
    incomplete: that is not damage (a local copy would be set aside and fetched again), and the error
    itself is what the log says."""
    from spotguard.checkpoint.resume import piece_read

    held = save_large(tmp_path, [1, 2])
    real = piece_read.crc32c_extend
    calls = []

    def failing_once(crc, data):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("no memory for this piece")
        return real(crc, data)

    monkeypatch.setattr(piece_read, "crc32c_extend", failing_once)
    loaded = blank(held[0])
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert_same(loaded, held[0])
    assert "skipping step-0000000002" in caplog.text and "MemoryError: no memory for this piece" in caplog.text
    assert "Damaged" not in caplog.text


def test_records_smaller_than_the_first_read_of_a_record_are_read_once(tmp_path, monkeypatch):
    """A record read straight into its tensor that is shorter than the first bytes read of a record: that first
    read stops at its end (else it took the next record's bytes too, read and counted twice: damage)."""
    from spotguard.checkpoint.resume import piece_read

    monkeypatch.setattr(piece_read, "DIRECT_MIN", 16 << 10)
    saved = {f"w{i}": torch.randn(8 << 10) + i for i in range(6)}  # 32 KiB records, under HEAD
    with Checkpointer(str(tmp_path), write_threads=1) as ck:
        ck.save(1, saved, reason="manual")
    loaded = {name: torch.zeros_like(t) for name, t in saved.items()}
    assert Checkpointer(str(tmp_path)).resume(loaded) == 1
    assert_same(loaded, saved)
