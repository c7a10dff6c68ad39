"""The Guard's settings: typed, frozen, grouped by concern, each value checked once, here.

    Guard("s3://bucket/run")                                   # the common case
    Guard("s3://bucket/run", keep_last=3, save_interval_s=600)  # keyword shortcuts: any field below
    Guard("s3://bucket/run", saving=SaveOptions(keep_last=3))   # or whole groups

Every field of every group is also a keyword of `Guard(...)`, so a group is only needed to
build settings once and share them. Seconds are `*_s` everywhere. The configuration reference
in the docs is generated from these classes (`describe()`), so it cannot drift from them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import Any

import torch.distributed as dist

from cloud_adapters import validation as check
from cloud_adapters.endpoints import normalise_base_url
from cloud_adapters.signals import parse_signal
from cloud_adapters.sources import CLOUDS
from spotguard.checkpoint.format.auth import resolve_key
from spotguard.ending import elastic
from spotguard.ending.exit_policy import DEFAULT_EXIT_CODE, DEFAULT_LOST_EXIT_CODE
from spotguard.goodput.cadence import DEFAULT_MAX_S, DEFAULT_MIN_S, Cadence

CLOUD_CHOICES = CLOUDS + ("none", "auto")
# Keyword names of earlier versions: still accepted, with a DeprecationWarning.
RENAMED = {"poll_interval": "poll_interval_s", "thread_count": "transfer_threads"}


def _option(default: Any, doc: str, *, shown: str | None = None, repr: bool = True) -> Any:  # noqa: A002
    """A field with its documentation (and how the docs show its default, where None means "computed")."""
    return dataclasses.field(default=default, repr=repr, metadata={"doc": doc, "shown": shown})


@dataclasses.dataclass(frozen=True)
class NoticeOptions:
    """Where interruption notices come from."""

    cloud: str = _option(
        "auto", "`aws`, `gcp`, `azure`, `none` (signals only) or `auto` (DMI files, then a 0.3 s metadata probe)"
    )
    metadata_url: str | None = _option(
        None,
        "the metadata service, e.g. an emulator (`http://HOST[:PORT]`)",
        shown="`$SPOTGUARD_METADATA_URL`, then the cloud's own variables, then the real address",
    )
    poll_interval_s: float = _option(1.0, "seconds between metadata polls (AWS, Azure; GCP uses a hanging GET)")
    signals: tuple[str | int, ...] = _option(
        ("SIGTERM",), 'signals that mean "you are being stopped"; add `"SIGUSR1"` for Slurm `--signal`'
    )
    grace_s: float = _option(25.0, "deadline after a signal (torchrun SIGKILLs workers 30 s after SIGTERM)")
    save_on_rebalance: bool = _option(True, "an AWS rebalance recommendation triggers a background save")

    def __post_init__(self) -> None:
        if self.cloud not in CLOUD_CHOICES:
            raise ValueError(f"cloud must be one of {CLOUD_CHOICES}, not {self.cloud!r}")
        if self.metadata_url is not None:
            _set(self, "metadata_url", normalise_base_url(self.metadata_url))
        _set(self, "poll_interval_s", check.seconds("poll_interval_s", self.poll_interval_s))
        if isinstance(self.signals, (str, int)):
            raise TypeError(f'signals must be a sequence of signals, e.g. ("SIGTERM",), not {self.signals!r}')
        _set(self, "signals", tuple(parse_signal(s) for s in self.signals))
        _set(self, "grace_s", check.seconds("grace_s", self.grace_s))
        _set(self, "save_on_rebalance", _boolean("save_on_rebalance", self.save_on_rebalance))


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """When to save besides an interruption, and how many saves to keep."""

    save_interval_s: float | str | None = _option(
        None,
        'a background save every this many seconds (agreed like a notice); `"auto"`: at the interval that '
        "costs least in save stalls plus expected lost work (see [Adaptive save cadence](../guide/goodput.md))",
        shown="none",
    )
    min_save_interval_s: float | None = _option(
        None, 'the lower bound of the `"auto"` interval (an error without `save_interval_s="auto"`)', shown="60"
    )
    max_save_interval_s: float | None = _option(None, 'the upper bound of the `"auto"` interval', shown="3600")
    interruptions_per_hour: float | None = _option(
        None,
        '`"auto"` only: the prior interruption rate, e.g. from the AWS Spot Advisor\'s frequency band (less '
        "than 5 % a month: under 0.00007/h); the ledger's history outweighs it after a few hours of running",
        shown="one a day",
    )
    save_every: int | None = _option(
        None,
        "a background save every this many steps (a step reported again, as at each micro-batch of a "
        "gradient accumulation, is not saved again)",
        shown="none",
    )
    keep_last: int | None = _option(
        None, "the highest committed steps to keep; the step just saved is never deleted", shown="all"
    )

    def __post_init__(self) -> None:
        interval = self.save_interval_s
        if interval == "auto":
            low = check.optional(check.seconds, "min_save_interval_s", self.min_save_interval_s)
            high = check.optional(check.seconds, "max_save_interval_s", self.max_save_interval_s)
            if (low or DEFAULT_MIN_S) > (high or DEFAULT_MAX_S):
                raise ValueError(
                    f"min_save_interval_s ({low or DEFAULT_MIN_S:g}) must not exceed "
                    f"max_save_interval_s ({high or DEFAULT_MAX_S:g})"
                )
            _set(self, "min_save_interval_s", low)
            _set(self, "max_save_interval_s", high)
            prior = check.optional(check.positive, "interruptions_per_hour", self.interruptions_per_hour)
            _set(self, "interruptions_per_hour", prior)
        else:
            if isinstance(interval, str):
                raise ValueError(f'save_interval_s must be a number of seconds or "auto", not {interval!r}')
            _set(self, "save_interval_s", check.optional(check.seconds, "save_interval_s", interval))
            given = [n for n in ("min_save_interval_s", "max_save_interval_s", "interruptions_per_hour")
                     if getattr(self, n) is not None]  # fmt: skip
            if given:
                raise ValueError(f'{" and ".join(given)}: only with save_interval_s="auto"')
        _set(self, "save_every", check.optional(check.count, "save_every", self.save_every))
        _set(self, "keep_last", check.optional(check.count, "keep_last", self.keep_last))

    def cadence(self) -> Cadence | None:
        """The adaptive cadence for `save_interval_s="auto"` (a new one per Guard), else None."""
        if self.save_interval_s != "auto":
            return None
        low = DEFAULT_MIN_S if self.min_save_interval_s is None else self.min_save_interval_s
        high = DEFAULT_MAX_S if self.max_save_interval_s is None else self.max_save_interval_s
        return Cadence(low, high, self.interruptions_per_hour)


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    """How saves are written, moved and signed."""

    local_dir: str | None = _option(
        None,
        "fast local disk to stage in before uploading to an object store",
        shown="object store: `$TMPDIR/spotguard-staging/<hash>`; path: none (staged in `checkpoint_dir`)",
    )
    write_threads: int | None = _option(
        None,
        "files each rank writes in parallel when saving, and reads in parallel when resuming "
        "(`LOCAL_WORLD_SIZE` ranks share `os.cpu_count()` cores; 2 on a 2-core machine, where it was fastest; "
        "16 on a 16-core H100 VM, 0.3 s faster than 8 for 8 GB)",
        shown="cores / ranks per node, 2 to 16",
    )
    transfer_threads: int = _option(
        4,
        "parallel uploads, downloads and verifications per rank (and a save's streaming upload threads); "
        "formerly `thread_count`",
    )
    stream_uploads: bool = _option(
        True,
        "with an `s3://`, `az://` or `gs://` `checkpoint_dir`, each shard file goes up part by part while it is "
        "written, not after the local commit (see [Streaming to the bucket while writing]"
        "(../guide/checkpoints.md)); paths ignore it",
    )
    checkpoint_key: bytes | str | None = _option(
        None,
        "a secret: saves are signed with it and resume loads only steps signed with it (see [What the "
        "checksums protect against](../guide/checkpoints.md#what-the-checksums-protect-against)); never shown "
        "in reprs or logs",
        shown="`$SPOTGUARD_CHECKPOINT_KEY`, else none",
        repr=False,
    )

    def __post_init__(self) -> None:
        _set(self, "write_threads", check.optional(check.count, "write_threads", self.write_threads))
        _set(self, "transfer_threads", check.count("transfer_threads", self.transfer_threads))
        _set(self, "stream_uploads", _boolean("stream_uploads", self.stream_uploads))
        if self.checkpoint_key is not None:
            resolve_key(self.checkpoint_key)  # its type and emptiness; the environment is read at Guard()


@dataclasses.dataclass(frozen=True)
class ExitOptions:
    """How the process ends after an emergency."""

    exit_code: int | None = _option(
        DEFAULT_EXIT_CODE,
        "exit code after an emergency whose checkpoint was committed; `None` to return normally "
        "(`guard.emergency_saved` tells)",
    )
    lost_exit_code: int = _option(
        DEFAULT_LOST_EXIT_CODE, "exit code after an emergency whose checkpoint was **not** committed (EX_TEMPFAIL)"
    )
    min_nodes: int | None = _option(
        None,
        "under an elastic torchrun, its MIN: survivors fewer than this stop their agents after committing "
        "(see [Elastic training](../guide/elastic.md))",
        shown="`$SPOTGUARD_MIN_NODES`, else 1",
    )

    def __post_init__(self) -> None:
        _set(self, "exit_code", check.optional(check.exit_status, "exit_code", self.exit_code))
        _set(self, "lost_exit_code", check.exit_status("lost_exit_code", self.lost_exit_code))
        if self.min_nodes is not None:
            elastic.min_nodes(self.min_nodes)


@dataclasses.dataclass(frozen=True)
class CoordinationOptions:
    """Where this process sits in the job, and how long the ranks wait for each other."""

    store: dist.Store | None = _option(
        None, "the `torch.distributed` Store to broadcast through", shown="the default group's"
    )
    rank: int | None = _option(
        None,
        "this process's place in the job, stated as `init_process_group(store=, rank=, world_size=)` takes it "
        "(with `store` and `world_size`): the guard then coordinates through `store` alone and needs a process "
        "group only when it saves or resumes, so several guards can live in one process; the k-th guard each "
        "rank of a job enters on one store is one guard (per `TORCHELASTIC_RESTART_COUNT` on one node): ranks "
        "whose counts cannot match, as after an attempt in which a rank never entered, are an error at start "
        "(see [Limits](../limits.md))",
        shown="the default group's",
    )
    world_size: int | None = _option(None, "the job's number of ranks, with `rank`", shown="the default group's")
    local_rank: int | None = _option(
        None,
        "with `rank`: this process's rank on its node (local rank 0 watches the cloud)",
        shown="`LOCAL_RANK`, else `rank`",
    )
    node: str | None = _option(
        None,
        "with `rank`: a name for this process's node (a notice makes every rank of its node leave)",
        shown="the host name and `GROUP_RANK`",
    )
    agreement_timeout_s: float = _option(30.0, "longest wait for every rank in an agreement round")

    def __post_init__(self) -> None:
        _set(self, "agreement_timeout_s", check.seconds("agreement_timeout_s", self.agreement_timeout_s))
        if self.store is not None and not isinstance(self.store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, not {type(self.store).__name__}")
        if self.rank is None and self.world_size is None:
            if self.local_rank is not None or self.node is not None:
                raise ValueError("local_rank and node need rank and world_size too")
            return
        if self.rank is None or self.world_size is None:
            raise ValueError("rank and world_size go together")
        # Checked here, not when the guard starts: the one check against the default process group
        # waits for start (topology.explicit), since the group may be made after Guard().
        rank, world = check.count("rank", self.rank, minimum=0), check.count("world_size", self.world_size)
        if rank >= world:
            raise ValueError(f"rank must lie in [0, world_size={world}), not {rank}")
        local = check.optional(check.count, "local_rank", self.local_rank, 0)
        if local is not None and local > rank:
            raise ValueError(f"local_rank ({local}) cannot exceed rank ({rank})")
        if self.node is not None and not isinstance(self.node, str):
            raise TypeError(f"node must be a str, not {type(self.node).__name__}")
        if self.store is None and world > 1:
            raise ValueError("a stated rank and world_size need the store the ranks share (store=)")
        _set(self, "rank", rank)
        _set(self, "world_size", world)
        _set(self, "local_rank", local)

    @property
    def stated(self) -> tuple[int, int, int | None, str | None] | None:
        """The topology the caller states (checked when the guard starts), or None to read the process group's."""
        if self.rank is None or self.world_size is None:
            return None
        return self.rank, self.world_size, self.local_rank, self.node


