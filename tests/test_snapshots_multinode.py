"""Losses without a notice: torchrun agents as nodes on 127.0.0.1 (tests/nodes.py), each with its own
snapshot dir standing for its host memory, snapshots switched on by the environment alone
(SPOTGUARD_SNAPSHOT_EVERY, no code change in examples/train_ddp.py). A node is SIGKILLed with no
notice after the durable save D and a later snapshot S; the job is launched again with a replacement
node (an empty snapshot dir) and resumes from what the survivors hold. A node frozen with no notice is
declared lost by its neighbour and ends the job within seconds, then the same. Then the other
layouts: two ranks per node, and two replicas of each shard (tests/reshard_worker.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from spotguard.snapshots import shard_file
from tests.nodes import EXAMPLE, Node, json_lines, start_nodes, stop_all

STEPS = 36
SAVE_EVERY = 10  # the durable tier
SNAPSHOT_EVERY = 3
# FSDP2: every rank's shard differs, so a lost node's shard can only come from its buddy. (DDP over
# three gloo ranks is not bit-reproducible across any restart, a durable one included: its first step
# after a start reduces in another order than the steps after DDP rebuilt its buckets.)
ARGS = ["--steps", str(STEPS), "--step-time", "0.05", "--save-every", str(SAVE_EVERY), "--fsdp"]
ENV = {"SPOTGUARD_SNAPSHOT_EVERY": str(SNAPSHOT_EVERY)}
# A loss loses at most one interval plus the newest snapshot's own write and replication: a kill right
# after step 24's snapshot began, before its replica was whole, resumes from step 21 (docs/guide/snapshots.md);
# `last` is the step the worker printed last, before its guard.step().
MOST_LOST = 2 * SNAPSHOT_EVERY
STEP_LINE = re.compile(r'^\{"step": (\d+)', re.MULTILINE)  # what rank 0 prints after each step
RESUMED = re.compile(r"resumed from the snapshot of step (\d+)")
SNAP_NAME = re.compile(r"step-(\d+)/shard-(\d+)-of-(\d+)\.snap$")


@dataclasses.dataclass(frozen=True)
class Job:
    """How the job is launched: its nodes, their workers, the script and its arguments."""

    nnodes: int = 3
    nproc_per_node: int | tuple[int, ...] = 1
    script: tuple[str, ...] = tuple(EXAMPLE)
    args: tuple[str, ...] = tuple(ARGS)
    replicas: int = 1  # snapshot_replicas (tests/reshard_worker.py only)

    def start(self, tmp: Path, extra: Sequence[str] = (), env: dict[str, str] | None = None) -> list[Node]:
        args = [*self.args, *(["--snapshot-replicas", str(self.replicas)] if self.replicas != 1 else []), *extra]
        layout = {"script": list(self.script), "nproc_per_node": self.nproc_per_node}
        return start_nodes(self.nnodes, str(tmp / "ckpt"), tmp, args, env, **layout)

    def run(self, tmp: Path, steps: int = STEPS, env: dict[str, str] | None = None) -> tuple[dict, str]:
        """A whole run to `steps` (a resume, if `tmp` holds an earlier one): ({"start", "digest"} of
        rank 0, every node's output)."""
        out = tmp / "out.json"
        example = self.script == tuple(EXAMPLE)
        nodes = self.start(tmp, ["--steps", str(steps), *(["--out", str(out)] if example else [])], env)
        try:
            codes = [node.finish(180) for node in nodes]
        finally:
            stop_all(nodes)
        assert codes == [0] * len(nodes), "\n".join(node.tail() for node in nodes)
        text = "\n".join(node.output() for node in nodes)
        if example:
            return json.loads(out.read_text()), text
        (resumed,) = json_lines(nodes[0], "resumed")
        (final,) = json_lines(nodes[0], "final")
        return {"start": resumed["resumed"] + 1, "digest": final["digest"]}, text


# tests/reshard_worker.py: FSDP2 too, with the digest of the whole state (the optimizer's too) and
# --snapshot-replicas.
WORKER = (str(Path(__file__).resolve().parent / "reshard_worker.py"),)
WORKER_ARGS = ("--step-time", "0.05", "--save-every", str(SAVE_EVERY))
THREE = Job()
TWO_BY_TWO = Job(nnodes=2, nproc_per_node=2, script=WORKER, args=WORKER_ARGS)
THREE_TWO_REPLICAS = Job(script=WORKER, args=WORKER_ARGS, replicas=2)
UNEVEN = Job(nnodes=2, nproc_per_node=(2, 1), script=WORKER, args=WORKER_ARGS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Callable[[Job], str]:
    """The final digest of a run of the job that was never interrupted (and never snapshot), made
    once per module and layout."""
    found: dict[Job, str] = {}

    def get(job: Job) -> str:
        plain = dataclasses.replace(job, replicas=1)  # the replicas do not change the weights
        if plain not in found:
            found[plain] = plain.run(tmp_path_factory.mktemp("reference"))[0]["digest"]
        return found[plain]

    return get


def interrupted_run(
    tmp_path: Path, lost: list[int], job: Job = THREE, at_step: int = 25, ready: Callable[[], bool] | None = None
) -> int:
    """Run the job until rank 0 printed `at_step` (and `ready()` holds), then SIGKILL the nodes `lost`
    (no notice) and the rest (their collectives fail without the lost ones); returns the last step
    rank 0 printed."""
    nodes = job.start(tmp_path, env=ENV)
    try:
        nodes[0].step_reached(at_step)
        deadline = time.monotonic() + 60
        while ready is not None and not ready():
            assert time.monotonic() < deadline, "never ready to be interrupted:\n" + nodes[0].tail()
            time.sleep(0.01)
        for i in lost:
            nodes[i].kill()
    finally:
        stop_all(nodes)
        for node in nodes:  # for resumed_snapshot's message
            (tmp_path / f"interrupted-node{node.rank}.log").write_text(node.output())
    for i in lost:  # replacement VMs: nothing in their memory or on their local disk
        shutil.rmtree(nodes[i].snapshot_dir, ignore_errors=True)
        shutil.rmtree(nodes[i].local_dir, ignore_errors=True)
    held = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("node*-memory/**/*.snap"))
    (tmp_path / "interrupted-held.log").write_text("\n".join(held))  # for resumed_snapshot's message
    return max(map(int, STEP_LINE.findall(nodes[0].output())))  # every line it printed, once it has ended


def relaunch(tmp_path: Path, job: Job = THREE, steps: int = STEPS) -> tuple[dict, str]:
    """The job launched again over what the interrupted run left (`Job.run`)."""
    return job.run(tmp_path, steps, ENV)


def resumed_snapshot(text: str, tmp_path: Path) -> int:
    """The step of the snapshot the relaunch resumed from (it must have resumed from one)."""
    found = RESUMED.search(text)
    if not found:
        before = [f"--- {log.name}:\n" + "\n".join(log.read_text().splitlines()[-40:])
                  for log in sorted(tmp_path.glob("interrupted-*.log"))]  # fmt: skip
        raise AssertionError("the relaunch did not resume from a snapshot:\n" + "\n".join(text.splitlines()[-60:])
                             + "\n" + "\n".join(before))  # fmt: skip
    return int(found[1])


def ledger_lines(tmp_path) -> list[str]:
    return (tmp_path / "ckpt" / "spotguard-ledger.jsonl").read_text().splitlines()


def ledger_resumes(tmp_path) -> list[dict]:
    return [r for r in map(json.loads, ledger_lines(tmp_path)) if r.get("event") == "resume"]


def committed(tmp_path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "ckpt").glob("step-*"))


