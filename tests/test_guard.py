"""The Guard in one process: signals and metadata notices end the loop with a committed
checkpoint, background saves, and failures that never reach the training loop."""

import email.utils
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import torch

import spotguard
from cloud_adapters.aws.emulator import AWSMetadataEmulator
from cloud_adapters.gcp.emulator import GCPMetadataEmulator
from cloud_adapters.storage import LocalStore
from cloud_adapters.validation import MAX_SECONDS
from spotguard.checkpoint import list_checkpoints
from spotguard.goodput.ledger import read_ledger
from tests.ckpt_workers import finish, launch_code
from tests.servers import FaultProxy


def make_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def train(guard, state, steps=400, on_step=None, step_time=0.01, step_s: list[float] | None = None):
    """Run a loop like a user's; returns the step at which guard.step() said stop, or None. With
    `step_s`, the time of each guard.step() call that did not stop the loop is appended to it."""
    start = guard.resume(state)
    for step in range(start, steps):
        loss = state["model"](torch.ones(2, 8)).pow(2).sum()
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        if on_step:
            on_step(step)
        time.sleep(step_time)
        began = time.monotonic()
        if guard.step(step, state):
            return step
        if step_s is not None:
            step_s.append(time.monotonic() - began)
    return None


def committed(path):
    return [(c.step, c.reason) for c in list_checkpoints(str(path)) if c.committed]


def test_sigterm_ends_the_loop_with_a_committed_checkpoint(tmp_path):
    state = make_state()
    with spotguard.Guard(tmp_path, cloud="none", exit_code=None) as guard:
        stopped = train(guard, state, on_step=lambda s: s == 5 and os.kill(os.getpid(), signal.SIGTERM))
        assert guard.notice is not None and guard.notice.action == "SIGTERM"
    assert stopped is not None and 5 <= stopped < 60
    assert guard.emergency_saved
    assert committed(tmp_path) == [(stopped, "emergency")]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored on exit

    fresh = make_state()
    with spotguard.Guard(tmp_path, cloud="none") as guard:
        assert guard.resume(fresh) == stopped + 1
    assert torch.equal(fresh["model"].weight, state["model"].weight)
    assert torch.equal(
        fresh["optim"].state_dict()["state"][0]["momentum_buffer"],
        state["optim"].state_dict()["state"][0]["momentum_buffer"],
    )


def test_sigterm_with_the_longest_grace_still_ends_the_loop_with_a_committed_checkpoint(tmp_path):
    """grace_s=1e12 was accepted and its SIGTERM lost: the notice's deadline (now + grace) overflowed
    datetime inside the watcher's poll, after the signal was read. The bound leaves room for it."""
    state = make_state()
    with spotguard.Guard(tmp_path, cloud="none", exit_code=None, grace_s=MAX_SECONDS) as guard:
        stopped = train(guard, state, on_step=lambda s: s == 5 and os.kill(os.getpid(), signal.SIGTERM))
        assert guard.notice is not None and guard.notice.seconds_left() > MAX_SECONDS - 60
    assert stopped is not None and guard.emergency_saved
    assert committed(tmp_path) == [(stopped, "emergency")]


def test_a_gcp_preemption_is_saved_well_before_its_deadline(tmp_path):
    with GCPMetadataEmulator() as emu:
        state = make_state()
        with spotguard.Guard(tmp_path, cloud="gcp", metadata_url=emu.url, exit_code=None) as guard:
            stopped = train(guard, state, on_step=lambda s: s == 10 and emu.raise_notice())
    assert stopped is not None
    assert guard.last_save.margin_s > 25  # GCP gives 30 s
    events = [e.event for e in guard.timeline.entries]
    assert events[events.index("notice") :] == ["notice", "agreed", "save-start", "committed", "durable"]


