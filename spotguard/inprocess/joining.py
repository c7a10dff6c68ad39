"""Nodes that join a running job (`spotguard.run`) without restarting its processes.

A joining node is launched on its own, not through the job's rendezvous (an elastic torchrun agent
restarts every worker when another agent joins): `torchrun --standalone` with `SPOTGUARD_JOIN=HOST:PORT`,
the job's store (torchrun's `--master-addr` and `--master-port` of the job). In the job's store, under
`spotguard/joins/`:

- the node's local rank 0 takes the next number (`count`) and says what it brings (`<n>/node`: its ranks);
  its other ranks learn the number from their own launcher's store;
- rank 0 of the job looks for new numbers every JOIN_POLL_S (`Door`, a thread) and asks every rank to stop
  at the next step they agree on (`Guard.admit`). At that step every rank takes a snapshot, the training
  function returns, and rank 0 takes each node (`<n>/claim`, a compare-and-set: a node that gave up waiting
  has taken it first, and is left out), writes the next generation's members (`members/<g>`, which the other
  members read) and answers each node (`<n>/answer`: an `Answer`), then moves `settled` past them; a node
  the job cannot take is answered at once with why;
- the joining ranks then form that generation with the others, and their `ctx.resume` loads the step from
  the nodes' memory.

Members keep one number each for the job's life: generation 0's ranks, then `founders + (n - 1) * ranks per
node + local rank` for joining node n, which also names the node (`GROUP_RANK`). Rank 0 of the job is
generation 0's rank 0 for as long as the job runs in-process (its node's loss ends it as without), so it
alone hands numbers out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from spotguard.inprocess.generation import FORM_TIMEOUT_S, Generation
from spotguard.inprocess.join_address import split
from spotguard.job.kvstore import Connection
from spotguard.job.topology import ranks_per_node

log = logging.getLogger("spotguard.inprocess")

JOIN_ENV = "SPOTGUARD_JOIN"  # HOST:PORT of the running job's store: this process joins it
JOIN_TIMEOUT_ENV = "SPOTGUARD_JOIN_TIMEOUT"  # how long a joining node waits to be taken in (seconds)
JOIN_TIMEOUT_S = 600.0
JOIN_POLL_S = 1.0  # how often rank 0 of the job looks for joining nodes
JOIN_RETRY_S = 30.0  # a join put off (an emergency came first) is asked for again after this
RECORD_WAIT_S = 30.0  # a number whose node never said what it brings (it died at once) is refused after this
PREFIX = "spotguard/joins/"
COUNT, SETTLED = f"{PREFIX}count", f"{PREFIX}settled"
TAKEN, WITHDRAWN = "taken", "withdrawn"  # who won a node's claim: the job, or the node that gave up


class JoinError(RuntimeError):
    """This node could not join the running job (refused, never taken in, or the job's store unreachable)."""


@dataclasses.dataclass(frozen=True)
class Answer:
    """The job's answer to a joining node: the generation it forms and its place in it, or why it is refused."""

    generation: int = 0
    members: tuple[int, ...] = ()
    first: int = 0  # the member number of the node's local rank 0
    world_before: int = 0  # the world size of the generation it joins after
    run_id: str | None = None  # the job's TORCHELASTIC_RUN_ID: its guards' store keys are under it
    refused: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: bytes) -> Answer:
        record = json.loads(text)
        return cls(**{**record, "members": tuple(record["members"])})


def _key(n: int, what: str) -> str:
    return f"{PREFIX}{n}/{what}"


def _members_key(generation: int) -> str:
    return f"{PREFIX}members/{generation}"


