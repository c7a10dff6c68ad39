"""The snapshot tier is one user's and one job's, and a bad or full snapshot directory never ends
training: a private root per user (what another local user plants there is refused, never written
through), space reserved before a byte is stored (a full tmpfs is a failed snapshot, never a
SIGBUS), files keyed by the job's location and identity, an unusable directory that counts as
"no room" on every rank at once, and a resume that weighs a snapshot against the durable step that
actually loads."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard.checkpoint.format.identity import IDENTITY_NAME
from spotguard.checkpoint.state import to_dcp
from spotguard.job.topology import location_key
from spotguard.snapshots import shard_file, tier
from spotguard.snapshots.node_dir import NodeDir, UnusableDir, name_of, private_root
from spotguard.snapshots.peers import PeerServer, push
from tests.ckpt_workers import run_ranks
from tests.conftest import backend_for
from tests.test_checkpoint import flip_byte, shard
from tests.test_snapshots import digest, resumes, run, trained, write

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: to act as another user, or to mount a tmpfs")


def snaps(where: Path) -> list[Path]:
    return sorted(where.rglob("*.snap"))


# ---- 1. a private root -------------------------------------------------------------------------------


def test_each_user_gets_a_root_of_their_own_made_0700(tmp_path):
    root = private_root(tmp_path)
    assert root == tmp_path / f"spotguard-{os.geteuid()}"
    assert stat.S_IMODE(root.lstat().st_mode) == 0o700
    root.chmod(0o755)  # as an older version left it: readable by every local user
    assert stat.S_IMODE(private_root(tmp_path).lstat().st_mode) == 0o700
    run(tmp_path, 5)  # snapshots of steps 0 and 4, in the private root
    assert snaps(tmp_path / "memory")
    for snap in snaps(tmp_path / "memory"):
        assert snap.is_relative_to(tmp_path / "memory" / f"spotguard-{os.geteuid()}")
        assert stat.S_IMODE(snap.stat().st_mode) == 0o600


@as_root
@pytest.mark.parametrize("planted", ["a directory of another user's", "a link to a directory of ours"])
def test_a_root_another_user_planted_means_no_snapshots_and_nothing_written_there(tmp_path, caplog, planted):
    base = tmp_path / "memory"
    base.mkdir()
    base.chmod(0o1777)  # as /dev/shm: anyone may create a name in it
    root = base / f"spotguard-{os.geteuid()}"
    target = tmp_path / "elsewhere"
    target.mkdir()
    if planted.startswith("a directory"):
        root.mkdir(mode=0o777)
        os.chown(root, NOBODY, NOBODY)
        target = root
    else:
        root.symlink_to(target)
    with caplog.at_level(logging.WARNING):
        start, _, guard = run(tmp_path, 9)
    assert start == 0 and "snapshots are off on this node" in caplog.text
    assert "snapshots are off: a node lacks the room" in caplog.text  # the whole job learnt it from the vote
    assert list(target.iterdir()) == []  # nothing of the job's in the stranger's hands


def test_a_base_others_can_write_without_the_sticky_bit_is_refused(tmp_path):
    base = tmp_path / "open"
    base.mkdir()
    base.chmod(0o777)  # anyone could rename this user's root away and put their own in its place
    with pytest.raises(UnusableDir, match="not sticky"):
        private_root(base)
    with pytest.raises(UnusableDir, match="not sticky"):
        private_root(base / "deeper")  # nor a base reached through it


@as_root
def test_a_base_another_user_made_first_is_refused(tmp_path):
    base = tmp_path / "snaps"
    base.mkdir(mode=0o755)
    os.chown(base, NOBODY, NOBODY)  # its owner could rename this user's root and put a link there
    with pytest.raises(UnusableDir, match="belongs to uid 65534"):
        private_root(base)
    (tmp_path / "mine").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "mine")
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)  # a link of theirs could be pointed elsewhere
    with pytest.raises(UnusableDir, match="belongs to uid 65534"):
        private_root(link)


def test_a_base_made_under_a_group_writable_umask_is_used(tmp_path):
    old = os.umask(0o002)
    try:
        root = private_root(tmp_path / "new" / "base")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new" / "base").stat().st_mode) == 0o755 and root.is_dir()


MAKE_ROOT_AT_ONCE = """
import os, sys, time
from spotguard.snapshots.node_dir import private_root

