"""Checkpoints in one process: round trip, manifest, verification, fallback, upload path, retention, async."""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from cloud_adapters.notice import INTERRUPTION, Notice, deadline_after, utc_now
from cloud_adapters.storage import LocalStore
from spotguard.checkpoint import (
    Checkpointer,
    CheckpointError,
    IfSaved,
    list_checkpoints,
    verify_checkpoint,
)
from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.format.manifest import FileRecord, checksum_file
from spotguard.checkpoint.io.transfer import download
from spotguard.checkpoint.save import shard_io
from tests.ckpt_workers import Own, assert_same, make_model, snapshot, train


def trained(optim_cls=torch.optim.Adam, steps=3, **optim_kwargs):
    model = make_model(seed=0)
    optim = optim_cls(model.parameters(), **(optim_kwargs or {"lr": 1e-2}))
    train(model, optim, range(steps))
    return model, optim


def fresh(optim_cls=torch.optim.Adam, **optim_kwargs):
    model = make_model(seed=99)
    return model, optim_cls(model.parameters(), **(optim_kwargs or {"lr": 1e-2}))


def save_steps(ckpt, steps, **kwargs) -> list[dict]:
    """Save a training run at each of `steps`; what each step holds."""
    model, optim = trained(steps=0)
    held = []
    with Checkpointer(str(ckpt), **kwargs) as ck:
        for step in steps:
            train(model, optim, range(step, step + 1))
            ck.save(step, {"model": model, "optim": optim, "step": step}, reason="periodic")
            held.append(snapshot(model, optim))
    return held


def resume_fresh(ckpt, **kwargs):
    model, optim = fresh()
    state = {"model": model, "optim": optim, "step": -1}
    with Checkpointer(str(ckpt), **kwargs) as ck:
        step = ck.resume(state)
    return step, state, snapshot(model, optim)


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def shard(step_dir: Path) -> Path:
    return sorted(step_dir.glob("__0_*.distcp"))[0]


@pytest.mark.parametrize(
    "optim_cls,kwargs",
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 1e-2})],
)
def test_round_trip_restores_model_and_optimizer_bit_identically(tmp_path, optim_cls, kwargs):
    model, optim = trained(optim_cls, **kwargs)
    extra = torch.arange(6.0)
    state = {"model": model, "optim": optim, "extra": extra, "epoch": 7}
    with Checkpointer(str(tmp_path)) as ck:
        report = ck.save(3, state, reason="manual")
    assert report.durable and report.step == 3 and report.files >= 2 and report.bytes > 0
    assert report.location == f"{tmp_path}/{step_dir_name(3)}"

    model2, optim2 = fresh(optim_cls, **kwargs)
    state2 = {"model": model2, "optim": optim2, "extra": torch.zeros(6), "epoch": 0}
    assert Checkpointer(str(tmp_path)).resume(state2) == 3
    assert_same(snapshot(model2, optim2), snapshot(model, optim))
    assert torch.equal(state2["extra"], extra) and state2["epoch"] == 7
    # Training on from both gives the same weights: the optimizer state was matched by parameter name.
    train(model, optim, range(3, 5))
    train(model2, optim2, range(3, 5))
    assert_same(snapshot(model2, optim2), snapshot(model, optim))


