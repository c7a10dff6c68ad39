"""Snapshots at any world size: torchrun agents as nodes on 127.0.0.1 (spotguard.demo.localnodes), each
with its own snapshot dir standing for its host memory, FSDP2 on CPU (tests/reshard_worker.py),
snapshots every 3 steps and durable saves every 10.

Elastic (`--nnodes 2:3`, the c10d rendezvous hosted by the test): node 2 is SIGKILLed with no
notice, the survivors go on at world size 2 from the newest snapshot, then a new node joins and the
job goes on at world size 3 from the snapshot again. Each time the whole state (model and optimizer)
equals a plain DCP checkpoint of the same step loaded at the same new size. Then one test per
fallback, with a relaunch at 2 nodes of a job taken at 3: a shard nowhere, a corrupted replica, a
node whose peer server does not answer."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from spotguard.demo import localnodes
from tests.nodes import CHECKOUT, stop_all

WORKER = [str(Path(__file__).resolve().parent / "reshard_worker.py")]
SNAPSHOT_EVERY = 3
ARGS = ["--step-time", "0.1", "--save-every", "10"]
# Workers that torchrun restarts at a change of world size are not taken for lost nodes.
ENV = {"SPOTGUARD_SNAPSHOT_EVERY": str(SNAPSHOT_EVERY), "SPOTGUARD_PEER_TIMEOUT": "2"}
RESUMED = re.compile(r"resumed from the snapshot of step (\d+) in the nodes' memory .*resharded (\d) -> (\d)")


def records(nodes: list[localnodes.LocalNode], key: str) -> list[dict]:
    """Rank 0's JSON lines that have `key`, whichever node ran rank 0 at the time (after any prefix)."""
    found = []
    for node in nodes:
        for line in list(node.lines):
            at = line.find(f'{{"{key}"')
            if at >= 0:
                found.append(json.loads(line[at:]))
    return found