SNAPSHOT_EVERY_ENV = "SPOTGUARD_SNAPSHOT_EVERY"
SNAPSHOT_MIN_S, SNAPSHOT_MAX_S = 10.0, 900.0  # the bounds of snapshot_interval_s="auto"


@dataclasses.dataclass(frozen=True)
class SnapshotOptions:
    """Snapshots in the nodes' memory, for losses that come without a notice (off unless asked for)."""

    snapshot_every: int | None = _option(
        None,
        "a snapshot every this many steps, into host memory that outlives the workers, replicated to other "
        "nodes (see [Snapshots in the peers' memory](../guide/snapshots.md))",
        shown=f"`${SNAPSHOT_EVERY_ENV}` (a number of steps, or `auto`), else none",
    )
    snapshot_interval_s: float | str | None = _option(
        None,
        'a snapshot every this many seconds (agreed like an interval save); `"auto"`: the interval that costs '
        "least in snapshot stalls plus expected lost work, from "
        f"{SNAPSHOT_MIN_S:g} s to {SNAPSHOT_MAX_S:g} s",
        shown="none",
    )
    snapshot_dir: str | None = _option(
        None,
        "where this node keeps snapshots, in a root of the user's own made in it (`spotguard-<uid>`, mode 0700); "
        "a tmpfs survives a restart of the workers, not of the VM",
        shown="`$SPOTGUARD_SNAPSHOT_DIR` (empty: unset), else `/dev/shm`",
    )
    snapshot_replicas: int = _option(
        1, "other nodes that keep a copy of each rank's snapshot (at most the nodes less one)"
    )

    def __post_init__(self) -> None:
        every, interval, name = self.snapshot_every, self.snapshot_interval_s, "snapshot_every"
        if every is None and interval is None and os.environ.get(SNAPSHOT_EVERY_ENV):
            value = os.environ[SNAPSHOT_EVERY_ENV].strip()
            if value == "auto":
                interval = "auto"
            elif value.isascii() and value.isdigit():  # str.isdigit() alone takes "²", which int() refuses
                every, name = int(value), f"${SNAPSHOT_EVERY_ENV}"
            else:
                raise ValueError(f'${SNAPSHOT_EVERY_ENV} must be a number of steps or "auto", not {value!r}')
        if every is not None and interval is not None:
            raise ValueError("give snapshot_every (steps) or snapshot_interval_s (seconds), not both")
        _set(self, "snapshot_every", check.optional(check.count, name, every))
        if interval != "auto":
            if isinstance(interval, str):
                raise ValueError(f'snapshot_interval_s must be a number of seconds or "auto", not {interval!r}')
            interval = check.optional(check.seconds, "snapshot_interval_s", interval)
        _set(self, "snapshot_interval_s", interval)
        _set(self, "snapshot_replicas", check.count("snapshot_replicas", self.snapshot_replicas))
        if self.snapshot_dir is not None and not isinstance(self.snapshot_dir, (str, os.PathLike)):
            raise TypeError(f"snapshot_dir must be a path, not {type(self.snapshot_dir).__name__}")
        if self.snapshot_dir is not None and not os.fspath(self.snapshot_dir):  # "" would mean the default
            raise ValueError("snapshot_dir must not be empty (leave it out for the default)")

    @property
    def enabled(self) -> bool:
        return self.snapshot_every is not None or self.snapshot_interval_s is not None

    def cadence(self) -> Cadence | None:
        """The adaptive cadence for `snapshot_interval_s="auto"`, else None."""
        return Cadence(SNAPSHOT_MIN_S, SNAPSHOT_MAX_S, name="snapshot") if self.snapshot_interval_s == "auto" else None


