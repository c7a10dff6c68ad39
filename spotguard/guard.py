"""Guard: the one object a training loop touches.

    with spotguard.Guard("s3://bucket/run-7") as guard:
        start = guard.resume(state)
        for step in range(start, total_steps):
            train_step()
            if guard.step(step, state):
                break

Entering starts the watcher (cloud metadata on each node's local rank 0, signals
on every rank) and the broadcast listener; `step()` is a lock and a comparison
until all ranks have agreed on a step to save at; at that step every rank saves
its shards, the checkpoint is committed, and `step()` returns True. When only some
nodes of the job are reclaimed, the survivors save without them (see
`spotguard.checkpoint.checkpointer`). Leaving the block after an emergency exits with
`exit_code` (143) when its checkpoint was committed, `lost_exit_code` (75) when it was not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cloud_adapters import validation as check
from cloud_adapters.detect import detect_cloud
from cloud_adapters.endpoints import normalise_base_url
from cloud_adapters.notice import INTERRUPTION, REBALANCE, Notice, isoformat_z, utc_now
from cloud_adapters.signals import SignalSource, parse_signal
from cloud_adapters.sources import CLOUDS, cloud_sources
from cloud_adapters.storage import write_durably
from cloud_adapters.stores import check_location
from spotguard import __version__, elastic, topology
from spotguard import ledger_records as records
from spotguard.agreement import Decision, StepAgreement
from spotguard.broadcast import EMERGENCY, Broadcast
from spotguard.cadence import DEFAULT_MAX_S, DEFAULT_MIN_S, Cadence, Choice
from spotguard.checkpoint import Checkpointer, CheckpointError, CheckpointUnavailable, SaveReport
from spotguard.checkpoint.auth import resolve_key
from spotguard.checkpoint.comm import new_gloo_group
from spotguard.checkpoint.departure import Departure, senders_to
from spotguard.checkpoint.handoff import sharded_nbytes
from spotguard.kvstore import Connection
from spotguard.ledger import Ledger, LedgerContents
from spotguard.report import INTERRUPTED, summarize
from spotguard.timeline import Timeline, seconds
from spotguard.watcher import Watcher

log = logging.getLogger(__name__)

DEFAULT_EXIT_CODE = 143  # 128 + SIGTERM: what schedulers read as "terminated, restart me"
DEFAULT_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: interrupted, and no new checkpoint was committed
UNAVAILABLE_EXIT_CODE = 69  # EX_UNAVAILABLE: committed checkpoints exist but cannot be read now
# Where the node leader records how the job ended after an emergency: launchers such as torchrun
# replace the workers' exit codes with their own, so a startup script reads this instead.
EXIT_FILE_ENV = "SPOTGUARD_EXIT_FILE"


class Guard:
    """Watches for interruptions and saves every rank's state at one agreed step.

    Args:
        checkpoint_dir: where committed checkpoints live: a local or shared path, file://,
            s3://bucket/prefix, gs://bucket/prefix or az://container/prefix.
        cloud: "aws", "gcp", "azure", "none" (signals only) or "auto" (detect).
        local_dir: fast local disk to stage saves in before uploading to an object store.
        metadata_url: the metadata service (an emulator in tests); default from
            SPOTGUARD_METADATA_URL, then the cloud's own variables, then the real address.
        poll_interval: seconds between metadata polls (AWS, Azure; GCP uses a hanging GET).
        save_interval_s: also save every this many seconds, in the background; "auto": at the
            interval that minimises save stalls plus expected lost work (`spotguard.cadence`).
        min_save_interval_s: the lower bound of the "auto" interval (60 s).
        max_save_interval_s: the upper bound of the "auto" interval (3600 s).
        interruptions_per_hour: the prior rate of interruptions for "auto" (e.g. from the AWS Spot
            Advisor's frequency band); default one a day, until the ledger has measured better.
        save_every: also save every this many steps, in the background.
        keep_last: keep this many committed checkpoints (None keeps all).
        signals: signals that mean "you are being stopped" (SIGTERM; add SIGUSR1 for Slurm --signal).
        grace_s: deadline after a signal (torchrun SIGKILLs workers 30 s after SIGTERM).
        exit_code: process exit code after an emergency whose checkpoint was committed;
            None to return normally (then `emergency_saved` tells).
        lost_exit_code: process exit code after an emergency whose checkpoint was not committed.
        store: the torch.distributed Store to broadcast through (default: the default group's).
        rank: this process's rank, stated as `init_process_group(store=, rank=, world_size=)`
            takes it (give `store` and `world_size` too); default: the default process group's.
            With it the Guard coordinates through `store` alone and needs a process group only
            when it saves, so several Guards may live in one process (a scale test).
        world_size: the job's number of ranks, with `rank`.
        local_rank: with `rank`, this process's rank on its node (default: LOCAL_RANK, else `rank`).
        node: with `rank`, a name for this process's node (default: the host name and GROUP_RANK).
        agreement_timeout_s: longest wait for all ranks to agree on a step.
        save_on_rebalance: take a background save when AWS recommends a rebalance.
        write_threads: files each rank writes in parallel when saving (and reads when resuming);
            default: this node's cores shared among its ranks, 2 to 16 (2 was fastest on a 2-core VM
            with 2 ranks).
        thread_count: parallel uploads / downloads / verifications per rank.
        stream_uploads: with an S3, Azure or GCS checkpoint_dir, upload each shard file while it is written
            (notice -> durable about max(write, upload) instead of their sum); False: after the commit.
        checkpoint_key: a secret (bytes or str) to sign saves with and to require on resume;
            default: SPOTGUARD_CHECKPOINT_KEY when set, else no authentication.
        min_nodes: under an elastic torchrun (`--nnodes=MIN:MAX`), its MIN: survivors fewer than
            this stop their agents instead of restarting (default: SPOTGUARD_MIN_NODES, else 1).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        cloud: str = "auto",
        *,
        local_dir: str | None = None,
        metadata_url: str | None = None,
        poll_interval: float = 1.0,
        save_interval_s: float | str | None = None,
        min_save_interval_s: float | None = None,
        max_save_interval_s: float | None = None,
        interruptions_per_hour: float | None = None,
        save_every: int | None = None,
        keep_last: int | None = None,
        signals: Sequence[str | int] = ("SIGTERM",),
        grace_s: float = 25.0,
        exit_code: int | None = DEFAULT_EXIT_CODE,
        lost_exit_code: int = DEFAULT_LOST_EXIT_CODE,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        node: str | None = None,
        agreement_timeout_s: float = 30.0,
        save_on_rebalance: bool = True,
        write_threads: int | None = None,
        thread_count: int = 4,
        checkpoint_key: bytes | str | None = None,
        min_nodes: int | None = None,
        stream_uploads: bool = True,
    ) -> None:
        if cloud not in CLOUDS + ("none", "auto"):
            raise ValueError(f"cloud must be one of {CLOUDS + ('none', 'auto')}, not {cloud!r}")
        self._cadence = _cadence(save_interval_s, min_save_interval_s, max_save_interval_s, interruptions_per_hour)
        self.checkpoint_dir = check_location(checkpoint_dir)
        self.cloud = cloud
        self.local_dir = local_dir
        self.metadata_url = normalise_base_url(metadata_url) if metadata_url else None
        self.poll_interval = check.seconds("poll_interval", poll_interval)
        if not self._cadence:
            save_interval_s = check.optional(check.seconds, "save_interval_s", save_interval_s)
        self.save_interval_s = save_interval_s
        self.save_every = check.optional(check.count, "save_every", save_every)
        self.keep_last = check.optional(check.count, "keep_last", keep_last)
        self.signals = tuple(parse_signal(s) for s in signals)
        self.grace_s = check.seconds("grace_s", grace_s)
        self.exit_code = check.optional(check.exit_status, "exit_code", exit_code)
        self.lost_exit_code = check.exit_status("lost_exit_code", lost_exit_code)
        self.agreement_timeout_s = check.seconds("agreement_timeout_s", agreement_timeout_s)
        self.save_on_rebalance = save_on_rebalance
        self.write_threads = check.optional(check.count, "write_threads", write_threads)
        self.thread_count = check.count("thread_count", thread_count)
        self.stream_uploads = stream_uploads
        self._checkpoint_key = resolve_key(checkpoint_key)  # checked now; kept out of reprs and logs
        self.min_nodes = elastic.min_nodes(min_nodes)
        self._store = store
        self._stated = _stated_topology(store, rank, world_size, local_rank, node)

        self.notice: Notice | None = None  # the interruption being handled, once one arrives
        self.interrupted = False  # step() returned True for an emergency
        self.emergency_saved = False  # ... and its checkpoint was committed where a new VM finds it
        self._upload_abandoned = False  # ... and its upload did not finish (the stores are not closed)
        self.leaving = False  # ... and this node was the one reclaimed
        self._withdrawal: str | None = None  # why this node's torchrun agent must not restart it
        self.timeline = Timeline()
        self._started = False
        self._ckpt: Checkpointer | None = None
        self._ledger: Ledger | None = None  # global rank 0 writes the goodput ledger
        self._last_step: int | None = None  # the last step the loop reported (for the ledger)
        self._last_state: Mapping[str, Any] | None = None  # the state the loop last passed to step()
        self._stop_timer = threading.Event()
        self._agreement: StepAgreement | _NotStarted = _NotStarted()

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> Guard:
        """Start watching: signal handlers, the watcher and listener threads, the coordination
        through the store (what entering `with guard:` does). Returns the guard."""
        if self._started:
            raise RuntimeError("this Guard is started already: start a Guard once at a time")
        self.topology = topology.explicit(*self._stated) if self._stated else topology.current()
        self._group = self._ckpt = self._broadcast = self._watcher = self._ledger = None
        self._meeting: Connection | None = None
        self._started_at = time.monotonic()
        try:
            self._start()
        except BaseException:
            self._teardown()  # never leave a signal handler, a thread or a group behind
            raise
        self._started = True
        return self

    __enter__ = start  # the same frame depth either way: warnings point at the caller's line

    def _start(self) -> None:
        has_group = dist.is_available() and dist.is_initialized()
        if self.topology.distributed and has_group:
            self._group = new_gloo_group(timeout=timedelta(minutes=10))
        if has_group or not self.topology.distributed:
            self._checkpointer()  # now, so that a checkpoint_dir that cannot work fails here
        # The default group's store (a private accessor, present since torch 1.x) is the one every rank shares.
        self._store_in_use = store = self._store or (
            dist.distributed_c10d._get_default_store() if self.topology.distributed else dist.HashStore()
        )
        self._prefix = prefix = topology.run_prefix(store, self._group, self.topology)
        listen = Connection.of(store)  # the listener blocks on it; the agreement runs on the listener thread too
        self._broadcast = Broadcast(store, prefix, self._on_event, rank=self.topology.rank, connection=listen)
        self._agreement = StepAgreement(
            listen, prefix, self.topology.rank, self.topology.world_size, node=self.topology.node
        )
        self._broadcast.start()
        self._watcher = Watcher([], self._on_notice, interval_s=self.poll_interval, on_update=self._on_notice_update)
        self._add_sources(self._watcher.sources)
        self._watcher.start()
        if self._cadence is not None:
            self._cadence_history_read = False
            self._cadence.on_change = self._on_cadence  # rank 0's timer is the one that asks
        if self.save_interval_s and self.topology.is_coordinator:
            threading.Thread(target=self._interval_timer, name="spotguard-interval", daemon=True).start()

    def _checkpointer(self) -> Checkpointer:
        """The Checkpointer (and rank 0's ledger), made at the first need: with a stated topology and no
        process group yet, that is the first resume or save."""
        if self._ckpt is not None:
            return self._ckpt
        if self.topology.distributed and not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(
                f"saving or resuming at world_size={self.topology.world_size} needs torch.distributed "
                "initialised (init_process_group) first"
            )
        if self.topology.distributed and self._group is None:
            topology.explicit(self.topology.rank, self.topology.world_size)  # the group must be the stated one
            self._group = new_gloo_group(timeout=timedelta(minutes=10))
        self._ckpt = Checkpointer(
            self.checkpoint_dir,
            local_dir=self.local_dir,
            group=self._group,
            keep_last=self.keep_last,
            write_threads=self.write_threads,
            thread_count=self.thread_count,
            stream_uploads=self.stream_uploads,
            on_event=self.timeline.add,
            on_outcome=self._on_save_outcome,
            checkpoint_key=self._checkpoint_key,
        )
        if self.topology.is_coordinator:
            self._ledger = Ledger(self._ckpt.remote, progress=lambda: self._last_step)
            self._ledger.record(
                records.Start(
                    world_size=self.topology.world_size,
                    node=self.topology.node,
                    save_interval_s=self.save_interval_s,
                    save_every=self.save_every,
                    version=__version__,
                )
            )
        return self._ckpt

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    def close(self, error: BaseException | None = None) -> None:
        """Stop watching and release everything `start` took (what leaving `with guard:` does).

        After an emergency, and unless `exit_code` is None or `error` (the exception that ended
        the training, if any) is given, this exits the process: `exit_code` when the emergency
        checkpoint was committed, `lost_exit_code` when not. Closing a guard not started does nothing.
        """
        if not self._started:
            return
        self._started = False
        exiting = self.interrupted and self.exit_code is not None and error is None
        code = self.exit_code if self.emergency_saved else self.lost_exit_code
        if exiting:
            self._record_exit(code)
        if exiting and self._upload_abandoned:
            # The upload was abandoned at the deadline: closing the stores would wait for SDK
            # threads still sending it, and the VM is going away. Leave now.
            why = self.last_save.error if self.last_save is not None else None
            if self.emergency_saved:  # leaving: the survivors committed it and upload it
                log.warning(
                    "emergency checkpoint committed, not by this node (%s); exiting with code %d now", why, code
                )
            else:
                log.error(
                    "interrupted without a new checkpoint; exiting with code %d now (only this VM's disk has it: %s)",
                    code,
                    why,
                )
            self._ledger_exit(code, error)
            if self._ledger is not None:
                self._ledger.close(timeout_s=2.0)
            self._leave_agent()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if exiting:  # before the teardown: meanwhile the agent could restart this node into the next round
            self._leave_agent()
        self._teardown(lambda: self._ledger_exit(code if exiting else None, error))
        if exiting:
            if self.emergency_saved:
                log.warning("emergency checkpoint committed; exiting with code %d so the job is restarted", code)
            else:
                log.error("interrupted without a new checkpoint; exiting with code %d so the job is restarted", code)
            sys.exit(code)

    def _leave_agent(self) -> None:
        if self._withdrawal and self.topology.is_node_leader:
            elastic.withdraw_agent(self._withdrawal)

    def _teardown(self, saves_done: Callable[[], None] = lambda: None) -> None:
        """Stop everything the guard started; `saves_done` runs once the last save has ended."""
        self._stop_timer.set()
        if self._watcher is not None:
            self._watcher.stop()  # also restores the signal handlers
            if self._withdrawal and self.topology.is_node_leader:  # the withdrawn agent passes its SIGTERM on
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self._broadcast is not None:
            self._broadcast.stop()
        if self._ckpt is not None:
            try:
                self._ckpt.wait()
            except Exception:  # noqa: BLE001 - a failed background save is already logged; leave cleanly
                log.exception("the last background checkpoint failed")
            saves_done()  # the ledger's exit record comes after the last save's
            if self._ledger is not None:  # after the last save's record, before the store closes
                self._ledger.close()
            self._ckpt.close()
        if self._group is not None:
            dist.destroy_process_group(self._group)

    def _add_sources(self, sources: list[Any]) -> None:
        """Fill `sources` as each is made, so a failure half-way still lets teardown close them all."""
        if threading.current_thread() is threading.main_thread():
            signals = SignalSource(self.signals, grace_s=self.grace_s)
            sources.append(signals)
            signals.install()
        else:
            warnings.warn("Guard started outside the main thread: signals are not watched", stacklevel=4)
        if self.topology.is_node_leader:
            cloud = detect_cloud(self.metadata_url) if self.cloud == "auto" else self.cloud
            sources += cloud_sources(cloud, self.metadata_url)

    @property
    def last_save(self) -> SaveReport | None:
        """The report of the last save that committed, a background one too (None before any)."""
        return self._ckpt.last_report if self._ckpt is not None else None

    # ---- the training loop's calls ----------------------------------------------
    def resume(self, state: MutableMapping[str, Any]) -> int:
        """Load the newest committed checkpoint into `state`; returns the step to start from (0 if none)."""
        self._require_started("resume")
        started = time.monotonic()
        try:
            step = self._checkpointer().resume(state)
        except CheckpointUnavailable as exc:
            if self.exit_code is None:
                raise
            # Committed work exists but cannot be read now: starting afresh would throw it away.
            log.error("%s; exiting with code %d (start again once the storage answers)", exc, UNAVAILABLE_EXIT_CODE)
            raise SystemExit(UNAVAILABLE_EXIT_CODE) from None
        next_step = 0 if step is None else step + 1
        if self._ledger is not None:
            self._ledger.record(
                records.Resume(step=step, next_step=next_step, resume_s=time.monotonic() - started, run=self._ckpt.run)
            )
        if step is None:
            self.timeline.add("fresh-start", checkpoint_dir=self.checkpoint_dir)
            return 0
        self._agreement.reset(step)
        self.timeline.add("resumed", step=step, next_step=next_step)
        return next_step

    def step(self, step: int, state: Mapping[str, Any]) -> bool:
        """Call after every training step; True once the emergency checkpoint of `step` is committed.

        A step reported again (a loop that counts optimizer steps, called at every micro-batch of a
        gradient accumulation) is not saved again.
        """
        if type(step) is not int or step < 0:  # the fast path is one comparison; anything else is checked
            step = _as_step(step)
        again = step == self._last_step
        due = self._agreement.reached(step)
        self._last_step = step
        self._last_state = state  # for the listener thread to size a coming handoff (_expect_handoff)
        if due:
            return self._run_due(step, state, due)
        if self.save_every and step % self.save_every == 0 and not again:
            self._save(step, state, reason="periodic", wait=False)
        return False

    def request_checkpoint(self, reason: str = "manual") -> None:
        """Ask every rank, from this one (any thread), to save at the next step they all agree on, in the
        background, as an interval save does: unlike `save()`, the other ranks need not call anything."""
        self._require_started("request_checkpoint")
        self._request(reason)

    def _request(self, reason: str) -> None:
        self.timeline.add("save-requested", reason=reason)
        self._broadcast.request_checkpoint(reason)

    def save(self, step: int, state: Mapping[str, Any]) -> SaveReport | None:
        """Save now, on demand. With several ranks, every rank must call it at the same step."""
        self._require_started("save")
        return self._save(_as_step(step), state, reason="manual", wait=True)

    # ---- internals ---------------------------------------------------------------
    def _run_due(self, step: int, state: Mapping[str, Any], due: list[Decision]) -> bool:
        emergencies = [d for d in due if d.event["type"] == EMERGENCY]
        if not emergencies:
            self._save(step, state, reason=due[-1].event.get("reason", "periodic"), wait=False)
            return False
        # Several nodes' interruptions due at one step (the same on every rank): all of them leave,
        # and the save keeps to the earliest deadline.
        notices = [Notice.from_json(d.event["notice"]) for d in emergencies]
        notice = min(notices, key=lambda n: (n.deadline is None, n.deadline or n.detected_at))
        leaving = frozenset(r for d in emergencies for r in d.leaving)
        departure = None
        if leaving and len(leaving) < self.topology.world_size:
            if self._meeting is None:  # where leaving ranks and survivors meet, on a connection made at first use
                self._meeting = Connection.of(self._store_in_use, lazy=True)
            prefix = f"{self._prefix}emergency/{emergencies[0].round}/"
            departure = Departure(leaving, self._meeting, prefix, self.topology.world_size)
        self.leaving = self.topology.rank in leaving or departure is None
        self._withdrawal = elastic.withdrawal(
            # this node's own cloud notice, whatever other notices (a joining node's SIGTERM) came with it
            reclaimed=any(n.node == self.topology.node and n.cloud != "signal" for n in notices),
            leaving=self.leaving,
            ranks_left=self.topology.world_size - len(leaving),
            at_least=self.min_nodes,
        )
        self.timeline.add(
            "save-start",
            step=step,
            reason="emergency",
            **({"as": "leaving" if self.leaving else "survivor"} if departure else {}),
        )
        report = self._save(step, state, reason="emergency", wait=True, notice=notice, departure=departure)
        if report is None:
            log.error(
                "the emergency checkpoint of step %d was NOT committed (see the error above); stopping anyway: "
                "the work since the last committed checkpoint is lost, and resume will start from that one",
                step,
            )
        # Safe: durable in checkpoint_dir, or (leaving a job that goes on) committed by the survivors,
        # who hold everything of this node's. A copy only in local_dir goes away with the VM.
        safe = report is not None and (report.durable or departure is not None)
        if report is not None and not safe:
            log.error(
                "the emergency checkpoint of step %d is committed only in %s, which goes away with this VM (%s): "
                "reporting it as not saved",
                step,
                report.local_location,
                report.error,
            )
        if self.topology.is_node_leader and safe:
            self._watcher.ack(notice)  # Azure may proceed early only once the checkpoint is safe
        self.interrupted = True
        self.emergency_saved = safe
        self._upload_abandoned = report is not None and not report.durable
        if self._ledger is not None:
            self._ledger.record(
                _notice_record(
                    notice,
                    agreed_step=step,
                    committed=report is not None,
                    durable=report is not None and report.durable,
                    margin_s=_margin(notice, report),
                    leaving=tuple(sorted(leaving)),
                )
            )
        return True

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        reason: str,
        wait: bool,
        notice: Notice | None = None,
        departure: Departure | None = None,
    ) -> SaveReport | None:
        try:
            report = self._checkpointer().save(
                step,
                state,
                reason=reason,
                notice=notice,
                deadline=notice.deadline if notice else None,
                wait=wait,
                departure=departure,
            )
        except CheckpointError as exc:  # says what failed, where and why: one line is enough
            log.error("%s checkpoint of step %d failed: %s", reason, step, exc)
            self.timeline.add("save-failed", step=step, reason=reason)
            return None
        except Exception:  # noqa: BLE001 - invariant 3: a failed save never crashes the training loop
            log.exception("%s checkpoint of step %d failed", reason, step)
            self.timeline.add("save-failed", step=step, reason=reason)
            return None
        return report

    def _on_notice(self, notice: Notice) -> None:
        """Watcher thread: turn a notice into an event every rank sees."""
        notice = dataclasses.replace(notice, node=self.topology.node)
        self.timeline.add(
            "notice",
            source=notice.source,
            action=notice.action,
            node=notice.node,
            deadline_in_s=seconds(notice.seconds_left()),
        )
        if notice.kind == INTERRUPTION:
            self._broadcast.publish_interruption(notice)
        elif notice.kind == REBALANCE and self.save_on_rebalance:
            self._request("rebalance")

    def _on_notice_update(self, notice: Notice) -> None:
        """Watcher thread: a notice already handled came again with an earlier deadline (logged by
        the watcher). Recorded; a save already agreed keeps the deadline it was agreed with."""
        self.timeline.add("notice-update", source=notice.source, deadline_in_s=seconds(notice.seconds_left()))

    def _on_event(self, index: int, event: dict[str, Any]) -> None:
        """Listener thread: agree with every rank on the step to act at."""
        timeout = self.agreement_timeout_s
        leaving = None
        if event["type"] == EMERGENCY:
            self.notice = Notice.from_json(event["notice"])
            left = self.notice.seconds_left()
            if left is not None:  # leave most of the window for the save itself
                timeout = min(timeout, max(2.0, left / 4))
            leaving = self._broadcast.claimed_nodes
            log.warning("node %s is being reclaimed (%s)", self.notice.node, self.notice.source)
        decision = self._agreement.agree(index, event, timeout, leaving, round_keys=[self._broadcast.log.slot(index)])
        if decision is not None and event["type"] == EMERGENCY and self._ckpt is not None:
            self._ckpt.abandon_background_uploads()  # the training thread may be waiting on one
            self._expect_handoff(decision.leaving)
        if event["type"] == EMERGENCY and decision is None and self._ledger is not None:
            self._ledger.record(_notice_record(self.notice, agreed_step=None))
        if event.get("reason") == "rebalance":
            if self._ledger is not None:
                self._ledger.record(records.NoticeSeen(kind=REBALANCE, agreed_step=decision.step if decision else None))
            if self._cadence is not None:
                self._cadence.observe_interruption()
        if decision is not None:
            self.timeline.add(
                "agreed",
                step=decision.step,
                on=event["type"],
                ranks=self.topology.world_size,
                **({"leaving": ",".join(map(str, decision.leaving))} if decision.leaving else {}),
            )

    def _expect_handoff(self, leaving: Sequence[int]) -> None:
        """Listener thread, at the agreement: a survivor that will take a leaving rank's shards sets
        memory aside for them while the training step in flight still runs (sharded state only: a
        replicated one hands nothing over). Sized from this rank's own shards: FSDP-style layouts
        shard every tensor alike on every rank."""
        rank, world = self.topology.rank, self.topology.world_size
        state = self._last_state
        if not leaving or rank in leaving or len(leaving) >= world or state is None or self._ckpt is None:
            return
        try:
            nbytes = sharded_nbytes(state) * len(senders_to(leaving, rank, world))
        except Exception:  # noqa: BLE001 - only a head start: the handoff allocates as it goes without it
            log.debug("could not size the coming handoff", exc_info=True)
            return
        self._ckpt.expect_handoff(nbytes)

    def _record_exit(self, code: int) -> None:
        """Write $SPOTGUARD_EXIT_FILE (node leader): why this node's job is about to exit."""
        path = os.environ.get(EXIT_FILE_ENV)
        if not path or not self.topology.is_node_leader:
            return
        record = {
            "exit_code": code,
            "committed": self.emergency_saved,
            "step": self.last_save.step if self.emergency_saved and self.last_save else None,
            "leaving": self.leaving,
            "node": self.topology.node,
            "at": isoformat_z(utc_now()),
        }
        try:
            write_durably(Path(path), (json.dumps(record) + "\n").encode())
        except OSError as exc:
            log.warning("could not write %s=%s: %s", EXIT_FILE_ENV, path, exc)

    def _on_save_outcome(self, step: int, reason: str, report: SaveReport | None, error: str | None) -> None:
        """Any thread, every rank, after every save: into the ledger (rank 0) and the cadence."""
        if self._ledger is None:
            return
        measured = {}
        if report is not None:
            measured = {
                "bytes": report.bytes,
                "stall_s": report.stall_s,
                "write_s": report.write_s,
                "commit_s": report.commit_s,
                "upload_s": report.upload_s,
                "streamed_bytes": report.streamed_bytes,
                "durable": report.durable,
            }
        self._ledger.record(records.Save(step=step, reason=reason, ok=report is not None, error=error, **measured))
        if self._cadence is not None and report is not None and reason in ("periodic", "interval", "rebalance"):
            self._cadence.observe_save(report.stall_s)

    def _ledger_exit(self, code: int | None, exc: BaseException | None) -> None:
        """The ledger's last record of this segment: why it ends, and the exit code spotguard ends it with (None:
        it returns to the caller)."""
        if self._ledger is None:
            return
        why = INTERRUPTED if self.interrupted else "finished" if exc is None else f"error: {type(exc).__name__}"
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else 1
            why = "storage unavailable" if code == UNAVAILABLE_EXIT_CODE else "exit"
        self._ledger.record(records.Exit(code=code, why=why, committed=self.emergency_saved, last_step=self._last_step))

    def _interval(self) -> float:
        """The next wait of the interval timer: fixed, or the cadence's choice now."""
        if self._cadence is None:
            return self.save_interval_s  # type: ignore[return-value]
        history = self._ledger.history() if self._ledger is not None and not self._cadence_history_read else None
        if history is not None:
            self._cadence_history_read = True
            try:
                done = summarize(LedgerContents(history, 0))
                running_h = sum(s["wall_s"] for s in done.get("segment_details", [])) / 3600
                self._cadence.observe_history(done["interruptions"], running_h)
            except Exception as exc:  # noqa: BLE001 - a ledger this version cannot read: the prior alone decides
                log.warning("the save interval (auto) ignores the ledger's history: %s: %s", type(exc).__name__, exc)
        return self._cadence.interval((time.monotonic() - self._started_at) / 3600)

    def _on_cadence(self, choice: Choice) -> None:
        if self._ledger is not None:
            self._ledger.record(records.CadenceChange(**choice.to_json()))

    def _interval_timer(self) -> None:
        while not self._stop_timer.wait(self._interval()):
            try:
                self._request("interval")
            except Exception as exc:  # noqa: BLE001 - a store hiccup skips one interval save, not all of them
                log.warning("could not request an interval checkpoint: %s", exc)

    def _require_started(self, what: str) -> None:
        if not self._started:
            raise RuntimeError(_not_started(what))


