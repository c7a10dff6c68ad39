"""Nodes that join a running job (`spotguard.run`) without restarting its processes.

A joining node is launched on its own, not through the job's rendezvous (an elastic torchrun agent
restarts every worker when another agent joins): `torchrun --standalone` with `SPOTGUARD_JOIN=HOST:PORT`,
the job's store (torchrun's `--master-addr` and `--master-port` of the job). In the job's store, under
`spotguard/joins/`:

- the node's local rank 0 takes the next number (`count`) and says what it brings (`<n>/node`: its ranks);
  its other ranks learn the number from their own launcher's store;
- rank 0 of the job looks for new numbers every JOIN_POLL_S (`Door`, a thread) and asks every rank to stop
  at the next step they agree on (`Guard.admit`). At that step every rank takes a snapshot, the training
  function returns, and rank 0 answers each node (`<n>/answer`: the next generation, its members and the
  node's first member number; or why it is refused) and moves `settled` to it;
- the joining ranks then form that generation with the others, and their `ctx.resume` loads the step from
  the nodes' memory.

Members keep one number each for the job's life: generation 0's ranks, then `founders + (n - 1) * ranks per
node + local rank` for joining node n, which also names the node (`GROUP_RANK`). Rank 0 of the job is
generation 0's rank 0 for as long as the job runs in-process (its node's loss ends it as without), so it
alone hands numbers out.
"""

from __future__ import annotations

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
from spotguard.job.kvstore import Connection
from spotguard.job.topology import ranks_per_node

log = logging.getLogger("spotguard.inprocess")

JOIN_ENV = "SPOTGUARD_JOIN"  # HOST:PORT of the running job's store: this process joins it
JOIN_TIMEOUT_ENV = "SPOTGUARD_JOIN_TIMEOUT"  # how long a joining node waits to be taken in (seconds)
JOIN_TIMEOUT_S = 600.0
JOIN_POLL_S = 1.0  # how often rank 0 of the job looks for joining nodes
JOIN_RETRY_S = 30.0  # a join put off (its snapshot failed, an emergency came first) is asked for again after this
PREFIX = "spotguard/joins/"
COUNT, SETTLED = f"{PREFIX}count", f"{PREFIX}settled"


class JoinError(RuntimeError):
    """This node could not join the running job (refused, never answered, or a wrong address)."""


def _node_key(n: int) -> str:
    return f"{PREFIX}{n}/node"


def _answer_key(n: int) -> str:
    return f"{PREFIX}{n}/answer"


# ---- the joining node --------------------------------------------------------------------------------------
def knock(address: str, timeout_s: float | None = None) -> tuple[dist.Store, Generation, dict]:
    """Ask the job whose store is at `address` (HOST:PORT) to take this process's node in, and wait for its
    answer (`timeout_s`, default $SPOTGUARD_JOIN_TIMEOUT or 600 s): (the job's store, the generation to form,
    the answer). Sets the environment the job's ranks have (its run id; GROUP_RANK: the node's number)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{JOIN_ENV} must be HOST:PORT (the job's --master-addr and --master-port), not {address!r}")
    timeout_s = timeout_s if timeout_s is not None else float(os.environ.get(JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S))
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=FORM_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - said in one line, with where
        raise JoinError(f"cannot reach the job's store at {address}: {exc}") from None
    local_rank, ranks = int(os.environ.get("LOCAL_RANK", "0")), ranks_per_node()
    number = _take_number(store, local_rank, ranks)
    log.info("node %d waiting to join the job at %s (%d rank(s))", number, address, ranks)
    answer = Connection(store, own=True).get(_answer_key(number), timeout_s)
    if answer is None:
        raise JoinError(f"the job at {address} did not take node {number} in within {timeout_s:.0f} s")
    record = json.loads(answer)
    if "refused" in record:
        raise JoinError(f"the job at {address} refused node {number}: {record['refused']}")
    me = record["first"] + local_rank
    if record.get("run_id"):
        os.environ["TORCHELASTIC_RUN_ID"] = record["run_id"]  # the job's store keys are under its run id
    os.environ["GROUP_RANK"] = str(me // ranks)
    return store, Generation(record["generation"], tuple(record["members"]), me), record


def _take_number(store: dist.Store, local_rank: int, ranks: int) -> int:
    """The node's join number: drawn by its local rank 0, which also says how many ranks it brings; its
    other ranks read it from their own launcher's store."""
    local = next(dist.rendezvous("env://"))[0] if ranks > 1 else None
    if local_rank == 0:
        number = store.add(COUNT, 1)
        store.set(_node_key(number), json.dumps({"ranks": ranks, "host": socket.gethostname()}))
        if local is not None:
            local.set("spotguard/join-number", str(number))
        return number
    assert local is not None
    return int(local.get("spotguard/join-number").decode())


