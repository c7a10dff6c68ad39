"""An emergency in which some nodes leave and the others go on: the leaving ranks hand what exists
nowhere else to a survivor's memory and learn the outcome; the survivors take those handoffs and
run the save protocol in a group of their own (`departure`: where they meet; `handoff`: the transfer)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner

from cloud_adapters.deadline import Deadline
from cloud_adapters.notice import parse_iso8601
from spotguard.checkpoint.comm import FAILURES, Comm, describe, new_gloo_group
from spotguard.checkpoint.errors import CheckpointError
from spotguard.checkpoint.moves.handoff import ReceivePool, Receiver, send_shards
from spotguard.checkpoint.moves.ownership import SurvivorPlanner, expects_handoff, flat, unique_shards
from spotguard.checkpoint.outcome import SaveReport
from spotguard.job.departure import Departure, SurvivorsOutcome

log = logging.getLogger(__name__)

# How long the ranks of an emergency without a deadline wait for each other's handoff and outcome.
NO_DEADLINE_WAIT_S = 120.0
# How long a survivor waits for a leaving rank to say whether it hands anything over, when the survivor
# expects nothing from it: bounded, since a leaving rank may already be gone.
DECLARE_GRACE_S = 3.0

# The save protocol on the survivors' group: (their comm, the planner that adds the handed shards,
# what to call with the outcome of the local commit, on the group's rank 0).
SurvivorSave = Callable[[Comm, DefaultSavePlanner, Callable[[SurvivorsOutcome], None]], SaveReport]


def leave(
    step: int, state_dict: dict[str, Any], departure: Departure, cutoff: Deadline, started_at: datetime
) -> SaveReport:
    """A leaving rank: hand over what only it holds, then learn the survivors' outcome.

    Nothing here waits on this rank's disk, and the survivors wait for nothing but the handoff.
    The outcome is the survivors' word, whatever happened to the handoff on this side.
    """
    rank = dist.get_rank()
    survivors = set(departure.survivors())
    t0 = time.monotonic()
    handing = expects_handoff(flat(state_dict), rank, survivors)
    departure.declare(rank, handing)
    if handing:
        to = departure.receiver_of(rank)
        try:
            shards = unique_shards(state_dict, rank, survivors)
            log.warning(
                "rank %d is leaving: handing %d shards (%.1f MB) of step %d to rank %d",
                rank,
                len(shards),
                sum(t.numel() * t.element_size() for _, t in shards) / 1e6,
                step,
                to,
            )
            nbytes = send_shards(departure, rank, to, step, shards, cutoff)
            log.warning(
                "rank %d handed %d shards (%.1f MB) of step %d to rank %d in %.2f s; free to go",
                rank,
                len(shards),
                nbytes / 1e6,
                step,
                to,
                time.monotonic() - t0,
            )
        except Exception as exc:  # noqa: BLE001 - the survivors' outcome below says what became of the step
            log.error("rank %d could not hand its shards of step %d to rank %d: %s", rank, step, to, exc)
    else:
        log.warning("rank %d is leaving: the survivors hold all it has and save step %d without it", rank, step)
    handed_s = time.monotonic() - t0
    done = departure.wait_outcome(cutoff.left() or NO_DEADLINE_WAIT_S)
    if done is None:
        raise CheckpointError(f"the survivors did not confirm a commit of step {step} before the deadline")
    if done.error:
        raise CheckpointError(f"the survivors could not commit step {step}: {done.error}")
    return SaveReport(
        step=step,
        reason="emergency",
        bytes=done.bytes,
        files=done.files,
        write_s=handed_s,
        commit_s=0.0,
        upload_s=0.0,
        location=done.location,
        durable=done.durable,
        margin_s=None,
        started_at=started_at,
        committed_at=parse_iso8601(done.committed_at),
        durable_at=None,
        error=None if done.durable else "committed by the survivors, who upload it",
    )


def survive(
    step: int,
    state_dict: dict[str, Any],
    departure: Departure,
    cutoff: Deadline,
    pool: ReceivePool | None,
    save: SurvivorSave,
) -> SaveReport:
    """A survivor: take the handoffs meant for this rank, then save and commit with the other survivors.

    The leaving node's deadline bounds the handoff only: the survivors are staying, so their
    upload is not cut at it (the leaving ranks learn the outcome at the local commit).
    """
    survivors = departure.survivors()
    # Only the survivors create (and wait for each other in) this group: the leaving ranks never block it.
    try:
        group = new_gloo_group(
            survivors, timeout=timedelta(seconds=max(30.0, cutoff.left() or 0.0)), use_local_synchronization=True
        )
    except FAILURES as exc:  # the job's store went away (its host was the node leaving?)
        raise CheckpointError(
            f"the survivors could not form their group to save step {step} (is the job's store gone?): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    comm = Comm(group)
    try:
        received, why = _receive_handoffs(step, state_dict, departure, cutoff, pool)
        failed = [w for w in comm.all_gather(why) if w]
        if failed:
            raise CheckpointError(
                f"step {step} is not committed: a leaving rank's shards did not arrive whole ({'; '.join(failed)})"
            )
        report = save(comm, SurvivorPlanner(received), departure.publish_outcome)
    except FAILURES as exc:
        if comm.is_coordinator:
            departure.publish_outcome(SurvivorsOutcome(error=describe(exc)))
        raise
    finally:
        dist.destroy_process_group(group)
    return report


def _receive_handoffs(
    step: int, state_dict: dict[str, Any], departure: Departure, cutoff: Deadline, pool: ReceivePool | None
) -> tuple[list, str | None]:
    """(the shards handed to this survivor, or why not). Every rank infers from its own state who
    must hand over what; a leaving rank that declares shards this survivor did not expect (state
    laid out differently on each rank) makes the step fail rather than commit without them."""
    rank = dist.get_rank()
    assigned = departure.senders_to(rank)
    if not assigned:
        return [], None
    survivors = set(departure.survivors())
    flat_state = flat(state_dict)
    senders = [r for r in assigned if expects_handoff(flat_state, r, survivors)]
    mailbox = departure.mailbox(rank)
    try:
        received = Receiver(departure, rank, senders, step, mailbox, pool).collect(cutoff) if senders else []
        if pool is not None and senders:
            mb = (pool.used / 1e6, pool.nbytes / 1e6)
            log.info("the handoff took %.1f MB of the %.1f MB set aside at the agreement", *mb)
        said = mailbox.declarations([r for r in assigned if r not in senders], DECLARE_GRACE_S)
    except Exception as exc:  # noqa: BLE001 - reported through the all_gather, so ranks stay in step
        if senders:
            departure.refuse_handoffs(rank, f"rank {rank}: {exc}")
        return [], f"rank {rank}: {exc}"
    finally:
        mailbox.close()
    surprising = sorted(r for r, handing in said.items() if handing)
    if surprising:
        return [], (
            f"rank {rank}: leaving ranks {surprising} hold shards no survivor expected (is the state laid out "
            "differently on each rank, e.g. pipeline stages?)"
        )
    return received, None
