"""One job per checkpoint_dir: a run's id is in each manifest, a resumed job stays the same run,
and a second job writing into the same directory is detected, refused, and never has its steps
deleted or overwritten (a local path, and a real S3 server on 127.0.0.1)."""

from __future__ import annotations

import json

import pytest
import torch

from spotguard.checkpoint import Checkpointer, CheckpointError, list_checkpoints
from spotguard.checkpoint.format.layout import MANIFEST_NAME
from tests.conftest import backend_for


def state(value: float) -> dict:
    return {"w": torch.full((1000,), value)}


def run_of(root, step) -> str:
    return json.loads((root / f"step-{step:010d}" / MANIFEST_NAME).read_text())["run"]


def test_a_restarted_job_is_a_new_run_whose_saves_go_on_and_whose_retention_covers_the_old_steps(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=1) as first:
        first.save(1, state(1), reason="periodic")
    with Checkpointer(str(tmp_path), keep_last=1) as restarted:
        assert restarted.resume(state(0)) == 1
        assert restarted.run != run_of(tmp_path, 1)  # each start of the job is a run of its own
        restarted.save(2, state(2), reason="periodic")  # the old run's step is older than this run: no sign
        restarted.save(3, state(3), reason="periodic")
        assert run_of(tmp_path, 3) == restarted.run
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [3]  # keep_last deleted the older steps


def test_a_second_job_that_resumed_the_first_one_s_step_is_still_told_apart(tmp_path, caplog):
    """The commonest mistake: the same job launched twice; the second resumes the first's newest step."""
    with Checkpointer(str(tmp_path), keep_last=1) as a:
        a.save(1, state(1), reason="periodic")
        with Checkpointer(str(tmp_path), keep_last=1) as b:
            assert b.resume(state(0)) == 1
            a.save(2, state(2), reason="periodic")  # the first job goes on
            b.save(3, state(3), reason="periodic")  # B's look after its commit sees A's step 2
            with pytest.raises(CheckpointError, match=rf"step 2 committed by run {a.run}.*two jobs share"):
                b.save(4, state(4), reason="periodic")
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2, 3]  # B deleted none of A's


def test_two_jobs_in_one_directory_are_refused_and_keep_each_other_s_steps(tmp_path, caplog):
    a = Checkpointer(str(tmp_path), keep_last=1)
    b = Checkpointer(str(tmp_path), keep_last=1)  # a second job started with the same checkpoint_dir
    try:
        assert a.run != b.run
        a.save(10, state(10), reason="periodic")
        b.save(2, state(2), reason="periodic")  # B's look after its commit finds A's step: no retention
        assert "two jobs share this checkpoint_dir" in caplog.text
        with pytest.raises(CheckpointError, match=rf"step 10 committed by run {a.run}.*two jobs share"):
            b.save(3, state(3), reason="periodic")
        a.save(11, state(11), reason="periodic")  # A sees B's step 2 in turn: its own keep_last stops too
        with pytest.raises(CheckpointError, match="two jobs share"):
            a.save(12, state(12), reason="periodic")
    finally:
        a.close()
        b.close()
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2, 10, 11]  # nobody deleted the other's


def test_a_step_another_run_committed_is_never_overwritten_or_passed_off_as_this_run_s(tmp_path):
    with Checkpointer(str(tmp_path)) as a, Checkpointer(str(tmp_path)) as b:
        a.save(5, state(5), reason="periodic")
        with pytest.raises(CheckpointError, match=f"run {a.run}"):
            b.save(5, state(-5), reason="periodic")
    restored = state(0)
    Checkpointer(str(tmp_path)).resume(restored)
    assert torch.equal(restored["w"], state(5)["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000000005"]  # B's copy was discarded


def test_in_an_object_store_the_second_job_s_upload_of_a_taken_step_is_refused(storage_servers, monkeypatch, tmp_path):
    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    with (
        Checkpointer(backend.url, local_dir=str(tmp_path / "vm-a")) as a,
        Checkpointer(backend.url, local_dir=str(tmp_path / "vm-b")) as b,
    ):
        assert a.save(7, state(7), reason="periodic").durable
        report = b.save(7, state(-7), reason="periodic")  # committed on B's disk, not uploaded over A's
        assert not report.durable and "two jobs share" in report.error
        with pytest.raises(CheckpointError, match="two jobs share"):
            b.save(8, state(8), reason="periodic")
    restored = state(0)
    with Checkpointer(backend.url, local_dir=str(tmp_path / "fresh")) as c:
        assert c.resume(restored) == 7
    assert torch.equal(restored["w"], state(7)["w"])
