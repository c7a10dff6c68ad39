"""A save's coordination on real gloo ranks: no rank receives DCP's Metadata, one gather follows the
write, a failure on any rank is reported with its rank and commits nothing, and plain DCP reads the result."""

from __future__ import annotations

import functools
import json
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from spotguard.checkpoint import Checkpointer, list_checkpoints
from spotguard.checkpoint.format.layout import DCP_METADATA_NAME
from spotguard.checkpoint.save.dcp_steps import Placements, write_metadata
from spotguard.checkpoint.save.plan_cache import CachedPlanner
from tests.ckpt_workers import run_ranks
from tests.test_save_scale import LARGE, LINEAR_BOUND, SMALL, lines, local_plan, write_results

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


def test_rank_0_rebuilds_the_metadata_from_placements_in_lines_linear_in_the_ranks(tmp_path):
    counted = {}
    for world in (SMALL, LARGE):
        planner = CachedPlanner()
        final, metadata = planner.create_global_plan([local_plan(r, world) for r in range(world)])
        planner.forget()
        # Each rank's placements, pickled and read back as rank 0 gets them from the gather.
        placements = [pickle.loads(pickle.dumps(Placements.of(p, write_results(p, r)))) for r, p in enumerate(final)]
        (tmp_path / str(world)).mkdir()
        writer = FileSystemWriter(tmp_path / str(world))
        writer.set_up_storage_writer(True)
        counted[world] = lines(functools.partial(write_metadata, writer, metadata, planner.global_plan, placements))
        stored = pickle.loads((tmp_path / str(world) / DCP_METADATA_NAME).read_bytes()).storage_data
        assert stored == {w.index: w.storage_data for r, p in enumerate(final) for w in write_results(p, r)}
    assert counted[LARGE] <= LINEAR_BOUND * counted[SMALL], counted