PEER_TIMEOUT_ENV = "SPOTGUARD_PEER_TIMEOUT"
HANG_TIMEOUT_ENV = "SPOTGUARD_HANG_TIMEOUT"
DEFAULT_PEER_TIMEOUT_S = 20.0
MIN_PEER_TIMEOUT_S = 1.0  # beats go every fifth of it (at most 1 s): below this, scheduling noise is a loss


@dataclasses.dataclass(frozen=True)
class HealthOptions:
    """Failures without a notice: a node that stops answering, a training loop that stops stepping (on by default)."""

    peer_timeout_s: float | None = _option(  # None: read the environment; 0.0: off
        None,
        "a node silent this long (frozen, powered off, cut off: no FIN) is declared lost, and the job ends "
        "with `lost_exit_code` to restart from the nodes' memory (see [Silent failures](../guide/silent-failures.md)); "
        "`0` switches it off",
        shown=f"`${PEER_TIMEOUT_ENV}` (seconds, or `off`), else `{DEFAULT_PEER_TIMEOUT_S:g}`",
    )
    hang_timeout_s: float | str | None = _option(
        None,
        "no `guard.step()` for this long ends the job the same way, with every thread's stack in each rank's log; "
        '`"auto"`: five times the longest gap between steps, from 7 to 9.5 minutes; `0` switches it off',
        shown=f'`${HANG_TIMEOUT_ENV}` (seconds, `auto` or `off`), else `"auto"`',
    )

    def __post_init__(self) -> None:
        peer = _from_env(self.peer_timeout_s, PEER_TIMEOUT_ENV, DEFAULT_PEER_TIMEOUT_S)
        if isinstance(peer, str):
            wanted = 'a number of seconds or "off"'
            raise ValueError(f"peer_timeout_s (or ${PEER_TIMEOUT_ENV}) must be {wanted}, not {peer!r}")
        if peer:
            peer = check.seconds("peer_timeout_s", peer)
            if peer < MIN_PEER_TIMEOUT_S:
                raise ValueError(f"peer_timeout_s must be at least {MIN_PEER_TIMEOUT_S:g} s (0: off), got {peer!r}")
        _set(self, "peer_timeout_s", peer)
        hang = _from_env(self.hang_timeout_s, HANG_TIMEOUT_ENV, "auto")
        if isinstance(hang, str) and hang != "auto":
            raise ValueError(f'hang_timeout_s must be a number of seconds, "auto" or 0 (off), not {hang!r}')
        _set(self, "hang_timeout_s", hang if hang in (0.0, "auto") else check.seconds("hang_timeout_s", hang))