umask, start, bases = int(sys.argv[1], 8), float(sys.argv[2]), sys.argv[3:]
os.umask(umask)
for base in bases:  # one base after another, every process at once: as a node's local ranks start
    start += 0.05
    time.sleep(max(0.0, start - time.time()))
    try:
        private_root(base)
    except OSError as exc:
        print(f"{base}: {type(exc).__name__}: {exc}", flush=True)
"""


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_local_ranks_making_one_new_base_at_once_all_get_their_root(tmp_path, umask):
    """A node's ranks start together, and each makes the snapshot base's missing directories: one that
    another rank made between its look and its mkdir failed it ([Errno 17] File exists), and that
    rank's "no room" turned the job's snapshots off (bench/reshard.py: 2 runs in 5, its three ranks
    making /dev/shm/spotguard-bench-reshard/node<r>). Eight processes make 40 new bases, each three
    directories deep, at the same moments, under the usual umask and a group-writable one (a
    directory is made 0755 at once: never 0775 for a moment in which another rank checks it)."""
    bases = [str(tmp_path / f"base{i}" / "mid" / "node") for i in range(40)]
    code = [sys.executable, "-c", MAKE_ROOT_AT_ONCE, oct(umask)[2:], str(time.time() + 2.0), *bases]
    procs = [subprocess.Popen(code, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(8)]  # fmt: skip
    failed = [line for proc in procs for line in proc.communicate(timeout=60)[0].splitlines()]
    assert all(proc.returncode == 0 for proc in procs), failed
    assert failed == [], f"{len(failed)} of {8 * len(bases)}: {failed[:3]}"
    for base in bases:
        assert stat.S_IMODE(Path(base).stat().st_mode) == 0o755
        assert stat.S_IMODE((Path(base) / f"spotguard-{os.geteuid()}").stat().st_mode) == 0o700


def test_a_root_of_ours_that_others_could_write_is_refused(tmp_path):
    root = private_root(tmp_path)
    root.chmod(0o777)  # someone may have planted a link in it meanwhile
    with pytest.raises(UnusableDir, match="writable by other users"):
        private_root(tmp_path)


@pytest.mark.parametrize("side", ["the training thread", "a replica received"])
def test_a_link_or_a_file_planted_under_a_snapshot_name_is_never_written_through(tmp_path, side):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    node = NodeDir(private_root(tmp_path / "memory"), "run")
    name = name_of(4, 0, 1)
    part = node.prepare(name).with_name(Path(name).name + ".part")
    part.symlink_to(victim)
    if side == "the training thread":
        path = node.file(name)
        state = to_dcp(trained())
        shard_file.MappedShard(path, state).fill().finish(run="run", job="j", attempt="a", step=4, rank=0, world_size=1)
    else:
        source, _ = write(tmp_path, trained())
        server = PeerServer(node)
        try:
            push(server.address, source, name)
        finally:
            server.close()
    assert victim.read_bytes() == b"precious"
    made = node.file(name)
    assert not made.is_symlink() and stat.S_IMODE(made.stat().st_mode) == 0o600
    assert made.stat().st_uid == os.geteuid()


@as_root
def test_a_planted_world_readable_file_keeps_neither_its_owner_nor_its_mode(tmp_path):
    node = NodeDir(private_root(tmp_path / "memory"), "run")
    path = node.prepare(name_of(4, 0, 1))
    part = path.with_name(path.name + ".part")
    part.write_bytes(b"")
    part.chmod(0o666)
    os.chown(part, NOBODY, NOBODY)
    state = to_dcp(trained())
    shard_file.MappedShard(path, state).fill().finish(run="run", job="j", attempt="a", step=4, rank=0, world_size=1)
    made = path.stat()
    assert (made.st_uid, stat.S_IMODE(made.st_mode)) == (os.geteuid(), 0o600)


# ---- 2. a full tmpfs ---------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `mount` (the test is skipped where one cannot be mounted), unmounted after."""
    mount.mkdir()
    mounting = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]
    if os.geteuid() != 0 or subprocess.run(mounting).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs of this test's own."""
    with tmpfs(tmp_path / "tmpfs", "4m") as mount:
        yield mount


FILL_THEN_TRAIN = """
import logging, os, sys
import torch
import spotguard

logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
base, ckpt, filler = sys.argv[1:4]
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)  # 257 KiB of weights, 771 KiB with AdamW's moments
optim = torch.optim.AdamW(model.parameters())
state = {"model": model, "optim": optim}
with spotguard.Guard(ckpt, cloud="none", snapshot_every=2, snapshot_dir=base, exit_code=None) as guard:
    guard.resume(state)
    for step in range(8):
        model(torch.randn(4, 256)).sum().backward()
        optim.step()
        if step == 1:  # after the first snapshot: another process takes what is left of the tmpfs
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"x" * 65536)
                        f.flush()
                except OSError:
                    pass
        guard.step(step, state)
        print(f"trained step {step}", flush=True)  # one write: a log line from a thread cannot split it
print("done", flush=True)
"""


