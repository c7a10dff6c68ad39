"""Deadline-aware uploads against a real S3 server behind a slow link: use the window, never
go past it, and keep the committed local copy when the upload cannot finish."""

import threading
import time
from datetime import timedelta

import pytest
import torch

from cloud_adapters.notice import utc_now
from cloud_adapters.retry import DEFAULT_RETRY_DEADLINE_S
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
            assert ckpt.remote.retry_deadline_s == DEFAULT_RETRY_DEADLINE_S  # later saves retry as before
            closing = time.monotonic()
        closed_in = time.monotonic() - closing  # requests of the abandoned upload are still in the proxy
    finally:
        proxy.close()
        backend.point_at(backend.server.url)
    assert took < 9, f"the save ran past the deadline: {took:.1f} s"
    assert closed_in < 1.5, f"close() waited {closed_in:.1f} s for the abandoned upload"
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


@pytest.mark.parametrize("link_recovers", [True, False], ids=["link-recovers", "link-stays-slow"])
def test_an_emergency_save_takes_over_from_a_background_upload(storage_servers, monkeypatch, tmp_path, link_recovers):
    slow_s = 6.0  # per request: the background upload (5 files, 4 at a time), manifest and retention need 30 s
    backend, proxy = slow_s3(storage_servers, monkeypatch, tmp_path, slow_s=0.0)
    events = []
    uploading = threading.Event()
    slowed_at = []  # how many requests the proxy had seen when the link slowed down

    def on_event(event, **detail):
        events.append((event, detail))
        if (event, detail["step"]) == ("committed", 1):
            slowed_at.append(len(proxy.seen))
            proxy.slow_s = slow_s  # the link slows down just as the background upload starts
            uploading.set()

    try:
        ckpt = Checkpointer(backend.url, local_dir=str(tmp_path / "vm"), keep_last=1, on_event=on_event)
        ckpt.save(1, state(), reason="periodic", wait=False)
        assert uploading.wait(30)
        # A request of the background upload held at the slow link (streamed parts may have gone before).
        wait_for(lambda: any("step-0000000001" in path for _, path, _ in proxy.seen[slowed_at[0] :]))
        if link_recovers:
            proxy.slow_s = 0.1  # new requests go through; those of the background upload are still held
        deadline = utc_now() + timedelta(seconds=10)
        started = time.monotonic()
        report = ckpt.save(2, state(), reason="emergency", deadline=deadline)
        took = time.monotonic() - started
        closing = time.monotonic()
        ckpt.close()
        closed_in = time.monotonic() - closing
    finally:
        proxy.close()
        backend.point_at(backend.server.url)
    assert took < 8, f"the emergency save ran into the deadline's reserve: {took:.1f} s"
    assert closed_in < 1.5, f"close() waited {closed_in:.1f} s for abandoned uploads"
    background = [d for e, d in events if e == "not-durable" and d["step"] == 1]
    assert background and "deadline" in background[0]["why"]  # its upload was abandoned...
    local = [(c.step, c.committed) for c in list_checkpoints(str(tmp_path / "vm"))]
    assert local == [(1, True), (2, True)]  # ...its local copy kept, and no retention inside the window
    remote = [c.step for c in list_checkpoints(backend.url) if c.committed]
    if link_recovers:
        assert report.durable and report.margin_s > 3 and remote == [2]
    else:
        assert not report.durable and "deadline" in report.error and remote == []
    assert ckpt.remote.retry_deadline_s == DEFAULT_RETRY_DEADLINE_S


def test_an_emergency_save_leaves_retention_to_the_next_save(storage_servers, monkeypatch, tmp_path):
    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    with Checkpointer(backend.url, local_dir=str(tmp_path / "vm"), keep_last=1) as ckpt:
        ckpt.save(1, state(), reason="periodic")
        report = ckpt.save(2, state(), reason="emergency", deadline=utc_now() + timedelta(seconds=60))
        assert report.durable
        assert [c.step for c in list_checkpoints(backend.url)] == [1, 2]  # no listing or deletes in the window
    with Checkpointer(backend.url, local_dir=str(tmp_path / "vm"), keep_last=1) as ckpt:  # the next job
        ckpt.save(3, state(), reason="periodic")
    assert [c.step for c in list_checkpoints(backend.url)] == [3]
    assert [c.step for c in list_checkpoints(str(tmp_path / "vm"))] == [3]


def wait_for(condition, timeout_s: float = 10.0) -> None:
    limit = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < limit, "timed out waiting"
        time.sleep(0.05)


def test_a_stuck_background_upload_never_holds_the_emergency_back(storage_servers, monkeypatch, tmp_path):
    """save_every with a bucket whose link stalls: the training thread waits on the previous background
    save's upload; a SIGTERM must still get the emergency step committed locally within seconds."""
    import os
    import signal

    import spotguard

    backend, proxy = slow_s3(storage_servers, monkeypatch, tmp_path, slow_s=0.0)
    model = torch.nn.Linear(512, 512)
    stalled = threading.Event()

    def on_step(step):
        if step == 6 and not stalled.is_set():  # step 5's background upload is under way: the link stalls
            proxy.slow_s = 600.0
            stalled.set()
            threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()

    try:
        with spotguard.Guard(
            backend.url, cloud="none", local_dir=str(tmp_path / "vm"), save_every=5, grace_s=20, exit_code=None
        ) as guard:
            for step in range(10_000):
                on_step(step)
                time.sleep(0.01)
                if guard.step(step, {"model": model}):
                    break
    finally:
        proxy.slow_s = 0.0
        proxy.close()
        backend.point_at(backend.server.url)
    entries = {e.event: e for e in guard.timeline.entries}
    signalled, committed = entries["notice"].at, entries["committed"].at
    assert (committed - signalled).total_seconds() < 5, guard.timeline.format()
    assert guard.last_save.reason == "emergency" and not guard.last_save.durable
    assert not guard.emergency_saved  # its only copy is on the VM's disk: not reported saved
    assert [c.reason for c in list_checkpoints(str(tmp_path / "vm")) if c.committed][-1] == "emergency"


def test_background_saves_upload_again_once_the_emergency_they_made_way_for_is_saved(
    storage_servers, monkeypatch, tmp_path
):
    """Between an agreed emergency and its save, background saves commit locally only; after it, they upload."""
    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    with Checkpointer(backend.url, local_dir=str(tmp_path / "vm")) as ckpt:
        ckpt.abandon_background_uploads()
        ckpt.save(1, state(), reason="periodic", wait=False)
        assert not ckpt.wait(30).durable
        assert ckpt.save(2, state(), reason="emergency", deadline=utc_now() + timedelta(seconds=60)).durable
        ckpt.save(3, state(), reason="periodic", wait=False)
        assert ckpt.wait(30).durable
    assert [c.step for c in list_checkpoints(backend.url) if c.committed] == [2, 3]
