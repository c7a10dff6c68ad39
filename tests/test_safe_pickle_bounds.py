"""No `.metadata` can keep the unpickler busy for long: values it reuses are charged, keys of one
hash refused, and resume skips such a step.

A tuple that holds the tuple before it twice, 60 times over, takes a few bytes of pickle (the memo
or DUP gives each one twice) and expands to 2**60 nodes. Hashing it (a dict key, a set member, what a
lookup is called with) runs in C and holds the GIL for ever: not even SIGTERM would be handled. Keys
of one hash make filling a dict or set quadratic: 40,000 ints cost seconds, a few MB of them hours.
So every load here runs in a subprocess with a timeout: a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.format.safe_pickle import RefusedPickle, load_metadata
from tests.ckpt_workers import ROOT, assert_same, run_ranks
from tests.test_checkpoint import save_steps
from tests.test_checkpoint_security import vouch_for

META = "torch.distributed.checkpoint.metadata"
LOOKUP = b"ctorch.serialization\n_get_layout\n"  # an allowed global that hashes what it is called with


def dag(levels: int = 60, *, memo: bool = True) -> bytes:
    """Opcodes that push (), then `levels` times a tuple of the one before twice (4 or 2 bytes a level)."""
    ops = b")"
    for level in range(levels):
        ops += b"\x94h" + bytes([level]) + b"\x86" if memo else b"2\x86"  # MEMOIZE BINGET TUPLE2, or DUP TUPLE2
    return ops


def nested(depth: int) -> bytes:
    """Opcodes that push a tuple nested `depth` deep (one byte a level, nothing reused)."""
    return b")" + b"\x85" * depth


def pickled(ops: bytes) -> bytes:
    return b"\x80\x04" + ops + b"."


P = 2**61 - 1  # an int hashes to itself modulo P: k * P all hash to 0


def long1(value: int) -> bytes:
    encoded = pickle.encode_long(value)
    return b"\x8a" + bytes([len(encoded)]) + encoded


def colliding(n: int) -> bytes:
    """Opcodes that push n ints of one hash."""
    return b"".join(long1(k * P) for k in range(1, n + 1))


def colliding_pairs(n: int) -> bytes:
    return b"".join(long1(k * P) + b"N" for k in range(1, n + 1))


def colliding_puts(n: int) -> bytes:
    """Opcodes that memoize the value on the stack under n indices of one hash."""
    return b"".join(b"p%d\n" % (k * P) for k in range(n))


def colliding_indexes(n: int) -> bytes:
    """Opcodes that push a set of n MetadataIndex objects of one hash, that of ("w", (0,)): their offsets' is."""
    index = b"h\x00)\x81}(\x8c\x03fqn\x8c\x01w\x8c\x06offset%b\x85ub"  # NEWOBJ, then BUILD with its fields
    members = b"".join(index % long1(k * P) for k in range(n))
    return f"c{META}\nMetadataIndex\n".encode() + b"\x94\x8f(" + members + b"\x90"


REUSED = "reused from the memo"
# An instance whose first BUILD sets a lookup as its __setstate__, which a second BUILD would call.
SETSTATE_LOOKUP = f"c{META}\nChunkStorageMetadata\n".encode() + b")\x81}V__setstate__\n" + LOOKUP + b"sb"
ATTACKS = {  # name: (pickle, what the refusal says)
    "DAG as a dict key (SETITEM)": (pickled(b"}" + dag() + b"Ns"), REUSED),
    "DAG as a dict key (SETITEMS)": (pickled(b"}(" + dag() + b"Nu"), REUSED),
    "DAG as a dict key (DICT)": (pickled(b"(" + dag() + b"Nd"), REUSED),
    "DAG as a set member (ADDITEMS)": (pickled(b"\x8f(" + dag() + b"\x90"), REUSED),
    "DAG as a frozenset member": (pickled(b"(" + dag() + b"\x91"), REUSED),
    "DAG as what a lookup is called with": (pickled(LOOKUP + dag() + b"\x85R"), REUSED),
    "DAG of DUPs as a dict key": (pickled(b"}" + dag(memo=False) + b"Ns"), REUSED),
    # Nothing reused, but hash() recurses in C with no depth check: a million levels crash the process.
    "a million nested tuples as a dict key": (pickled(b"}" + nested(10**6) + b"Ns"), "would hash a value"),
    "a lookup made __setstate__ by a first BUILD": (pickled(SETSTATE_LOOKUP + nested(10**6) + b"b"), "reused or built"),
    # Each would take seconds (a MetadataIndex's == runs in Python: 10,000 take 20 s), more of them hours.
    "ints of one hash as dict keys (SETITEMS)": (pickled(b"}(" + colliding_pairs(40_000) + b"u"), "keys of one hash"),
    "ints of one hash as dict keys (DICT)": (pickled(b"(" + colliding_pairs(40_000) + b"d"), "keys of one hash"),
    "ints of one hash as set members": (pickled(b"\x8f(" + colliding(40_000) + b"\x90"), "keys of one hash"),
    "ints of one hash as frozenset members": (pickled(b"(" + colliding(40_000) + b"\x91"), "keys of one hash"),
    "MetadataIndex keys of one hash": (pickled(colliding_indexes(10_000)), "keys of one hash"),
    "memo indices of one hash (PUT)": (pickled(b"N" + colliding_puts(40_000)), "memo index"),
}

