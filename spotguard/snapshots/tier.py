"""The snapshot tier: frequent copies of every rank's state in host memory, kept on other nodes too.

At a snapshot step the training thread copies its state into the file of this node's snapshot
directory, through a memory map (a GPU state: into reused pinned buffers, written to the file in
the background), and goes on: that copy is the stall. A background thread checksums the file,
names it, and sends it to the rank's buddies, the same local rank on the next `replicas` nodes (a
ring); what a node receives goes straight into a file's mapped pages too. The files of a freed
snapshot are written over by the next one (their tmpfs pages reused). Each rank then
reports through the job's store; the last to report sets the step's verdict. A snapshot is
complete once every rank has written and replicated its shard. At the next snapshot each rank
waits for the previous one's verdict (as a save waits for the one before it), keeps the newest
complete snapshot and the one it begins, and frees the rest: a node holds two generations of its
own shards and of its replicas (three after an emergency's final snapshot, which keeps the one
before it too). A snapshot that failed with every shard written (a replica that did not arrive,
a verdict that did not come) may still be whole on the nodes that survive a loss: the newest such
one newer than the newest complete snapshot is kept too (three generations), until a newer one is
complete; one with a shard that was never written can never be whole and is freed at once. Store
traffic per snapshot: O(N) (an `add` and a blocking `get` per rank, a `set` and three deletions by
the last).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Collection, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from spotguard.checkpoint.comm import FAILURES, Comm, describe
from spotguard.checkpoint.io.staging import Stager, on_device
from spotguard.checkpoint.state import optional_keys, tensors_of, to_dcp
from spotguard.goodput.cadence import Cadence
from spotguard.job.kvstore import Connection
from spotguard.job.topology import layout_said, node_count, ranks_per_node
from spotguard.snapshots import recovery, shard_file
from spotguard.snapshots.loading import HeldHere, PlanLoader
from spotguard.snapshots.node_dir import BASE_ENV, DEFAULT_BASE, NodeDir, name_of, private_root
from spotguard.snapshots.peers import PeerServer, push

log = logging.getLogger(__name__)

VERDICT_WAIT_S = 300.0  # the longest a snapshot waits for the previous one's verdict
ADDRESS_WAIT_S = 60.0
# The newest complete snapshot, the one being made, and a freed one's files kept to be written over
# (replicas that arrive before their node has freed its old ones make new files), or a failed one
# that may be whole (`SnapshotTier.maybe_whole`), or an emergency's final snapshot's one before.
GENERATIONS = 3
TIMED_OUT = "failed: not every rank reported in time"
# Every rank that failed had written its shard (a replica did not arrive): whole where it arrived.
NOT_REPLICATED = "failed: every shard written, not every replica"
LACKING_SAID = 4  # the ranks without room named in the reason every rank logs; the rest counted


@dataclasses.dataclass(frozen=True)
class SnapshotDone:
    """One rank's snapshot, from the background thread: what it cost and whether it is safe elsewhere."""

    step: int
    bytes: int
    stall_s: float  # the training thread's time in the call (waiting for the previous one included)
    write_s: float
    replicate_s: float
    replicas: int
    ok: bool
    error: str | None = None
    skipped: str | None = None  # why this step's snapshot was not taken at all (nothing written or sent)

    @property
    def taken(self) -> bool:
        """False for a snapshot that was never begun (`skipped` says why); a taken one may still have failed."""
        return self.skipped is None


