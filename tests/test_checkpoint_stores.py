"""Checkpoints in real object-store protocol servers on 127.0.0.1: upload, fresh-VM resume, verify, retention."""

from __future__ import annotations

import torch

from cloud_adapters.storage import open_store
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