def snapshot_files(memory: Path) -> dict[Path, tuple[int, int]]:
    """The complete snapshot files a node's memory holds: (step, shard) of each."""
    return {p: (int(m[1]), int(m[2])) for p in memory.rglob("*.snap") if (m := SNAP_NAME.search(str(p)))}


def test_a_node_lost_without_notice_resumes_from_the_peers_memory_bit_identical(tmp_path, reference):
    last = interrupted_run(tmp_path, lost=[2])
    durable = max(committed(tmp_path))
    resumed, text = relaunch(tmp_path)
    snapshot = resumed_snapshot(text, tmp_path)
    assert snapshot > durable  # newer than the bucket's newest: from the survivors' memory
    assert resumed["start"] == snapshot + 1
    assert last - snapshot <= MOST_LOST  # lost work: at most one interval and the newest snapshot in flight
    assert re.search(r"read \d+ bytes of rank 2's shard \(of 3\) from rank 0", text)  # its buddy kept it
    assert resumed["digest"] == reference(THREE)
    assert ledger_resumes(tmp_path)[-1]["tier"] == "snapshot"
    assert any(s > snapshot for s in committed(tmp_path))  # the durable save that follows at once


def test_a_frozen_node_ends_the_job_in_seconds_and_the_relaunch_resumes_from_the_peers_memory(tmp_path, reference):
    """Node 2 frozen (SIGSTOP of its agent and its worker: no FIN, no RST), with the default settings:
    the survivors would wait 30 minutes in gloo's collective. Node 0, which watches node 2, declares it
    lost after 20 s of silence; every survivor exits with the restart code, its exit file and the ledger
    saying why. The relaunch with a replacement node resumes from the peers' memory, bit-identical."""
    nodes = THREE.start(tmp_path, env=ENV)
    try:
        nodes[0].step_reached(25)
        frozen = time.monotonic()
        nodes[2].freeze()
        codes = [node.finish(120) for node in nodes[:2]]
        ended_after = time.monotonic() - frozen
    finally:
        stop_all(nodes)
    last = max(map(int, STEP_LINE.findall(nodes[0].output())))
    assert codes == [1, 1] and ended_after < 60  # a hang bound; bench/silent_failures.py measures it
    for node in nodes[:2]:
        ended = json.loads(node.exit_file.read_text())
        assert (ended["exit_code"], ended["committed"], ended["cause"]) == (75, False, "peer-lost")
        assert ended["culprit"].endswith("/node-2")
    (silent,) = [r for r in map(json.loads, ledger_lines(tmp_path)) if r["event"] == "silent-failure"]
    assert silent["culprit"].endswith("/node-2") and silent["noticed_after_s"] >= 20
    shutil.rmtree(nodes[2].snapshot_dir, ignore_errors=True)  # a replacement VM
    shutil.rmtree(nodes[2].local_dir, ignore_errors=True)
    durable = max(committed(tmp_path))
    resumed, text = relaunch(tmp_path)
    snapshot = resumed_snapshot(text, tmp_path)
    assert durable < snapshot and last - snapshot <= MOST_LOST
    assert resumed["start"] == snapshot + 1
    assert resumed["digest"] == reference(THREE)