@pytest.mark.parametrize("saved", [True, False])
def test_exit_code_after_an_emergency_says_whether_it_was_saved(tmp_path, saved):
    ckpt = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, pathlib, shutil, signal, time, torch, spotguard
        model = torch.nn.Linear(2, 2)
        with spotguard.Guard({str(ckpt)!r}, cloud="none") as guard:
            for step in range(1000):
                time.sleep(0.01)
                if step == 3:
                    if not {saved}:  # the disk goes away under the job: the emergency save fails
                        shutil.rmtree({str(ckpt)!r})  # the goodput ledger is in it
                        pathlib.Path({str(ckpt)!r}).write_text("")
                    os.kill(os.getpid(), signal.SIGTERM)
                if guard.step(step, {{"model": model}}):
                    break
        print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == (143 if saved else 75), proc.stderr[-2000:]
    assert "not reached" not in proc.stdout
    assert [r for _, r in committed(ckpt)] == (["emergency"] if saved else [])


def test_a_staged_emergency_save_whose_upload_failed_is_not_reported_saved(tmp_path):
    """With local_dir, the local commit is the only copy when the upload fails, and it goes away
    with the VM: exit 75 ("nothing new committed") and `committed: false` in the exit file."""
    remote, local, exit_file = tmp_path / "remote", tmp_path / "local", tmp_path / "exit.json"
    remote.mkdir()
    for step in range(3, 8):  # every upload of the emergency's step fails
        (remote / f"step-{step:010d}").write_text("not a directory")
    script = textwrap.dedent(f"""
        import os, signal, time, torch, spotguard
        model = torch.nn.Linear(2, 2)
        with spotguard.Guard({str(remote)!r}, cloud="none", local_dir={str(local)!r}) as guard:
            for step in range(1000):
                time.sleep(0.01)
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                if guard.step(step, {{"model": model}}):
                    break
        print("not reached")
    """)
    env = dict(os.environ, SPOTGUARD_EXIT_FILE=str(exit_file))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 75, proc.stderr[-2000:]
    record = json.loads(exit_file.read_text())
    assert (record["exit_code"], record["committed"], record["step"]) == (75, False, None)
    assert "committed only in" in proc.stderr and "goes away with this VM" in proc.stderr
    assert "exiting with code 75 now (only this VM's disk has it" in proc.stderr  # said before leaving at once
    assert list(local.glob("step-*/spotguard.json"))  # kept, for a restart on the same VM


# The longest guard.step() allowed while the metadata service hangs. The documented figure is under
# 50 ms (docs/benchmarks.md, bench/fault_matrix.py, on an idle machine); on two cores shared with other
# test runs a thread can wait a few hundred ms for the CPU, while a step that waited on the hung poll
# would take its whole 2 s timeout (cloud_adapters/aws/metadata.py DEFAULT_TIMEOUT_S).
NEVER_STALLED_S = 1.0  # half the timeout: a stall on the poll cannot pass


def test_metadata_down_never_touches_the_training_loop(tmp_path, caplog):
    """The metadata service is blackholed (its connection accepted, the request never read nor
    answered): each poll hangs for the client's whole timeout, on the watcher's thread only. Once the
    service is back, the next notice is seen and its emergency checkpoint committed."""
    with AWSMetadataEmulator() as emu:
        proxy = FaultProxy(emu.url)
        proxy.blackhole = True
        raised = []

        def lift_then_notice(step: int) -> None:
            if proxy.blackhole and "got no answer within" in caplog.text:  # a poll waited out its timeout
                proxy.blackhole = False
            elif not proxy.blackhole and "recovered after" in caplog.text and not raised:
                emu.raise_notice()
                raised.append(step)

        step_s: list[float] = []
        try:
            with spotguard.Guard(
                tmp_path, cloud="aws", metadata_url=proxy.url, poll_interval_s=0.05, exit_code=None
            ) as guard:
                stopped = train(guard, make_state(), steps=3000, on_step=lift_then_notice, step_s=step_s)
        finally:
            proxy.close()
    assert raised and stopped is not None, caplog.text[-2000:]
    assert max(step_s) < NEVER_STALLED_S, f"guard.step() took {max(step_s):.3f} s while the metadata service hung"
    assert committed(tmp_path) == [(stopped, "emergency")] and guard.emergency_saved


