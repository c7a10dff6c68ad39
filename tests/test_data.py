"""spotguard.data: every index of an epoch consumed exactly once over interruptions and
world-size changes (random schedules), through plain DataLoaders (sampler= and batch_sampler=,
with worker processes), and the sampler's state through a real Guard save and resume."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import spotguard
from spotguard.data import ResumableBatchSampler, ResumableSampler


class Indices(Dataset):
    """Sample i is the tensor [i]: what a loader delivers says which indices were read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def ranks(state, size, batch, world, seed, kind=ResumableSampler):
    samplers = [kind(size, batch, seed=seed, rank=r, world_size=world) for r in range(world)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
    return samplers


@pytest.mark.parametrize("trial", range(200))
def test_random_world_size_schedules_and_interruptions_consume_each_index_once(trial):
    rng = random.Random(trial)
    size, batch, seed = rng.randint(1, 200), rng.randint(1, 6), rng.randint(0, 10**6)
    epochs = rng.randint(1, 3)
    seen = {e: [] for e in range(epochs)}
    state, ended_at = None, {}  # ended_at: the global batch when each epoch ran out
    while True:  # one segment per restart: a random world size, interrupted after a random number of steps
        world = rng.randint(1, 5)
        samplers = ranks(state, size, batch, world, seed)
        epoch = samplers[0].epoch
        if epoch >= epochs:
            break
        iterators = [iter(s.batches()) for s in samplers]
        # Prefetched but never trained on: a loader reads ahead; only advance() counts.
        for it in iterators[: rng.randint(0, world)]:
            next(it, None)
        iterators = [iter(s.batches()) for s in samplers]
        left = samplers[0].steps_left()
        steps = rng.randint(0, left + 1)  # left + 1: the loop runs through the epoch's end
        for _ in range(min(steps, left)):
            for it in iterators:
                got = next(it)
                assert len(got) == batch
                seen[epoch].extend(got)
            for s in samplers:
                s.advance()
        if steps > left:
            ended_at[epoch] = world * batch
            for s in samplers:  # the epoch ran out at this world size: the loop moves on
                assert next(iterators[s.rank], None) is None
                s.set_epoch(epoch + 1)
        state = samplers[0].state_dict()
        assert all(s.state_dict() == state for s in samplers)
    for epoch, got in seen.items():
        order = ResumableSampler(size, batch, seed=seed, world_size=1)
        order.set_epoch(epoch)
        assert got == order.order()[: len(got)], "an index repeated, skipped or out of order"
        assert not [i for i, n in Counter(got).items() if n > 1]
        if epoch in ended_at:
            assert size - len(got) < ended_at[epoch]  # only a tail shorter than a global batch is skipped


def test_shrink_and_grow_keep_the_global_order():
    """2 ranks -> 1 -> 3: the job's samples in step order are the epoch's order, whatever the split."""
    size, batch = 40, 2
    consumed = []
    state = None
    for world, steps in ((2, 3), (1, 5), (3, 100)):
        samplers = ranks(state, size, batch, world, seed=7)
        its = [iter(s.batches()) for s in samplers]
        for _ in range(min(steps, samplers[0].steps_left())):
            for it in its:
                consumed += next(it)
            for s in samplers:
                s.advance()
        state = samplers[0].state_dict()
    assert consumed == ResumableSampler(size, batch, seed=7, world_size=1).order()  # 12 + 10 + 18: the whole epoch
    assert ResumableSampler(size, batch, seed=7, world_size=1).order() != list(range(size))


@pytest.mark.parametrize("kind", ["sampler", "batch_sampler"])
def test_plain_dataloader_with_workers_resumes_at_another_world_size(kind):
    size, batch = 48, 3
    data = Indices(size)

    def loader(sampler):
        if kind == "sampler":
            return DataLoader(data, sampler=sampler, batch_size=batch, num_workers=2, prefetch_factor=4)
        return DataLoader(data, batch_sampler=sampler, num_workers=2, prefetch_factor=4)

    cls = ResumableSampler if kind == "sampler" else ResumableBatchSampler
    consumed, state = [], None
    for world, steps in ((2, 3), (4, 100)):
        samplers = ranks(state, size, batch, world, seed=1, kind=cls)
        loaders = [iter(loader(s)) for s in samplers]
        assert len(loaders[0]) == samplers[0].steps_left()
        for _ in range(min(steps, samplers[0].steps_left())):
            for it in loaders:
                consumed += next(it).flatten().tolist()
            for s in samplers:
                s.advance()
        state = samplers[0].state_dict()  # the workers have read ahead; the state has not moved with them
        del loaders
    # 3 steps of 6, then 2 of 12; the last 6 indices are fewer than a global batch of 12: skipped.
    assert consumed == ResumableSampler(size, batch, seed=1, world_size=1).order()[:42]


def test_state_goes_through_a_guard_checkpoint(tmp_path):
    sampler = ResumableSampler(Indices(30), 4, seed=3)
    sampler.set_epoch(2)
    sampler.advance(3)
    with spotguard.Guard(str(tmp_path), cloud="none") as guard:
        guard.save(5, {"data": sampler})
    fresh = ResumableSampler(Indices(30), 4, seed=3)
    with spotguard.Guard(str(tmp_path), cloud="none") as guard:
        assert guard.resume({"data": fresh}) == 6
    assert (fresh.epoch, fresh.position) == (2, 12)
    assert list(fresh)[:4] == sampler.order()[12:16]


def test_bad_input_is_refused_at_the_call():
    with pytest.raises(ValueError, match="batch_size must be positive"):
        ResumableSampler(10, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        ResumableSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        ResumableSampler(10, 2.5)
    sampler = ResumableSampler(10, 3, world_size=2)
    with pytest.raises(ValueError, match="cannot advance 2 steps: 1 left"):
        sampler.advance(2)
    with pytest.raises(ValueError, match="made for another order"):
        ResumableSampler(11, 3).load_state_dict(sampler.state_dict())