def _from_env(value: Any, env: str, default: Any) -> Any:
    """A timeout given, else the one in `$env`, else `default`; 0.0 when it is switched off (0, or `off`)."""
    if isinstance(value, bool):
        raise TypeError(f"a timeout must be a number of seconds, not bool ({value!r})")
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        if raw.lower() in ("auto", "off"):
            value = raw.lower()
        else:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f'${env} must be a number of seconds, "auto" or "off", not {raw!r}') from None
    if value == "off" or (not isinstance(value, (str, bool)) and value == 0):
        return 0.0
    return value


@dataclasses.dataclass(frozen=True)
class GuardOptions:
    """All of a Guard's settings, one group per concern."""

    notices: NoticeOptions = dataclasses.field(default_factory=NoticeOptions)
    saving: SaveOptions = dataclasses.field(default_factory=SaveOptions)
    storage: StorageOptions = dataclasses.field(default_factory=StorageOptions)
    exiting: ExitOptions = dataclasses.field(default_factory=ExitOptions)
    coordination: CoordinationOptions = dataclasses.field(default_factory=CoordinationOptions)
    snapshots: SnapshotOptions = dataclasses.field(default_factory=SnapshotOptions)
    health: HealthOptions = dataclasses.field(default_factory=HealthOptions)

    @classmethod
    def build(cls, groups: dict[str, Any], shortcuts: dict[str, Any]) -> GuardOptions:
        """Groups given whole, with keyword shortcuts (any field's name) applied on top of them.

        A name that is no field's is a TypeError naming it, as Python's own for a wrong keyword; a
        renamed one is accepted with a DeprecationWarning; a field set both ways is an error.
        """
        made: dict[str, Any] = {}
        for name, kind in GROUPS.items():
            given = groups.get(name)
            if given is not None and not isinstance(given, kind):
                raise TypeError(f"{name} must be a {kind.__name__}, not {type(given).__name__}")
            made[name] = given
        changes: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for key, value in shortcuts.items():
            if key in RENAMED:
                warnings.warn(
                    f"Guard({key}=...) is deprecated: use {RENAMED[key]}=",
                    DeprecationWarning,
                    stacklevel=caller_stacklevel(),
                )
                if RENAMED[key] in shortcuts:
                    raise TypeError(f"give {RENAMED[key]} or its old name {key}, not both")
                key = RENAMED[key]
            if key not in FIELD_GROUPS:
                raise TypeError(f"Guard() got an unexpected keyword argument {key!r}")
            group = FIELD_GROUPS[key]
            if made[group] is not None:
                raise TypeError(f"{key} is given twice: as a keyword and in {group}=")
            changes[group][key] = value
        return cls(**{name: made[name] or GROUPS[name](**changes[name]) for name in GROUPS})


