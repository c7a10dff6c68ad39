"""A tampered checkpoint never runs code; resume skips it and falls back; nothing outside a step is used.

The payloads are harmless: unpickling one creates a marker directory under the test's tmp dir.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from pathlib import Path, PosixPath

import google_crc32c
import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

from cloud_adapters.storage import LocalStore, StoreError
from spotguard.checkpoint import Checkpointer, CheckpointError, list_checkpoints, verify_checkpoint
from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.format.manifest import FileRecord, Manifest, crc32c_hex
from spotguard.checkpoint.format.safe_pickle import RefusedPickle, load_metadata
from spotguard.checkpoint.save.retention import keep_last, remove_leftovers
from tests.ckpt_workers import assert_same, run_ranks, snapshot
from tests.test_checkpoint import resume_fresh, save_steps

REFUSED_MKDIR = f"refused to unpickle global {os.mkdir.__module__}.mkdir"


class Payload:
    """Unpickling this creates `marker`: proof that code chosen by the checkpoint's writer ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@dataclasses.dataclass
class RunConfig:
    lr: float


_CRC32C_POLY = 0x82F63B78  # Castagnoli, bit-reflected


def forge_crc32c(data: bytes, target: str) -> bytes:
    """4 bytes that, appended to `data`, give CRC32C `target` (8 hex digits).

    Appending 4 bytes xors them into the CRC register and then runs it 32 linear, invertible
    steps; so run the target register back 32 steps and xor with the register after `data`.
    """
    register = int(target, 16) ^ 0xFFFFFFFF
    for _ in range(32):
        register = (((register ^ _CRC32C_POLY) << 1) | 1 if register & 0x80000000 else register << 1) & 0xFFFFFFFF
    return (register ^ google_crc32c.value(data) ^ 0xFFFFFFFF).to_bytes(4, "little")


def impersonate(payload: bytes, original: bytes) -> bytes:
    """`payload` padded to the size and CRC32C of `original` (pickle ignores what follows its STOP)."""
    padded = payload + b"\0" * (len(original) - len(payload) - 4)
    return padded + forge_crc32c(padded, crc32c_hex(original))


def rewrite_manifest(step_dir: Path, **changes) -> None:
    path = step_dir / "spotguard.json"
    path.write_bytes(dataclasses.replace(Manifest.from_bytes(path.read_bytes()), **changes).to_bytes())


def vouch_for(step_dir: Path, name: str) -> None:
    """Update the manifest's record of `name` to what is on disk now (an attacker can write the manifest too)."""
    data = (step_dir / name).read_bytes()
    manifest = Manifest.from_bytes((step_dir / "spotguard.json").read_bytes())
    files = tuple(FileRecord(name, len(data), crc32c_hex(data)) if f.name == name else f for f in manifest.files)
    rewrite_manifest(step_dir, files=files)


# -- pickles ---------------------------------------------------------------------------------------


