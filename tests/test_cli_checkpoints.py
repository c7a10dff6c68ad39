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
    as_json = json.loads(cli("ls", str(two_steps), "--json").stdout)
    assert [(r["step"], r["committed"]) for r in as_json] == [(10, True), (20, True), (30, False)]
    run = as_json[0]["run"]  # both steps were committed by one run, which ls names
    assert len(run) == 16 and as_json[1]["run"] == run and run in rows[10] and run in rows[20]


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


def test_verify_lists_steps_without_a_manifest_as_uncommitted_not_bad(two_steps):
    (two_steps / "step-0000000010" / "spotguard.json").unlink()  # retention killed right after the manifest
    out = cli("verify", str(two_steps))
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "step 10: uncommitted" in out.stdout and "step 30: uncommitted" in out.stdout
    assert "step 20: OK" in out.stdout and "BAD" not in out.stdout


def test_ls_of_an_empty_directory_says_so(tmp_path):
    out = cli("ls", str(tmp_path))
    assert out.returncode == 0 and out.stdout == f"no checkpoints in {tmp_path}\n"
    as_json = cli("ls", str(tmp_path), "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == []


@pytest.mark.parametrize("command", ["ls", "verify"])
@pytest.mark.parametrize("what,message", [("nothing-here", "no such directory"), ("a-file", "not a directory")])
def test_a_location_that_is_no_directory_is_an_error(tmp_path, command, what, message):
    (tmp_path / "a-file").write_text("x")
    out = cli(command, str(tmp_path / what))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == f"spotguard {command}: {tmp_path / what}: {message}\n"


@pytest.mark.parametrize("command", ["ls", "verify", "report"])
def test_an_empty_location_is_an_error_not_the_current_directory(two_steps, command):
    out = subprocess.run(
        [sys.executable, "-m", "spotguard.cli", command, ""], capture_output=True, text=True, timeout=60, cwd=two_steps
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == f"spotguard {command}: location: empty location: use a path, file://, s3://, gs:// or az://\n"


def test_verify_reports_a_nul_in_a_manifest_name_as_bad_and_goes_on(two_steps):
    manifest = two_steps / "step-0000000010" / "spotguard.json"
    body = json.loads(manifest.read_text())
    body["files"][0]["name"] = "a\x00b"
    manifest.write_text(json.dumps(body))
    out = cli("verify", str(two_steps))
    assert out.returncode == 1, out.stderr
    assert "step 10: BAD" in out.stdout and "unsafe file name" in out.stdout
    assert "step 20: OK" in out.stdout


def test_demo_runs_end_to_end_at_three_ranks_and_removes_its_directory(tmp_path, monkeypatch):
    # 3 ranks: the first where gradient summation order shows in the weights; 2 runs in CI's `spotguard demo`.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = cli("demo", "--world-size", "3", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "final weights identical to the uninterrupted run: YES" in out.stdout
    assert not list(tmp_path.glob("spotguard-demo-*"))
    for event in ("notice", "agreed", "save-start", "committed"):
        assert f" {event} " in out.stdout


def test_elastic_demo_refuses_options_that_do_not_apply():
    out = cli("demo", "--elastic", "--world-size", "3")
    assert out.returncode == 2 and out.stderr.strip() == (
        "spotguard demo: --elastic runs two nodes of one rank each with AWS notices: drop --world-size / --cloud"
    )


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