def test_two_nodes_lost_with_one_replica_resume_from_the_durable_checkpoint(tmp_path, reference):
    """Rank 1's shard was on nodes 1 and 2 only. The survivor's snapshots newer than the durable
    step belong to a past the resume does not take: deleted at the resume, before any new snapshot
    (whose regular sweep would hide it) could be taken, so that none is ever mixed with the new
    run's snapshots of the same step numbers."""
    interrupted_run(tmp_path, lost=[1, 2])
    durable = max(committed(tmp_path))
    memories = [tmp_path / f"node{i}-memory" for i in range(3)]
    later = {p: shard_file.read_info(p).attempt for m in memories for p, (step, _) in snapshot_files(m).items()
             if step > durable}  # fmt: skip
    assert later, f"node 0 held no snapshot newer than the durable step {durable}"
    short, text = relaunch(tmp_path, steps=durable + 1)  # resumes, then ends before its first step
    assert short["start"] == durable + 1 and not RESUMED.search(text)
    # Shard 1 was on nodes 1 and 2 only (2 may be lacking too: its copy of the newest step under way).
    lacks = rf"the durable step {durable} in the nodes' memory: step \d+ \(world size 3\) lacks shard\(s\) 1\b"
    assert re.search(lacks, text), "the log does not say why no snapshot was loaded"
    kept = [p for p, attempt in later.items() if p.exists() and shard_file.read_info(p).attempt == attempt]
    assert not kept, f"snapshots of the abandoned steps survived the resume: {kept}"
    resumed, text = relaunch(tmp_path)
    assert not RESUMED.search(text)
    assert resumed["start"] == durable + 1
    assert resumed["digest"] == reference(THREE)
    assert [r["tier"] for r in ledger_resumes(tmp_path)][-2:] == ["durable", "durable"]


def test_a_corrupted_replica_is_skipped_for_the_newest_whole_snapshot(tmp_path, reference):
    """Node 2 is lost once node 0 holds rank 2's replicas of two snapshots newer than the durable
    save of step 20: the newest complete one and the one after it. The newest copy is corrupted;
    the resume reads it, refuses it, and takes the older snapshot, whole in the survivors' memory."""
    node0 = tmp_path / "node0-memory"

    def two_newer_replicas() -> bool:
        return sum(step > 2 * SAVE_EVERY for step, shard in snapshot_files(node0).values() if shard == 2) >= 2

    interrupted_run(tmp_path, lost=[2], ready=two_newer_replicas)
    durable = max(committed(tmp_path))
    held = {p: step for p, (step, shard) in snapshot_files(node0).items() if shard == 2}  # only its buddy's
    assert len(held) == 2, held  # two generations: the newest complete snapshot and the one after it
    older, newest = sorted(held.values())
    assert older > durable, f"the durable save of step {durable} came after the snapshot of step {older}"
    # The older snapshot is whole in the survivors' memory: every shard, of one start of the job.
    survivors = {**snapshot_files(node0), **snapshot_files(tmp_path / "node1-memory")}
    whole = {shard: shard_file.read_info(p).attempt for p, (step, shard) in survivors.items() if step == older}
    assert sorted(whole) == [0, 1, 2] and len(set(whole.values())) == 1, whole
    (path,) = [p for p, step in held.items() if step == newest]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)
    resumed, text = relaunch(tmp_path)
    assert re.search(r"cannot use shard 2 from rank 0 \(SnapshotError: .*CRC32C", text)
    assert resumed_snapshot(text, tmp_path) == older
    assert resumed["start"] == older + 1
    assert resumed["digest"] == reference(THREE)


