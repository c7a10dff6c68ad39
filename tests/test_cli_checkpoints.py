"""`spotguard ls` and `spotguard verify` on real checkpoints, and `spotguard demo` end to end."""

import json
import subprocess
import sys

import pytest
import torch

from spotguard.checkpoint import Checkpointer


def cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "spotguard.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def two_steps(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(10, state, reason="periodic")
        ckpt.save(20, state, reason="emergency")
    (tmp_path / "step-0000000030").mkdir()  # a save that never committed
    (tmp_path / "step-0000000030" / "__0_0.distcp").write_bytes(b"partial")
    return tmp_path


def test_ls_lists_steps_and_marks_the_uncommitted_one(two_steps):
    out = cli("ls", str(two_steps))
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["STEP", "REASON", "SIZE"]
    rows = {int(line.split()[0]): line for line in lines[1:]}
    assert "periodic" in rows[10] and "yes" in rows[10]
    assert "emergency" in rows[20] and "yes" in rows[20]
    assert "NO" in rows[30]
    as_json = [json.loads(line) for line in cli("ls", str(two_steps), "--json").stdout.splitlines()]
    assert [(r["step"], r["committed"]) for r in as_json] == [(10, True), (20, True), (30, False)]


def test_verify_reports_a_flipped_byte_and_exits_1(two_steps):
    assert cli("verify", str(two_steps / "step-0000000020")).returncode == 0
    shard = next((two_steps / "step-0000000020").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = cli("verify", str(two_steps))
    assert out.returncode == 1
    assert "step 10: OK" in out.stdout
    assert "step 20: BAD" in out.stdout and shard.name in out.stdout


def test_ls_of_a_missing_place_is_a_clear_message(tmp_path):
    out = cli("ls", str(tmp_path / "nothing-here"))
    assert out.returncode == 0 and "no checkpoints" in out.stdout


def test_demo_runs_end_to_end(tmp_path):
    out = cli("demo", "--dir", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "final weights identical to the uninterrupted run: YES" in out.stdout
    for event in ("notice", "agreed", "save-start", "committed"):
        assert f" {event} " in out.stdout


def test_ls_and_verify_a_bucket_show_progress(storage_servers, monkeypatch, tmp_path):
    from tests.conftest import backend_for

    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    with Checkpointer(backend.url, local_dir=str(tmp_path / "stage")) as ckpt:
        ckpt.save(7, {"w": torch.arange(250_000, dtype=torch.float32)}, reason="manual")
    listed = cli("ls", backend.url)
    assert listed.returncode == 0 and "manual" in listed.stdout and "yes" in listed.stdout
    checked = cli("verify", f"{backend.url}/step-0000000007")
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert "step 7: OK" in checked.stdout
    assert "verifying step-0000000007: 1.0 / 1.0 MB (100%)" in checked.stderr