def _not_started(what: str) -> str:
    return f"Guard.{what}() needs the guard started: use `with Guard(...) as guard:` or `guard.start()`"


class _NotStarted:
    """Stands in for the agreement until the guard is started, so a misuse gets a clear error."""

    def reached(self, step: int) -> list[Decision]:
        raise RuntimeError(_not_started("step"))


def _cadence(
    interval: float | str | None, min_s: float | None, max_s: float | None, prior: float | None
) -> Cadence | None:
    """The adaptive cadence for save_interval_s="auto" (checked here: a one-line error at Guard())."""
    if isinstance(interval, str) and interval != "auto":
        raise ValueError(f'save_interval_s must be a number of seconds or "auto", not {interval!r}')
    if interval != "auto":
        given = [n for n, v in (("min_save_interval_s", min_s), ("max_save_interval_s", max_s),
                                ("interruptions_per_hour", prior)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(f'{" and ".join(given)}: only with save_interval_s="auto"')
        return None
    low = DEFAULT_MIN_S if min_s is None else check.seconds("min_save_interval_s", min_s)
    high = DEFAULT_MAX_S if max_s is None else check.seconds("max_save_interval_s", max_s)
    prior = check.optional(check.positive, "interruptions_per_hour", prior)
    if low > high:
        raise ValueError(f"min_save_interval_s ({low:g}) must not exceed max_save_interval_s ({high:g})")
    return Cadence(low, high, prior)


def _margin(notice: Notice, report: SaveReport | None) -> float | None:
    """Seconds left before the deadline when the emergency checkpoint was safe (None: lost, or no deadline)."""
    if report is None or notice.deadline is None:
        return None
    return report.margin_s if report.margin_s is not None else notice.seconds_left()


def _notice_record(notice: Notice, **outcome: Any) -> records.NoticeSeen:
    return records.NoticeSeen(
        kind=notice.kind,
        cloud=notice.cloud,
        action=notice.action,
        source=notice.source,
        node=notice.node,
        deadline=isoformat_z(notice.deadline) if notice.deadline else None,
        detected_at=isoformat_z(notice.detected_at),
        **outcome,
    )


def _stated_topology(
    store: dist.Store | None, rank: int | None, world_size: int | None, local_rank: int | None, node: str | None
) -> tuple[int, int, int | None, str | None] | None:
    """The topology the caller states (checked at enter), or None to read the process group's."""
    if rank is None and world_size is None:
        if local_rank is not None or node is not None:
            raise ValueError("local_rank and node need rank and world_size too")
        return None
    if rank is None or world_size is None:
        raise ValueError("rank and world_size go together")
    if store is None and world_size > 1:
        raise ValueError("a stated rank and world_size need the store the ranks share (store=)")
    return rank, world_size, local_rank, node


def _as_step(step: Any) -> int:
    """`step` as an int (numpy integers and 0-dim integer tensors too), or a one-line error at the call."""
    return check.count("step", step, minimum=0)