def test_two_ranks_per_node_a_node_lost_resumes_from_the_same_local_ranks_on_its_buddy(tmp_path, reference):
    """Two nodes of two ranks: a rank's buddy is the same local rank on the next node (ranks 2 and 3
    keep their copies on ranks 0 and 1). Node 1 lost: each of its shards comes from that buddy, and
    the whole state (the optimizer's too) ends as an uninterrupted run's."""
    last = interrupted_run(tmp_path, lost=[1], job=TWO_BY_TWO)
    durable = max(committed(tmp_path))
    resumed, text = relaunch(tmp_path, TWO_BY_TWO)
    snapshot = resumed_snapshot(text, tmp_path)
    assert durable < snapshot and last - snapshot <= MOST_LOST
    assert resumed["start"] == snapshot + 1
    for shard, buddy in ((2, 0), (3, 1)):
        assert re.search(rf"read \d+ bytes of rank {shard}'s shard \(of 4\) from rank {buddy}\b", text), shard
    assert resumed["digest"] == reference(TWO_BY_TWO)
    assert ledger_resumes(tmp_path)[-1]["tier"] == "snapshot"


def test_two_replicas_two_adjacent_nodes_lost_resume_from_the_survivors_memory(tmp_path, reference):
    """snapshot_replicas=2 over three nodes: each shard is on its node and the next two, so losing
    nodes 1 and 2 (which, with one replica, falls back to the durable checkpoint) leaves every shard
    on node 0."""
    last = interrupted_run(tmp_path, lost=[1, 2], job=THREE_TWO_REPLICAS)
    durable = max(committed(tmp_path))
    resumed, text = relaunch(tmp_path, THREE_TWO_REPLICAS)
    snapshot = resumed_snapshot(text, tmp_path)
    assert durable < snapshot and last - snapshot <= MOST_LOST
    assert resumed["start"] == snapshot + 1
    for shard in (1, 2):
        assert re.search(rf"read \d+ bytes of rank {shard}'s shard \(of 3\) from rank 0\b", text), shard
    assert resumed["digest"] == reference(THREE_TWO_REPLICAS)
    assert ledger_resumes(tmp_path)[-1]["tier"] == "snapshot"


def test_an_uneven_layout_keeps_snapshots_on_each_node_and_a_lost_node_resumes_from_the_durable_checkpoint(
    tmp_path, reference
):
    """A node of two ranks beside a node of one: which ranks share a node cannot be told from the world
    size, so no node sends copies to another (a rank's buddy could be on its own node) and there is no
    liveness ring; both node leaders say why. Node 1 lost, its shard is nowhere else: the relaunch
    loads the durable checkpoint, and the whole state ends as an uninterrupted run's."""
    interrupted_run(tmp_path, lost=[1], job=UNEVEN)
    durable = max(committed(tmp_path))
    resumed, text = relaunch(tmp_path, UNEVEN)
    for said in ("LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2", "LOCAL_WORLD_SIZE=1, GROUP_WORLD_SIZE=2"):
        assert f"snapshots stay on this node: {said} does not fit the world size 3" in text, said
        assert f"{said} does not fit the world size 3: no liveness ring" in text, said
    assert not re.search(r"read \d+ bytes of rank \d+'s shard", text)  # nothing was kept on another node
    assert resumed["start"] == durable + 1
    assert ledger_resumes(tmp_path)[-1]["tier"] == "durable"
    assert resumed["digest"] == reference(UNEVEN)
    for node in ("node0-memory", "node1-memory"):  # each rank's snapshots on its own node only
        shards = {shard for _, shard in snapshot_files(tmp_path / node).values()}
        assert shards <= ({0, 1} if node == "node0-memory" else {2}), (node, shards)
