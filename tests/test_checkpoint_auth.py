"""Checkpoint authentication: with a key, only steps signed with it and matching every file's SHA-256 are used.

The tampering here is what someone who can write the checkpoint but has no key can do: flip
a byte, replace a file keeping its size and CRC32C, rewrite the manifest to vouch for a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import spotguard
from spotguard.checkpoint import Checkpointer, CheckpointError, verify_checkpoint
from spotguard.checkpoint.format.auth import KEY_ENV, resolve_key
from spotguard.checkpoint.format.layout import step_dir_name
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.checkpoint.resume.verified_load import VerifiedReader
from tests.ckpt_workers import assert_same, run_ranks
from tests.test_checkpoint import flip_byte, resume_fresh, save_steps, shard
from tests.test_checkpoint_security import Payload, impersonate, vouch_for

KEY, OTHER = b"the key of this job", "another job's key"


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


def manifest_json(step_dir) -> dict:
    return json.loads((step_dir / "spotguard.json").read_text())


def test_a_signed_save_records_every_files_sha256_and_resumes_with_the_key(tmp_path):
    ckpt = tmp_path / "ckpt"
    held = save_steps(ckpt, [1, 2], checkpoint_key=KEY)
    body = manifest_json(ckpt / step_dir_name(2))
    assert len(body["hmac"]) == 64 and body["format_version"] == 1
    for record in body["files"]:  # computed as the bytes were written: they are what is on disk
        assert record["sha256"] == hashlib.sha256((ckpt / step_dir_name(2) / record["name"]).read_bytes()).hexdigest()
    assert all(r.ok for r in verify_checkpoint(str(ckpt), key=KEY))

    step, state, loaded = resume_fresh(ckpt, checkpoint_key=KEY)
    assert step == 2 and state["step"] == 2
    assert_same(loaded, held[1])


def test_a_save_without_a_key_writes_no_sha256_or_hmac(tmp_path):
    save_steps(tmp_path, [1])
    body = manifest_json(tmp_path / step_dir_name(1))
    assert "hmac" not in body and all("sha256" not in record for record in body["files"])


def forge_shard(step_dir, marker) -> str:
    """Replace a shard with other bytes of the same size and CRC32C: the checksums alone cannot tell."""
    target = shard(step_dir)
    target.write_bytes(impersonate(b"not the weights", target.read_bytes()))
    return target.name


def forge_metadata(step_dir, marker) -> str:
    """Replace `.metadata` with a pickle payload of the same size and CRC32C."""
    metadata = step_dir / ".metadata"
    metadata.write_bytes(impersonate(pickle.dumps(Payload(marker)), metadata.read_bytes()))
    return ".metadata"


def flip_a_byte(step_dir, marker) -> str:
    flip_byte(shard(step_dir))
    return shard(step_dir).name


def rewrite_manifest_for_a_new_file(step_dir, marker) -> str:
    """Change a shard and rewrite the manifest to vouch for it, as someone who can write the manifest can."""
    name = flip_a_byte(step_dir, marker)
    vouch_for(step_dir, name)
    return "HMAC does not match"


@pytest.mark.parametrize("tamper", [flip_a_byte, forge_shard, forge_metadata, rewrite_manifest_for_a_new_file])
def test_a_step_changed_after_the_save_is_refused_with_the_key_and_resume_falls_back(tmp_path, caplog, tamper):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    held = save_steps(ckpt, [1, 2], checkpoint_key=KEY)
    named = tamper(ckpt / step_dir_name(2), marker)

    [result] = verify_checkpoint(str(ckpt), step=2, key=KEY)
    assert not result.ok and named in "; ".join(result.problems)
    step, _, loaded = resume_fresh(ckpt, checkpoint_key=KEY)
    assert step == 1 and not marker.exists()
    assert_same(loaded, held[0])
    assert "step-0000000002" in caplog.text and named in caplog.text


@pytest.mark.parametrize("tamper", [forge_shard, forge_metadata])
def test_a_forged_crc32c_is_caught_by_sha256_on_a_download_too(tmp_path, caplog, tamper):
    remote, marker = tmp_path / "remote", tmp_path / "ran"
    held = save_steps(remote, [1, 2], checkpoint_key=KEY, local_dir=str(tmp_path / "stage"))
    named = tamper(remote / step_dir_name(2), marker)
    assert verify_checkpoint(str(remote), step=2)[0].ok  # without the key, a forged CRC32C passes

    step, _, loaded = resume_fresh(remote, checkpoint_key=KEY, local_dir=str(tmp_path / "fresh-vm"))
    assert step == 1 and not marker.exists()
    assert_same(loaded, held[0])
    assert f"does not match its manifest: {named}: sha256 " in caplog.text  # refused before DCP read a byte


def test_the_reader_checks_metadata_against_sha256_before_unpickling_it(tmp_path):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    save_steps(ckpt, [1], checkpoint_key=KEY)
    step_dir = ckpt / step_dir_name(1)
    manifest = Manifest.from_bytes((step_dir / "spotguard.json").read_bytes())
    VerifiedReader(step_dir, manifest, KEY)
    forge_metadata(step_dir, marker)
    with pytest.raises(CheckpointError, match=r"\.metadata: sha256 [0-9a-f]{64} != "):
        VerifiedReader(step_dir, manifest, KEY)
    assert not marker.exists()


@pytest.mark.parametrize(
    "second_key,why", [(None, "unsigned: its manifest has no HMAC"), (OTHER, "signed with another key")]
)
def test_a_step_not_signed_with_the_key_is_refused_and_resume_falls_back(tmp_path, caplog, second_key, why):
    ckpt = tmp_path / "ckpt"
    held = save_steps(ckpt, [1], checkpoint_key=KEY)
    save_steps(ckpt, [2], checkpoint_key=second_key)

    [result] = verify_checkpoint(str(ckpt), step=2, key=KEY)
    assert not result.ok and why in result.problems[0]
    step, _, loaded = resume_fresh(ckpt, checkpoint_key=KEY)
    assert step == 1
    assert_same(loaded, held[0])
    assert "step-0000000002" in caplog.text and why in caplog.text


def test_without_a_key_a_signed_step_loads_as_any_other(tmp_path):
    held = save_steps(tmp_path, [3], checkpoint_key=KEY)
    assert verify_checkpoint(str(tmp_path))[0].ok
    step, _, loaded = resume_fresh(tmp_path)
    assert step == 3
    assert_same(loaded, held[0])


def test_the_key_comes_from_the_environment_unless_given(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, OTHER)
    save_steps(tmp_path / "env", [1])
    save_steps(tmp_path / "explicit", [1], checkpoint_key=KEY)
    assert verify_checkpoint(str(tmp_path / "env"), key=OTHER.encode())[0].ok
    assert verify_checkpoint(str(tmp_path / "explicit"), key=KEY)[0].ok
    assert resume_fresh(tmp_path / "explicit")[0] is None  # the environment's key did not sign it
    monkeypatch.setenv(KEY_ENV, "")  # set but empty: no key
    assert resolve_key() is None


def test_a_bad_key_is_refused_at_the_call(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_key must not be empty"):
        spotguard.Guard(tmp_path, cloud="none", checkpoint_key="")
    with pytest.raises(TypeError, match="checkpoint_key must be bytes or str, not int"):
        Checkpointer(str(tmp_path), checkpoint_key=42)


def test_two_ranks_sign_one_manifest_with_both_ranks_sha256_and_resume_with_the_key(tmp_path, monkeypatch):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv(KEY_ENV, KEY.decode())  # the ranks inherit the environment
    run_ranks("ddp_train_save", 2, ckpt=str(ckpt), local=None, out=str(out), save_at=[2], steps=3)
    step_dir = ckpt / step_dir_name(2)
    records = manifest_json(step_dir)["files"]
    assert {r["name"][:3] for r in records if r["name"].endswith(".distcp")} == {"__0", "__1"}
    for record in records:
        assert record["sha256"] == hashlib.sha256((step_dir / record["name"]).read_bytes()).hexdigest()
    assert verify_checkpoint(str(ckpt), key=KEY)[0].ok

    run_ranks("ddp_resume", 2, ckpt=str(ckpt), local=None, out=str(out))
    for rank in (0, 1):
        got = torch.load(out / f"resumed-rank{rank}.pt")
        assert got["step"] == 2 and got["saved_step"] == 2
        assert_same(got["state"], torch.load(out / "step-2.pt"))


# -- the command line ------------------------------------------------------------------------------


def cli(*args, key=None):
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    if key is not None:
        env[KEY_ENV] = key
    return subprocess.run(
        [sys.executable, "-m", "spotguard.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture
def signed_and_unsigned(tmp_path):
    save_steps(tmp_path, [10], checkpoint_key=KEY)
    save_steps(tmp_path, [20])
    return tmp_path


def test_verify_without_a_key_checks_checksums_only(signed_and_unsigned):
    out = cli("verify", str(signed_and_unsigned))
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "step 10: OK" in out.stdout and "step 20: OK" in out.stdout


def test_verify_with_the_key_reports_an_unsigned_step_as_bad(signed_and_unsigned):
    out = cli("verify", str(signed_and_unsigned), key=KEY.decode())
    assert out.returncode == 1
    assert "step 10: OK" in out.stdout
    assert "step 20: BAD\n  - unsigned: its manifest has no HMAC" in out.stdout
    other = cli("verify", str(signed_and_unsigned / step_dir_name(10)), key=OTHER)
    assert other.returncode == 1 and "step 10: BAD\n  - signed with another key" in other.stdout


def test_verify_with_the_key_reports_a_forged_crc32c_as_bad(signed_and_unsigned, tmp_path):
    name = forge_shard(signed_and_unsigned / step_dir_name(10), tmp_path / "unused")
    assert cli("verify", str(signed_and_unsigned)).returncode == 0
    out = cli("verify", str(signed_and_unsigned), key=KEY.decode())
    assert out.returncode == 1 and f"  - {name}: sha256 " in out.stdout


def test_ls_shows_which_steps_are_signed_and_with_the_key_which_are_not_usable(signed_and_unsigned):
    out = cli("ls", str(signed_and_unsigned))
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0].split()[4:6] == ["COMMITTED", "SIGNED"]
    rows = {int(line.split()[0]): line.split() for line in lines[1:]}
    assert rows[10][5:7] == ["yes", "yes"] and rows[20][5:7] == ["yes", "no"]
    as_json = json.loads(cli("ls", str(signed_and_unsigned), "--json").stdout)
    assert [(r["step"], r["committed"], r["signed"]) for r in as_json] == [(10, True, True), (20, True, False)]

    keyed = json.loads(cli("ls", str(signed_and_unsigned), "--json", key=KEY.decode()).stdout)
    assert [(r["step"], r["committed"], r["signed"]) for r in keyed] == [(10, True, True), (20, False, False)]
    assert keyed[1]["problem"].startswith("unsigned")
    assert "unsigned: its manifest has no HMAC" in cli("ls", str(signed_and_unsigned), key=KEY.decode()).stdout
