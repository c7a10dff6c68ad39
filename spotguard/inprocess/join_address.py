"""Where a node that boots while the job runs finds the job's store, to join it in-process.

A job launched through torchrun's c10d rendezvous keeps its workers' store at an address that torchrun
picks (node 0's host, a free port): a node booting later knows only the rendezvous endpoint. With
SPOTGUARD_JOIN_REGISTRY=HOST:PORT (a store every node reaches; the startup script gives the rendezvous
endpoint), rank 0 of an in-process job records there, under its job id (TORCHELASTIC_RUN_ID, torchrun's
`--rdzv-id`), the address of the job's store. For as long as the job runs in its processes, between
generations too, a thread of rank 0 counts in the job's store, once a second, while the job's door would
take a node like the job's own (snapshots on: `takes`, which each generation's door sets); the record and
the count are removed as the job ends. `look_up` (`spotguard join-address`) gives the address only once it
has seen the count move, so that a node never knocks on a job that is gone, ending, or that would refuse
it: it then starts through the rendezvous, as without in-process recovery.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist

from spotguard.job.kvstore import Connection

log = logging.getLogger("spotguard.inprocess")

REGISTRY_ENV = "SPOTGUARD_JOIN_REGISTRY"  # HOST:PORT of a store where rank 0 records the job's store's address
OPEN = "spotguard/joins/open"  # in the job's store: rank 0's count while its door would take a node like the job's
CONNECT_S = 10.0
BEAT_S = 1.0


def _key(job: str) -> str:
    return f"spotguard/join-address/{job}"


def split(address: str, what: str, hint: str = "") -> tuple[str, int]:
    """(host, port) of HOST:PORT; ValueError naming `what` (and what it should be, `hint`) otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT{f' ({hint})' if hint else ''}, not {address!r}")
    return host, int(port)


def _client(address: str, what: str, timeout_s: float) -> dist.TCPStore:
    host, port = split(address, what)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _beats(store: dist.Store) -> int | None:
    return int(store.get(OPEN)) if store.check([OPEN]) else None


class Advertised:
    """Rank 0's record of the job's store (`address`, whose client is `store`) in the registry at
    `registry`, under `job`, and its count while `takes()`, until `withdraw()`."""

    def __init__(self, registry: str, job: str, address: str, store: dist.Store) -> None:
        self.registry, self.job, self.address = registry, job, address
        self.takes: Callable[[], bool] = lambda: False  # set by each generation's door
        self._store = Connection.of(store).store  # its own client: the training thread's never waits behind it
        self._registry = _client(registry, REGISTRY_ENV, CONNECT_S)
        self._registry.set(_key(job), address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._count, name="spotguard-join-address", daemon=True)
        self._thread.start()
        log.info("nodes booting later find this job's store (%s) in the registry at %s, under %r", address,
                 registry, job)  # fmt: skip

    def _count(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                if self.takes():
                    self._store.add(OPEN, 1)
            except Exception as exc:  # noqa: BLE001 - a node booting meanwhile starts through the rendezvous
                log.debug("the count for nodes booting later failed: %s: %s", type(exc).__name__, exc)

    def withdraw(self) -> None:
        """The job ends in its processes: no node is to join it any more (each part best effort; again: nothing)."""
        self._stop.set()
        self._thread.join(timeout=10)
        for store, key in ((self._registry, _key(self.job)), (self._store, OPEN)):
            try:
                store.delete_key(key)
            except Exception as exc:  # noqa: BLE001 - without the count moving, `look_up` turns a node away
                log.warning("the record that this job takes nodes was not removed (%s): %s: %s", key,
                            type(exc).__name__, exc)  # fmt: skip


def advertise(store: dist.Store) -> Advertised | None:
    """On rank 0 of an in-process job whose store (`store`) is at MASTER_ADDR:MASTER_PORT: its record in the
    registry that SPOTGUARD_JOIN_REGISTRY names, or None when none is named or it cannot be reached (said in
    the log: a node booting later then starts through the rendezvous, restarting the workers)."""
    registry = os.environ.get(REGISTRY_ENV)
    if not registry:
        return None
    job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    try:
        return Advertised(registry, job, address, store)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - the job trains on; only its joins go through a restart
        log.warning("the registry at %s was not reached (%s: %s): nodes booting later cannot find this job",
                    registry, type(exc).__name__, exc)  # fmt: skip
        return None


@contextlib.contextmanager
def advertising(store: dist.Store, rank0: bool) -> Iterator[Advertised | None]:
    """On rank 0 of the job (`rank0`), the job's store `advertise`d for as long as the job runs here."""
    advertised = advertise(store) if rank0 else None
    try:
        yield advertised
    finally:
        if advertised is not None:
            advertised.withdraw()


def look_up(registry: str, job: str, timeout_s: float = CONNECT_S) -> str | None:
    """The address of the store of the in-process job `job` recorded in the registry at `registry`, once its
    rank 0's count moved (it counts once a second), waited for up to `timeout_s`; None otherwise (no such job,
    it ended or would refuse a node, or its node is gone). The registry itself must answer within `timeout_s`
    (DistStoreError otherwise)."""
    found = _client(registry, "the registry", timeout_s)
    if not found.check([_key(job)]):
        return None
    address = found.get(_key(job)).decode()
    deadline = time.monotonic() + timeout_s
    try:
        store = _client(address, "the recorded address", timeout_s)
        first = _beats(store)
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = _beats(store)
            if now is not None and now != first:
                return address
    except Exception as exc:  # noqa: BLE001 - its node is gone (a record left behind)
        log.info("the job's store recorded at %s does not answer: %s: %s", address, type(exc).__name__, exc)
        return None
    log.info("the job's store at %s answers, but its rank 0 takes no nodes", address)
    return None
