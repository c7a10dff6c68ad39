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