# The groups by name (GuardOptions' fields), and the group of every field.
GROUPS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(GuardOptions)}  # type: ignore[misc]
FIELD_GROUPS: dict[str, str] = {f.name: group for group, kind in GROUPS.items() for f in dataclasses.fields(kind)}


# The settings earlier versions kept as public Guard attributes -> where each lives now
# (guard.options.<group>.<field>); the checkpoint key never was one.
FORMER_ATTRIBUTES = {
    name: (FIELD_GROUPS[RENAMED.get(name, name)], RENAMED.get(name, name))
    for name in ("cloud", "local_dir", "metadata_url", "poll_interval", "save_interval_s", "save_every", "keep_last",
                 "signals", "grace_s", "exit_code", "lost_exit_code", "agreement_timeout_s", "save_on_rebalance",
                 "write_threads", "thread_count", "stream_uploads", "min_nodes")
}  # fmt: skip


def former_attribute(options: GuardOptions, name: str) -> Any:
    """A setting read by the name of the Guard attribute it was before the groups, with a
    DeprecationWarning at the reader's line; AttributeError for any other name."""
    where = FORMER_ATTRIBUTES.get(name)
    if where is None:
        raise AttributeError(f"'Guard' object has no attribute {name!r}")
    group, field = where
    warnings.warn(f"Guard.{name} is deprecated: read guard.options.{group}.{field}", DeprecationWarning, stacklevel=3)
    if name == "min_nodes":  # what the guard uses: $SPOTGUARD_MIN_NODES when not given
        return elastic.min_nodes(options.exiting.min_nodes)
    return getattr(getattr(options, group), field)


def describe() -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """(group name, class name and what it is for, [(field, default as the docs show it, meaning)])."""
    out = []
    for group, kind in GROUPS.items():
        rows = []
        for f in dataclasses.fields(kind):
            shown = f.metadata["shown"] or f"`{f.default!r}`"
            rows.append((f.name, shown, f.metadata["doc"]))
        out.append((group, f"{kind.__name__}: {(kind.__doc__ or '').strip()}", rows))
    return out


def caller_stacklevel() -> int:
    """The `stacklevel` of a warning that points at the first frame outside spotguard: the user's line,
    also when an integration (the Lightning callback, `guarded(...)`) made the Guard for them."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _set(obj: Any, name: str, value: Any) -> None:
    """Store the checked (normalised) value in a frozen instance."""
    object.__setattr__(obj, name, value)


def _boolean(name: str, value: Any) -> bool:
    """True or False (also 1, 0 and numpy's booleans, which compare equal to them); a string, None or
    anything else is refused: `"false"` would be true."""
    if isinstance(value, (str, bytes, float)) or value is None or value not in (True, False):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return bool(value)