LOAD_EACH = """
import json, sys, time
from spotguard.checkpoint.format.safe_pickle import RefusedPickle, load_metadata
for name, data in json.load(open(sys.argv[1])).items():
    print("loading", name, flush=True)  # the last one named is the one that hung or crashed
    start = time.monotonic()
    try:
        load_metadata(bytes.fromhex(data))
        outcome = "loaded"
    except RefusedPickle as exc:
        outcome = str(exc)
    print(json.dumps([name, outcome, round(time.monotonic() - start, 3)]), flush=True)
"""


def test_pickles_that_would_hash_for_ever_or_crash_are_refused_at_once(tmp_path):
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({name: data.hex() for name, (data, _) in ATTACKS.items()}))
    assert len(ATTACKS["DAG as a dict key (SETITEM)"][0]) < 260 and len(ATTACKS["DAG of DUPs as a dict key"][0]) < 140
    try:
        done = subprocess.run(
            [sys.executable, "-c", LOAD_EACH, str(cases)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,  # the refusals take milliseconds, the two million-opcode pickles about a second
        )
    except subprocess.TimeoutExpired as hung:
        raise AssertionError(f"a load hung:\n{(hung.stdout or b'').decode()}") from None
    assert done.returncode == 0, f"the loads ended with {done.returncode}:\n{done.stdout}{done.stderr[-2000:]}"
    outcomes = {name: (outcome, seconds) for name, outcome, seconds in map(json.loads, done.stdout.splitlines()[1::2])}
    assert outcomes.keys() == ATTACKS.keys()
    for name, (outcome, seconds) in outcomes.items():
        assert ATTACKS[name][1] in outcome, (name, outcome)
        assert seconds < 10, (name, seconds)


def sharded(ranks: int, tensors: int) -> Metadata:
    """The metadata of `tensors` tensors sharded by rows over `ranks` ranks (as FSDP saves them)."""
    state, storage = {}, {}
    for t in range(tensors):
        fqn, chunks = f"model.layers.{t}.mlp.weight", []
        for rank in range(ranks):
            chunks.append(ChunkStorageMetadata(torch.Size([4 * rank, 0]), torch.Size([4, 64])))
            storage[MetadataIndex(fqn, chunks[-1].offsets)] = _StorageInfo(f"__{rank}_0.distcp", 1024 * t, 1024)
        state[fqn] = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([4 * ranks, 64]), chunks)
    return Metadata(state, planner_data={fqn: (fqn,) for fqn in state}, storage_data=storage)


@pytest.mark.parametrize("ranks,tensors", [(128, 40), (2048, 3)])
def test_metadata_of_many_ranks_still_loads(ranks, tensors):
    """The bound on keys is one of each hash, not of their number: real metadata has thousands; and a
    tensor cut into a chunk per rank of a 2,048-rank job is a layout DCP writes, not one refused."""
    metadata = sharded(ranks=ranks, tensors=tensors)
    assert load_metadata(pickle.dumps(metadata)) == metadata


def test_values_reused_within_the_bound_still_load():
    shared = (torch.Size([4, 4]), "model.layers.0.weight", [1, 2])
    metadata = Metadata(state_dict_metadata={}, planner_data={"a": shared, "b": shared, "c": [shared] * 100})
    assert load_metadata(pickle.dumps(metadata)) == metadata


# A list reused in a tuple and then filled: the tuple would hold what its reuse was never charged for.
@pytest.mark.parametrize("ops", [b"]\x94h\x00\x850K\x01a", b"]\x94h\x00a"], ids=["reused then filled", "in itself"])
def test_a_value_once_reused_does_not_change(ops):
    with pytest.raises(RefusedPickle, match="APPEND would change a builtins.list once reused or built"):
        load_metadata(pickled(ops))


def test_a_step_whose_metadata_would_hash_for_ever_is_skipped_and_the_previous_one_loads(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    held = save_steps(ckpt, [1, 2])
    step_dir = ckpt / step_dir_name(2)
    (step_dir / ".metadata").write_bytes(ATTACKS["DAG as a dict key (SETITEM)"][0])
    vouch_for(step_dir, ".metadata")  # whoever can write the checkpoint can write its manifest too

    # A rank in a process of its own: a resume that hung would be killed at the timeout and fail the test.
    output = run_ranks("ddp_resume", 1, timeout=90, ckpt=str(ckpt), local=None, out=str(out))[0]
    got = torch.load(out / "resumed-rank0.pt")
    assert got["step"] == 1 and got["saved_step"] == 1
    assert_same(got["state"], held[0])
    assert "skipping step-0000000002" in output and REUSED in output
