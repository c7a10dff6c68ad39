"""Where the leaving ranks and the survivors of an emergency meet in the job's store.

Everything here is a handful of keys under one emergency's prefix, and every wait blocks on
the store server rather than polling it:
- `handoff/<survivor>`: the address a survivor takes handoffs on (`host port token`), or
  `!<why>` when it cannot take them; a leaving rank blocks on its survivor's key.
- `mailbox/<survivor>/<i>`: what the leaving ranks assigned to a survivor tell it (whether
  they hand shards over, a failure before they could connect), an `EventLog` the survivor
  reads on a thread of its own (`Mailbox`).
- `outcome`: the survivors' coordinator's word on the commit, which the leaving ranks block on.
Only the leaving ranks and the survivors they are assigned to (one each) touch these keys: the
other survivors of a large job make no request at all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Collection
from typing import Any

import torch.distributed as dist

from spotguard.job.kvstore import IDLE_WAIT, Connection, EventLog

log = logging.getLogger(__name__)


class HandoffError(RuntimeError):
    """A handoff did not complete: its bytes are not safe with a survivor."""


def receiver_of(leaving: Collection[int], rank: int, world_size: int) -> int:
    """The survivor that takes leaving `rank`'s shards: spread evenly over the survivors."""
    survivors = [r for r in range(world_size) if r not in leaving]
    return survivors[sorted(leaving).index(rank) % len(survivors)]


def senders_to(leaving: Collection[int], survivor: int, world_size: int) -> list[int]:
    """The leaving ranks whose shards `survivor` takes."""
    return [r for r in sorted(leaving) if receiver_of(leaving, r, world_size) == survivor]


@dataclasses.dataclass(frozen=True)
class SurvivorsOutcome:
    """The survivors to the leaving ranks, through the job's store as JSON: where the emergency
    step was committed, or why it was not."""

    error: str | None = None
    location: str = ""
    durable: bool = False
    bytes: int = 0
    files: int = 0
    committed_at: str = ""  # ISO 8601, UTC

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> SurvivorsOutcome:
        value = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in value.items() if k in known})


