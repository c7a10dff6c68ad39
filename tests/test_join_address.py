"""Where a node booting while an in-process job runs finds the job's store (spotguard.inprocess.join_address,
`spotguard join-address`), on real TCPStores: the registry (the rendezvous endpoint's store) and the job's."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from spotguard.cli import main
from spotguard.demo.processes import free_port
from spotguard.inprocess import join_address
from spotguard.inprocess.join_address import advertise, advertising, look_up


def serve() -> tuple[dist.TCPStore, str]:
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), f"127.0.0.1:{port}"


@pytest.fixture
def job(monkeypatch):
    """A registry, and the job's store at MASTER_ADDR:MASTER_PORT under run id "llm-run", as torchrun sets them."""
    registry, registry_address = serve()
    store, address = serve()
    host, port = address.split(":")
    for name, value in (("MASTER_ADDR", host), ("MASTER_PORT", port), ("TORCHELASTIC_RUN_ID", "llm-run"),
                        (join_address.REGISTRY_ENV, registry_address)):  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(join_address, "BEAT_S", 0.2)
    yield registry_address, store, address
    del registry  # its server lives as long as the test


def test_a_job_is_found_while_it_would_take_a_node_between_generations_too_and_not_once_it_ended(job):
    registry, store, address = job
    assert look_up(registry, "llm-run", timeout_s=1) is None  # nothing recorded yet: the node starts as usual
    with advertising(store, rank0=True) as advertised:
        assert look_up(registry, "llm-run", timeout_s=1) is None  # no door has said it would take one yet
        advertised.takes = lambda: True  # what a generation's door sets, and leaves through the pause after it
        assert look_up(registry, "llm-run") == address
        assert look_up(registry, "other-job", timeout_s=1) is None
    assert look_up(registry, "llm-run", timeout_s=1) is None
    assert not store.check([join_address.OPEN])


def test_a_job_that_would_refuse_a_node_or_whose_count_stopped_is_not_joined(job):
    """Its door would refuse a node like the job's own (no snapshots, no room), or its rank 0 died and left the
    record and the count behind in a store that torchrun's agent keeps."""
    registry, store, _ = job
    with advertising(store, rank0=True) as advertised:
        advertised.takes = lambda: False
        assert look_up(registry, "llm-run", timeout_s=1) is None
        advertised.takes = lambda: True
        assert look_up(registry, "llm-run") is not None
        advertised._stop.set()  # its thread stops counting: the process is gone
        advertised._thread.join()
        assert store.check([join_address.OPEN])
        assert look_up(registry, "llm-run", timeout_s=1.5) is None


def test_only_rank_0_records_the_job(job):
    registry, store, _ = job
    with advertising(store, rank0=False) as advertised:
        assert advertised is None
        assert look_up(registry, "llm-run", timeout_s=1) is None


def test_a_record_left_behind_by_a_job_whose_store_is_gone_is_not_followed(job):
    registry, store, _ = job
    assert advertise(store) is not None
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    host, port = registry.split(":")
    dist.TCPStore(host, int(port), is_master=False).set("spotguard/join-address/llm-run", dead)
    assert look_up(registry, "llm-run", timeout_s=2) is None


def test_an_unreachable_registry_leaves_the_job_training_and_says_so(job, monkeypatch, caplog):
    _, store, _ = job
    monkeypatch.setenv(join_address.REGISTRY_ENV, f"127.0.0.1:{free_port()}")
    monkeypatch.setattr(join_address, "CONNECT_S", 1.0)
    with caplog.at_level(logging.WARNING, "spotguard.inprocess"):
        assert advertise(store) is None
    assert "nodes booting later cannot find this job" in caplog.text


def test_no_registry_named_records_nothing(job, monkeypatch):
    _, store, _ = job
    monkeypatch.delenv(join_address.REGISTRY_ENV)
    assert advertise(store) is None
    assert not store.check([join_address.OPEN])


def test_the_command_prints_the_address_or_says_in_one_line_why_not(job, capsys):
    registry, store, address = job
    assert main(["join-address", registry, "--job", "llm-run", "--timeout", "1"]) == 1
    assert capsys.readouterr().err.strip().endswith(f"no in-process job 'llm-run' takes nodes at {registry}")
    with advertising(store, rank0=True) as advertised:
        advertised.takes = lambda: True
        assert main(["join-address", registry, "--job", "llm-run"]) == 0
        assert capsys.readouterr().out == f"{address}\n"
    assert main(["join-address", f"127.0.0.1:{free_port()}", "--job", "llm-run", "--timeout", "1"]) == 1
    assert "did not answer" in capsys.readouterr().err
    assert main(["join-address", "node-0", "--job", "llm-run"]) == 2
    assert capsys.readouterr().err.strip() == "spotguard join-address: the registry must be HOST:PORT, not 'node-0'"