def wait_for(nodes: list[localnodes.LocalNode], key: str, world: int, after: int = -1, timeout: float = 150) -> dict:
    """The first line with `key` at world size `world` whose value is greater than `after`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in records(nodes, key) if r["world"] == world and r[key] > after]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no {key!r} line at world size {world}:\n" + "\n".join(n.tail() for n in nodes))


def loaded_digest(tmp: Path, nnodes: int, mirror: Path, step: int) -> str:
    """The digest of the plain DCP checkpoint of `step` loaded by `nnodes` fresh nodes."""
    nodes = localnodes.start_nodes(
        nnodes, WORKER, str(tmp / "unused"), tmp / f"load{step}", ["--load", f"{mirror}/step-{step}"], CHECKOUT
    )
    try:
        assert [node.finish(120) for node in nodes] == [0] * nnodes, "\n".join(n.tail() for n in nodes)
    finally:
        stop_all(nodes)
    (line,) = records(nodes, "loaded")
    return line["digest"]


def ledger_resumes(ckpt: Path) -> list[dict]:
    lines = (ckpt / "spotguard-ledger.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "resume"]


def test_a_node_lost_without_notice_then_a_new_one_joins_both_resume_from_the_peers_memory(tmp_path):
    ckpt, mirror = tmp_path / "ckpt", tmp_path / "mirror"
    rdzv = localnodes.Rendezvous("2:3", 3, WORKER, CHECKOUT)
    args = [*ARGS, "--steps", "90", "--mirror", str(mirror)]  # room for two snapshots at size 3 under load
    nodes = [rdzv.join(i, str(ckpt), tmp_path, args, ENV) for i in range(3)]
    try:
        assert nodes[0].wait_for(r'"step": 25, "world": 3'), nodes[0].tail()
        nodes[2].kill()  # no notice: the VM vanishes
        last = max(r["step"] for r in records(nodes, "step") if r["world"] == 3)
        shrunk = wait_for(nodes, "resumed", 2)
        time.sleep(2)  # a few steps at world size 2, a snapshot among them
        nodes.append(rdzv.join(3, str(ckpt), tmp_path, args, ENV))
        grown = wait_for(nodes, "resumed", 3, after=shrunk["resumed"])
        codes = [node.finish(180) for node in (nodes[0], nodes[1], nodes[3])]
    finally:
        stop_all(nodes)
    assert codes == [0, 0, 0], "\n".join(n.tail() for n in nodes)
    text = "\n".join(node.output() for node in nodes)
    resumes = [(int(a), int(b), int(c)) for a, b, c in RESUMED.findall(text)]
    assert resumes == [(shrunk["resumed"], 3, 2), (grown["resumed"], 2, 3)], resumes
    # The shrink lost at most one snapshot interval, not the work since the last durable save (step 19).
    assert last - shrunk["resumed"] <= SNAPSHOT_EVERY
    assert re.search(r"read \d+ bytes of rank 2's shard \(of 3\) from rank \d", text)  # the lost node's, from its buddy
    tiers = [(r["tier"], r.get("resharded")) for r in ledger_resumes(ckpt)]
    assert tiers[-2:] == [("snapshot", [3, 2]), ("snapshot", [2, 3])], tiers
    # The whole state after each reshard equals a durable checkpoint of the same step loaded at the same size.
    assert shrunk["digest"] == loaded_digest(tmp_path, 2, mirror, shrunk["resumed"])
    assert grown["digest"] == loaded_digest(tmp_path, 3, mirror, grown["resumed"])
    for node in (nodes[0], nodes[1], nodes[3]):  # the former shapes' files freed once the new one's are whole
        assert {p.name[-10:-5] for p in node.snapshot_dir.rglob("*.snap")} == {"00003"}


def interrupted(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[Path, list[localnodes.LocalNode]]:
    """Three nodes until step 16, then all SIGKILLed; node 2 is gone for good (its memory with it)."""
    ckpt = tmp_path / "ckpt"
    nodes = localnodes.start_nodes(3, WORKER, str(ckpt), tmp_path, [*ARGS, "--steps", "40"], {**CHECKOUT, **ENV})
    try:
        assert nodes[0].wait_for(r'"step": 16, "world": 3'), nodes[0].tail()
    finally:
        for node in (nodes[2], nodes[0], nodes[1]):
            node.kill()
        stop_all(nodes)
    shutil.rmtree(nodes[2].snapshot_dir)
    return ckpt, nodes


def relaunch_at_two(tmp_path: Path, ckpt: Path, env: dict[str, str] | None = None) -> tuple[dict, str]:
    nodes = localnodes.start_nodes(
        2, WORKER, str(ckpt), tmp_path, [*ARGS, "--steps", "40"], {**CHECKOUT, **ENV, **(env or {})}
    )
    try:
        codes = [node.finish(180) for node in nodes]
    finally:
        stop_all(nodes)
    assert codes == [0, 0], "\n".join(n.tail() for n in nodes)
    (resumed,) = records(nodes, "resumed")
    return resumed, "\n".join(node.output() for node in nodes)


def snapshot_steps(memory: Path, shard: int) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in memory.rglob(f"shard-{shard:05d}-of-00003.snap"))


def test_a_shard_held_nowhere_falls_back_to_the_snapshot_before(tmp_path):
    ckpt, nodes = interrupted(tmp_path)
    older, newest = snapshot_steps(nodes[0].snapshot_dir, 2)[-2:]  # node 2's shards: only its buddy's copies
    for path in nodes[0].snapshot_dir.rglob(f"step-{newest:010d}/shard-00002-of-00003.snap"):
        path.unlink()
    resumed, text = relaunch_at_two(tmp_path, ckpt)
    assert resumed["resumed"] == older and RESUMED.search(text).groups() == (str(older), "3", "2")


def test_a_corrupted_replica_is_struck_off_for_the_snapshot_before(tmp_path):
    ckpt, nodes = interrupted(tmp_path)
    older, newest = snapshot_steps(nodes[0].snapshot_dir, 2)[-2:]
    (replica,) = nodes[0].snapshot_dir.rglob(f"step-{newest:010d}/shard-00002-of-00003.snap")
    data = bytearray(replica.read_bytes())
    data[100] ^= 0xFF  # in the first block: every reader of the shard needs it
    replica.write_bytes(data)
    resumed, text = relaunch_at_two(tmp_path, ckpt)
    assert re.search(
        rf"snapshot of step {newest} \(world size 3\): rank \d cannot use shard 2 from rank 0 .*CRC32C", text
    )
    assert resumed["resumed"] == older and RESUMED.search(text).groups() == (str(older), "3", "2")


STALLED_SERVER = """
import os, time
if os.environ.get("SPOTGUARD_SNAPSHOT_DIR", "").endswith("node0-memory"):
    from spotguard.snapshots import peers
    def stalled(self, conn, request):
        time.sleep(3600)  # the server took the request and never answers
    peers.PeerServer._give_runs = stalled
"""


def test_a_node_that_does_not_answer_leaves_the_durable_checkpoint(tmp_path):
    ckpt, nodes = interrupted(tmp_path)
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(STALLED_SERVER)
    durable = max(int(p.name.removeprefix("step-")) for p in ckpt.glob("step-*"))
    resumed, text = relaunch_at_two(tmp_path, ckpt, {"PYTHONPATH": f"{inject}:{CHECKOUT['PYTHONPATH']}"})
    # Rank 1 needs part of node 2's shard, held by node 0 alone, whose server takes the request and stays silent.
    assert re.search(r"rank 1 cannot use shard 2 from rank 0 \(.*timed out", text)
    assert resumed["resumed"] == durable and not RESUMED.search(text)
    assert ledger_resumes(ckpt)[-1]["tier"] == "durable"