# ---- the joining node --------------------------------------------------------------------------------------
def knock(address: str, timeout_s: float | None = None) -> tuple[dist.Store, Generation, Answer]:
    """Ask the job whose store is at `address` (HOST:PORT) to take this process's node in, and wait for its
    answer (`timeout_s`, default $SPOTGUARD_JOIN_TIMEOUT or 600 s): (the job's store, the generation to form,
    the answer). Sets the environment the job's ranks have (its run id; GROUP_RANK: the node's number)."""
    host, port = split(address, JOIN_ENV, "the job's --master-addr and --master-port")
    timeout_s = timeout_s if timeout_s is not None else float(os.environ.get(JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S))
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=FORM_TIMEOUT_S))
        local_rank, ranks = int(os.environ.get("LOCAL_RANK", "0")), ranks_per_node()
        number = _take_number(store, local_rank, ranks)
        log.info("node %d waiting to join the job at %s (%d rank(s))", number, address, ranks)
        answer = _wait_for_answer(store, number, timeout_s, withdraw=local_rank == 0)
    except (JoinError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - the job's store went away, or never answered: one line, with where
        raise JoinError(f"the job's store at {address} failed: {type(exc).__name__}: {exc}") from None
    if answer is None:
        raise JoinError(f"the job at {address} did not take node {number} in within {timeout_s:.0f} s")
    if answer.refused is not None:
        raise JoinError(f"the job at {address} refused node {number}: {answer.refused}")
    me = answer.first + local_rank
    if answer.run_id:
        os.environ["TORCHELASTIC_RUN_ID"] = answer.run_id
    os.environ["GROUP_RANK"] = str(me // ranks)
    return store, Generation(answer.generation, answer.members, me), answer


def _take_number(store: dist.Store, local_rank: int, ranks: int) -> int:
    """The node's join number: drawn by its local rank 0, which also says how many ranks it brings; its
    other ranks read it from their own launcher's store (under its restart count: a number is drawn again
    after a restart)."""
    local = next(dist.rendezvous("env://"))[0] if ranks > 1 else None
    key = f"spotguard/join-number/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if local_rank == 0:
        number = store.add(COUNT, 1)
        store.set(_key(number, "node"), json.dumps({"ranks": ranks, "host": socket.gethostname()}))
        if local is not None:
            local.set(key, str(number))
        return number
    assert local is not None
    return int(local.get(key).decode())


def _wait_for_answer(store: dist.Store, number: int, timeout_s: float, *, withdraw: bool) -> Answer | None:
    """The job's answer to node `number`, or None once `timeout_s` passed and the node withdrew (its local rank
    0 takes the claim; the job had not: else the answer is on its way, and waited for)."""
    conn = Connection(store, own=True)
    said = conn.get(_key(number, "answer"), timeout_s)
    if said is None and withdraw and store.compare_set(_key(number, "claim"), "", WITHDRAWN).decode() == WITHDRAWN:
        return None
    if said is None:  # taken by the job (or, on another local rank, withdrawn: no answer comes then either)
        said = conn.get(_key(number, "answer"), FORM_TIMEOUT_S)
    return None if said is None else Answer.from_json(said)


# ---- the job's side ----------------------------------------------------------------------------------------
class Door:
    """Rank 0 of the job, while one generation trains: every JOIN_POLL_S, the nodes that asked to join since
    the last answered one, asked for through `admit(numbers, on_failed)` (again after JOIN_RETRY_S while
    unanswered). A node that cannot be taken (`refusal(ranks)` says why, else None), whose join failed
    (`on_failed`), or whose record never came within RECORD_WAIT_S is answered at once with why."""

    def __init__(
        self,
        store: dist.Store,
        admit: Callable[[list[int], Callable[[list[int], str], None]], None],
        refusal: Callable[[int], str | None],
    ) -> None:
        self._conn = Connection.of(store)  # its own client: the training thread's must never wait behind it
        self._admit = admit
        self._refusal = refusal
        self._asked: tuple[list[int], float] | None = None
        self._failed: dict[int, str] = {}  # nodes whose join failed (the training thread's word), to refuse
        self._missing_since: dict[int, float] = {}
        self._settled = 0  # the highest number answered, as last read: an idle poll is one request
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spotguard-join-door", daemon=True)

    def start(self) -> Door:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(JOIN_POLL_S):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - the job trains on; the next poll tries again
                log.warning("looking for joining nodes failed: %s: %s", type(exc).__name__, exc)

    def _on_failed(self, nodes: list[int], why: str) -> None:
        self._failed.update(dict.fromkeys(nodes, f"the job could not stop for it: {why}"))

    def poll(self) -> None:
        store = self._conn.store
        count = store.add(COUNT, 0)
        if count <= self._settled:
            return
        self._settled = _settled(self._conn)
        self._missing_since = {n: t for n, t in self._missing_since.items() if n > self._settled}
        waiting = []
        for number in range(self._settled + 1, count + 1):
            why = self._failed.get(number) or self._why_not(number)
            if why is None:
                waiting.append(number)
                continue
            if not why or waiting:  # its record is to come; or `settled` must move over the ones before it first
                break
            refuse(store, [number], why)
            self._failed.pop(number, None)
            self._settled = number
        now = time.monotonic()
        if waiting and (self._asked is None or self._asked[0] != waiting or now - self._asked[1] > JOIN_RETRY_S):
            log.info("node(s) %s ask to join: asking every rank to stop at the next step", waiting)
            self._asked = (waiting, now)
            self._admit(waiting, self._on_failed)

    def _why_not(self, number: int) -> str | None:
        """Why node `number` cannot be asked for: None if it can, "" while its record is still to come."""
        node = self._conn.get_now(_key(number, "node"))
        if node is not None:
            return self._refusal(json.loads(node)["ranks"])
        first_seen = self._missing_since.setdefault(number, time.monotonic())
        if time.monotonic() - first_seen < RECORD_WAIT_S:
            return ""
        return f"it never said what it brings within {RECORD_WAIT_S:.0f} s"


def _settled(conn: Connection) -> int:
    value = conn.get_now(SETTLED)
    return int(value.decode()) if value else 0


def settle(store: dist.Store, number: int) -> None:
    """Move `settled` up to `number`, never back: the door's thread refuses nodes while the training thread
    takes earlier ones in, and a `settled` moved back would have the door ask again for a node it refused."""
    expected = ""  # no value yet
    while True:
        now = store.compare_set(SETTLED, expected, str(number)).decode()
        if now and int(now) >= number:
            return
        expected = now


def refuse(store: dist.Store, numbers: list[int], why: str) -> None:
    """Rank 0 of the job: answer joining nodes (in order, after every number before them) with why they are
    refused, and move `settled` past them."""
    for number in numbers:
        store.set(_key(number, "answer"), Answer(refused=why).to_json())
        log.warning("node %d cannot join: %s", number, why)
    settle(store, max(numbers))


def take_in(store: dist.Store, generation: Generation, nodes: tuple[int, ...], founders: int | None) -> Generation:
    """The generation after `generation` with the joining `nodes` (their numbers, in order) that still wait as
    its last members. Rank 0 (`founders`: generation 0's world size) takes, numbers and answers them; every
    other member reads the members it wrote (within FORM_TIMEOUT_S), so that all form the same generation."""
    number = generation.number + 1
    if founders is None:
        said = Connection(store, own=False).get(_members_key(number), FORM_TIMEOUT_S)
        if said is None:
            raise RuntimeError(f"rank 0 did not say generation {number}'s members within {FORM_TIMEOUT_S:.0f} s")
        return Generation(number, tuple(json.loads(said)), generation.me)
    per_node = ranks_per_node()
    taken = [n for n in nodes if store.compare_set(_key(n, "claim"), "", TAKEN).decode() == TAKEN]
    firsts = {n: founders + (n - 1) * per_node for n in taken}
    joined = [m for n in taken for m in range(firsts[n], firsts[n] + per_node)]
    following = Generation(number, (*generation.members, *joined), generation.me)
    store.set(_members_key(number), json.dumps(following.members))
    answer = Answer(number, following.members, 0, generation.world_size, os.environ.get("TORCHELASTIC_RUN_ID"))
    for n in taken:
        store.set(_key(n, "answer"), dataclasses.replace(answer, first=firsts[n]).to_json())
    if len(taken) < len(nodes):
        log.warning("node(s) %s gave up waiting to join", [n for n in nodes if n not in taken])
    settle(store, max(nodes))
    return following


def refuse_waiting(store: dist.Store, why: str) -> None:
    """Rank 0, as the job ends: answer every node still waiting to join, so that none waits for nothing."""
    conn = Connection(store, own=False)
    waiting = list(range(_settled(conn) + 1, store.add(COUNT, 0) + 1))
    if waiting:
        refuse(store, waiting, why)