def test_a_failed_emergency_save_is_logged_and_still_stops_the_loop(tmp_path, caplog):
    ckpt = tmp_path / "ckpt"

    def lose_the_disk_then_sigterm(step):
        if step == 2:
            shutil.rmtree(ckpt)  # the goodput ledger is in it
            ckpt.write_text("a file where the checkpoints should go")
            os.kill(os.getpid(), signal.SIGTERM)

    with spotguard.Guard(ckpt, cloud="none", exit_code=None) as guard:
        stopped = train(guard, make_state(), on_step=lose_the_disk_then_sigterm)
    assert stopped is not None
    assert guard.last_save is None
    assert guard.interrupted and not guard.emergency_saved  # a loss is never reported as saved
    assert any("emergency checkpoint" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
    assert any("was NOT committed" in r.getMessage() for r in caplog.records)


def test_background_saves_every_n_steps_with_retention(tmp_path):
    with spotguard.Guard(tmp_path, cloud="none", save_every=10, keep_last=2) as guard:
        assert train(guard, make_state(), steps=45, step_time=0) is None
    assert committed(tmp_path) == [(30, "periodic"), (40, "periodic")]
    assert (guard.last_save.step, guard.last_save.reason) == (40, "periodic")  # background saves report too
    manifest, shard = (
        tmp_path / "step-0000000040" / "spotguard.json",
        next((tmp_path / "step-0000000040").glob("*.distcp")),
    )
    assert manifest.stat().st_mode == shard.stat().st_mode  # one mode for every file: readable by the same users


def test_a_step_reported_again_is_not_saved_again(tmp_path, caplog):
    """Lightning's global_step, reported at every micro-batch of a gradient accumulation of 2."""
    state = make_state()
    with spotguard.Guard(tmp_path, cloud="none", save_every=2) as guard:
        for step in (1, 1, 2, 2, 3, 3, 4, 4):
            guard.step(step, state)
    assert committed(tmp_path) == [(2, "periodic"), (4, "periodic")]
    # Before: each step saved twice, the second copy discarded ("already committed") and counted in the ledger.
    assert [r.step for r in read_ledger(LocalStore(tmp_path)).records if r.EVENT == "save"] == [2, 4]
    assert not any("already committed" in r.getMessage() for r in caplog.records)


# One rank of a two-rank gloo job (argv: checkpoint dir, output dir): a DDP-like loop (an all_reduce per
# step) under a Guard with interval saves; rank 0 watches its own AWS emulator and raises a rebalance
# recommendation at step 60. Each rank writes when each guard.step() began and returned, and its timeline.
INTERVAL_AND_REBALANCE_RANK = """
import json, sys, time, torch, torch.distributed as dist, spotguard
from cloud_adapters.aws.emulator import AWSMetadataEmulator
ckpt, out = sys.argv[1:]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(1024, 1024)  # 8 MB with its momentum: a save takes tens of ms
state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}
emu = AWSMetadataEmulator().__enter__() if rank == 0 else None
steps = []
with spotguard.Guard(
    ckpt, cloud="aws" if rank == 0 else "none", metadata_url=emu.url if emu else None,
    poll_interval_s=0.05, save_interval_s=0.5,
) as guard:
    for step in range(120):
        model(torch.ones(2, 1024)).pow(2).sum().backward()
        state["optim"].step()
        dist.all_reduce(torch.ones(1))
        time.sleep(0.01 * (1 + rank))
        if emu is not None and step == 60:
            emu.raise_notice(kind="rebalance")
        began = time.time()
        assert not guard.step(step, state)
        steps.append((step, began, time.time()))
timeline = [(e.event, e.at.timestamp(), e.detail.get("step")) for e in guard.timeline.entries]
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"steps": steps, "timeline": timeline}, f)
if emu is not None:
    emu.stop()
dist.destroy_process_group()
"""


def test_rounds_agreed_on_one_step_make_one_save_named_for_the_one_that_is_not_routine(tmp_path):
    """An interval round that lands on the step of a rebalance (or any named) save must not rename it."""
    state = make_state()
    with spotguard.Guard(tmp_path, cloud="none", exit_code=None) as guard:
        guard.step(0, state)
        guard.request_checkpoint("manual")
        guard._rounds.request("interval")  # what the interval timer asks, after it: both agree on step 1
        deadline = time.monotonic() + 30
        while sum(e.event == "agreed" for e in guard.timeline.entries) < 2:
            assert time.monotonic() < deadline, "the two rounds were not agreed"
            time.sleep(0.01)
        guard.step(1, state)  # leaving the block waits for the background save
    assert [e.detail.get("step") for e in guard.timeline.entries if e.event == "agreed"] == [1, 1]
    assert committed(tmp_path) == [(1, "manual")]


def test_interval_saves_and_rebalance_saves_are_agreed_then_taken_in_the_background(tmp_path):
    """Two ranks, rank 1 the slower (rank 0 waits for it in the all_reduce, as under DDP): every interval
    and rebalance save is taken by both at one agreed step, and guard.step() at that step returns on
    every rank before the save is committed (a save taken in the foreground commits first)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    finish(launch_code(INTERVAL_AND_REBALANCE_RANK, 2, str(ckpt), str(out)), timeout=180)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    saves = [c for c in list_checkpoints(str(ckpt)) if c.committed]
    reasons = {c.reason for c in saves}
    assert reasons == {"interval", "rebalance"}, reasons
    reached = {step for step, _, _ in ranks[0]["steps"]}  # a round agreed as the loop ended is never reached
    agreed = [[step for event, _, step in r["timeline"] if event == "agreed" and step in reached] for r in ranks]
    assert agreed[0] == agreed[1]  # one step per round, the same on both ranks
    # an interval round and the rebalance's may agree on the same step: one save takes both
    assert sorted(set(agreed[0])) == [c.step for c in saves]
    for c in saves:  # each holds both ranks' shards (DCP's files are named __RANK_N.distcp)
        shards = {p.name.split("_")[2] for p in (ckpt / f"step-{c.step:010d}").glob("__*_*.distcp")}
        assert c.world_size == 2 and shards == {"0", "1"}, c
    committed_at = {step: at for event, at, step in ranks[0]["timeline"] if event == "committed"}
    for rank, done in enumerate(ranks):
        returned = {step: end for step, _, end in done["steps"]}
        late = {c.step: returned[c.step] - committed_at[c.step] for c in saves}
        late = {step: seconds for step, seconds in late.items() if seconds >= 0}
        assert not late, f"rank {rank}: guard.step() returned this many s after its save was committed: {late}"
    ledger = read_ledger(LocalStore(ckpt)).records  # the advisory is in the goodput ledger too
    assert [r.kind for r in ledger if r.EVENT == "notice"] == ["rebalance"]
    assert {r.reason for r in ledger if r.EVENT == "save"} == {"interval", "rebalance"}


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"grace_s": float("nan")}, ValueError, "grace_s must be a finite number of seconds > 0, got nan"),
        ({"grace_s": float("inf")}, ValueError, "grace_s must be a finite"),
        ({"poll_interval_s": float("nan")}, ValueError, "poll_interval_s must be a finite"),
        ({"poll_interval_s": 0}, ValueError, "poll_interval_s must be a finite number of seconds > 0"),
        ({"save_interval_s": float("nan")}, ValueError, "save_interval_s must be a finite"),
        ({"save_interval_s": float("inf")}, ValueError, "save_interval_s must be a finite"),
        ({"agreement_timeout_s": -1.0}, ValueError, "agreement_timeout_s must be a finite"),
        ({"save_interval_s": "auto", "max_save_interval_s": float("inf")}, ValueError, "max_save_interval_s must be"),
        # finite but huge: a deadline past datetime's range (SIGTERM lost), a wait past threading.TIMEOUT_MAX
        ({"grace_s": 1e12}, ValueError, "grace_s must be at most 30 days (2592000 s), got 1000000000000.0"),
        ({"poll_interval_s": 1e10}, ValueError, "poll_interval_s must be at most 30 days"),
        ({"save_interval_s": 1e10}, ValueError, "save_interval_s must be at most 30 days"),
        ({"save_interval_s": "auto", "max_save_interval_s": 1e10}, ValueError, "max_save_interval_s must be at most"),
        ({"agreement_timeout_s": 1e10}, ValueError, "agreement_timeout_s must be at most 30 days"),
        ({"snapshot_interval_s": 1e10}, ValueError, "snapshot_interval_s must be at most 30 days"),
        ({"save_every": 0.5}, TypeError, "save_every must be an int, not float"),
        ({"save_every": 0}, ValueError, "save_every must be >= 1"),
        ({"keep_last": 1.5}, TypeError, "keep_last must be an int, not float"),
        ({"keep_last": True}, TypeError, "keep_last must be an int, not bool"),
        ({"transfer_threads": 0}, ValueError, "transfer_threads must be >= 1"),
        ({"save_on_rebalance": "yes"}, TypeError, "save_on_rebalance must be True or False"),
        ({"signals": "SIGTERM"}, TypeError, "signals must be a sequence of signals"),
        ({"signals": ["SIGNOPE"]}, ValueError, "unknown signal 'SIGNOPE'"),
        ({"signals": ["KILL"]}, ValueError, "SIGKILL cannot be caught"),
        ({"exit_code": 256}, ValueError, "exit_code must be an exit status from 0 to 255, got 256"),
        ({"lost_exit_code": -1}, ValueError, "lost_exit_code must be >= 0"),
        ({"metadata_url": "not a url"}, ValueError, "metadata URL must look like http://HOST"),
    ],
)
def test_values_that_would_bend_the_guard_are_refused_at_the_call(tmp_path, kwargs, error, message):
    """NaN passes any `<= 0` test and inf any `> 0`: a NaN grace_s lost SIGTERM, an inf interval
    killed the timer thread, keep_last=1.5 turned retention off, exit_code=256 exited 0."""
    with pytest.raises(error, match="^" + re.escape(message)):
        spotguard.Guard(tmp_path, cloud="none", **kwargs)


def test_misuse_gets_clear_errors(tmp_path, monkeypatch):
    guard = spotguard.Guard(tmp_path, cloud="none")
    with pytest.raises(RuntimeError, match="needs the guard started"):
        guard.step(0, {})
    with pytest.raises(RuntimeError, match="needs the guard started"):
        guard.resume({})
    with pytest.raises(ValueError, match="cloud must be one of"):
        spotguard.Guard(tmp_path, cloud="mars")
    import numpy as np

    with spotguard.Guard(tmp_path, cloud="none") as entered:
        for bad, error in (("3", TypeError), (2.5, TypeError), (True, TypeError), (-1, ValueError)):
            with pytest.raises(error, match="^step must be"):  # at the call, before any notice is pending
                entered.step(bad, {})
        with pytest.raises(TypeError, match="^step must be an int, not str"):
            entered.save("5", {})
        assert not entered.step(np.int64(3), {}) and not entered.step(torch.tensor(4), {})
        for reserved in ("snapshot", "emergency"):  # a snapshot and no save; a save counted as a notice's
            with pytest.raises(ValueError, match=f"^request_checkpoint: reason '{reserved}' is reserved"):
                entered.request_checkpoint(reserved)
        # A name the manifest would refuse: said at the call, not agreed and then failed at the step's save.
        with pytest.raises(ValueError, match="^request_checkpoint: reason must be one of .*'manual'.*, not 'asked'$"):
            entered.request_checkpoint("asked")
    for bad in ("", None, "s3://", "ftp://host/x"):
        with pytest.raises(ValueError, match="^checkpoint_dir: "):  # one line, from Guard(...) itself
            spotguard.Guard(bad, cloud="none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        with spotguard.Guard(tmp_path, cloud="none"):
            pass


def test_entering_a_guard_again_is_refused_and_the_first_entry_still_saves_on_sigterm(tmp_path):
    """A second `with guard:` replaced the first entry's threads and SIGTERM handler; its exit
    then restored the default handler while the first entry ran on, unguarded."""
    state = make_state()
    guard = spotguard.Guard(tmp_path, cloud="none", exit_code=None)
    with guard:
        threads = {t for t in threading.enumerate() if t.name.startswith("spotguard")}
        handler = signal.getsignal(signal.SIGTERM)
        with pytest.raises(RuntimeError, match="^this Guard is started already"):
            with guard:
                pass
        assert signal.getsignal(signal.SIGTERM) is handler
        assert {t for t in threading.enumerate() if t.name.startswith("spotguard")} == threads
        stopped = train(guard, state, on_step=lambda s: s == 3 and os.kill(os.getpid(), signal.SIGTERM))
    assert stopped is not None and committed(tmp_path) == [(stopped, "emergency")]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_start_and_close_do_what_the_with_block_does(tmp_path):
    """For frameworks that call in at setup and teardown instead of wrapping the loop."""
    state = make_state()
    guard = spotguard.Guard(tmp_path, cloud="none")
    guard.close()  # not started: nothing to do
    assert guard.start() is guard and signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    stopped = train(guard, state, on_step=lambda s: s == 3 and os.kill(os.getpid(), signal.SIGTERM))
    assert stopped is not None and guard.emergency_saved
    with pytest.raises(SystemExit) as exited:
        guard.close()
    assert exited.value.code == 143 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    guard.close()  # closed already: nothing to do
    assert committed(tmp_path) == [(stopped, "emergency")]


def test_a_guard_started_again_has_resumed_from_nothing_until_it_resumes(tmp_path):
    state = make_state()
    guard = spotguard.Guard(tmp_path, cloud="none", exit_code=None)
    with guard:
        guard.save(4, state)
        assert guard.resume(state) == 5 and guard.resumed_from == "durable"
    with guard:
        assert guard.resumed_from is None  # the last start's resume, not this one's
        assert guard.resume(state) == 5 and guard.resumed_from == "durable"


def test_a_failed_enter_leaves_nothing_behind(tmp_path, monkeypatch):
    before = set(threading.enumerate())
    (tmp_path / "blocker").write_text("a file where the checkpoints should go")
    with pytest.raises(ValueError, match="^checkpoint_dir: cannot create .*blocker/ckpt"):
        with spotguard.Guard(tmp_path / "blocker" / "ckpt", cloud="none"):
            pass
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(ValueError, match="^local_dir: .* is not writable"):
            with spotguard.Guard("s3://bucket/run", local_dir=tmp_path / "ro", cloud="none"):
                pass
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert not [t for t in threading.enumerate() if t.name.startswith("spotguard") and t not in before]


def test_a_notice_seen_again_with_an_earlier_deadline_is_an_update_not_a_second_notice(tmp_path):
    def event(in_s):
        when = email.utils.format_datetime(datetime.now(timezone.utc) + timedelta(seconds=in_s), usegmt=True)
        return json.dumps(
            [{"Code": "system-reboot", "EventId": "instance-event-1", "NotBefore": when, "State": "active"}]
        )

    with (
        AWSMetadataEmulator() as emu,
        spotguard.Guard(tmp_path, cloud="aws", metadata_url=emu.url, poll_interval_s=0.05) as guard,
    ):
        emu.set_metadata("events/maintenance/scheduled", event(3600))
        wait_for(lambda: [e for e in guard.timeline.entries if e.event == "notice"])
        emu.set_metadata("events/maintenance/scheduled", event(3700))  # later: ignored
        time.sleep(2.0)
        emu.set_metadata("events/maintenance/scheduled", event(600))
        wait_for(lambda: [e for e in guard.timeline.entries if e.event == "notice-update"])
        time.sleep(2.0)
        events = [e for e in guard.timeline.entries if e.event.startswith("notice")]
    assert [e.event for e in events] == ["notice", "notice-update"]
    assert 590 <= float(events[1].detail["deadline_in_s"]) <= 600


def wait_for(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