@dataclasses.dataclass(frozen=True)
class Departure:
    """The ranks leaving in an emergency, and where in the job's store they meet the survivors.

    `connection` is the training thread's own (see `Connection`); `prefix` is unique to this emergency.
    """

    leaving: frozenset[int]  # global ranks of the reclaimed nodes
    connection: Connection
    prefix: str
    world_size: int

    @property
    def store(self) -> dist.Store:
        return self.connection.store

    def survivors(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.leaving]

    def receiver_of(self, rank: int) -> int:
        return receiver_of(self.leaving, rank, self.world_size)

    def senders_to(self, survivor: int) -> list[int]:
        return senders_to(self.leaving, survivor, self.world_size)

    # -- a leaving rank --------------------------------------------------------------------

    def declare(self, rank: int, handing: bool) -> None:
        """Leaving `rank` tells its survivor whether it hands anything over."""
        self._post(rank, {"rank": rank, "handing": handing})

    def report_failure(self, rank: int, why: str) -> None:
        """Leaving `rank` tells its survivor it failed before its handoff could say so itself."""
        self._post(rank, {"rank": rank, "failed": why})

    def _post(self, rank: int, record: dict[str, Any]) -> None:
        try:
            EventLog(self.connection, self._mailbox_prefix(self.receiver_of(rank))).append(record)
        except Exception as exc:  # noqa: BLE001 - the survivor then waits a bounded time for nothing
            log.warning("could not tell rank %d's survivor %s (%s)", rank, record, exc)

    def address_of(self, survivor: int, timeout_s: float) -> tuple[str, int, str]:
        """(host, port, token) `survivor` takes handoffs on, once it says; HandoffError when it
        cannot take them or says nothing within `timeout_s`."""
        value = self.connection.get(self._address_key(survivor), timeout_s)
        if value is None:
            raise HandoffError(f"rank {survivor} never published its handoff address")
        text = value.decode()
        if text.startswith("!"):
            raise HandoffError(f"the survivors gave up: {text[1:]}")
        host, port, token = text.split()
        return host, int(port), token

    def wait_outcome(self, timeout_s: float) -> SurvivorsOutcome | None:
        """The survivors' outcome, or None when it does not come within `timeout_s`."""
        try:
            value = self.connection.get(self.prefix + "outcome", timeout_s)
        except Exception as exc:  # noqa: BLE001 - the store host may be the node going away
            log.warning("cannot read the survivors' outcome from the store (%s)", exc)
            return None
        return None if value is None else SurvivorsOutcome.from_json(value)

    # -- a survivor --------------------------------------------------------------------------

    def publish_address(self, survivor: int, host: str, port: int, token: str) -> None:
        self.store.set(self._address_key(survivor), f"{host} {port} {token}")

    def refuse_handoffs(self, survivor: int, why: str) -> None:
        """`survivor` cannot take its handoffs: its senders stop waiting for its address (an
        address already published stays: its sender learns on the connection)."""
        try:
            self.store.compare_set(self._address_key(survivor), "", "!" + why)
        except Exception as exc:  # noqa: BLE001 - the senders then wait until their deadline
            log.warning("could not tell the leaving ranks that rank %d takes no handoff (%s)", survivor, exc)

    def mailbox(self, survivor: int) -> Mailbox:
        return Mailbox(self, survivor)

    def publish_outcome(self, outcome: SurvivorsOutcome) -> None:
        """The survivors' coordinator: the commit's outcome. A failure also stops the leaving ranks
        that still wait for a survivor's address."""
        try:
            self.store.set(self.prefix + "outcome", outcome.to_json())
        except Exception as exc:  # noqa: BLE001 - only the leaving ranks' report depends on it
            log.warning("could not tell the leaving ranks the outcome (%s)", exc)
            return
        if outcome.error:
            for survivor in sorted({self.receiver_of(r) for r in self.leaving}):
                self.refuse_handoffs(survivor, outcome.error)

    def _address_key(self, survivor: int) -> str:
        return f"{self.prefix}handoff/{survivor}"

    def _mailbox_prefix(self, survivor: int) -> str:
        return f"{self.prefix}mailbox/{survivor}/"


class Mailbox:
    """What the leaving ranks assigned to one survivor tell it, read as it comes on a thread of its
    own (with a connection of its own: the training thread keeps the departure's). `close()` ends it."""

    def __init__(self, departure: Departure, survivor: int) -> None:
        self._departure = departure
        self._log = EventLog(departure.connection, departure._mailbox_prefix(survivor))
        self.handing: dict[int, bool] = {}
        self.failed: dict[int, str] = {}
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._read, args=(Connection.of(departure.store),), name="spotguard-mailbox", daemon=True
        )
        self._thread.start()

    def _read(self, connection: Connection) -> None:
        index = 1
        try:
            while True:
                record = self._log.read(connection, index, IDLE_WAIT.total_seconds())
                if record is None:
                    continue
                index += 1
                if record.get("closed"):
                    return
                with self._changed:
                    rank = int(record["rank"])
                    if "failed" in record:
                        self.failed[rank] = str(record["failed"])
                    else:
                        self.handing[rank] = bool(record["handing"])
                    self._changed.notify_all()
        except Exception as exc:  # noqa: BLE001 - the store is gone: the senders' connections tell the rest
            log.debug("the handoff mailbox stopped: %s", exc)

    def declarations(self, ranks: Collection[int], timeout_s: float) -> dict[int, bool]:
        """Whether each of `ranks` hands shards over, waiting up to `timeout_s` in all for their word
        (one that is already gone never says: it is left out)."""
        until = time.monotonic() + timeout_s
        with self._changed:
            self._changed.wait_for(lambda: all(r in self.handing for r in ranks), max(0.0, until - time.monotonic()))
            return {r: self.handing[r] for r in ranks if r in self.handing}

    def close(self, timeout_s: float = 2.0) -> None:
        try:  # wakes the reader, on the departure's connection (the reader blocks on its own)
            self._log.append({"closed": True})
        except Exception as exc:  # noqa: BLE001 - a daemon reader blocked on a dead store ends with it
            log.debug("could not close the handoff mailbox: %s", exc)
        self._thread.join(timeout_s)
