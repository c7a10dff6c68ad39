"""The goodput ledger, `spotguard report` (text, JSON, picture) and the "auto" save cadence, with real
Guards in this process and in a child killed hard; torchrun runs are checked in test_torchrun.py."""

import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import spotguard
from cloud_adapters.storage import LocalStore, StoreError
from spotguard.cli import main
from spotguard.goodput.cadence import Cadence, IntervalTimer, young_daly
from spotguard.goodput.ledger import LEDGER_NAME, LEDGER_PREFIX, Ledger, read_ledger
from spotguard.goodput.records import Exit, NoticeSeen, Progress, Resume, Save, Start
from spotguard.goodput.report import summarize
from tests.conftest import backend_for
from tests.test_guard import make_state, train


def report_json(location, capsys):
    assert main(["report", str(location), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def interrupted_then_resumed(tmp_path_factory):
    """A run stopped by SIGTERM at step 12 (periodic saves every 5 steps), then resumed with "auto" saves."""
    ckpt = tmp_path_factory.mktemp("goodput") / "ckpt"
    with spotguard.Guard(ckpt, cloud="none", exit_code=None, save_every=5) as guard:
        stopped = train(
            guard, make_state(), steps=100, on_step=lambda s: s == 12 and os.kill(os.getpid(), signal.SIGTERM)
        )
    time.sleep(0.3)  # the time between the segments, which counts against goodput
    with spotguard.Guard(
        ckpt, cloud="none", exit_code=None, save_interval_s="auto", min_save_interval_s=0.2, max_save_interval_s=60
    ) as guard:
        assert train(guard, make_state(), steps=60) is None
    return ckpt, stopped


def test_the_ledger_records_an_interrupted_and_resumed_run_and_report_reads_it_back(interrupted_then_resumed, capsys):
    ckpt, stopped = interrupted_then_resumed
    records = read_ledger(LocalStore(ckpt)).records
    assert (ckpt / LEDGER_NAME).is_file()
    first, second = sorted({r.segment for r in records})
    events = [r.EVENT for r in records if r.segment == first]
    assert events[:2] == ["start", "resume"] and events[-1] == "exit"
    saves = [r for r in records if isinstance(r, Save) and r.segment == first]
    assert [(s.step, s.reason) for s in saves] == [(0, "periodic"), (5, "periodic"), (10, "periodic"),
                                                         (stopped, "emergency")]  # fmt: skip
    assert all(s.ok and s.durable and s.bytes > 0 and s.stall_s >= 0 for s in saves)
    notice = next(r for r in records if isinstance(r, NoticeSeen))
    assert (notice.cloud, notice.kind, notice.agreed_step, notice.committed) == (
        "signal", "interruption", stopped, True)  # fmt: skip
    assert 15 < notice.margin_s <= 25  # grace_s 25
    resume = next(r for r in records if isinstance(r, Resume) and r.segment == second)
    assert (resume.step, resume.next_step) == (stopped, stopped + 1)
    assert resume.since_previous_s >= 0.3

    summary = report_json(ckpt, capsys)
    assert (summary["segments"], summary["interruptions"], summary["steps_lost"]) == (2, 1, 0)
    assert 0 < summary["goodput"] < 1
    assert summary["training_s"] + 0.3 < summary["wall_s"]
    [x] = summary["interruption_details"]
    assert x["committed"] and x["exact"] and x["agreed_step"] == stopped
    assert 0.3 <= x["time_to_resume_s"] < 30
    assert [s["ended"] for s in summary["segment_details"]] == ["interrupted", "finished"]
    assert summary["segment_details"][1]["first_step"] == stopped + 1
    assert summary["segment_details"][1]["last_step"] == 59
    # The second segment saved at the "auto" interval, and said why.
    assert any(s["reason"] == "interval" for s in summary["segment_details"][1]["saves"])
    assert summary["cadence"]["interruptions"] == 1 and "sqrt(2 x" in summary["cadence"]["explain"]

    assert main(["report", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "2 segment(s), 1 interruption(s)" in text and "goodput" in text and "signal:SIGTERM" in text


def test_the_picture_shows_every_segment(interrupted_then_resumed, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from spotguard.goodput.plot import timeline_figure

    ckpt, _ = interrupted_then_resumed
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    assert main(["report", str(ckpt), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["report", str(ckpt), "--plot", str(page)]) == 0
    assert page.read_text().count('id="segment-') == 2 and "goodput" in page.read_text()
    fig = timeline_figure(summarize(read_ledger(LocalStore(ckpt))))
    bars = [c for c in fig.axes[0].collections if (c.get_gid() or "").startswith("segment-")]
    assert len(bars) == 2
    assert main(["report", str(ckpt), "--plot", str(tmp_path / "t.pdf")]) == 2
    assert "must end in .png or .html" in capsys.readouterr().err


def test_a_hard_kill_and_a_torn_line(tmp_path, capsys):
    """A run killed with SIGKILL writes no exit record, and its last line may be torn: the report skips that
    line, says so, counts the interruption, and gives its loss as a lower bound."""
    ckpt = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, signal, sys, time, torch, spotguard
        sys.path.insert(0, {os.getcwd()!r})
        from tests.test_guard import make_state, train
        def kill(step):
            if step == 17:
                time.sleep(0.5)  # the ledger has the step-15 save
                os.kill(os.getpid(), signal.SIGKILL)
        with spotguard.Guard({str(ckpt)!r}, cloud="none", save_every=5) as guard:
            train(guard, make_state(), steps=100, on_step=kill)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with open(ckpt / LEDGER_NAME, "ab") as ledger:
        ledger.write(b'{"event":"progress","segment":"2')  # a write cut short by the kill
    with spotguard.Guard(ckpt, cloud="none", exit_code=None) as guard:
        assert train(guard, make_state(), steps=20, step_time=0) is None
    summary = report_json(ckpt, capsys)
    assert summary["torn_lines"] == 1
    assert (summary["segments"], summary["interruptions"]) == (2, 1)
    [x] = summary["interruption_details"]
    assert not x["exact"] and x["cloud"] is None and x["steps_lost"] == 0  # known: trained 15, resumed at 16
    assert [s["ended"] for s in summary["segment_details"]] == ["no exit record", "finished"]
    assert summary["segment_details"][1]["resumed_from"] == 15
    assert main(["report", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "1 torn line(s) skipped" in text and ">=0" in text


def test_ledger_objects_in_a_bucket_one_per_segment(tmp_path, storage_servers, monkeypatch, capsys):
    store = backend_for("s3", storage_servers, monkeypatch, tmp_path).store()
    last = {"step": 3}
    for segment in range(2):
        ledger = Ledger(store, progress=lambda: last["step"], heartbeat_s=0.05)
        ledger.record(Start(world_size=1))
        ledger.record(Resume(step=None if segment == 0 else 9, next_step=0 if segment == 0 else 10, resume_s=0.1))
        assert ledger.history(timeout=10) is not None  # read before the first write
        time.sleep(0.3)  # heartbeats with the last step
        ledger.record(Exit(code=143, why="interrupted", committed=False, last_step=12 + 10 * segment))
        ledger.close()
    keys = [o.key for o in store.list(LEDGER_PREFIX)]
    assert len(keys) == 2 and all(k.endswith(".jsonl") for k in keys)
    contents = read_ledger(store)
    assert contents.torn == 0
    assert any(isinstance(r, Progress) and r.last_step == 3 for r in contents.records)
    summary = report_json(store.url, capsys)
    assert (summary["segments"], summary["interruptions"]) == (2, 2)
    # The first interruption: trained to 12, resumed at 10 (3 steps redone); the second: nothing committed.
    assert [x["steps_lost"] for x in summary["interruption_details"]] == [3, 23]


def test_a_long_segment_goes_on_in_a_new_bucket_object_instead_of_rewriting_its_whole_history(
    tmp_path, storage_servers, monkeypatch
):
    store = backend_for("s3", storage_servers, monkeypatch, tmp_path).store()
    put_bytes, refused = store.put_bytes, threading.Event()

    def refuse_once(key, data):
        if data.count(b"\n") == 3 and not refused.is_set():  # the write that would fill the first object
            refused.set()
            raise StoreError("refused once")
        put_bytes(key, data)

    monkeypatch.setattr(store, "put_bytes", refuse_once)
    ledger = Ledger(store, heartbeat_s=3600, object_lines=3)
    for n in range(1, 8):
        ledger.record(Save(step=n))
        deadline = time.monotonic() + 30  # bounds a hang only
        while not (refused.is_set() if n == 3 else len(read_ledger(store).records) >= n):  # one record per write
            assert time.monotonic() < deadline, f"record {n} not written"
            time.sleep(0.02)
    ledger.close()
    lines = {o.key.removeprefix(LEDGER_PREFIX): store.get_bytes(o.key).count(b"\n") for o in store.list(LEDGER_PREFIX)}
    # Record 3's write failed: it went again with record 4, which filled the first object.
    assert lines == {f"{ledger.segment}.jsonl": 4, f"{ledger.segment}.2.jsonl": 3}
    assert [r.step for r in read_ledger(store).records] == list(range(1, 8))


def test_the_auto_cadence_is_young_daly_within_bounds(caplog):
    assert young_daly(2.0, 3600.0) == pytest.approx(120.0)
    changes = []
    cadence = Cadence(min_s=10, max_s=1000, prior_per_hour=1.0, on_change=changes.append)
    with caplog.at_level(logging.INFO, logger="spotguard.goodput.cadence"):
        assert cadence.interval(0.0) == 10  # nothing measured yet: the lower bound, to measure soon
        cadence.observe_save(2.0)
        # prior 1/h weighing 4 h, nothing seen: rate 1/h, M = 3600 s
        assert cadence.interval(0.0) == pytest.approx(120.0)
        cadence.observe_history(interruptions=24, hours=24.0)  # (24 + 4) / (24 + 4) = 1/h still
        assert cadence.interval(0.0) == pytest.approx(120.0)
        cadence.observe_history(interruptions=52, hours=24.0)  # (52 + 4) / 28 = 2/h
        assert cadence.interval(0.0) == pytest.approx(math.sqrt(2 * 2.0 * 1800))
        cadence.observe_interruption(now=1000.0)  # a rebalance recommendation counts as one more
        assert cadence.rate_per_hour(0.0)[0] == pytest.approx(57 / 28)
        cadence.observe_interruption(now=1005.0)  # another node leader's request of the same wave
        assert cadence.rate_per_hour(0.0)[0] == pytest.approx(57 / 28)
        cadence.observe_interruption(now=1000.0 + 601)  # a later wave
        assert cadence.rate_per_hour(0.0)[0] == pytest.approx(58 / 28)
        cadence.observe_history(interruptions=0, hours=10_000.0)
        assert cadence.interval(0.0) == 1000 and cadence.last.bound == "max"
    assert [round(c.interval_s) for c in changes] == [10, 120, 85, 1000]  # each change logged once
    assert sum("save interval (auto)" in r.getMessage() for r in caplog.records) == 4


def test_the_interval_timer_applies_a_changed_interval_to_the_wait_under_way():
    """The adaptive cadence learns a save's cost only after the save that the last wait asked for: a
    shorter interval then ends the wait under way (counted from the last request), not the one after."""
    asked: list[float] = []
    interval = [30.0]  # nothing measured yet: a long first wait
    timer = IntervalTimer(lambda: interval[0], lambda: asked.append(time.monotonic()))
    try:
        started = time.monotonic()
        time.sleep(0.3)
        assert not asked
        interval[0] = 1.0  # the cadence measured a save: 1 s from the start, which has passed
        deadline = started + 10
        while len(asked) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(asked) >= 2, asked
        assert asked[0] - started < 2.5  # within RECHECK_S of the change, not after the 30 s
        assert asked[1] - asked[0] == pytest.approx(1.0, abs=0.5)  # then every interval, from the last request
    finally:
        timer.stop()


def test_the_interval_timer_stops_between_requests_that_take_longer_than_the_interval():
    """A request can take its whole bound (a slow store) while the interval is shorter: the timer still
    stops when asked, instead of requesting back to back after its guard is gone."""
    asked: list[float] = []

    def slow_request() -> None:
        asked.append(time.monotonic())
        time.sleep(0.3)

    timer = IntervalTimer(lambda: 0.1, slow_request)
    deadline = time.monotonic() + 10
    while len(asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    timer.stop()
    stopped = time.monotonic()
    time.sleep(1.0)
    assert len(asked) >= 2 and not [t for t in asked if t > stopped + 0.35], asked


def test_auto_cadence_arguments_are_checked_at_guard(tmp_path):
    for kwargs, message in (
        ({"save_interval_s": "often"}, 'save_interval_s must be a number of seconds or "auto"'),
        (
            {"save_interval_s": "auto", "min_save_interval_s": 0},
            "min_save_interval_s must be a finite number of seconds > 0",
        ),
        (
            {"save_interval_s": "auto", "min_save_interval_s": 90, "max_save_interval_s": 30},
            r"min_save_interval_s \(90\) must not exceed",
        ),
        (
            {"save_interval_s": 30, "interruptions_per_hour": 0.1},
            'interruptions_per_hour: only with save_interval_s="auto"',
        ),
        ({"min_save_interval_s": 5}, 'min_save_interval_s: only with save_interval_s="auto"'),
        (
            {"save_interval_s": "auto", "interruptions_per_hour": -1},
            "interruptions_per_hour must be a finite number > 0",
        ),
    ):
        with pytest.raises(ValueError, match=f"^{message}"):
            spotguard.Guard(tmp_path, cloud="none", **kwargs)


def test_the_ledger_schema_is_shared_by_writer_and_reader_and_versioned(tmp_path):
    """Every record type goes through the writer and back unchanged; a line from before versions is
    read, a newer version's record or an unknown event is skipped and counted, a record missing a
    required field counts as torn."""
    from spotguard.goodput.records import LEDGER_VERSION, RECORDS, CadenceChange, Recovered, SilentEnd

    store = LocalStore(tmp_path)
    written = [
        Start(world_size=2, node="n0", save_every=5, version="0.1.0"),
        Resume(step=None, next_step=0, resume_s=0.2, run="ab12"),
        Save(step=5, reason="periodic", ok=True, bytes=10, stall_s=0.01, durable=True),
        NoticeSeen(kind="interruption", cloud="aws", agreed_step=7, committed=True, leaving=(2, 3)),
        Progress(last_step=9),
        CadenceChange(
            interval_s=60.0, save_cost_s=None, rate_per_h=0.1, interruptions=0, hours=0.0, bound="min", explain="x"
        ),
        SilentEnd(cause="peer-lost", culprit="host/node-2", noticed_after_s=20.4, seen_by="host/node-0", last_step=9),
        Recovered(
            cause="interruption",
            generation=1,
            world_before=3,
            world_after=2,
            step=9,
            paused_s=1.2,
            formed_s=1.0,
            source="snapshot",
        ),  # fmt: skip
        Exit(code=143, why="interrupted", committed=True, last_step=9),
    ]
    assert {type(r) for r in written} == set(RECORDS.values())
    ledger = Ledger(store)
    for record in written:
        ledger.record(record)
    ledger.close()
    at = '"segment":"0","seq":{},"at":"2026-01-01T00:00:00.000Z"'
    with open(tmp_path / LEDGER_NAME, "a") as f:
        f.write('{"event":"save","step":3,"reason":"manual","ok":true,' + at.format(1) + "}\n")  # no "v"
        f.write('{"event":"save","v":%d,"step":4,' % (LEDGER_VERSION + 1) + at.format(2) + "}\n")
        f.write('{"event":"checkup","v":1,' + at.format(3) + "}\n")
        f.write('{"event":"exit","v":1,' + at.format(4) + "}\n")  # no code, no why
    contents = read_ledger(store)
    assert (contents.torn, contents.unknown) == (1, 2)
    older, *mine = contents.records
    assert older == Save(segment="0", seq=1, at="2026-01-01T00:00:00.000Z", step=3, reason="manual", ok=True)
    assert [type(r) for r in mine] == [type(r) for r in written]
    for got, sent in zip(mine, written):
        assert got.seq > 0 and got.segment == ledger.segment
        assert dataclasses.replace(got, segment="", seq=0, at="") == sent