def survives(script: str, *args: Path) -> subprocess.CompletedProcess:
    """`script` run in a process of its own (a SIGBUS there fails the test, not the test run); it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


def test_a_tmpfs_filled_between_snapshots_fails_the_snapshot_not_the_process(tmp_path, small_tmpfs):
    proc = survives(FILL_THEN_TRAIN, small_tmpfs, tmp_path / "ckpt", small_tmpfs / "filler")
    assert "trained step 7" in proc.stdout and "done" in proc.stdout
    assert "No space left on device" in proc.stdout  # the failed snapshot, said


RECEIVE_ON_FULL_TMPFS = """
import sys
from pathlib import Path
import torch
from spotguard.job.departure import HandoffError
from spotguard.checkpoint.state import to_dcp
from spotguard.snapshots import shard_file
from spotguard.snapshots.node_dir import NodeDir, name_of, private_root
from spotguard.snapshots.peers import PeerServer, push

full, source = Path(sys.argv[1]), Path(sys.argv[2])
state = to_dcp({"w": torch.ones(2 << 20)})  # 8 MiB: more than the tmpfs holds
shard_file.MappedShard(source, state).fill().finish(run="r", job="j", attempt="a", step=1, rank=0, world_size=1)
server = PeerServer(NodeDir(private_root(full), "r"))
try:
    push(server.address, source, name_of(1, 0, 1))
except (HandoffError, OSError) as exc:  # refused, or the connection closed on the sender mid-file
    print("refused:", exc, flush=True)
