"""Checkpoints in real object-store protocol servers on 127.0.0.1: upload, fresh-VM resume, verify, retention."""

from __future__ import annotations

import torch

from cloud_adapters.stores import open_store
from spotguard.checkpoint import Checkpointer, list_checkpoints, verify_checkpoint
from tests.ckpt_workers import assert_same, make_model, snapshot, train


def test_object_store_round_trip(cloud_backend, tmp_path):
    url = cloud_backend.url
    model = make_model(seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    held = {}
    with Checkpointer(url, local_dir=str(tmp_path / "local"), keep_last=2) as ck:
        for step in (1, 2, 3):
            train(model, optim, range(step, step + 1))
            report = ck.save(step, {"model": model, "optim": optim}, reason="periodic")
            assert report.durable and report.location == f"{url}/step-{step:010d}", report
            held[step] = snapshot(model, optim)

    # Retention kept the two newest committed steps, in the bucket and on local disk.
    assert [(i.step, i.committed) for i in list_checkpoints(url)] == [(2, True), (3, True)]
    assert [i.step for i in list_checkpoints(str(tmp_path / "local"))] == [2, 3]
    assert [(r.step, r.ok) for r in verify_checkpoint(url)] == [(2, True), (3, True)]

    # A fresh VM downloads the newest step, checks it and loads it.
    model2 = make_model(seed=5)
    optim2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    with Checkpointer(url, local_dir=str(tmp_path / "fresh")) as ck:
        assert ck.resume({"model": model2, "optim": optim2}) == 3
    assert_same(snapshot(model2, optim2), held[3])

    # A damaged object fails verification, and a VM without a local copy falls back to the step before.
    store = open_store(url)
    victim = next(i.key for i in store.list("step-0000000003/") if i.key.endswith(".distcp"))
    data = bytearray(store.get_bytes(victim))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(victim, bytes(data))
    assert [(r.step, r.ok) for r in verify_checkpoint(url)] == [(2, True), (3, False)]
    with Checkpointer(url, local_dir=str(tmp_path / "fresh2")) as ck:
        assert ck.resume({"model": model2, "optim": optim2}) == 2
    assert_same(snapshot(model2, optim2), held[2])


def test_abandoned_uploads_are_removed_after_the_next_commit(storage_servers, monkeypatch, tmp_path):
    import boto3

    from tests.conftest import backend_for

    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    store = backend.store()
    # What a VM killed mid-upload leaves: some finished objects and an unfinished multipart upload.
    (tmp_path / "part").write_bytes(b"x" * 1000)
    store.put_file(tmp_path / "part", "step-0000000005/__0_0.distcp")
    client = boto3.client("s3")
    client.create_multipart_upload(Bucket=backend.bucket, Key="run-7/step-0000000005/__1_0.distcp")
    with Checkpointer(backend.url, local_dir=str(tmp_path / "vm")) as ckpt:
        ckpt.save(9, {"w": torch.ones(10)}, reason="periodic")
    assert [c.step for c in list_checkpoints(backend.url)] == [9]
    assert not client.list_multipart_uploads(Bucket=backend.bucket).get("Uploads")
