"""The generations of an in-process job (spotguard.inprocess): who is in the next one, the fence that
keeps an older generation out of a newer one, a bounded wait for the members, and what the ends say."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

import spotguard
from spotguard.demo.processes import free_port
from spotguard.ending.exit_policy import ExitPolicy
from spotguard.inprocess import generation
from spotguard.inprocess.generation import Fenced, FormError, Generation


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)


def test_the_next_generation_keeps_the_staying_ranks_in_order_and_their_names():
    first = Generation(0, (0, 1, 2, 3), me=3)
    following = first.without((0, 1, 3))  # rank 2 left
    assert (following.number, following.members, following.rank, following.world_size) == (1, (0, 1, 3), 2, 3)
    assert following.prefix == "spotguard/generation/1/"
    after = following.without((1, 2))  # generation 1's rank 0 (named 0) left too
    assert (after.members, after.rank) == ((1, 3), 1)
    with pytest.raises(Fenced, match="does not stay"):
        Generation(0, (0, 1, 2), me=2).without((0, 1))


def test_the_generation_only_moves_forward_and_an_older_one_is_fenced_out(store):
    one = Generation(0, (0, 1, 2), me=0).without((0, 1))
    generation._fence(one, store)
    generation._fence(Generation(1, (0, 1), me=1), store)  # its other member: the same generation, fine
    generation._fence(one.without((0,)), store)  # generation 2
    with pytest.raises(Fenced, match="generation 2 already"):
        generation._fence(Generation(1, (0, 2), me=2), store)  # a straggler that would form generation 1 now
    with pytest.raises(FormError, match="generation 4 cannot follow"):
        generation._fence(Generation(4, (0,), me=0), store)
    assert store.get(generation.CURRENT_KEY) == b"2"


def test_the_members_meet_on_the_store_and_a_missing_one_ends_the_wait_in_bounded_time(store, monkeypatch):
    two = Generation(1, (0, 1), me=0)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # each member's own, as in its process
    other = threading.Thread(
        target=generation._meet, args=(Generation(1, (0, 1), me=1), dist.PrefixStore(two.prefix, client))
    )
    other.start()
    generation._meet(two, dist.PrefixStore(two.prefix, store))
    other.join(10)
    assert not other.is_alive()

    monkeypatch.setattr(generation, "FORM_TIMEOUT_S", 0.5)
    three = Generation(2, (0, 1, 2), me=0)
    started = time.monotonic()
    with pytest.raises(FormError, match="not every one of its 3 members came within"):
        generation._meet(three, dist.PrefixStore(three.prefix, store))
    assert time.monotonic() - started < 10


def test_the_ends_of_a_departure_that_goes_on_in_process():
    policy = ExitPolicy(143, 75, node="n", node_leader=True)
    assert policy.code(interrupted=True, saved=True, error=None, goes_on=True, leaving=False) is None  # trains on
    assert policy.code(interrupted=True, saved=True, error=None, goes_on=True, leaving=True) == 0  # nothing to restart
    assert policy.code(interrupted=True, saved=True, error=None) == 143  # without it: as always
    assert (
        ExitPolicy(None, 75, node="n", node_leader=True).code(
            interrupted=True, saved=True, error=None, goes_on=True, leaving=True
        )
        is None
    )  # exit_code=None: the caller decides, in-process too


def test_run_with_one_process_runs_the_function_once_under_a_guard(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []

    def train(ctx):
        seen.append((ctx.generation, ctx.rank, ctx.world_size, ctx.recovered, ctx.guard.started))
        state = {"x": 1}
        start = ctx.resume(state)
        return [ctx.step(step, state) for step in range(start, 3)]

    assert spotguard.run(train, str(tmp_path / "ckpt"), cloud="none") == [False, False, False]
    assert seen == [(0, 0, 1, None, True)]


def test_run_refuses_a_process_group_made_before_it(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="forms the job's process group itself"):
            spotguard.run(lambda ctx: None, str(tmp_path))
    finally:
        dist.destroy_process_group()