server.close()
print("alive", flush=True)
"""


def test_a_replica_that_does_not_fit_is_refused_and_the_receiver_lives(tmp_path, small_tmpfs):
    proc = survives(RECEIVE_ON_FULL_TMPFS, small_tmpfs, tmp_path / "source.snap")
    assert "refused:" in proc.stdout and "alive" in proc.stdout
    assert "snapshot peer request refused: OSError: [Errno 28] No space left on device" in proc.stderr
    assert not list(small_tmpfs.rglob("*.part"))


# ---- 3. one job's ------------------------------------------------------------------------------------


def test_two_jobs_with_the_same_relative_checkpoint_dir_never_share_snapshots(tmp_path, monkeypatch):
    memory = tmp_path / "memory"
    for job in ("a", "b"):
        (tmp_path / job).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    run_here(memory, 11)  # job A: snapshots of steps 4 and 8 under "ckpt"
    monkeypatch.chdir(tmp_path / "b")
    start, _ = run_here(memory, 3)  # job B also says Guard("ckpt")
    assert start == 0  # not A's step 8
    assert not list((tmp_path / "b" / "ckpt").glob("step-*"))  # and nothing of A's committed as B's
    keys = {p.relative_to(memory).parts[1] for p in snaps(memory)}
    assert keys == {location_key(str(tmp_path / "a" / "ckpt")), location_key(str(tmp_path / "b" / "ckpt"))}


def test_a_restart_with_the_bucket_url_spelled_another_way_finds_the_snapshots(tmp_path, storage_servers, monkeypatch):
    bucket = backend_for("s3", storage_servers, monkeypatch, tmp_path).bucket
    run_here(tmp_path / "memory", 11, f"s3://{bucket}/run", local_dir=str(tmp_path / "staging"))  # snapshots 4, 8
    start, _ = run_here(tmp_path / "memory", 11, f"s3://{bucket}//run/", local_dir=str(tmp_path / "staging"))
    assert start == 9  # one location, one key: the snapshot of step 8
    assert location_key(f"s3://{bucket}//run/") == location_key(f"s3://{bucket}/run")


def run_here(memory: Path, stop: int, checkpoint_dir: str = "ckpt", **options) -> tuple[int, dict]:
    """`run` with the checkpoint_dir as typed: by default the relative "ckpt" (two jobs typing the same string)."""
    import spotguard

    state = trained(1, steps=0)
    options = {"cloud": "none", "snapshot_every": 4, "snapshot_dir": str(memory), "exit_code": None, **options}
    with spotguard.Guard(checkpoint_dir, **options) as guard:
        start = guard.resume(state)
        for step in range(start, stop):
            guard.step(step, state)
    return start, state


def test_a_job_started_over_ignores_and_sweeps_the_deleted_runs_snapshots(tmp_path, caplog):
    run(tmp_path, 11)  # snapshots 4 and 8
    identity = json.loads((tmp_path / "ckpt" / IDENTITY_NAME).read_text())["job"]
    assert {shard_file.read_info(p).job for p in snaps(tmp_path / "memory")} == {identity}
    start, _, _ = run(tmp_path, 9)  # a restart of the same job resumes its snapshot
    assert start == 9
    shutil.rmtree(tmp_path / "ckpt")  # the run is started over
    with caplog.at_level(logging.INFO):
        start, _, _ = run(tmp_path, 3)
    assert start == 0
    assert "it belongs to job" in caplog.text
    kept = {shard_file.read_info(p).job for p in snaps(tmp_path / "memory")}
    assert identity not in kept  # the old job's files are gone, not kept for ever
    assert json.loads((tmp_path / "ckpt" / IDENTITY_NAME).read_text())["job"] != identity


@pytest.mark.parametrize("lost", ["deleted", "corrupted"])
def test_a_lost_identity_is_re_adopted_from_the_steps_and_the_jobs_snapshots_resume(tmp_path, caplog, lost):
    _, reference, _ = run(tmp_path / "ref", 16, snapshot_every=5)
    run(tmp_path, 16, snapshot_every=5, save_every=11)  # durable 0 and 11; the newest snapshot: 15
    identity_file = tmp_path / "ckpt" / IDENTITY_NAME
    identity = json.loads(identity_file.read_text())["job"]
    if lost == "deleted":  # a lifecycle rule expires the oldest object first: this one, written once
        identity_file.unlink()
    else:
        identity_file.write_text('{"job": ')
    with caplog.at_level(logging.INFO):
        start, state, _ = run(tmp_path, 16, snapshot_every=5)
    assert start == 16, caplog.text  # the snapshot of step 15, not the durable step 11
    assert digest(state) == digest(reference)
    assert "re-adopted the job identity" in caplog.text and "it belongs to job" not in caplog.text
    assert json.loads(identity_file.read_text())["job"] == identity  # written back
    assert {shard_file.read_info(p).job for p in snaps(tmp_path / "memory")} == {identity}


def test_a_lost_identity_is_vouched_for_by_the_steps_never_by_the_snapshots(tmp_path):
    run(tmp_path, 11)  # job A: snapshots 4 and 8 in this node's memory
    shutil.rmtree(tmp_path / "ckpt")  # started over: job B, on another node, to its durable step 2
    run(tmp_path, 3, save_every=2, snapshot_dir=str(tmp_path / "other-node"))
    (tmp_path / "ckpt" / IDENTITY_NAME).unlink()
    start, _, _ = run(tmp_path, 3)  # B restarted on A's node
    assert start == 3  # B's durable step 2, never A's snapshot of step 8
    assert not snaps(tmp_path / "memory")  # A's files were another job's


def test_steps_from_before_identities_in_manifests_give_a_lost_identity_a_new_one(tmp_path, caplog):
    run(tmp_path, 11, save_every=6)  # durable 0 and 6, snapshots 4 and 8
    for manifest in (tmp_path / "ckpt").glob("step-*/spotguard.json"):  # as an earlier version wrote them
        body = json.loads(manifest.read_text())
        del body["job"]
        manifest.write_text(json.dumps(body))
    (tmp_path / "ckpt" / IDENTITY_NAME).unlink()
    with caplog.at_level(logging.WARNING):
        start, _, _ = run(tmp_path, 11)
    assert start == 7  # the durable step 6, not the snapshot of step 8: nothing vouches for it
    assert "none of its 2 committed step(s) carries the job identity: a new one" in caplog.text


# ---- 5. an unusable directory -------------------------------------------------------------------------


def test_a_snapshot_dir_under_a_regular_file_means_training_without_snapshots(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        start, _, _ = run(tmp_path, 9, snapshot_dir=str(tmp_path / "file" / "memory"))
    assert start == 0
    assert "snapshots are off on this node" in caplog.text and "snapshots are off: a node lacks the room" in caplog.text
    start, _, _ = run(tmp_path, 10, snapshot_dir=str(tmp_path / "file" / "memory"))  # a resume too
    assert start == 0  # nothing durable, nothing in memory: afresh, without an error


@pytest.mark.parametrize("lacking", [1, 0], ids=["rank 1: a dir under a regular file", "rank 0: a tmpfs too small"])
def test_one_rank_without_room_turns_snapshots_off_for_all_at_once(tmp_path, lacking):
    dirs = [str(tmp_path / "memory0"), str(tmp_path / "memory1")]
    with contextlib.ExitStack() as stack:
        if lacking == 1:
            (tmp_path / "file").write_text("not a directory")
            dirs[1] = str(tmp_path / "file" / "memory1")
        else:  # the job needs 230 KiB a node (38 KiB x own + replica x 3 generations): the tmpfs holds 64
            dirs[0] = str(stack.enter_context(tmpfs(tmp_path / "tmpfs", "64k")))
        outputs = run_ranks("guarded_snapshots", 2, ckpt=str(tmp_path / "ckpt"), snapshot_dirs=dirs, steps=9,
                            out=str(tmp_path))  # fmt: skip
    done = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(d["train_s"] < 60 for d in done), done  # no rank waited out the room verdict (300 s)
    assert snaps(Path(dirs[1 - lacking])) == []  # the other rank has room, yet no snapshots: the job is off
    if lacking == 0:
        assert "no room, so no snapshots" in outputs[0]
    # Every rank says that the snapshot of step 0 was not taken, and why, naming the rank that lacks the room;
    # the later ones are not taken either, and each is what the tier's wait() returns: never None, never ok.
    why = {1: "rank 1: its snapshot directory cannot be used: [Errno 20] Not a directory",
           0: "rank 0: 0.2 MiB needed in"}[lacking]  # fmt: skip
    for output, d in zip(outputs, done, strict=True):
        said = [line for line in output.splitlines() if "the snapshot of step 0 was not taken" in line]
        assert len(said) == 1, output
        assert "snapshots are off: a node lacks the room, or not every rank answered (" in said[0], said
        assert why in said[0] and said[0].endswith("; nor will any later one be"), said
        assert "the snapshot of step 2 was not taken" not in output  # said once, not at every step
        last = d["last"]
        assert last is not None and last["step"] == 8 and not last["taken"] and not last["ok"], last
        assert last["skipped"].startswith("snapshots are off: a node lacks the room") and why in last["skipped"], last


def test_a_peer_server_that_cannot_start_means_no_snapshots_not_a_failed_resume(tmp_path, monkeypatch, caplog):
    def no_port(node_dir):
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(tier, "PeerServer", no_port)
    with caplog.at_level(logging.WARNING):
        start, _, _ = run(tmp_path, 9)
    assert start == 0 and "its peer server cannot start (OSError: [Errno 98]" in caplog.text
    assert "snapshots are off: a node lacks the room" in caplog.text and snaps(tmp_path / "memory") == []


def test_a_room_vote_the_store_fails_is_a_snapshot_not_taken_said_with_its_step(tmp_path, monkeypatch, caplog):
    def store_gone(*args):
        raise ConnectionResetError("the store went away")

    monkeypatch.setattr(tier, "_report", store_gone)  # the room vote's report to the job's store
    state = {"w": torch.ones(8)}
    with caplog.at_level(logging.WARNING), spotguard.Guard(
        str(tmp_path / "ckpt"), cloud="none", snapshot_every=1, snapshot_dir=str(tmp_path / "memory"), exit_code=None
    ) as guard:  # fmt: skip
        guard.step(0, state)
        done = guard.snapshots.wait()
    assert "the snapshot of step 0 was not taken" in caplog.text and "the store went away" in caplog.text
    assert done is not None and done.step == 0 and not done.taken and not done.ok, done
    assert done.skipped == "ConnectionResetError: the store went away"


# ---- 9. resume weighs a snapshot against what loads ------------------------------------------------------


def test_a_damaged_newest_durable_step_yields_to_an_intact_newer_snapshot(tmp_path, caplog):
    _, reference, _ = run(tmp_path / "ref", 35, save_every=10)
    run(tmp_path, 31, save_every=10)  # durable 10, 20, 30; snapshots 24 and 28
    flip_byte(shard(tmp_path / "ckpt" / "step-0000000030"))
    with caplog.at_level(logging.INFO):
        start, state, _ = run(tmp_path, 35, save_every=10)
    assert start == 29  # the snapshot of 28, not the durable 20 that loaded (start 21)
    assert resumes(tmp_path)[-1]["tier"] == "snapshot"
    assert digest(state) == digest(reference)
