"""`spotguard watch` end to end: a subprocess against each cloud's emulator."""

import json
import subprocess
import sys
import time

import pytest

from cloud_adapters.aws.emulator import AWSMetadataEmulator
from cloud_adapters.azure.emulator import AzureMetadataEmulator
from cloud_adapters.gcp.emulator import GCPMetadataEmulator

EMULATORS = {"aws": AWSMetadataEmulator, "gcp": GCPMetadataEmulator, "azure": AzureMetadataEmulator}
ADVISORY = {
    "aws": {"kind": "rebalance"},
    "gcp": {"kind": "maintenance", "event": "MIGRATE_ON_HOST_MAINTENANCE"},
    "azure": {"event_type": "Freeze", "not_before_in_s": 60},
}


def watch(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "spotguard.cli", "watch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until_polled(emu, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while emu.requests_seen < 2:
        assert time.monotonic() < deadline, "the watcher never polled the emulator"
        time.sleep(0.05)


@pytest.mark.parametrize("cloud", sorted(EMULATORS))
def test_watch_once_prints_advisories_and_exits_on_the_interruption(cloud):
    with EMULATORS[cloud]() as emu:
        proc = watch("--cloud", cloud, "--metadata-url", emu.url, "--json", "--once", "--interval", "0.3")
        try:
            wait_until_polled(emu)
            emu.raise_notice(**ADVISORY[cloud])
            first = json.loads(proc.stdout.readline())
            assert first["kind"] in ("rebalance", "maintenance")
            assert proc.poll() is None, "an advisory must not end --once"
            emu.raise_notice()
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 1
    notice = lines[0]
    assert notice["cloud"] == cloud and notice["kind"] == "interruption"
    assert notice["deadline"].endswith("Z") and notice["detected_at"].endswith("Z")
    assert notice["source"].startswith(cloud) and notice["action"]


def test_plain_output_is_one_readable_line():
    with AWSMetadataEmulator() as emu:
        emu.raise_notice(action="stop", in_s=90)
        proc = watch("--cloud", "aws", "--metadata-url", emu.url, "--once")
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.startswith("INTERRUPTION aws stop from aws:spot/instance-action: deadline ")


def test_exec_runs_a_command_per_notice(tmp_path):
    target = tmp_path / "notice.json"
    with AWSMetadataEmulator() as emu:
        emu.raise_notice()
        proc = watch(
            "--cloud",
            "aws",
            "--metadata-url",
            emu.url,
            "--once",
            "--exec",
            f'printf "%s" "$SPOTGUARD_NOTICE" > {target}',
        )
        proc.communicate(timeout=30)
    assert json.loads(target.read_text())["action"] == "terminate"


def test_exec_runs_once_for_one_interruption_whose_times_move(tmp_path):
    """An IMDS serving "now + 2 min" (and a rebalance noticeTime of "now") on every request: one
    interruption and one rebalance, each CMD run once, over many polls."""
    runs = tmp_path / "runs"
    with AWSMetadataEmulator(moving_times=True) as emu:
        emu.raise_notice(kind="rebalance")
        emu.raise_notice()
        command = f'echo "$SPOTGUARD_NOTICE" >> {runs}'
        proc = watch("--cloud", "aws", "--metadata-url", emu.url, "--interval", "0.1", "--exec", command)
        try:
            deadline = time.monotonic() + 30
            while emu.requests_seen < 40:  # 20 polls of the spot path or more, the Date's second moving on
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
            time.sleep(1.2)
        finally:
            proc.terminate()
            proc.communicate(timeout=30)
    notices = [json.loads(line) for line in runs.read_text().splitlines()]  # the SIGTERM: cloud "signal"
    assert sorted(n["kind"] for n in notices if n["cloud"] == "aws") == ["interruption", "rebalance"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cloud", "mars"], "invalid choice"),
        (["--interval", "0"], "argument --interval: must be a finite number of seconds > 0"),
        (["--interval", "nan"], "argument --interval: must be a finite number of seconds > 0"),
        (["--interval", "inf"], "argument --interval: must be a finite number of seconds > 0"),
        (["--grace", "nan"], "argument --grace: must be a finite number of seconds > 0"),
        # huge but finite: it overflowed the watcher's wait (threading.TIMEOUT_MAX) and the signal's deadline
        (["--interval", "1e10"], "argument --interval: must be at most 30 days (2592000 s)"),
        (["--grace", "1e12"], "argument --grace: must be at most 30 days (2592000 s)"),
        (["--interval", "soon"], "not a number"),
        (["--metadata-url", "ftp://x"], "must look like http://HOST[:PORT]"),
        (["--metadata-url", "http://127.0.0.1:99999"], "invalid port"),
        (["--signals", "SIGNOPE"], "unknown signal"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_get_a_one_line_error(args, message):
    proc = watch(*args)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert message in err and err.count("\n") == 1


def test_simulate_serves_an_emulator_that_watch_sees():
    sim = subprocess.Popen(
        [sys.executable, "-m", "spotguard.cli", "simulate", "--cloud", "aws", "--notice-after", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        first = sim.stdout.readline()
        assert first.startswith("aws metadata emulator on http://127.0.0.1:")
        url = first.split(" on ")[1].strip()
        proc = watch("--cloud", "aws", "--metadata-url", url, "--json", "--once", "--interval", "0.2")
        out, err = proc.communicate(timeout=30)
    finally:
        sim.terminate()
        sim.wait(timeout=10)
    assert proc.returncode == 0, err
    assert json.loads(out)["source"] == "aws:spot/instance-action"


def test_simulate_on_a_port_in_use_says_so_in_one_line_and_leaves_nothing_open():
    import os
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "spotguard.cli", "simulate", "--cloud", "gcp", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONDEVMODE="1"),  # an event loop or socket left open would warn
        )
    assert out.returncode == 2 and out.stdout == ""
    # Development mode also warns of a slow event-loop step, which a loaded machine's timing makes: not a leak.
    said = [line for line in out.stderr.splitlines() if " WARNING asyncio: Executing <" not in line]
    assert len(said) == 1 and said[0].startswith("spotguard simulate: ") and "address already in use" in said[0], said
