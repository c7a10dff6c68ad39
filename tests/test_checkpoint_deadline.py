"""Deadline-aware uploads against a real S3 server behind a slow link: use the window, never
go past it, and keep the committed local copy when the upload cannot finish."""

import time
from datetime import timedelta

import torch

from cloud_adapters.notice import utc_now
from spotguard.checkpoint import Checkpointer, list_checkpoints
from tests.conftest import backend_for
from tests.servers import FaultProxy


def slow_s3(storage_servers, monkeypatch, tmp_path, slow_s):
    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    proxy = FaultProxy(backend.server.url)
    proxy.slow_s = slow_s
    backend.point_at(proxy.url)  # the Checkpointer's store reads the endpoint from the environment
    return backend, proxy


def state():
    return {"w": torch.arange(200_000, dtype=torch.float32), "b": torch.ones(1000)}


def test_an_upload_that_cannot_finish_is_abandoned_at_the_deadline(storage_servers, monkeypatch, tmp_path):
    backend, proxy = slow_s3(storage_servers, monkeypatch, tmp_path, slow_s=4.0)
    events = []
    try:
        with Checkpointer(
            backend.url, local_dir=str(tmp_path / "vm"), on_event=lambda e, **d: events.append((e, d))
        ) as ckpt:
            deadline = utc_now() + timedelta(seconds=9)
            started = time.monotonic()
            report = ckpt.save(3, state(), reason="emergency", deadline=deadline)
            took = time.monotonic() - started
    finally:
        proxy.close()
        backend.point_at(backend.server.url)
    assert took < 9, f"the save ran past the deadline: {took:.1f} s"
    assert not report.durable and "deadline" in report.error
    assert [e for e, _ in events] == ["committed", "upload-plan", "not-durable"]
    assert not [c for c in list_checkpoints(backend.url) if c.committed]  # no manifest for incomplete data
    local = list_checkpoints(str(tmp_path / "vm"))
    assert [(c.step, c.committed) for c in local] == [(3, True)]  # the local commit is what remains
    restored = {"w": torch.zeros(200_000), "b": torch.zeros(1000)}
    with Checkpointer(backend.url, local_dir=str(tmp_path / "vm")) as ckpt:
        assert ckpt.resume(restored) == 3
    assert torch.equal(restored["w"], state()["w"])


def test_the_plan_uses_the_throughput_measured_on_earlier_uploads(storage_servers, monkeypatch, tmp_path):
    backend, proxy = slow_s3(storage_servers, monkeypatch, tmp_path, slow_s=0.2)
    events = []
    try:
        with Checkpointer(
            backend.url, local_dir=str(tmp_path / "vm"), on_event=lambda e, **d: events.append((e, d))
        ) as ckpt:
            ckpt.save(1, state(), reason="periodic")
            assert ckpt.upload_bytes_per_s > 0
            report = ckpt.save(2, state(), reason="emergency", deadline=utc_now() + timedelta(seconds=60))
    finally:
        proxy.close()
        backend.point_at(backend.server.url)
    assert report.durable and 40 < report.margin_s < 60
    plan = next(d for e, d in events if e == "upload-plan")
    assert plan["step"] == 2 and plan["expected_s"] != "n/a"
    assert float(plan["expected_margin_s"]) > 0
    assert [c.step for c in list_checkpoints(backend.url) if c.committed] == [1, 2]
