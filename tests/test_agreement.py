"""Invariant 1: all ranks decide to save at the same step, or none does; never a hang."""

import collections
import json
import subprocess
import sys

import pytest

from tests.servers import free_port


def run_ranks(world, trials, seed, gone_trial=-1):
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.agreement_worker",
                str(rank),
                str(world),
                str(port),
                str(trials),
                str(seed),
                str(gone_trial),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world
    by_trial = collections.defaultdict(dict)
    for out in outputs:
        for line in out.splitlines():
            row = json.loads(line)
            by_trial[row["trial"]][row["rank"]] = row["step"]
    assert sorted(by_trial) == list(range(trials))
    return by_trial


@pytest.mark.parametrize("world,trials,seed", [(2, 60, 1), (3, 50, 2)])
def test_every_rank_decides_the_same_step(world, trials, seed):
    by_trial = run_ranks(world, trials, seed)
    for trial, steps in by_trial.items():
        assert len(steps) == world
        assert None not in steps.values(), f"trial {trial}: a rank never fired: {steps}"
        assert len(set(steps.values())) == 1, f"trial {trial}: ranks disagree: {steps}"


def test_a_gone_rank_makes_the_others_give_up_together():
    by_trial = run_ranks(3, 3, seed=3, gone_trial=1)
    assert by_trial[1][2] == "gone"
    assert by_trial[1][0] is None and by_trial[1][1] is None  # nobody saves, nobody hangs
    for trial in (0, 2):  # the rounds around it are unaffected
        assert len(set(by_trial[trial].values())) == 1 and None not in by_trial[trial].values()


def test_a_long_run_keeps_only_the_last_round_s_decision_in_the_store():
    """A few keys per round would pile up over a week of interval saves: the rank that decides a round
    removes its steps and counter at once, and the earlier rounds' decisions (every rank has read them)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from spotguard.job.agreement import StepAgreement

    world, rounds = 3, 8
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    clients = [
        dist.TCPStore("127.0.0.1", server.port, world, False, timeout=timedelta(seconds=30)) for _ in range(world)
    ]
    decided = collections.defaultdict(list)

    def rank_loop(rank):
        agreement = StepAgreement(clients[rank], "job/", rank, world, last_step=10 * rank)
        for i in range(rounds):
            decision = agreement.agree(i, {"type": "checkpoint"}, timeout_s=20)
            decided[rank].append(decision.step)
            agreement.reached(decision.step)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(world)]
    before = server.num_keys()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert decided[0] == decided[1] == decided[2] and len(decided[0]) == rounds
    left = server.num_keys() - before
    assert left == 1, f"{left} keys left after {rounds} rounds"  # the last round's decision