class SnapshotTier:
    """Snapshots of one rank's state; made by the Guard when `SnapshotOptions` ask for them.

    `run` keys the checkpoint location and `job` is the identity it holds (`spotguard.checkpoint.format.identity`;
    rank 0's, the same on every rank), written into every snapshot with `attempt` (this start of the
    job, rank 0's, new at every start) and the world size: files of another job are never loaded,
    and a snapshot is whole only with every shard of one attempt at one world size. None (it could
    not be read), a snapshot directory this node cannot use safely, or a peer server that cannot
    start, means no snapshots: this rank votes "no room" at the first snapshot,
    so the whole job learns it at once and trains on. A snapshot that is not taken is said, with the
    step and why, and is what `wait()` returns next (`SnapshotDone.skipped`).
    """

    def __init__(
        self,
        *,
        run: str,
        job: str | None,
        attempt: str,
        snapshot_dir: str | None,
        replicas: int,
        comm: Comm,
        store: dist.Store,
        prefix: str,
        cadence: Cadence | None = None,
    ) -> None:
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.ranks_per_node = ranks_per_node()
        nodes = node_count(self.world_size)
        if nodes is None:  # which ranks share a node is unknown: this node replicates nothing
            if comm.is_node_leader:
                log.warning("snapshots stay on this node: %s does not fit the world size %d", layout_said(),
                            self.world_size)  # fmt: skip
            nodes = 1
        elif nodes == 1 and comm.is_coordinator:
            log.info("snapshots stay on this node: it is the job's only one (they outlive the workers, not the VM)")
        self.replicas = min(replicas, nodes - 1)
        if nodes > 1 and self.replicas < replicas and comm.is_coordinator:
            log.warning("snapshots: %d node(s) can keep %d replica(s) of each shard, not %d", nodes, self.replicas,
                        replicas)  # fmt: skip
        self.buddies = [(self.rank + k * self.ranks_per_node) % self.world_size for k in range(1, self.replicas + 1)]
        self.run = run
        self.job = job
        self.attempt = attempt
        self._unusable: str | None = None  # why this rank cannot keep snapshots, when it cannot
        self.node_dir = self._open_node_dir(snapshot_dir or os.environ.get(BASE_ENV) or DEFAULT_BASE)
        self.cadence = cadence
        self.last: SnapshotDone | None = None
        self.complete: int | None = None  # the newest snapshot known complete everywhere
        # The newest snapshot newer than `complete` that failed with every shard written (or whose
        # verdict timed out): the nodes that survive a loss may hold it whole, so it is kept.
        self.maybe_whole: int | None = None
        self._prefix = f"{prefix}snap/"
        self._conn = Connection.of(store)  # the training thread's: it blocks on verdicts
        self._background_conn = Connection.of(store, lazy=True)
        self._addresses: dict[int, str] = {}
        self._stager = Stager()
        self._pending: threading.Thread | None = None  # the background part of the snapshot in flight
        self._begun: int | None = None  # the step of the snapshot last begun
        self._room: bool | None = None  # None until the first snapshot checked it
        self._no_room: str | None = None  # why the job has no snapshots, once the room vote said no
        self._files_per_step = self.ranks_per_node * (1 + self.replicas)  # this node's, own and replicas
        self._server: PeerServer | None = None  # a rank without a directory holds nothing to serve
        if self.node_dir is not None:
            try:
                self._server = PeerServer(self.node_dir)
                store.set(f"{self._prefix}addr/{self.rank}", self._server.address)
            except Exception as exc:  # noqa: BLE001 - no port, say: this rank votes "no room" (a collective)
                log.warning("snapshots are off on this rank: its peer server cannot start (%s: %s)",
                            type(exc).__name__, exc)  # fmt: skip
                self.close(wait=False)
                self.node_dir, self._server = None, None
                self._unusable = f"its peer server cannot start ({type(exc).__name__}: {exc})"

    # ---- the training thread ---------------------------------------------------------
    def snapshot(
        self, step: int, state: Mapping[str, Any], *, final: bool = False, leaving: Collection[int] = ()
    ) -> None:
        """Begin the snapshot of `step`: returns once `state` is copied; the rest runs in the background.

        Whatever fails here is reported as this rank's failed snapshot: no rank waits for it. The
        `final` snapshot of a process (after an emergency) never touches the job's store, which a rank
        that leaves first may take down with it: it waits for no verdict, reports none, and keeps the
        snapshot begun before it too (whether that one was complete is not known). No replica goes to the
        `leaving` ranks (a final snapshot's: the job goes on without them).
        """
        started = time.monotonic()
        try:
            self._begin(step, state, final, started, frozenset(leaving))
        except BaseException as exc:  # the job's store failed a vote, say: nothing was begun; the caller says so
            self.skip(step, f"{type(exc).__name__}: {exc}", started, quiet=True)
            raise

    def _begin(self, step: int, state: Mapping[str, Any], final: bool, started: float, leaving: frozenset[int]) -> None:
        self.wait()
        problem: Exception | None = None
        try:
            state_dict: Mapping[str, Any] | None = to_dcp(state)
        except Exception as exc:  # noqa: BLE001 - the state cannot be read: this snapshot fails (below)
            state_dict, problem = None, exc
        first = self._room is None
        if first:
            self._no_room = self._check_room(state_dict, problem)
            self._room = self._no_room is None
        if not self._room:  # said at the first; each later one is only what wait() returns
            why = f"snapshots are off: {self._no_room}"
            self.skip(step, f"{why}; nor will any later one be" if first else why, started, quiet=not first)
            return
        if self._begun is not None and not final:
            verdict = self._verdict(f"{self._prefix}{self._begun}")
            if verdict == "ok":
                self.complete, self.maybe_whole = self._begun, None
            else:
                log.warning("the snapshot of step %d is not complete everywhere (%s)", self._begun, verdict)
                if verdict in (NOT_REPLICATED, TIMED_OUT):  # kept: resume loads it only where it is whole
                    self.maybe_whole = self._begun
        previous, self._begun = self._begun, step
        path = self.node_dir.file(name_of(step, self.rank, self.world_size))
        copied: shard_file.MappedShard | BaseException | Mapping[str, Any]
        try:
            # At most three generations: a final snapshot keeps the one before it (its verdict not read) instead.
            # Cleared before a state that cannot be read fails this one: the node's buddies go on replicating.
            kept = {self.complete, step, previous if final else self.maybe_whole} - {None}
            self.node_dir.keep_only(kept, spares=self._files_per_step)  # type: ignore[arg-type]
            if problem is not None:
                raise problem
            path.parent.mkdir(parents=True, exist_ok=True)
            if on_device(state_dict):  # into pinned buffers at the copy's full speed; into the file in the background
                copied = self._stager.stage(state_dict)
            else:  # straight into the file's mapped pages: the copy is the write
                copied = shard_file.MappedShard(path, state_dict, self.node_dir.take_spare).fill()
        except Exception as exc:  # noqa: BLE001 - reported as this rank's failed snapshot
            copied = exc
        stall = time.monotonic() - started
        if self.cadence is not None:
            self.cadence.observe_save(stall)
        # A daemon thread: a process leaving after an emergency does not wait for a snapshot's replication.
        self._pending = threading.Thread(
            target=self._write_and_replicate,
            args=(step, path, copied, stall, None if final else previous),
            kwargs={"report": not final, "leaving": leaving},
            name="spotguard-snapshot",
            daemon=True,
        )
        try:
            self._pending.start()
        except RuntimeError as exc:  # no thread to be had: this rank's failed snapshot, voted now (the next waits
            self._pending = None  # for that vote, every rank for VERDICT_WAIT_S without it)
            if isinstance(copied, shard_file.MappedShard):
                copied.discard()
            failure = copied if isinstance(copied, BaseException) else exc
            self._write_and_replicate(step, path, failure, stall, None if final else previous, report=not final,
                                      leaving=leaving)  # fmt: skip

    def everyone_replicated(self, step: int, timeout_s: float) -> bool:
        """After the final snapshot of `step`, once this rank's replicas are pushed (`wait()`), when the job goes
        on without some ranks (its store stays): say so, and wait until every rank has, `timeout_s` at most;
        whether all did. The leaving ranks' replicas are the survivors' to load: a survivor closing its peer
        server before they came would leave the next generation without them."""
        key = f"{self._prefix}{step}/final"
        if self._conn.store.add(key, 1) == self.world_size:
            self._conn.store.set(f"{key}/all", "1")
        return self._conn.get(f"{key}/all", timeout_s) is not None

    def restore(
        self, state: MutableMapping[str, Any], durable: int | None, own: HeldHere | None = None
    ) -> recovery.Plan | None:
        """Load the newest whole snapshot newer than (or as new as) the durable step `durable` (rank 0's
        word), at whatever world size it was taken (a collective): the plan it came from, or None when
        there is none to load. `own`: a step this rank holds whole in its memory, loaded from there when the
        plan is of it (a survivor's, as a node joins: the joining ranks read the snapshot)."""
        local_rank = self.rank % self.ranks_per_node  # the layout the buddies assume: nodes' ranks contiguous
        held = []
        if self.node_dir is not None and self.job is not None:
            held = recovery.holdings(self.node_dir, (self.run, self.job), local_rank, self.ranks_per_node)
        loader = PlanLoader(
            self.comm,
            self.node_dir,
            self.ranks_per_node,
            lambda r: self._address_of(r, self._conn),
            functools.cache(lambda: to_dcp(state, to_load=True)),  # made only to load into
            optional_keys(state),
            own,
        )
        plan = recovery.agree(self.comm, held, durable, loader)
        if plan is None:
            touched = self.comm.gather(loader.touched)
            if self.comm.broadcast(touched is not None and any(touched)):  # a shard was read, then given up
                raise shard_file.SnapshotLoadError("no snapshot could be read whole after a rank began reading one")
            return None
        problem = None
        try:
            loader.load_into(plan, state)
        except FAILURES as exc:
            problem = describe(exc, self.rank)
        problems = [p for p in (self.comm.gather(problem) or []) if p]
        problems = self.comm.broadcast(problems)
        if problems:
            self.forget_after(plan.step - 1)  # never chosen again
            why = " | ".join(problems)
            raise shard_file.SnapshotLoadError(f"the snapshot of step {plan.step} did not load: {why}")
        self.complete = plan.step  # kept by the next snapshot's sweep; its verdict was another run's
        return plan

    def wait(self, timeout: float | None = None) -> SnapshotDone | None:
        """The background part of the snapshot in flight, finished (it never raises: it reports);
        None when it did not finish within `timeout`, or when no snapshot was ever asked for. After a
        snapshot that was not taken, its record: `taken` False, `skipped` saying why."""
        if self._pending is not None:
            self._pending.join(timeout)
            if self._pending.is_alive():
                return None
            self._pending = None
        return self.last

    def skip(self, step: int, why: str, started: float | None = None, *, quiet: bool = False) -> SnapshotDone:
        """Record that the snapshot of `step` is not taken, and why: a warning (unless `quiet`: said
        already), and the record `wait()` returns next. `started`: when the training thread's call
        began (what it cost, the room vote, say)."""
        if not quiet:
            log.warning("the snapshot of step %d was not taken: %s", step, why)
        else:
            log.debug("the snapshot of step %d was not taken: %s", step, why)
        stall = time.monotonic() - started if started is not None else 0.0
        self.last = SnapshotDone(step=step, bytes=0, stall_s=stall, write_s=0.0, replicate_s=0.0, replicas=0,
                                 ok=False, skipped=why)  # fmt: skip
        return self.last

    @property
    def has_room(self) -> bool:
        """Whether every node agreed, at the first snapshot, that it has room for the tier."""
        return bool(self._room)

    @property
    def no_room(self) -> str | None:
        """Why the job takes no snapshots, once the first snapshot's room vote said so (else None)."""
        return self._no_room

    @property
    def in_flight(self) -> bool:
        """Whether a snapshot's background part is still running."""
        return self._pending is not None and self._pending.is_alive()

    def forget_after(self, step: int | None) -> None:
        """This node's snapshots of steps after `step` (the step a resume started from; None: a fresh
        start) belong to a past that will not happen: deleted, so that no later snapshot of the same
        step number can ever be made whole with them."""
        if self.node_dir is not None:
            self.node_dir.keep_only({h.step for h in self.node_dir.held() if step is not None and h.step <= step})

    def close(self, wait: bool = True) -> None:
        """Stop serving peers; with `wait`, first finish the snapshot in flight (after an emergency the
        process leaves without it). The files stay for the next start."""
        try:
            if wait:
                self.wait()
        finally:
            if self._server is not None:
                self._server.close(wait)

    # ---- internals ------------------------------------------------------------------------
    def _open_node_dir(self, base: str) -> NodeDir | None:
        """This node's directory for the job, in the user's private root; None (said once per node)
        when it cannot be used or the job has no identity."""
        try:
            if self.job is None:
                raise ValueError("the checkpoint location's job identity could not be read")
            return NodeDir(private_root(base), self.run)
        except (OSError, ValueError) as exc:
            self._unusable = f"its snapshot directory cannot be used: {exc}"
            log.log(logging.WARNING if self.comm.is_node_leader else logging.DEBUG,
                    "snapshots are off on this node: %s (snapshot dir %s)", exc, base)  # fmt: skip
            return None

    def _check_room(self, state_dict: Mapping[str, Any] | None, problem: Exception | None = None) -> str | None:
        """None when every node has room for the tier (a collective through the store), else why not,
        in words every rank can say; logs the sizes. A state that cannot be read (None: `problem`
        says why), or a directory that cannot be used, counts as no room."""
        lacks: str | None = self._unusable or "it has no snapshot directory"  # said when the tier was made
        if state_dict is None:
            lacks = f"its state cannot be read ({type(problem).__name__}: {problem})"
        elif self.node_dir is not None:
            try:
                lacks = self._lacks(state_dict, self.node_dir)
            except OSError as exc:
                log.warning("snapshots: %s cannot be used: %s", self.node_dir.path, exc)
                lacks = f"{self.node_dir.path} cannot be used ({exc})"
        key = f"{self._prefix}room"
        store = self._conn.store
        if lacks is not None:  # before this rank's report: the verdict's reader finds every one
            store.append(f"{key}/lacking", f"rank {self.rank}: {lacks}; ")
        _report(store, key, self.world_size, lacks is None)
        verdict = self._verdict(key)
        if verdict == "ok":
            return None
        said = self._conn.get_now(f"{key}/lacking")  # empty when a rank never answered: the vote timed out
        lacking = [part for part in said.decode().split("; ") if part] if said else []
        if len(lacking) > LACKING_SAID:
            lacking[LACKING_SAID:] = [f"{len(lacking) - LACKING_SAID} more rank(s)"]
        return f"a node lacks the room, or not every rank answered ({'; '.join(lacking) or verdict})"

    def _lacks(self, state_dict: Mapping[str, Any], node_dir: NodeDir) -> str | None:
        """None when this node has room for the tier, else what it lacks (logged with the sizes)."""
        shard = sum(t.numel() * t.element_size() for t in tensors_of(state_dict))
        files = self.ranks_per_node * shard * (1 + self.replicas) * GENERATIONS
        host_copy = self.ranks_per_node * shard if on_device(state_dict) else 0  # GPU state: pinned buffers
        free = node_dir.free_bytes()
        fits = files + host_copy <= free
        if self.comm.is_node_leader:
            log.log(
                logging.INFO if fits else logging.WARNING,
                "snapshots need %s on this node: %d rank(s) x %s x (own + %d replica(s)) x %d generations at most "
                "in %s, plus %s of host copies; %s free%s",
                _size(files + host_copy), self.ranks_per_node, _size(shard), self.replicas, GENERATIONS,
                node_dir.path, _size(host_copy), _size(free),
                "" if fits else ": no room, so no snapshots (make the tmpfs larger or snapshot less state)",
            )  # fmt: skip
        return None if fits else f"{_size(files + host_copy)} needed in {node_dir.path}, {_size(free)} free"

    def _verdict(self, key: str) -> str:
        """`<key>/verdict` once the last rank set it; after VERDICT_WAIT_S, "failed" for every rank (the
        first to write it wins, so no two ranks can see different verdicts)."""
        value = self._conn.get(f"{key}/verdict", VERDICT_WAIT_S)
        if value is None:
            value = self._conn.store.compare_set(f"{key}/verdict", "", TIMED_OUT)
        return value.decode()

    def _write_and_replicate(
        self,
        step: int,
        path: Path,
        copied: shard_file.MappedShard | BaseException | Mapping[str, Any],
        stall: float,
        previous: int | None,
        report: bool = True,
        leaving: frozenset[int] = frozenset(),
    ) -> SnapshotDone:
        started = time.monotonic()
        size, write_s, error, written = 0, 0.0, None, False
        try:
            if isinstance(copied, BaseException):
                raise copied
            if not isinstance(copied, shard_file.MappedShard):  # staged in host buffers
                copied = shard_file.MappedShard(path, copied, self.node_dir.take_spare).fill()
            info = copied.finish(run=self.run, job=self.job, attempt=self.attempt, step=step, rank=self.rank,
                                 world_size=self.world_size)  # fmt: skip
            size, write_s, written = info.body_bytes, time.monotonic() - started, True
            for buddy in self.buddies:
                if buddy in leaving or (not report and buddy not in self._addresses):
                    continue  # a final snapshot never asks the store for an address
                push(self._address_of(buddy, self._background_conn), path, name_of(step, self.rank, self.world_size))
        except Exception as exc:  # noqa: BLE001 - a failed snapshot leaves the previous one; training goes on
            error = f"{type(exc).__name__}: {exc}"
            kept = " (kept on this node, not replicated)" if size else ""
            log.warning("the snapshot of step %d failed%s: %s", step, kept, error)
        done = SnapshotDone(
            step=step,
            bytes=size,
            stall_s=stall,
            write_s=write_s,
            replicate_s=time.monotonic() - started - write_s,
            replicas=len([b for b in self.buddies if b not in leaving]),
            ok=error is None,
            error=error,
        )
        try:
            if report:  # (the connection made only here: a final snapshot never touches the store)
                store = self._background_conn.store
                last = _report(store, f"{self._prefix}{step}", self.world_size, done.ok, written=written)
                if last and previous is not None:
                    for suffix in ("done", "failed", "verdict"):  # every rank has read the previous verdict by now
                        store.delete_key(f"{self._prefix}{previous}/{suffix}")
        except Exception as exc:  # noqa: BLE001 - the store is gone: the job is ending, the training thread says so
            log.warning("the snapshot of step %d could not be reported: %s: %s", step, type(exc).__name__, exc)
        log.debug("snapshot of step %d: %s", step, done)
        self.last = done
        return done

    def _address_of(self, rank: int, connection: Connection) -> str:
        if rank not in self._addresses:
            value = connection.get(f"{self._prefix}addr/{rank}", ADDRESS_WAIT_S)
            if value is None:
                raise TimeoutError(f"rank {rank} published no snapshot address in {ADDRESS_WAIT_S:.0f} s")
            self._addresses[rank] = value.decode()
        return self._addresses[rank]


def _report(store: dist.Store, key: str, world_size: int, ok: bool, *, written: bool = False) -> bool:
    """Count this rank's outcome under `key` (`written`: a failed rank's shard was written all the
    same); the last rank to report sets `<key>/verdict` and gets True. The verdict is `ok`,
    NOT_REPLICATED when every rank that failed had written its shard, else `failed`."""
    if not ok and written:
        store.compare_set(f"{key}/failed", "", "written")  # never over another rank's "unwritten"
    elif not ok:
        store.set(f"{key}/failed", "unwritten")
    if store.add(f"{key}/done", 1) != world_size:
        return False
    verdict = "ok"
    if store.check([f"{key}/failed"]):
        verdict = NOT_REPLICATED if store.get(f"{key}/failed") == b"written" else "failed"
    store.compare_set(f"{key}/verdict", "", verdict)
    return True


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
