"""Load the newest good step into the user's state, falling back to older steps when one is bad.

Rank 0 lists the candidate steps. Before DCP reads a byte of a step, its files are
checked against the manifest for presence and size, and all ranks agree on the outcome
before loading; the CRC32C of every byte is checked as the load reads it (shard_read.py: one
read of each file, not a checking pass and a loading pass). With a separate local directory,
each node's leader (LOCAL_RANK 0) makes sure a copy of the step is on its local disk,
downloading (and fully checking) it when needed, and every rank of the node reads from there;
a local copy found damaged while loading is set aside and fetched again, once. A step that
fails to load (a damaged file, a refused pickle, a DCP error) is skipped on every rank alike,
like one that failed the checks before it: an older step is then loaded over the whole state
(and when none loads after tensors were overwritten, resume raises rather than start afresh).
A step the store cannot deliver (network or store errors) is not bad: resume tries again,
within RESUME_TIMEOUT_S, and then fails loudly rather than start afresh. The checksums catch
damage, not malice: what makes a tampered step harmless is that its pickles are read by
`safe_pickle`, which cannot run code. With a checkpoint key (`auth`), only steps signed with
it are loaded, and every file must match its SHA-256 too.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

from torch.distributed.checkpoint import CheckpointException

from cloud_adapters.deadline import Deadline
from cloud_adapters.retry import calls_until
from cloud_adapters.storage import (
    LocalStore,
    NotFound,
    ObjectStore,
    StoreError,
    Unreachable,
    fsync_path,
    write_durably,
)
from spotguard.checkpoint.comm import FAILURES, Comm, describe
from spotguard.checkpoint.errors import CheckpointError, CheckpointUnavailable, Damaged
from spotguard.checkpoint.format.commit import is_committed, set_aside
from spotguard.checkpoint.format.layout import MANIFEST_NAME, manifest_key, sibling_name, step_dir_name
from spotguard.checkpoint.format.listing import committed_manifests, dir_problems
from spotguard.checkpoint.format.manifest import Manifest, ManifestError
from spotguard.checkpoint.io.transfer import DeadlineExceeded, download
from spotguard.checkpoint.resume.verified_load import VerifiedReader, load_verified
from spotguard.checkpoint.state import to_dcp

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long resume keeps trying while the store cannot deliver committed steps (network or store
# errors); then CheckpointUnavailable. Read at each resume.
RESUME_TIMEOUT_S = 300.0
_RETRY_PAUSES_S = (1.0, 2.0, 4.0, 8.0, 15.0)

LOCAL, SHARED, FOLLOW = "local", "shared", "follow"  # where a rank reads from; FOLLOW: as its node leader says
UNAVAILABLE = "unavailable"  # the store did not deliver the step: try again later, never skip it
OK, BAD = "ok", "bad"  # a step's verdict, with UNAVAILABLE


def load_newest(
    state: MutableMapping[str, Any],
    *,
    remote: ObjectStore,
    local_root: Path | None,
    comm: Comm,
    threads: int = 4,
    read_threads: int = 4,
    key: bytes | None = None,
    bad: set[int] | None = None,
) -> int | None:
    """Load the newest step that every rank can verify; return it, or None when there is none.

    `local_root` is None when `remote` is a filesystem read directly; otherwise steps
    are read from `local_root` (a newer committed local step wins over the remote one).
    A bad step (checksums, manifest, a refused pickle, a DCP error) is skipped for the one
    before it. A step the store cannot deliver (a network or store error) is not: the whole
    resume is tried again until RESUME_TIMEOUT_S has passed, then CheckpointUnavailable is
    raised, since starting afresh would throw the committed progress away. With a checkpoint
    `key`, a step not signed with it is bad (and files are checked against their SHA-256).
    `threads` transfer and check downloads; `read_threads` read a step's files into the state.
    The steps found bad are added to `bad` (the caller's, when given).
    """
    deadline = Deadline.after(RESUME_TIMEOUT_S)  # rank 0's clock decides when every rank gives up
    bad = set() if bad is None else bad
    unloadable: list[str] = []
    pauses = itertools.chain(_RETRY_PAUSES_S, itertools.repeat(_RETRY_PAUSES_S[-1]))
    step_failure: _Unavailable | None = None  # the last step the store could not deliver
    with calls_until(deadline):
        while isinstance(
            outcome := _load_newest_once(
                state, remote, local_root, comm, (threads, read_threads), key, deadline, bad, unloadable
            ),
            _Unavailable,
        ):
            step_failure = outcome if outcome.names_a_step else step_failure
            pause = next(pauses)
            pause = comm.broadcast(pause if comm.is_coordinator and deadline.left() > pause else None)
            if pause is None:
                # The deadline may cut a listing short: the step that kept failing is still the news.
                why = outcome.why
                if step_failure is not None and step_failure is not outcome:
                    why += f"; before that, {step_failure.why}"
                raise CheckpointUnavailable(
                    f"checkpoints in {remote.url} could not be read within {RESUME_TIMEOUT_S:.0f} s ({why}); "
                    "not starting afresh: fix the store or the network, then restart"
                )
            if comm.is_coordinator:
                log.warning("%s; trying again in %.0f s (for %.0f s more)", outcome.why, pause, deadline.left())
            time.sleep(pause)
    if outcome is not None:
        return outcome
    if unloadable:
        # Verified steps that did not fit the state: starting afresh would hide the cause (most
        # likely a state that changed shape), and retention would then delete the new saves first.
        raise CheckpointError("no checkpoint could be loaded: " + " | ".join(unloadable))
    if comm.is_coordinator:
        log.info("no usable checkpoint in %s%s", remote.url, f" or {local_root}" if local_root else "")
    return None


@dataclasses.dataclass(frozen=True)
class _Unavailable:
    why: str
    names_a_step: bool = True


def _load_newest_once(
    state: MutableMapping[str, Any],
    remote: ObjectStore,
    local_root: Path | None,
    comm: Comm,
    threads_for: tuple[int, int],
    key: bytes | None,
    cutoff: Deadline,
    bad: set[int],
    unloadable: list[str],
) -> int | None | _Unavailable:
    """One pass over the committed steps, newest first: the step loaded, None, or what the store could not deliver.

    Adds the steps found bad to `bad` (not tried again) and the load failures to `unloadable`.
    `threads_for` is (threads for transfers and checks, threads reading files into the state).
    """
    threads, read_threads = threads_for
    steps: list[int] | str | _Unavailable | None = None
    if comm.is_coordinator:
        try:
            steps = [s for s in candidate_steps(remote, local_root, key) if s not in bad]
        except Unreachable as exc:
            steps = _Unavailable(f"listing checkpoints: {exc}", names_a_step=False)
        except FAILURES as exc:  # every rank must hear of it, or the others would wait for the list forever
            steps = f"listing checkpoints in {remote.url} failed: {describe(exc)}"
    steps = comm.broadcast(steps)
    if isinstance(steps, str):
        raise CheckpointError(steps)
    if isinstance(steps, _Unavailable):
        return steps
    for step in steps:
        refetched = False
        while True:
            try:
                where, why = _prepare(step, remote, local_root, comm, threads, key, cutoff)
            except FAILURES as exc:  # reported through the all_gather below, so ranks stay in step
                where, why = (UNAVAILABLE if _undelivered(exc) else None), f"{comm.host}: {describe(exc)}"
            verdict, problems = _verdict(comm.all_gather((comm.host, where, why)), local_root is not None)
            if verdict == UNAVAILABLE:
                return _Unavailable(f"{step_dir_name(step)}: " + "; ".join(problems))
            if verdict != OK:
                break
            step_dir = (local_root if local_root is not None else Path(remote.url)) / step_dir_name(step)
            failure, damaged_on = _load(step_dir, state, comm, key, read_threads)
            if failure is None:
                if comm.is_coordinator:
                    log.info("resumed from %s (world size %d)", step_dir, comm.world_size)
                return step
            unloadable.append(failure)  # tensors may be overwritten: no step loading now means an error
            if damaged_on and local_root is not None and not refetched:
                # A local copy went bad on disk: the store may still hold a good one.
                if comm.is_node_leader and comm.host in damaged_on:
                    log.warning("local copy is damaged (%s); fetching %s again", failure, step_dir.name)
                    try:
                        set_aside(step_dir, step)
                    except OSError as exc:  # then it is loaded (and found damaged) once more, and skipped
                        log.error("could not set %s aside: %s", step_dir, exc)
                refetched = True
                continue
            problems = [failure]
            break
        bad.add(step)
        if comm.is_coordinator:
            log.warning("skipping %s: %s", step_dir_name(step), "; ".join(problems))
    return None


def candidate_steps(remote: ObjectStore, local_root: Path | None, key: bytes | None) -> list[int]:
    """The committed steps of `remote` and `local_root`, newest first."""
    steps = {m.step for m in committed_manifests(remote, key=key)}
    if local_root is not None:
        steps |= {m.step for m in committed_manifests(LocalStore(local_root), key=key)}
    return sorted(steps, reverse=True)


def _verdict(everyone: list[tuple[str, str | None, str | None]], per_node: bool) -> tuple[str, list[str]]:
    """(OK, BAD or UNAVAILABLE, the problems): the same on every rank, from every rank's (host, where, why).

    Bad on any node wins: that step is skipped however the others fared.
    """
    problems = [why or "unknown problem" for _, where, why in everyone if where is None]
    if per_node:
        answered = {host for host, where, _ in everyone if where != FOLLOW}
        problems += [
            f"{host}: no rank with LOCAL_RANK=0 prepared the local copy"
            for host in sorted({h for h, _, _ in everyone} - answered)
        ]
    if problems:
        return BAD, problems
    undelivered = [why or "unknown problem" for _, where, why in everyone if where == UNAVAILABLE]
    return (UNAVAILABLE, undelivered) if undelivered else (OK, [])


def _undelivered(exc: BaseException | None) -> bool:
    """Whether the store or the network failed to deliver (try again later), as opposed to a bad step."""
    while exc is not None and not isinstance(exc, (StoreError, DeadlineExceeded)):
        exc = exc.__cause__
    return exc is not None and not isinstance(exc, NotFound)


def _prepare(
    step: int,
    remote: ObjectStore,
    local_root: Path | None,
    comm: Comm,
    threads: int,
    key: bytes | None,
    cutoff: Deadline,
) -> tuple[str | None, str | None]:
    """(where this rank can read `step` from, or None (a bad step) or UNAVAILABLE with the reason)."""
    if local_root is None:
        if not comm.is_coordinator:
            return FOLLOW, None
        why = _verify(Path(remote.url) / step_dir_name(step), step, threads, key, contents=key is not None)
        return (SHARED, None) if why is None else (None, why)
    if not comm.is_node_leader:
        return FOLLOW, None
    return _ensure_local(step, remote, local_root, comm.host, threads, key, cutoff)


def _verify(step_dir: Path, step: int, threads: int, key: bytes | None, *, contents: bool) -> str | None:
    """Why `step_dir` cannot be loaded, or None. Without `contents` the files are not read (the load
    checks them as it reads). With a checkpoint key they are, before loading: no byte that its SHA-256
    has not vouched for then reaches a parser (torch's zip reader, the weights-only unpickler)."""
    try:
        manifest = Manifest.from_bytes((step_dir / MANIFEST_NAME).read_bytes())
    except (OSError, ManifestError) as exc:
        return f"{step_dir}: {exc}"
    if manifest.step != step:
        return f"{step_dir}: manifest says step {manifest.step}"
    problems = dir_problems(step_dir, manifest, threads=threads, key=key, contents=contents)
    return f"{step_dir}: " + "; ".join(problems) if problems else None


def _ensure_local(
    step: int, remote: ObjectStore, local_root: Path, host: str, threads: int, key: bytes | None, cutoff: Deadline
) -> tuple[str | None, str | None]:
    """Make `local_root/step-N` a copy to load, downloading it from `remote` when it is missing or damaged.

    A download is checked in full; a copy already there only for presence and sizes (the load
    checks its bytes as it reads them), except with a checkpoint `key` (see `_verify`).
    """
    final = local_root / step_dir_name(step)
    if is_committed(final):
        why = _verify(final, step, threads, key, contents=key is not None)
        if why is None:
            return LOCAL, None
        log.warning("local copy is damaged (%s); fetching %s again from %s", why, step_dir_name(step), remote.url)
    try:
        raw = remote.get_bytes(manifest_key(step))
        manifest = Manifest.from_bytes(raw)
    except (StoreError, ManifestError) as exc:
        where = UNAVAILABLE if _undelivered(exc) else None
        return where, f"{host}: no good local copy of {step_dir_name(step)} and none in {remote.url}: {exc}"
    scratch = local_root / sibling_name(step, "dl")
    try:
        scratch.mkdir(parents=True)
        log.info(
            "downloading %s (%d files, %.1f MB) from %s",
            step_dir_name(step),
            len(manifest.files),
            manifest.total_bytes / 1e6,
            remote.url,
        )
        items = [(f"{step_dir_name(step)}/{r.name}", scratch / r.name) for r in manifest.files]
        download(remote, items, threads=threads, cutoff=cutoff)
        problems = dir_problems(scratch, manifest, threads=threads, key=key)
        if problems:
            return (
                None,
                f"{host}: download of {step_dir_name(step)} from {remote.url} does not match its manifest: "
                + "; ".join(problems),
            )
        write_durably(scratch / MANIFEST_NAME, raw)  # last, as in a save
        if final.exists():
            set_aside(final, step)
        os.rename(scratch, final)
        fsync_path(local_root)
    except OSError as exc:
        where = UNAVAILABLE if _undelivered(exc) else None
        return where, f"{host}: download of {step_dir_name(step)} from {remote.url} failed: {exc}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return LOCAL, None


def _load(
    step_dir: Path, state: MutableMapping[str, Any], comm: Comm, key: bytes | None, threads: int
) -> tuple[str | None, set[str]]:
    """Load `step_dir` into `state` on every rank: (None, no hosts), or (why it failed on some rank,
    the hosts where a file read did not match the manifest), the same on all ranks."""
    # Outside the checks: a state DCP cannot take (an optimizer without its model) is the user's error, on every rank.
    loaded = to_dcp(state, to_load=True)
    # Opening the step is agreed before dcp.load: a rank failing alone would leave the others waiting in it.
    reader, failure, damaged_on = _on_every_rank(
        comm,
        lambda: VerifiedReader(
            step_dir,
            Manifest.from_bytes((step_dir / MANIFEST_NAME).read_bytes()),
            key,
            threads=threads,
            state_dict=loaded,
        ),
    )
    if failure is None:
        # Tensors are loaded in place: if this fails midway, the next step tried overwrites them all again.
        _, failure, damaged_on = _on_every_rank(comm, lambda: load_verified(reader, loaded, state, comm))
    return (None, set()) if failure is None else (f"loading {step_dir} failed: {failure}", damaged_on)


def _on_every_rank(comm: Comm, action: Callable[[], T]) -> tuple[T | None, str | None, set[str]]:
    """(what `action` returned here, None, no hosts) when it succeeded on every rank, else
    (None, why, by rank, the hosts of the ranks that read a damaged file)."""
    result, why, damaged = None, None, False
    try:
        result = action()
    except CheckpointException as exc:  # DCP hands every rank all the ranks' failures: each tells its own
        own = exc.failures.get(comm.rank)
        why = describe(own[0]) if own else ""
        damaged = bool(own) and isinstance(own[0], Damaged)
    except Exception as exc:
        why = describe(exc)
        damaged = isinstance(exc, Damaged)
    gathered = comm.all_gather((comm.host, why, damaged))
    if all(w is None for _, w, _ in gathered):
        return result, None, set()
    ranks_by_reason: dict[str, list[str]] = {}
    for rank, (_, reason, _) in enumerate(gathered):
        if reason:
            ranks_by_reason.setdefault(reason, []).append(str(rank))
    why = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {reason}" for reason, ranks in ranks_by_reason.items()
    )
    return None, why, {host for host, _, was_damaged in gathered if was_damaged}
