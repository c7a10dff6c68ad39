"""Ranks of the `.metadata.index` tests: an FSDP2 model and its Adam saved at one world size, resumed at
another, each rank comparing the whole state with what was saved (`python tests/index_workers.py scenario args`)."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

from tests.ckpt_workers import _wrapped, train

ROOT = Path(__file__).resolve().parent.parent


def _full(model, optim) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state, gathered on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from tests.ckpt_workers import flatten

    whole = StateDictOptions(full_state_dict=True)
    return flatten({"model": get_model_state_dict(model, options=whole),
                    "optim": get_optimizer_state_dict(model, optim, options=whole)})  # fmt: skip


def save(group, rank: int, ckpt: str, out: str) -> None:
    from spotguard.checkpoint import Checkpointer

    model, optim = _wrapped("fsdp", seed=0)
    train(model, optim, range(2), rank)
    with Checkpointer(ckpt, group=group) as ck:
        ck.save(2, {"model": model, "optim": optim}, reason="periodic")
    full = _full(model, optim)
    if rank == 0:
        torch.save(full, Path(out) / "saved.pt")


def resume(group, rank: int, ckpt: str, out: str) -> None:
    """Resume into a fresh model; record whether the index was read and how many chunks this rank kept."""
    from spotguard.checkpoint import Checkpointer
    from spotguard.checkpoint.resume import verified_load

    seen = []
    real = verified_load.read_index

    def counted(data, wanted, listed):
        metadata = real(data, wanted, listed)
        seen.append(sum(len(getattr(md, "chunks", ())) for md in metadata.state_dict_metadata.values()))
        return metadata

    verified_load.read_index = counted
    model, optim = _wrapped("fsdp", seed=123)
    with Checkpointer(ckpt, group=group) as ck:
        assert ck.resume({"model": model, "optim": optim}) == 2
    saved = torch.load(Path(out) / "saved.pt", weights_only=True)
    full = _full(model, optim)
    equal = sorted(saved) == sorted(full) and all(_same(saved[k], full[k]) for k in saved)
    world = torch.distributed.get_world_size()
    (Path(out) / f"resumed-{world}-{rank}.json").write_text(json.dumps({"equal": equal, "kept": seen}))


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


SCENARIOS = {f.__name__: f for f in (save, resume)}

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    try:
        SCENARIOS[scenario](group, dist.get_rank(), **args)
    finally:
        dist.destroy_process_group()