def test_metadata_pickle_vouched_for_by_the_manifest_is_refused_and_resume_falls_back(tmp_path, caplog):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    held = save_steps(ckpt, [1, 2])
    step_dir = ckpt / step_dir_name(2)
    (step_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    vouch_for(step_dir, ".metadata")
    assert verify_checkpoint(str(ckpt), step=2)[0].ok  # checksums catch damage, not someone who rewrites them

    step, state, loaded = resume_fresh(ckpt)
    assert not marker.exists()
    assert step == 1 and state["step"] == 1
    assert_same(loaded, held[0])
    assert "skipping step-0000000002" in caplog.text and REFUSED_MKDIR in caplog.text


def test_metadata_with_a_forged_crc32c_passes_verify_but_never_runs(tmp_path, caplog):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    held = save_steps(ckpt, [1, 2])
    metadata = ckpt / step_dir_name(2) / ".metadata"
    original = metadata.read_bytes()
    forged = impersonate(pickle.dumps(Payload(marker)), original)
    assert len(forged) == len(original) and crc32c_hex(forged) == crc32c_hex(original)
    pickle.loads(forged)  # a live payload: a general unpickler runs it
    assert marker.is_dir()
    marker.rmdir()
    metadata.write_bytes(forged)
    assert verify_checkpoint(str(ckpt), step=2)[0].ok  # the manifest is untouched and still matches

    step, _, loaded = resume_fresh(ckpt)
    assert not marker.exists()
    assert step == 1
    assert_same(loaded, held[0])
    assert REFUSED_MKDIR in caplog.text


def test_tampered_metadata_is_skipped_alike_on_two_ranks(tmp_path):
    ckpt, out, marker = tmp_path / "ckpt", tmp_path / "out", tmp_path / "ran"
    out.mkdir()
    held = save_steps(ckpt, [1, 2])
    metadata = ckpt / step_dir_name(2) / ".metadata"
    metadata.write_bytes(impersonate(pickle.dumps(Payload(marker)), metadata.read_bytes()))

    outputs = run_ranks("ddp_resume", 2, ckpt=str(ckpt), local=None, out=str(out))
    assert not marker.exists()
    for rank in (0, 1):
        got = torch.load(out / f"resumed-rank{rank}.pt")
        assert got["step"] == 1 and got["saved_step"] == 1
        assert_same(got["state"], held[0])
    assert REFUSED_MKDIR in outputs[0]


def test_metadata_unpickler_names_the_refused_global_in_one_line():
    with pytest.raises(RefusedPickle) as refused:
        load_metadata(pickle.dumps(Payload(Path("/nonexistent/never-created"))))
    message = str(refused.value)
    assert REFUSED_MKDIR in message and "add_safe_globals" in message and "\n" not in message
    with pytest.raises(RefusedPickle, match="not a Metadata"):
        load_metadata(pickle.dumps({"storage_data": {}}))
    with pytest.raises(RefusedPickle, match="unreadable DCP metadata"):
        load_metadata(b"\x80\x04garbage")


SHARED: dict[str, int] = {}


def shared() -> dict[str, int]:
    """A function the tests allow with add_safe_globals: a dict the whole process shares."""
    return SHARED


META = "torch.distributed.checkpoint.metadata"

# Pickles written opcode by opcode that change an object they did not create. BUILD with state
# (None, {name: value}) sets attributes with setattr, which works on a class; with a plain dict it
# updates __dict__, which works on a function or an instance.
STATE_CHANGES = {
    # The one reproduced: PosixPath.parent replaced process-wide, so a later save commits elsewhere.
    "BUILD on an allowed class": (lambda: PosixPath, "cpathlib\nPosixPath\n(N}Vparent\nI1\nstb.", []),
    "BUILD on a DCP metadata class": (lambda: Metadata, f"c{META}\nMetadata\n(N}}Vstorage_meta\nI1\nstb.", []),
    # _get_layout reads a cache it keeps on itself, for torch.load with weights_only=True too.
    "BUILD on an allowed function": (
        lambda: torch.serialization._get_layout,
        "ctorch.serialization\n_get_layout\n}Vcache\n}Vtorch.strided\nI1\nssb.",
        [],
    ),
    "BUILD on a function the user allowed": (lambda: shared, f"c{__name__}\nshared\n}}Vcalls\nI1\nsb.", [shared]),
    # Calling the Enum returns one of its members, which the whole process shares.
    "BUILD on what a call returned": (
        lambda: _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
        f"c{META}\n_MEM_FORMAT_ENCODING\n(I0\ntR}}V_value_\nI7\nsb.",
        [],
    ),
    "SETITEM on what a call returned": (lambda: SHARED, f"c{__name__}\nshared\n)RVk\nI1\ns.", [shared]),
}


def state_of(obj) -> dict:
    return dict(obj) if isinstance(obj, dict) else dict(vars(obj))


def put_back(obj, saved: dict) -> None:
    """Undo what a payload changed, so that a failure here does not break the tests after it."""
    if isinstance(obj, dict):
        obj.clear()
        obj.update(saved)
        return
    for name in vars(obj).keys() - saved.keys():
        delattr(obj, name)
    for name, value in saved.items():
        if vars(obj).get(name) is not value:
            setattr(obj, name, value)


@pytest.mark.parametrize("target, payload, allowed", STATE_CHANGES.values(), ids=STATE_CHANGES.keys())
def test_metadata_pickle_changes_nothing_it_did_not_create_even_when_refused(target, payload, allowed):
    obj = target()
    saved = state_of(obj)
    try:
        with torch.serialization.safe_globals(allowed), pytest.raises(RefusedPickle) as refused:
            load_metadata(payload.encode())
        changed = state_of(obj)
    finally:
        put_back(obj, saved)
    assert changed == saved
    assert "which this pickle did not create" in str(refused.value)


NEVER_WRITTEN = {  # opcodes that call or look up something by other ways than the ones checked
    "INST": b"(Vx\nipathlib\nPosixPath\n.",
    "OBJ": b"(cpathlib\nPosixPath\nVx\no.",
    "PERSID": b"P0\n.",
    "EXT1": b"\x80\x02\x82\x01.",
}


@pytest.mark.parametrize("opcode", NEVER_WRITTEN)
def test_metadata_unpickler_refuses_opcodes_dcp_never_writes(opcode):
    with pytest.raises(RefusedPickle, match=f"opcode {opcode} "):
        load_metadata(NEVER_WRITTEN[opcode])


def test_real_metadata_loads_as_pickle_loads_it(tmp_path):
    save_steps(tmp_path, [1])
    data = (tmp_path / step_dir_name(1) / ".metadata").read_bytes()
    loaded, expected = load_metadata(data), pickle.loads(data)
    assert loaded == expected
    assert pickle.dumps(loaded) == pickle.dumps(expected)  # the same objects, shared the same way


def test_a_value_carrying_a_pickle_payload_is_refused_and_resume_falls_back(tmp_path, caplog):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    with Checkpointer(str(ckpt)) as ck:
        ck.save(1, {"t": torch.ones(3), "epoch": 1}, reason="periodic")
        # A real writer stores the payload as DCP stores every non-tensor value: torch.save into a shard.
        ck.save(2, {"t": torch.ones(3), "epoch": Payload(marker)}, reason="periodic")
    assert not marker.exists() and all(r.ok for r in verify_checkpoint(str(ckpt)))

    state = {"t": torch.zeros(3), "epoch": 0}
    assert Checkpointer(str(ckpt)).resume(state) == 1
    assert not marker.exists()
    assert state["epoch"] == 1 and torch.equal(state["t"], torch.ones(3))
    assert f"epoch: {REFUSED_MKDIR}" in caplog.text


def test_a_type_of_your_own_loads_once_allowed(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"config": RunConfig(0.5)}, reason="manual")
    state = {"config": RunConfig(0.0)}
    with pytest.raises(CheckpointError, match=f"config: refused to unpickle global {__name__}.RunConfig"):
        Checkpointer(str(tmp_path)).resume(state)
    with torch.serialization.safe_globals([RunConfig]):
        assert Checkpointer(str(tmp_path)).resume(state) == 1
    assert state["config"] == RunConfig(0.5)


