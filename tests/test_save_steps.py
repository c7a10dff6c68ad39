"""A save's coordination on real gloo ranks: no rank receives DCP's Metadata, one gather follows the
write, a failure on any rank is reported with its rank and commits nothing, and plain DCP reads the result."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp

from spotguard.checkpoint import Checkpointer, list_checkpoints
from tests.ckpt_workers import run_ranks

WORLD = 3
FAILING = 1


def test_a_save_gathers_once_after_the_write_broadcasts_no_metadata_and_reports_failures_by_rank(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run_ranks("save_traffic", WORLD, ckpt=str(ckpt), out=str(out), failing=FAILING)
    saves = {r: json.loads((out / f"saves-{r}.json").read_text()) for r in range(WORLD)}

    for rank, (ok, write_failed, plan_failed) in saves.items():
        assert ok["error"] is None
        # The plans, then the records with the placements: DCP's third gather (its WriteResults) is gone.
        assert [t for c, t in ok["traffic"] if c == "gather"] == ["SavePlan", "Written"]
        # What is broadcast is small: the stage's name and the commit, never the whole Metadata.
        assert [t for c, t in ok["traffic"] if c == "broadcast"] == ["tuple", "LocalCommit"], rank
        assert f"rank {FAILING}: OSError: disk gone" in write_failed["error"]
        assert "nothing committed" in write_failed["error"]
        # A failed global plan reaches every rank (as a failure scattered in place of the plans).
        assert "rank 0: ValueError: bad plan" in plan_failed["error"]
    assert [i.step for i in list_checkpoints(str(ckpt)) if i.committed] == [1]

    # Plain DCP reads the checkpoint, and so does spotguard's resume (at world size 1).
    expected = {"shared": torch.arange(6.0)} | {f"own_{r}": torch.full((4,), float(r)) for r in range(WORLD)}
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=str(ckpt / "step-0000000001"), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    resumed = {k: torch.zeros_like(v) for k, v in expected.items()}
    with Checkpointer(str(ckpt)) as ck:
        assert ck.resume(resumed) == 1
    assert all(torch.equal(resumed[k], v) for k, v in expected.items())
