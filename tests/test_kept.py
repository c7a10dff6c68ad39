"""What a survivor keeps of its state across an in-process recovery (`spotguard/wiring/kept.py`): only a whole
state, loaded into the next generation's objects only when every rank kept the same step under its keys."""

from __future__ import annotations

import re
import time

import pytest
import torch

import spotguard
from spotguard.checkpoint import list_checkpoints
from spotguard.checkpoint.comm import Comm
from spotguard.wiring.kept import Kept, keep, load_kept, whole
from tests.ckpt_workers import run_ranks


def trained(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "step": seed}


class Shard(torch.Tensor):
    """A tensor that stands for a piece of a larger one (as a DTensor's or a ShardedTensor's type does)."""


def test_a_state_with_a_shard_or_off_the_host_is_not_whole_and_nothing_is_kept_of_it():
    assert whole({"a": torch.zeros(2), "b": [torch.nn.Parameter(torch.ones(1)), 3, {"c": b"x"}]})
    assert not whole({"a": {"b": [torch.zeros(2).as_subclass(Shard)]}})
    assert not whole({"a": torch.zeros(2, device="meta")})  # not in host memory (as on an accelerator)
    state = trained(1)
    assert keep(5, state).step == 5
    state["extra"] = torch.zeros(3).as_subclass(Shard)
    assert keep(5, state) == Kept()


def test_the_kept_step_loads_into_new_objects_bit_identical():
    old = trained(1)
    kept = keep(7, old)
    new = trained(2)  # other weights, other optimizer moments, another step count
    assert load_kept(kept, new, Comm()) == 7
    for name in ("weight", "bias"):
        assert torch.equal(getattr(new["model"], name), getattr(old["model"], name))
    moments = [s["exp_avg"] for s in new["optim"].state.values()], [s["exp_avg"] for s in old["optim"].state.values()]
    assert all(torch.equal(a, b) for a, b in zip(*moments)) and new["step"] == 1


def test_a_state_with_other_keys_or_nothing_kept_is_left_untouched():
    new = trained(2)
    before = new["model"].weight.clone(), [s["exp_avg"].clone() for s in new["optim"].state.values()]
    assert load_kept(Kept(), new, Comm()) is None
    other = keep(7, {**trained(1), "rng.1": torch.zeros(1)})  # another rank's per-rank entry
    assert load_kept(other, new, Comm()) is None
    wider = torch.nn.Linear(4, 5)  # an optimizer over parameters of other shapes
    assert load_kept(keep(7, {"model": wider, "optim": torch.optim.AdamW(wider.parameters()), "step": 1}), new,
                     Comm()) is None  # fmt: skip
    assert torch.equal(new["model"].weight, before[0]) and new["step"] == 2
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(new["optim"].state.values(), before[1]))


@pytest.mark.parametrize("steps", [(7, 7), (7, None), (7, 6)])
def test_every_rank_loads_from_memory_or_none_does(steps):
    """Two ranks of a real gloo group: both load only when both kept the same step; else both are left as
    they were (and resume from the snapshots or the durable checkpoint together)."""
    outputs = run_ranks("kept_load", 2, steps=list(steps))
    results = [re.search(r"RESULT (.*)", out)[1] for out in outputs]
    assert results == (["loaded=7 same=True"] * 2 if steps == (7, 7) else ["loaded=None same=False"] * 2)


def test_a_module_of_other_shapes_is_not_loaded_and_nothing_is_touched():
    """Checked before any load: DCP's would fail on the first tensor of another shape, the others loaded (a survivor
    that fails its own load as nodes join would fail the snapshot they read)."""
    new = {"model": torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))}
    before = [t.clone() for t in new["model"].parameters()]
    wider = {"model": torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5))}
    assert load_kept(keep(7, wider), new, Comm()) is None
    assert all(torch.equal(a, b) for a, b in zip(new["model"].parameters(), before))


def test_an_optimizer_whose_groups_differ_is_not_loaded_and_nothing_is_touched():
    """The same parameter shapes split into other groups: torch's load would refuse it after the model loaded."""
    old = trained(1)
    model = old["model"]
    split = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    kept = keep(7, {"model": model, "optim": split, "step": 1})
    new = trained(2)
    before = new["model"].weight.clone()
    assert load_kept(kept, new, Comm()) is None
    assert torch.equal(new["model"].weight, before) and new["step"] == 2


class Sharded(torch.nn.Parameter):
    """A parameter that stands for a shard (as FSDP's flat parameter does)."""


def test_a_module_of_shards_or_a_renumbered_rank_keeps_nothing_without_asking_for_a_state_dict():
    model = torch.nn.Linear(2, 2)
    model.weight = Sharded(torch.zeros(2, 2))

    def collective(*args, **kwargs):
        raise AssertionError("a sharded module's state dict may be a collective: not asked for")

    model.state_dict = collective
    assert keep(3, {"model": model}) == Kept()
    assert keep(3, trained(1), goes_on=(0, 2)) == Kept()  # old rank 2 would become rank 1
    assert keep(3, trained(1), goes_on=(0, 1)).step == 3


@pytest.mark.parametrize("durable", [True, False])
def test_a_step_loaded_from_memory_that_is_not_durable_is_saved_durably_at_once(durable, tmp_path):
    """A guard's resume loads the kept step from memory (no snapshot, no checkpoint read); when the step is not
    in the checkpoint dir too, rank 0 asks for a durable save, as after a resume from the nodes' snapshots."""
    old, new = trained(1), trained(2)
    options = {"snapshot_every": 1000, "snapshot_dir": str(tmp_path / "memory"), "exit_code": None}
    with spotguard.Guard(str(tmp_path / "ckpt"), cloud="none", **options) as guard:
        start = guard.resume(new, kept=keep(8, old, durable=durable))
        assert (start, guard.resumed_from) == (9, "memory")
        assert torch.equal(new["model"].weight, old["model"].weight)
        for step in range(start, start + 40):  # the request is agreed at the first step after the listener has it
            guard.step(step, new)
            time.sleep(0.05)
    saved = [(c.step, c.reason) for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed]
    assert (saved[0][1] == "snapshot-resume" and saved[0][0] >= start) if not durable else saved == []


def test_a_state_that_cannot_be_read_keeps_nothing_and_says_so(caplog):
    class Broken:
        def state_dict(self):
            raise RuntimeError("unreadable")

        def load_state_dict(self, state):
            pass

    assert keep(3, {**trained(1), "broken": Broken()}) == Kept()  # never into the training loop
    assert "the state of step 3 cannot be kept in this process" in caplog.text