# ---- the job's side ----------------------------------------------------------------------------------------
class Door:
    """Rank 0 of the job, while one generation trains: every JOIN_POLL_S, the nodes that asked to join since
    the last answered one, asked for through `admit(numbers)` (again after JOIN_RETRY_S while unanswered);
    a node that cannot be taken (`refusal(ranks)` says why, else None) is answered at once."""

    def __init__(
        self, store: dist.Store, admit: Callable[[list[int]], None], refusal: Callable[[int], str | None]
    ) -> None:
        self._conn = Connection.of(store)  # its own client: the training thread's must never wait behind it
        self._admit = admit
        self._refusal = refusal
        self._asked: tuple[list[int], float] | None = None
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

    def poll(self) -> None:
        store = self._conn.store
        count = store.add(COUNT, 0)
        if count <= self._settled:
            return
        self._settled = _settled(self._conn)
        waiting = []
        for number in range(self._settled + 1, count + 1):
            node = self._conn.get_now(_node_key(number))
            if node is None:  # its record follows its number: seen at the next poll
                break
            why = self._refusal(json.loads(node)["ranks"])
            if why is not None and not waiting:
                answer(store, {number: {"refused": why}})
                log.warning("node %d cannot join: %s", number, why)
                continue
            if why is not None:  # answered once the ones before it are (`settled` only moves over answered ones)
                break
            waiting.append(number)
        now = time.monotonic()
        if waiting and (self._asked is None or self._asked[0] != waiting or now - self._asked[1] > JOIN_RETRY_S):
            log.info("node(s) %s ask to join: asking every rank to stop at the next step", waiting)
            self._asked = (waiting, now)
            self._admit(waiting)


def _settled(conn: Connection) -> int:
    value = conn.get_now(SETTLED)
    return int(value.decode()) if value else 0


def answer(store: dist.Store, answers: dict[int, dict]) -> None:
    """Rank 0 of the job: answer joining nodes (by number, in order), then move `settled` past them."""
    for number, record in sorted(answers.items()):
        store.set(_answer_key(number), json.dumps(record))
    store.set(SETTLED, str(max(answers)))


def take_in(store: dist.Store, generation: Generation, nodes: tuple[int, ...], founders: int | None) -> Generation:
    """The generation after `generation` with the joining `nodes` (their numbers, in order) as its last members.
    Rank 0 (`founders`: generation 0's world size) numbers them and answers them; every other member reads
    the answer of the last node (within FORM_TIMEOUT_S), so that all form the same one."""
    per_node = ranks_per_node()
    if founders is not None:
        firsts = {n: founders + (n - 1) * per_node for n in nodes}
        joined = [m for n in nodes for m in range(firsts[n], firsts[n] + per_node)]
        following = Generation(generation.number + 1, (*generation.members, *joined), generation.me)
        record = {"generation": following.number, "members": list(following.members),
                  "world_before": generation.world_size, "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}  # fmt: skip
        answer(store, {n: {**record, "first": firsts[n]} for n in nodes})
        return following
    said = Connection(store, own=False).get(_answer_key(nodes[-1]), FORM_TIMEOUT_S)
    if said is None:
        raise RuntimeError(f"rank 0 did not answer joining node {nodes[-1]} within {FORM_TIMEOUT_S:.0f} s")
    return Generation(json.loads(said)["generation"], tuple(json.loads(said)["members"]), generation.me)


def refuse_waiting(store: dist.Store, why: str) -> None:
    """Rank 0, as the job ends: answer every node still waiting to join, so that none waits for nothing."""
    conn = Connection.of(store)
    waiting = range(_settled(conn) + 1, conn.store.add(COUNT, 0) + 1)
    if waiting:
        answer(conn.store, {n: {"refused": why} for n in waiting})