def test_a_step_dcp_cannot_load_falls_back_to_the_previous_one(tmp_path, caplog):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"t": torch.arange(3.0), "epoch": 1}, reason="periodic")
        ck.save(2, {"t": torch.arange(4.0), "epoch": 2}, reason="periodic")  # a state of another shape
    state = {"t": torch.zeros(3), "epoch": 0}
    assert Checkpointer(str(tmp_path)).resume(state) == 1
    assert torch.equal(state["t"], torch.arange(3.0)) and state["epoch"] == 1
    assert "skipping step-0000000002: loading" in caplog.text and "Size mismatch" in caplog.text


@pytest.mark.parametrize(
    "optim_cls,kwargs", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.AdamW, {"amsgrad": True})]
)
def test_real_checkpoints_load_through_the_restricted_path(tmp_path, optim_cls, kwargs):
    from tests.ckpt_workers import make_model, train

    model = make_model(seed=0)
    optim = optim_cls(model.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(optim, 2)
    train(model, optim, range(3))
    sched.step()
    values = {
        "epoch": 3,
        "name": "run-7",
        "losses": [0.5, None, True],
        "pair": (1, 2),
        "raw": b"\x00\xff",
        "rng": torch.get_rng_state(),
        "half": torch.ones(2, dtype=torch.bfloat16),
        "ids": torch.arange(5),
        "image": torch.randn(1, 3, 2, 2).to(memory_format=torch.channels_last),
    }
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(3, {"model": model, "optim": optim, "sched": sched, **values}, reason="manual")

    model2 = make_model(seed=9)
    optim2 = optim_cls(model2.parameters(), **kwargs)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, 2)
    state = {"model": model2, "optim": optim2, "sched": sched2}
    state.update({k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in values.items()})
    assert Checkpointer(str(tmp_path)).resume(state) == 3
    assert_same(snapshot(model2, optim2), snapshot(model, optim))
    assert sched2.state_dict() == sched.state_dict()
    for key, value in values.items():
        assert torch.equal(state[key], value) if isinstance(value, torch.Tensor) else state[key] == value, key


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_checkpoints_on_two_ranks_load_through_the_restricted_path(tmp_path, wrap):
    run_ranks("wrapped_round_trip", 2, ckpt=str(tmp_path / "ckpt"), wrap=wrap)


