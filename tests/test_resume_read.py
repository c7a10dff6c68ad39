"""One-pass resume: every file is read once, checked as it is read, and a damaged byte anywhere means falling back."""

from __future__ import annotations

import pytest
import torch

from spotguard.checkpoint import Checkpointer, CheckpointError
from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.resume import shard_read
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
    real_readv, failed = os.readv, []

    def readv(fd, buffers):
        if not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        return real_readv(fd, buffers)

    monkeypatch.setattr(shard_read.os, "readv", readv)
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