def test_manifest_records_every_file_with_size_and_crc32c(tmp_path):
    model, optim = trained()
    notice = Notice("gcp", INTERRUPTION, "preempt", deadline_after(30), utc_now(), "gcp:instance/preempted", "k")
    with Checkpointer(f"file://{tmp_path}") as ck:
        report = ck.save(
            12, {"model": model, "optim": optim}, reason="emergency", notice=notice, deadline=notice.deadline
        )
    assert report.margin_s is not None and 0 < report.margin_s < 30
    step_dir = tmp_path / "step-0000000012"
    manifest = json.loads((step_dir / "spotguard.json").read_text())
    assert manifest["step"] == 12 and manifest["reason"] == "emergency" and manifest["world_size"] == 1
    assert manifest["notice"] == notice.to_json()
    assert manifest["created_at"].endswith("Z")
    assert set(manifest["versions"]) == {"spotguard", "torch", "python"}
    assert manifest["versions"]["torch"] == torch.__version__
    on_disk = {p.name: p for p in step_dir.iterdir() if p.name != "spotguard.json"}
    assert {f["name"] for f in manifest["files"]} == set(on_disk) and ".metadata" in on_disk
    import google_crc32c

    for f in manifest["files"]:
        data = on_disk[f["name"]].read_bytes()
        assert f["size"] == len(data) and f["crc32c"] == f"{google_crc32c.value(data):08x}"
    assert manifest["total_bytes"] == report.bytes == sum(f["size"] for f in manifest["files"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the staging sibling was renamed


def bytes_read() -> int:
    """Bytes this process has read so far through read(2) and its kin, any thread, any file or
    socket (/proc/self/io's rchar): what a second read of a file costs, however it is made."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def three_files() -> dict[str, torch.Tensor]:
    """A state that a save with write_threads=3 spreads over three files of 1 MiB."""
    return {f"t{i}": torch.arange(1 << 17, dtype=torch.float32) + i for i in range(6)}


def test_shards_are_checksummed_as_written_not_read_back(tmp_path):
    state = three_files()
    with Checkpointer(str(tmp_path), write_threads=3) as ck:
        ck.save(1, state, reason="manual")  # whatever the first save imports is read here
        before = bytes_read()
        ck.save(2, state, reason="manual")
        read = bytes_read() - before
    step_dir = tmp_path / step_dir_name(2)
    shards = sorted(step_dir.glob("*.distcp"))
    assert len(shards) == 3
    assert read < min(p.stat().st_size for p in shards)  # only the renamed .metadata is read back
    manifest = json.loads((step_dir / "spotguard.json").read_text())
    assert {f["name"] for f in manifest["files"]} == {p.name for p in shards} | {".metadata"}
    for f in manifest["files"]:
        assert checksum_file(step_dir / f["name"]) == FileRecord(f["name"], f["size"], f["crc32c"])


def zip_crcs(step_dir: Path) -> list[int]:
    """The zip CRC32 of every member of every torch.save record in the step's shard files."""
    import io
    import zipfile

    from spotguard.checkpoint.format.safe_pickle import load_metadata

    crcs = []
    for info in load_metadata((step_dir / ".metadata").read_bytes()).storage_data.values():
        with open(step_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        crcs += [member.CRC for member in zipfile.ZipFile(io.BytesIO(record)).infolist()]
    return crcs


@pytest.mark.skipif(not hasattr(torch.serialization, "set_crc32_options"), reason="torch < 2.5 cannot switch it")
@pytest.mark.parametrize("users_setting", [True, False])
def test_torch_save_s_zip_crc32_is_off_while_we_write_and_the_users_setting_comes_back(tmp_path, users_setting):
    torch.serialization.set_crc32_options(users_setting)
    try:
        with Checkpointer(str(tmp_path), write_threads=3) as ck:  # torch 2.13 keeps the switch per thread
            ck.save(1, three_files(), reason="manual")
        assert torch.serialization.get_crc32_options() is users_setting
    finally:
        torch.serialization.set_crc32_options(True)
    crcs = zip_crcs(tmp_path / step_dir_name(1))
    assert len(crcs) >= 6 and set(crcs) == {0}  # none computed (the manifest's CRC32C covers every byte)


class _Switch:
    """torch's zip CRC32 switch as torch 2.13 keeps it (per thread) or as older releases did (one for all)."""

    def __init__(self, per_thread: bool) -> None:
        self.per_thread, self.shared, self.local = per_thread, True, threading.local()

    def get(self) -> bool:
        return getattr(self.local, "value", True) if self.per_thread else self.shared

    def set(self, value: bool) -> None:
        if self.per_thread:
            self.local.value = value
        else:
            self.shared = value


@pytest.mark.parametrize("scope", ["thread", "process"])
def test_the_zip_crc32_switch_is_off_in_every_writing_thread_and_comes_back_as_the_user_set_it(monkeypatch, scope):
    """Saves and their writing threads overlap and end in any order; however torch keeps the switch."""
    switch = _Switch(per_thread=scope == "thread")
    monkeypatch.setattr(torch.serialization, "get_crc32_options", switch.get)
    monkeypatch.setattr(torch.serialization, "set_crc32_options", switch.set)
    monkeypatch.setattr(shard_io, "_zip_crc32_scope", None)  # learnt again, from this switch
    switch.set(True)
    inside, after, all_in = [], [], threading.Barrier(3)

    def writer(leave_after_s: float) -> None:
        with shard_io.without_zip_crc32():
            all_in.wait(5)  # all three inside at once
            inside.append(torch.serialization.get_crc32_options())
            time.sleep(leave_after_s)
        after.append(torch.serialization.get_crc32_options())

    with shard_io.without_zip_crc32():  # the save's own, on the calling thread
        threads = [threading.Thread(target=writer, args=(0.05 * i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert torch.serialization.get_crc32_options() is False
    assert shard_io._zip_crc32_scope == scope
    assert inside == [False] * 3  # off in every writing thread, whichever left first
    assert torch.serialization.get_crc32_options() is True  # the user's setting is back
    if scope == "thread":
        assert after == [True] * 3  # each thread's own put back as it left
    assert not any(t.name == "spotguard-probe" for t in threading.enumerate())


def test_corrupt_shard_is_reported_and_resume_falls_back(tmp_path, caplog):
    held = save_steps(tmp_path, [1, 2])
    flip_byte(shard(tmp_path / "step-0000000002"))

    results = {r.step: r for r in verify_checkpoint(str(tmp_path))}
    assert results[1].ok and not results[2].ok
    assert "crc32c" in results[2].problems[0] and "__0_" in results[2].problems[0]
    assert [r.step for r in verify_checkpoint(str(tmp_path), step=2)] == [2]

    step, state, loaded = resume_fresh(tmp_path)
    assert step == 1 and state["step"] == 1
    assert_same(loaded, held[0])
    assert "skipping step-0000000002" in caplog.text and "crc32c" in caplog.text


def test_truncated_shard_and_missing_file_fall_back(tmp_path):
    held = save_steps(tmp_path, [1, 2, 3])
    victim = shard(tmp_path / "step-0000000003")
    victim.write_bytes(victim.read_bytes()[:-1])
    shard(tmp_path / "step-0000000002").unlink()
    listed = {i.step: i for i in list_checkpoints(str(tmp_path))}
    assert not listed[3].committed and "size" in listed[3].problem
    assert not listed[2].committed and "missing" in listed[2].problem
    step, _, loaded = resume_fresh(tmp_path)
    assert step == 1
    assert_same(loaded, held[0])


def test_tampered_metadata_pickle_is_never_unpickled(tmp_path):
    held = save_steps(tmp_path, [1, 2])
    canary = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(canary),))

    metadata = tmp_path / "step-0000000002" / ".metadata"
    evil = pickle.dumps(Evil())  # padded to the right size: only the checksum can tell
    metadata.write_bytes(evil + b"\0" * (metadata.stat().st_size - len(evil)))
    assert not verify_checkpoint(str(tmp_path), step=2)[0].ok
    step, _, loaded = resume_fresh(tmp_path)
    assert step == 1 and not canary.exists()
    assert_same(loaded, held[0])


def test_step_without_manifest_and_stray_staging_dirs_are_ignored(tmp_path):
    held = save_steps(tmp_path, [1, 2])
    (tmp_path / "step-0000000002" / "spotguard.json").unlink()
    stray = tmp_path / ".step-0000000009.tmp-abcd"
    stray.mkdir()
    (stray / ".metadata").write_bytes(b"garbage")
    listed = {i.step: i.committed for i in list_checkpoints(str(tmp_path))}
    assert listed == {1: True, 2: False}
    step, _, loaded = resume_fresh(tmp_path)
    assert step == 1
    assert_same(loaded, held[0])


def test_empty_location_resumes_nothing(tmp_path):
    model, optim = fresh()
    assert Checkpointer(str(tmp_path / "none")).resume({"model": model, "optim": optim}) is None
    assert list_checkpoints(str(tmp_path / "none")) == []


def test_existing_committed_step_is_kept_not_overwritten(tmp_path, caplog):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(4, {"t": torch.ones(3)}, reason="periodic")
        report = ck.save(4, {"t": torch.zeros(3)}, reason="emergency")
    assert report.durable
    state = {"t": torch.empty(3)}
    assert Checkpointer(str(tmp_path)).resume(state) == 4
    assert torch.equal(state["t"], torch.ones(3))
    assert "already committed" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000004"]


def test_async_save_keeps_the_values_at_save_time(tmp_path):
    model, optim = trained()
    t = torch.arange(1000.0)
    state = {"model": model, "optim": optim, "t": t}
    at_save = snapshot(model, optim)
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.save(8, state, reason="periodic", wait=False) is None
        t.add_(100.0)  # the caller goes on training while the save is written
        train(model, optim, range(3, 6))
        report = ck.wait(timeout=60)
        assert report is not None and report.step == 8 and report.durable
        assert ck.wait() is None
    model2, optim2 = fresh()
    state2 = {"model": model2, "optim": optim2, "t": torch.zeros(1000)}
    assert Checkpointer(str(tmp_path)).resume(state2) == 8
    assert torch.equal(state2["t"], torch.arange(1000.0))
    assert_same(snapshot(model2, optim2), at_save)


def test_upload_path_commits_locally_then_remotely(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    held = save_steps(remote, [1, 2], local_dir=str(local))
    for root in (remote, local):
        assert [(i.step, i.committed) for i in list_checkpoints(str(root))] == [(1, True), (2, True)]
        assert all(r.ok for r in verify_checkpoint(str(root)))
        assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert (remote / "step-0000000002" / "spotguard.json").read_bytes() == (
        local / "step-0000000002" / "spotguard.json"
    ).read_bytes()

    # Fresh VM: nothing local, the step is downloaded and verified.
    fresh_local = tmp_path / "fresh"
    step, _, loaded = resume_fresh(remote, local_dir=str(fresh_local))
    assert step == 2
    assert_same(loaded, held[1])
    assert [(i.step, i.committed) for i in list_checkpoints(str(fresh_local))] == [(2, True)]

    # Same step on both sides: the local copy is read, the remote one never fetched.
    flip_byte(shard(remote / "step-0000000002"))
    step, _, loaded = resume_fresh(remote, local_dir=str(local))
    assert step == 2
    assert_same(loaded, held[1])

    # A damaged local copy is fetched again; a damaged remote copy then means falling back.
    flip_byte(shard(local / "step-0000000002"))
    step, _, loaded = resume_fresh(remote, local_dir=str(local))
    assert step == 1
    assert_same(loaded, held[0])


def _resume_t(location, **kwargs):
    state = {"t": torch.zeros(4)}
    with Checkpointer(str(location), **kwargs) as ck:
        return ck, ck.resume(state), state["t"]


@pytest.mark.parametrize("staged", [False, True], ids=["filesystem", "staged-then-uploaded"])
def test_a_committed_step_that_resume_rejected_is_replaced_by_the_new_save(tmp_path, staged, caplog):
    """Step 20 damaged: resume falls back to 11; the run reaches 20 again and saves it. Keeping
    the damaged copy ("already committed") would report a save that every later resume skips."""
    remote = tmp_path / "ckpt"
    local = (lambda name: {"local_dir": str(tmp_path / name)}) if staged else (lambda name: {})
    with Checkpointer(str(remote), **local("a")) as ck:
        for step in (11, 20):
            ck.save(step, {"t": torch.full((4,), float(step))}, reason="periodic")
    flip_byte(shard(remote / "step-0000000020"))
    ck, step, t = _resume_t(remote, **local("b"))
    assert step == 11 and torch.equal(t, torch.full((4,), 11.0))
    with Checkpointer(str(remote), **local("b")) as ck:
        assert ck.resume({"t": torch.zeros(4)}) == 11
        report = ck.save(20, {"t": torch.full((4,), 20.5)}, reason="emergency")
    assert report is not None and report.durable
    assert "resume would not load it (this run's resume found it bad)" in caplog.text
    _, step, t = _resume_t(remote, **local("c"))
    assert step == 20 and torch.equal(t, torch.full((4,), 20.5))


def test_a_new_checkpoint_key_replaces_an_unsigned_step_of_the_same_number(tmp_path, caplog):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(5, {"t": torch.ones(4)}, reason="periodic")
    key = b"k" * 32
    with Checkpointer(str(tmp_path), checkpoint_key=key) as ck:
        assert ck.resume({"t": torch.zeros(4)}) is None  # unsigned: not this key's
        ck.save(5, {"t": torch.full((4,), 2.0)}, reason="periodic")
    assert "resume would not load it" in caplog.text
    _, step, t = _resume_t(tmp_path, checkpoint_key=key)
    assert step == 5 and torch.equal(t, torch.full((4,), 2.0))


def test_failed_upload_keeps_the_local_commit_and_it_wins_on_resume(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    remote.mkdir()
    (remote / "step-0000000007").write_text("not a directory")  # every upload into it fails
    t = torch.arange(10.0)
    with Checkpointer(str(remote), local_dir=str(local)) as ck:
        report = ck.save(7, {"t": t}, reason="emergency")
    assert not report.durable and report.error and report.durable_at is None and report.margin_s is None
    assert report.location == report.local_location == str(local / "step-0000000007")
    assert not (remote / "step-0000000007").is_dir()
    state = {"t": torch.zeros(10)}
    assert Checkpointer(str(remote), local_dir=str(local)).resume(state) == 7
    assert torch.equal(state["t"], t)


def test_keep_last_deletes_only_older_committed_steps_and_stale_leftovers(tmp_path):
    old = time.time() - 3600
    stale_tmp = tmp_path / ".step-0000000001.tmp-0dd0"
    fresh_tmp = tmp_path / ".step-0000000009.tmp-f5e5"
    abandoned = tmp_path / "step-0000000000"
    for d in (stale_tmp, fresh_tmp, abandoned):
        d.mkdir(parents=True)
    os.utime(stale_tmp, (old, old))
    os.utime(abandoned, (old, old))
    save_steps(tmp_path, [1, 2, 3, 4], keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    # A recent staging dir may belong to a save in progress: it stays.
    assert names == [fresh_tmp.name, "step-0000000003", "step-0000000004"]


def test_cleanup_leaves_step_directories_that_spotguard_did_not_write(tmp_path):
    """An 11-digit `step-00000000009` is no name of ours, and a user's `step-N` holding their own
    files is theirs: both stay; a manifest-less step holding only our files (an interrupted upload) goes."""
    from spotguard.checkpoint.save.retention import remove_abandoned

    old = time.time() - 3600
    leftovers = {
        "step-00000000009": ["__0_0.distcp"],
        "step-0000000005": ["notes.txt", "__0_0.distcp"],
        "step-0000000006": ["__0_0.distcp", ".metadata", ".__1_0.distcp.0123456789ab.tmp"],
    }
    for name, files in leftovers.items():
        for file in files:
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / file).write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    (tmp_path / "step-0000000007" / "sub").mkdir(parents=True)  # a directory inside: not ours either
    os.utime(tmp_path / "step-0000000007", (old, old))
    save_steps(tmp_path, [10], keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000000009",
        "step-0000000005",
        "step-0000000007",
        "step-0000000010",
    ]
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [5, 10]  # 11 digits: not listed as step 9

    (tmp_path / "step-0000000006").mkdir()
    (tmp_path / "step-0000000006" / "__0_0.distcp").write_bytes(b"x")
    assert remove_abandoned(LocalStore(tmp_path)) == [6]  # the object-store cleanup: the same rule
    assert (tmp_path / "step-0000000005" / "notes.txt").is_file()


def test_keep_last_applies_to_local_and_remote(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    save_steps(remote, [1, 2, 3], local_dir=str(local), keep_last=1)
    for root in (remote, local):
        assert [i.step for i in list_checkpoints(str(root))] == [3]


def test_user_mistakes_get_one_line_errors(tmp_path):
    model, optim = trained()
    ck = Checkpointer(str(tmp_path))
    with pytest.raises(ValueError, match="optimizer whose parameters belong to no nn.Module"):
        ck.save(1, {"optim": optim}, reason="manual")
    with pytest.raises(ValueError, match="reason must be one of"):
        ck.save(1, {"model": model}, reason="because")
    with pytest.raises(ValueError, match="step must be >= 0"):
        ck.save(-1, {"model": model}, reason="manual")
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        Checkpointer(str(tmp_path), keep_last=0)
    with pytest.raises(ValueError, match="unsupported checkpoint location"):
        Checkpointer("ftp://host/x")
    with pytest.raises(CheckpointError, match="loading .* failed"):
        ck.save(1, {"t": torch.ones(3)}, reason="manual")
        ck.resume({"t": torch.ones(4)})
    ck.close()


def test_a_failed_save_raises_and_commits_nothing(tmp_path):
    blocker = tmp_path / "file"
    ck = Checkpointer(str(blocker))  # a directory at first: the disk goes away under the job
    blocker.rmdir()
    blocker.write_text("a file where the checkpoint directory should be")
    with pytest.raises(ValueError, match="^checkpoint_dir: cannot create .*: File exists"):
        Checkpointer(str(blocker))  # a new one is refused at once
    with pytest.raises(CheckpointError, match="step 3 failed, nothing committed"):
        ck.save(3, {"t": torch.ones(3)}, reason="emergency")
    ck.save(4, {"t": torch.ones(3)}, reason="periodic", wait=False)
    with pytest.raises(CheckpointError, match="step 4 failed"):
        ck.wait(timeout=60)
    ck.close()
    assert blocker.read_text().startswith("a file")


class Stop(BaseException):
    """Not an Exception: what a transfer thread may die of (DCP's CheckpointException is one too)."""


def test_a_transfer_dying_of_a_base_exception_fails_the_download_instead_of_hanging(tmp_path):
    store = LocalStore(tmp_path / "store")
    for key in ("a", "b", "c"):
        store.put_bytes(key, b"x" * 100)

    def stop(_: int) -> None:
        raise Stop("pulled the plug")

    outcome: dict = {}

    def run() -> None:
        try:
            download(store, [(k, tmp_path / k) for k in ("a", "b", "c")], threads=2, progress=stop)
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "download() hung on a transfer that died"
    assert isinstance(outcome.get("error"), OSError) and "of 3 transfers failed: Stop: pulled the plug" in str(
        outcome["error"]
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only (a no-op elsewhere)")
def test_writeback_hint_reaches_the_kernel_and_never_raises(tmp_path):
    from spotguard.checkpoint.save import shard_io

    assert shard_io._sync_file_range is not None
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x" * (1 << 20))
        f.flush()
        assert shard_io._sync_file_range(f.fileno(), 0, 1 << 20, shard_io._SYNC_FILE_RANGE_WRITE) == 0
        shard_io.start_writeback(f.fileno(), 0, 1 << 20)
    shard_io.start_writeback(-1, 0, 1)  # a bad descriptor: ignored, it is only a hint


def test_an_if_saved_entry_the_step_lacks_is_left_alone_and_only_a_top_level_one_is_taken(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"w": torch.ones(3), "a.b": {"x": torch.ones(1)}}, reason="manual")
        own = Own("fresh")
        # "a" is not saved although a saved name starts with "a.": it is left as it is, the rest loads.
        state = {"w": torch.zeros(3), "a.b": {"x": torch.zeros(1)}, "a": IfSaved(own)}
        assert ckpt.resume(state) == 1
        assert torch.equal(state["w"], torch.ones(3)) and torch.equal(state["a.b"]["x"], torch.ones(1))
        assert own.value == "fresh"
        with pytest.raises(TypeError, match=r"state\['nested'\] holds an IfSaved below the top level"):
            ckpt.save(2, {"w": torch.ones(3), "nested": {"rng": [IfSaved(own)]}}, reason="manual")


def _saved_on_a_clock_ahead(location, step, monkeypatch, days=2):
    """A step committed by a host whose clock is `days` ahead (its manifest's created_at)."""
    import spotguard.checkpoint.checkpointer as module

    real = module.utc_now
    monkeypatch.setattr(module, "utc_now", lambda: real() + timedelta(days=days))
    with Checkpointer(str(location)) as ck:
        ck.save(step, {"t": torch.full((4,), float(step))}, reason="periodic")
    monkeypatch.setattr(module, "utc_now", real)


def test_retention_keeps_the_highest_steps_whatever_clock_committed_them(tmp_path, monkeypatch):
    """A save from a VM whose clock ran 2 days ahead must not make keep_last=1 delete every later
    save right after reporting it committed."""
    _saved_on_a_clock_ahead(tmp_path, 10, monkeypatch)
    with Checkpointer(str(tmp_path), keep_last=1) as ck:
        assert ck.resume({"t": torch.zeros(4)}) == 10
        for step in (11, 12):
            assert ck.save(step, {"t": torch.full((4,), float(step))}, reason="periodic") is not None
    assert [(i.step, i.committed) for i in list_checkpoints(str(tmp_path))] == [(12, True)]


def test_a_step_committed_on_a_clock_ahead_before_this_run_is_not_another_jobs(tmp_path, monkeypatch, caplog):
    """The step this run resumed from, from a host whose clock was ahead, is an earlier run's: not
    "two jobs share this checkpoint_dir" (which would refuse every save, the emergency one too)."""
    _saved_on_a_clock_ahead(tmp_path, 10, monkeypatch)
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.resume({"t": torch.zeros(4)}) == 10
        first = ck.save(11, {"t": torch.ones(4)}, reason="periodic")
        second = ck.save(12, {"t": torch.ones(4)}, reason="emergency")
    assert first is not None and second is not None and second.durable
    assert "two jobs share" not in caplog.text


def test_a_closed_checkpointer_is_freed_without_the_garbage_collector(tmp_path):
    """A reference cycle would keep its process group alive until interpreter exit, where gloo's
    threads are torn down in no order (a rank then aborted with "terminate called")."""
    import gc
    import weakref

    gc.disable()
    try:
        ckpt = Checkpointer(str(tmp_path), local_dir=str(tmp_path / "vm"))
        ckpt.save(1, {"t": torch.zeros(4)}, reason="manual")
        ckpt.close()
        freed = weakref.ref(ckpt)
        del ckpt
        assert freed() is None
    finally:
        gc.enable()


def test_a_tensor_cast_to_another_dtype_is_planned_anew_not_saved_under_the_cached_dtype(tmp_path):
    """DCP's plan cache judges a plan by its items' names, sizes and places: a cast of the same shape
    would keep the old dtype in the metadata, and a resume would read half-precision bytes as float32."""
    from spotguard.checkpoint.format.safe_pickle import load_metadata

    w = torch.arange(8, dtype=torch.float32)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"w": w}, reason="periodic")
        ck.save(2, {"w": w}, reason="periodic")  # the cached plan
        ck.save(3, {"w": w.to(torch.float16) / 3}, reason="periodic")
        metadata = load_metadata((tmp_path / step_dir_name(3) / ".metadata").read_bytes())
        assert metadata.state_dict_metadata["w"].properties.dtype == torch.float16
        state = {"w": torch.zeros(8, dtype=torch.float16)}
        assert ck.resume(state) == 3
    assert torch.equal(state["w"], w.to(torch.float16) / 3)