# -- files outside the step ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../step-0000000001/__0_0.distcp", "/etc/hostname", "..", "a\\b", "nul\0"])
def test_a_manifest_naming_a_file_outside_its_step_is_refused_everywhere(tmp_path, name):
    held = save_steps(tmp_path, [1, 2])
    step_dir = tmp_path / step_dir_name(2)
    manifest = Manifest.from_bytes((step_dir / "spotguard.json").read_bytes())
    rewrite_manifest(step_dir, files=(*manifest.files, FileRecord(name, 1, "00000000")))

    listed = {i.step: i for i in list_checkpoints(str(tmp_path))}
    assert not listed[2].committed and "unsafe file name" in listed[2].problem
    assert "unsafe file name" in verify_checkpoint(str(tmp_path), step=2)[0].problems[0]
    step, _, loaded = resume_fresh(tmp_path)
    assert step == 1
    assert_same(loaded, held[0])
    # Retention neither counts the step (which would cost the good one) nor deletes it.
    assert keep_last(LocalStore(tmp_path), 1) == []
    assert (tmp_path / step_dir_name(1)).is_dir() and (step_dir / "spotguard.json").is_file()


def test_a_step_file_that_is_a_symlink_is_refused_everywhere(tmp_path):
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    held = save_steps(ckpt, [1, 2])
    elsewhere.mkdir()
    victim = sorted((ckpt / step_dir_name(2)).glob("__0_*.distcp"))[0]
    outside = elsewhere / victim.name
    victim.rename(outside)  # same bytes, same size and CRC32C: only where it lives differs
    victim.symlink_to(outside)

    listed = {i.step: i for i in list_checkpoints(str(ckpt))}
    assert not listed[2].committed and f"{victim.name}: missing" in listed[2].problem
    assert verify_checkpoint(str(ckpt), step=2)[0].problems == [f"{victim.name}: not a regular file (a symlink)"]
    step, _, loaded = resume_fresh(ckpt)
    assert step == 1
    assert_same(loaded, held[0])
    assert keep_last(LocalStore(ckpt), 1) == []
    assert outside.is_file() and (ckpt / step_dir_name(1)).is_dir()


def test_a_step_directory_that_is_a_symlink_is_refused_and_never_deleted_through(tmp_path):
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    held = save_steps(ckpt, [1, 2])
    save_steps(elsewhere, [3])
    (ckpt / step_dir_name(3)).symlink_to(elsewhere / step_dir_name(3), target_is_directory=True)
    old = time.time() - 3600
    stale = ckpt / ".step-0000000004.tmp-0dd0"
    stale.symlink_to(elsewhere, target_is_directory=True)
    os.utime(stale, (old, old), follow_symlinks=False)

    assert [i.step for i in list_checkpoints(str(ckpt))] == [1, 2]
    assert "leads outside the store" in verify_checkpoint(str(ckpt), step=3)[0].problems[0]
    step, _, loaded = resume_fresh(ckpt)
    assert step == 2
    assert_same(loaded, held[1])
    assert keep_last(LocalStore(ckpt), 1) == [1]
    assert remove_leftovers(ckpt) == []
    assert stale.is_symlink() and (elsewhere / step_dir_name(3) / "spotguard.json").is_file()
    assert sorted(p.name for p in elsewhere.iterdir()) == [step_dir_name(3)]


def test_the_local_store_refuses_keys_that_lead_outside_it(tmp_path):
    store = LocalStore(tmp_path / "store")
    (tmp_path / "secret").write_bytes(b"s")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "link").symlink_to(tmp_path / "secret")
    for key in ("../secret", "/etc/hostname", "link"):
        with pytest.raises(StoreError, match="leads outside the store"):
            store.get_bytes(key)
        with pytest.raises(StoreError, match="leads outside the store"):
            store.delete([key])
    assert [o.key for o in store.list()] == []
    assert (tmp_path / "secret").read_bytes() == b"s"
