"""One rank of the randomized agreement test: many trials against a shared TCPStore.

Each trial: ranks run a loop at random per-rank speeds (one rank lagging), a random
rank publishes an interruption at a random moment from a side thread (as the watcher
would), and every rank records the step at which its hot path fired. Prints one
JSON line per trial.
"""

import json
import random
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from cloud_adapters.notice import INTERRUPTION, Notice, deadline_after, utc_now
from spotguard.job.agreement import StepAgreement
from spotguard.job.broadcast import Broadcast
from spotguard.job.kvstore import Connection

MAX_STEPS = 400


def barrier(store, name, world):
    store.add(name, 1)
    while int(store.add(name, 0)) < world:
        time.sleep(0.002)


def main(rank, world, port, trials, seed, gone_trial):
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    # One of each for all trials (each trial's listener is stopped before the next), as a guard makes them
    # once: a new connection can take seconds (c10d looks up its peer's name).
    listen, publishing = Connection.of(store), Connection.of(store)
    for trial in range(trials):
        rng = random.Random(seed * 1000 + trial)  # same on every rank: who publishes, when
        publisher = rng.randrange(world)
        publish_after = rng.uniform(0, 0.05)
        laggard = rng.randrange(world)
        own = random.Random(seed * 7919 + trial * 31 + rank)  # this rank's own speed
        prefix = f"trial/{trial}/"
        gone = trial == gone_trial and rank == world - 1
        barrier(store, f"start/{trial}", world)
        if gone:  # this rank "died": it never listens, never answers
            print(json.dumps({"trial": trial, "rank": rank, "step": "gone"}), flush=True)
            continue
        agreement = StepAgreement(listen, prefix, rank, world)
        broadcast = Broadcast(
            store,
            prefix,
            lambda i, e, a=agreement: a.agree(i, e, timeout_s=1.0),
            rank=rank,
            connection=listen,
            publishing=publishing,
        )
        broadcast.start()
        if rank == publisher:
            now = utc_now()
            notice = Notice("aws", INTERRUPTION, "terminate", deadline_after(120, now), now, "test", f"n{trial}")
            threading.Timer(publish_after, broadcast.publish_interruption, args=(notice,)).start()
        decided = None
        time.sleep(0.03 if rank == laggard else 0)  # one rank starts behind the others
        for step in range(MAX_STEPS):
            time.sleep(own.uniform(0, 0.004))
            if agreement.reached(step):
                decided = step
                break
        broadcast.stop()
        print(json.dumps({"trial": trial, "rank": rank, "step": decided}), flush=True)
    barrier(store, "end", world)
    if rank == 0:  # the store lives in rank 0: leave only after everyone has left the barrier
        while int(store.add("bye", 0)) < world - 1:
            time.sleep(0.01)
    else:
        store.add("bye", 1)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
