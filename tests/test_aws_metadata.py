"""AWS IMDSv2 notice sources against the AWS metadata emulator, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import re
import socket
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import requests

from cloud_adapters.aws import metadata
from cloud_adapters.aws.emulator import AWSMetadataEmulator
from cloud_adapters.aws.metadata import notice_sources, probe
from cloud_adapters.notice import NoticeSource, NoticeSourceError
from tests.servers import Fault, FaultProxy

TTL = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN = "X-aws-ec2-metadata-token"
SPOT, ASG, REBALANCE, MAINTENANCE = (
    "spot/instance-action",
    "autoscaling/target-lifecycle-state",
    "events/recommendations/rebalance",
    "events/maintenance/scheduled",
)
AWS_DOC_EVENTS = """[
  {
    "NotBefore" : "21 Jan 2019 09:00:43 GMT",
    "Code" : "system-reboot",
    "Description" : "scheduled reboot",
    "EventId" : "instance-event-0d59937288b749b32",
    "NotAfter" : "21 Jan 2019 09:17:23 GMT",
    "State" : "active"
  },
  {
    "NotBefore" : "1 Jan 2019 09:00:43 GMT",
    "Code" : "instance-stop",
    "Description" : "[Completed] The instance is running on degraded hardware",
    "EventId" : "instance-event-0aaaaaaaaaaaaaaaa",
    "NotAfter" : "1 Jan 2019 09:17:23 GMT",
    "State" : "Completed"
  }
]"""


@pytest.fixture(autouse=True)
def _no_ambient_endpoint(monkeypatch):
    """Nothing in the test environment may point the client anywhere else."""
    monkeypatch.delenv("SPOTGUARD_METADATA_URL", raising=False)
    monkeypatch.delenv(metadata.ENDPOINT_ENV, raising=False)


@pytest.fixture
def emu():
    with AWSMetadataEmulator(in_asg=True) as emulator:
        yield emulator


@pytest.fixture
def sources(emu):
    """The four sources by path, with a short timeout so fault tests stay fast."""
    found = notice_sources(emu.url, timeout_s=0.5)
    yield {source.name.removeprefix("aws:"): source for source in found}
    for source in found:
        source.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def new_token(url: str, ttl: str = "21600") -> str:
    resp = requests.put(url + "/latest/api/token", headers={TTL: ttl}, timeout=5)
    assert resp.status_code == 200
    return resp.text


# ---- the sources -----------------------------------------------------------------------------


def test_sources_are_nonblocking_in_documented_order(emu):
    found = notice_sources(emu.url)
    assert [s.name for s in found] == [f"aws:{p}" for p in (SPOT, ASG, REBALANCE, MAINTENANCE)]
    assert all(isinstance(s, NoticeSource) and s.blocking is False for s in found)
    assert [getattr(s, "advisory", False) for s in found] == [False, False, True, True]


def test_no_notice_anywhere(sources):
    assert {name: source.poll() for name, source in sources.items()} == dict.fromkeys(sources)


def test_not_in_an_asg_is_no_notice():
    with AWSMetadataEmulator(in_asg=False) as emu:
        asg = notice_sources(emu.url)[1]
        resp = requests.get(emu.url + "/latest/meta-data/" + ASG, headers={TOKEN: new_token(emu.url)}, timeout=5)
        assert resp.status_code == 404
        assert asg.poll() is None


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_spot_interruption(emu, sources, action):
    emu.raise_notice(kind="interruption", action=action, in_s=90)
    first, second = sources[SPOT].poll(), sources[SPOT].poll()
    assert (first.cloud, first.kind, first.action, first.source) == ("aws", "interruption", action, "aws:" + SPOT)
    assert 85 <= first.seconds_left() <= 91
    assert first.detail == {"action": action, "time": first.detail["time"]}
    assert second.key == first.key and second.deadline == first.deadline


def test_default_notice_is_spot_terminate_in_two_minutes_in_aws_format(emu, sources):
    emu.raise_notice()
    resp = requests.get(emu.url + "/latest/meta-data/" + SPOT, headers={TOKEN: new_token(emu.url)}, timeout=5)
    assert resp.headers["Content-Type"].startswith("text/plain")
    assert re.fullmatch(r'\{"action": "terminate", "time": "\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"\}', resp.text)
    notice = sources[SPOT].poll()
    assert notice.action == "terminate" and 115 <= notice.seconds_left() <= 121


def test_rebalance_is_advisory_without_deadline(emu, sources):
    emu.raise_notice(kind="rebalance")
    first, second = sources[REBALANCE].poll(), sources[REBALANCE].poll()
    assert (first.kind, first.action, first.deadline) == ("rebalance", "rebalance", None)
    assert "noticeTime" in first.detail and first.key == second.key
    assert sources[SPOT].poll() is None


def test_asg_terminated_gives_a_stable_two_minute_deadline(emu, sources):
    assert sources[ASG].poll() is None  # InService
    emu.raise_notice(kind="asg-terminate")
    first = sources[ASG].poll()
    time.sleep(0.05)
    second = sources[ASG].poll()
    assert (first.kind, first.action) == ("interruption", "asg-terminate")
    assert first.deadline - first.detected_at == timedelta(seconds=120)
    assert (second.key, second.deadline) == (first.key, first.deadline)
    emu.clear()
    assert sources[ASG].poll() is None


def test_maintenance_earliest_active_event_skipping_canceled(emu, sources):
    emu.raise_notice(kind="maintenance", code="instance-stop", in_s=3600)
    emu.raise_notice(kind="maintenance", code="system-reboot", in_s=600)
    emu.raise_notice(kind="maintenance", code="instance-retirement", in_s=60, state="canceled")
    body = requests.get(
        emu.url + "/latest/meta-data/" + MAINTENANCE, headers={TOKEN: new_token(emu.url)}, timeout=5
    ).text
    assert re.search(r'"NotBefore": "\d{1,2} [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT"', body)
    notice = sources[MAINTENANCE].poll()
    assert (notice.kind, notice.action) == ("maintenance", "system-reboot")
    assert 595 <= notice.seconds_left() <= 601
    assert notice.key.endswith(notice.detail["EventId"]) and notice.detail["State"] == "active"
    assert sources[MAINTENANCE].poll().key == notice.key


def test_maintenance_in_the_documented_date_format(emu, sources):
    emu.set_metadata(MAINTENANCE, AWS_DOC_EVENTS)
    notice = sources[MAINTENANCE].poll()
    assert notice.action == "system-reboot"
    assert notice.deadline == datetime(2019, 1, 21, 9, 0, 43, tzinfo=timezone.utc)
    assert notice.key == "aws:events/maintenance/scheduled:instance-event-0d59937288b749b32"
    assert notice.seconds_left() < 0  # in the past: still reported, the watcher judges staleness


def test_only_finished_maintenance_is_no_notice(emu, sources):
    emu.raise_notice(kind="maintenance", state="completed")
    assert sources[MAINTENANCE].poll() is None


@pytest.mark.parametrize("in_s", [-30, -3600])
def test_a_spot_time_already_past_is_due_now(emu, sources, in_s, caplog):
    emu.raise_notice(in_s=in_s)
    notice = sources[SPOT].poll()
    assert notice.is_interruption and -1.0 <= notice.seconds_left() <= 0.0  # not 120 s from detection
    assert notice.describe_deadline().startswith("due now")
    time.sleep(0.05)
    assert sources[SPOT].poll().deadline == notice.deadline  # the earliest deadline stands
    assert sum("has passed already: due now" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_a_spot_time_beyond_the_two_minutes_is_taken_as_two_minutes(emu, sources, caplog):
    emu.raise_notice(in_s=400)
    notice = sources[SPOT].poll()
    assert 118 <= notice.seconds_left() <= 120
    assert sum("beyond the 2 minutes" in r.getMessage() for r in caplog.records) == 1


def test_the_spot_deadline_is_never_later_than_the_served_time():
    """IMDS's Date has whole seconds: read as the latest time it stands for, from when the request
    was sent, the deadline comes before the served time (by at most about a second), on every poll."""
    with AWSMetadataEmulator() as emu:
        spot = notice_sources(emu.url)[0]
        for in_s in (120.0, 119.5, 30.25, 1.9):
            emu.clear()
            assert spot.poll() is None
            emu.raise_notice(in_s=in_s)
            for _ in range(5):
                notice = spot.poll()
                served = datetime.fromisoformat(notice.detail["time"].replace("Z", "+00:00"))
                early = (served - notice.deadline).total_seconds()
                assert 0.0 <= early <= 1.5, (in_s, early)
                time.sleep(0.13)  # other phases of the Date's second


def test_a_moving_spot_time_is_one_notice_whose_deadline_never_moves_later():
    """Some IMDS implementations serve "now + 2 min" on every request: still one interruption, with
    the deadline read at first sight."""
    with AWSMetadataEmulator(moving_times=True) as emu:
        spot = notice_sources(emu.url)[0]
        emu.raise_notice(in_s=120)
        first = spot.poll()
        notices = []
        for _ in range(6):
            time.sleep(0.25)
            notices.append(spot.poll())
        assert {n.key for n in notices} == {first.key} == {"aws:spot/instance-action"}
        assert {n.deadline for n in notices} == {first.deadline}
        assert {n.detected_at for n in notices} == {first.detected_at}
        assert notices[-1].detail["time"] != first.detail["time"]  # the served time did move


def test_a_moving_rebalance_notice_time_is_one_recommendation():
    with AWSMetadataEmulator(moving_times=True) as emu:
        rebalance = notice_sources(emu.url)[2]
        emu.raise_notice(kind="rebalance")
        first = rebalance.poll()
        time.sleep(1.1)
        again = rebalance.poll()
        assert again.detail["noticeTime"] != first.detail["noticeTime"] and again.key == first.key


@pytest.mark.parametrize(
    "body",
    [
        '{"action": "terminate", "time": ',
        '{"action": "terminate"}',
        '{"time": "2026-11-22T10:02:00Z"}',
        '{"action": "explode", "time": "2026-11-22T10:02:00Z"}',
        '{"action": "terminate", "time": "in two minutes"}',
        '["terminate"]',
        "<html>maintenance</html>",
    ],
)
def test_an_unreadable_spot_answer_is_an_interruption_logged_once(emu, sources, body, caplog):
    """The path is 404 until an interruption: whatever it answers then, a needless save beats a
    missed interruption."""
    emu.set_metadata(SPOT, body)
    notice = sources[SPOT].poll()
    assert notice.is_interruption and notice.action == "unknown" and notice.key == "aws:spot/instance-action"
    assert 117 <= notice.seconds_left() <= 118
    assert notice.detail["unreadable"] == body
    assert sources[SPOT].poll().deadline == notice.deadline
    warnings = [r.getMessage() for r in caplog.records if "taking it as an interruption" in r.getMessage()]
    assert len(warnings) == 1 and "aws:spot/instance-action" in warnings[0]


@pytest.mark.parametrize("host_fast_s", [100, 730])
def test_a_host_clock_ahead_of_imds_still_gets_two_minutes(host_fast_s, caplog):
    with AWSMetadataEmulator(clock_offset_s=-host_fast_s) as emu:
        emu.raise_notice()  # time = IMDS's now + 120 s, which the host's clock reads as far less (or past)
        spot = notice_sources(emu.url)[0]
        notice = spot.poll()
        assert 117 <= notice.seconds_left() <= 121
        logged = re.search(r"host clock is ([+-]\d+) s off", caplog.text)  # the skew is logged
        assert logged and abs(int(logged.group(1)) - host_fast_s) <= 1  # (Date has whole seconds)


@pytest.mark.parametrize(
    "path, body, what",
    [
        (REBALANCE, '{"noticeTime": "yesterday"}', "unparseable ISO-8601 time"),
        (REBALANCE, "{}", "missing field 'noticeTime'"),
        (MAINTENANCE, "{}", "expected a JSON array"),
        (
            MAINTENANCE,
            '[{"Code": "system-reboot", "NotBefore": "2019-01-21T09:00:43Z", "State": "active"}]',
            "unparseable RFC 1123 time",
        ),
        (MAINTENANCE, '[{"Code": "system-reboot", "NotBefore": "21 Jan 2019 09:00:43 GMT"}]', "missing field 'State'"),
        (MAINTENANCE, '["system-reboot"]', "expected every event to be a JSON object"),
        (ASG, '{"state": "Terminated"}', "unexpected lifecycle state"),
    ],
)
def test_unusable_answers_raise_saying_what_was_wrong(emu, sources, path, body, what):
    emu.set_metadata(path, body)
    with pytest.raises(NoticeSourceError, match=re.escape(what)) as info:
        sources[path].poll()
    assert f"aws:{path}" in str(info.value) and body[:20] in str(info.value)  # names the source, quotes the body


# ---- the token ------------------------------------------------------------------------------


def test_one_token_for_many_gets_across_sources_and_threads(emu, sources):
    emu.raise_notice()
    for _ in range(5):
        for source in sources.values():
            source.poll()
    threads = [threading.Thread(target=source.poll) for source in sources.values() for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert emu.tokens_issued == 1


def test_token_refetched_after_401(emu, sources):
    emu.raise_notice()
    assert sources[SPOT].poll() is not None
    emu.set_fault("token-expiry", count=1)
    before = emu.requests_seen
    assert sources[SPOT].poll().action == "terminate"
    assert emu.tokens_issued == 2
    assert emu.requests_seen - before == 3  # GET (401), PUT, GET


def test_tokens_always_refused_raises_instead_of_looping(emu, sources):
    emu.set_fault("token-expiry")
    with pytest.raises(NoticeSourceError, match="answered 401"):
        sources[SPOT].poll()
    assert emu.tokens_issued == 2  # the first token and one re-fetch, no more


def test_token_renewed_before_it_expires(emu, monkeypatch):
    monkeypatch.setattr(metadata, "TOKEN_TTL_S", 2)  # renewed at 1 s, valid until 2 s
    spot = notice_sources(emu.url)[0]
    spot.poll()
    time.sleep(1.1)
    before = emu.requests_seen
    spot.poll()
    assert emu.tokens_issued == 2 and emu.requests_seen - before == 2  # PUT then GET, no 401 first


@pytest.mark.parametrize(
    "body",
    [
        "<html>\n<head><title>Sign in to the guest network</title></head>\n</html>\n",
        "tok en",
        "t\u00f6ken",
        "A" * 5000,
    ],
)
def test_an_answer_that_is_not_a_token_is_never_kept(emu, body):
    proxy = FaultProxy(emu.url)
    try:
        proxy.arm(Fault(200, body.encode()))  # the next token PUT gets this instead of a token
        spot = notice_sources(proxy.url, timeout_s=0.5)[0]
        with pytest.raises(NoticeSourceError, match="not an IMDSv2 token"):
            spot.poll()
        emu.raise_notice()
        assert spot.poll().action == "terminate"  # the next poll fetched a real token
        assert emu.tokens_issued == 1
    finally:
        proxy.close()


def test_a_get_that_got_no_answer_drops_the_token(emu, sources):
    sources[SPOT].poll()
    emu.set_fault("reset", count=1)
    with pytest.raises(NoticeSourceError, match="failed"):
        sources[SPOT].poll()
    assert sources[SPOT].poll() is None
    assert emu.tokens_issued == 2


def test_a_slow_advisory_poll_never_holds_up_the_spot_notice(emu):
    spot, _, _, maintenance = notice_sources(emu.url, timeout_s=5)
    spot.poll()  # the token is cached
    emu.raise_notice()
    emu.set_fault("slow", count=1, delay_s=2)
    before = emu.requests_seen
    slow = threading.Thread(target=maintenance.poll)
    slow.start()
    while emu.requests_seen == before:
        time.sleep(0.005)
    started = time.monotonic()
    assert spot.poll().action == "terminate"
    assert time.monotonic() - started < 1.0
    slow.join(timeout=10)


# ---- the emulator is as strict as IMDS ------------------------------------------------------------


@pytest.mark.parametrize(
    "ttl, status", [(None, 400), ("0", 400), ("21601", 400), ("-5", 400), ("abc", 400), ("1", 200), ("21600", 200)]
)
def test_token_ttl_header_rules(emu, ttl, status):
    headers = {} if ttl is None else {TTL: ttl}
    resp = requests.put(emu.url + "/latest/api/token", headers=headers, timeout=5)
    assert resp.status_code == status
    if status == 200:
        assert resp.headers[TTL] == ttl and resp.headers["Content-Type"].startswith("text/plain") and resp.text


def test_token_put_through_a_proxy_is_refused(emu):
    resp = requests.put(emu.url + "/latest/api/token", headers={TTL: "60", "X-Forwarded-For": "10.0.0.5"}, timeout=5)
    assert resp.status_code == 403 and emu.tokens_issued == 0


def test_gets_need_a_live_token(emu):
    url = emu.url + "/latest/meta-data/instance-id"
    assert requests.get(url, timeout=5).status_code == 401
    assert requests.get(url, headers={TOKEN: "not-a-token"}, timeout=5).status_code == 401
    short = new_token(emu.url, ttl="1")
    resp = requests.get(url, headers={TOKEN: short}, timeout=5)
    assert (resp.status_code, resp.text) == (200, emu.instance_id)
    assert resp.headers["Content-Type"].startswith("text/plain")
    time.sleep(1.1)
    assert requests.get(url, headers={TOKEN: short}, timeout=5).status_code == 401


def test_metadata_listing_looks_like_imds(emu):
    headers = {TOKEN: new_token(emu.url)}
    listing = requests.get(emu.url + "/latest/meta-data/", headers=headers, timeout=5).text.splitlines()
    assert {"instance-id", "events/", "placement/"} <= set(listing) and "spot/" not in listing
    emu.raise_notice()
    listing = requests.get(emu.url + "/latest/meta-data/", headers=headers, timeout=5).text.splitlines()
    assert "spot/" in listing
    spot = requests.get(emu.url + "/latest/meta-data/spot/", headers=headers, timeout=5).text.splitlines()
    assert spot == ["instance-action", "termination-time"]
    assert requests.get(emu.url + "/latest/meta-data/no-such-thing", headers=headers, timeout=5).status_code == 404


# ---- faults and unreachable endpoints ----------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 503])
def test_error_status_raises_then_recovers(emu, sources, status):
    sources[SPOT].poll()  # token cached: the fault hits the GET
    emu.set_fault("error", count=1, status=status)
    with pytest.raises(NoticeSourceError, match=f"answered {status} for spot/instance-action"):
        sources[SPOT].poll()
    assert sources[SPOT].poll() is None


def test_error_on_the_token_request_raises(emu, sources):
    emu.set_fault("error", count=1, status=503)
    with pytest.raises(NoticeSourceError, match="token request .* answered 503"):
        sources[SPOT].poll()


def test_slow_answer_times_out(emu, sources):
    sources[SPOT].poll()
    emu.set_fault("slow", count=1, delay_s=1.5)
    started = time.monotonic()
    with pytest.raises(NoticeSourceError, match=r"no answer within 0.5 s"):
        sources[SPOT].poll()
    assert time.monotonic() - started < 1.4


def test_slow_token_request_hints_at_the_hop_limit(emu, sources):
    emu.set_fault("slow", count=1, delay_s=1.5)
    with pytest.raises(NoticeSourceError, match="hop-limit"):
        sources[SPOT].poll()


@pytest.mark.parametrize(
    "path, what",
    [
        (REBALANCE, "malformed JSON"),
        (MAINTENANCE, "malformed JSON"),
        (ASG, "unexpected lifecycle state"),
    ],
)
def test_malformed_answer(emu, sources, path, what):
    emu.raise_notice(kind="rebalance")
    sources[path].poll()
    emu.set_fault("malformed", count=1)
    with pytest.raises(NoticeSourceError, match=what):
        sources[path].poll()


def test_a_malformed_fault_keeps_a_path_with_nothing_to_serve_at_404(emu, sources):
    sources[SPOT].poll()
    emu.set_fault("malformed", count=1)
    assert sources[SPOT].poll() is None  # no interruption out of nothing
    emu.raise_notice()
    emu.set_fault("malformed", count=1)
    assert sources[SPOT].poll().action == "unknown"


def test_connection_reset(emu, sources):
    sources[SPOT].poll()
    emu.set_fault("reset", count=1)
    with pytest.raises(NoticeSourceError, match="failed"):
        sources[SPOT].poll()
    assert sources[SPOT].poll() is None


def test_connection_refused_fails_fast():
    spot = notice_sources(f"http://127.0.0.1:{closed_port()}")[0]
    started = time.monotonic()
    with pytest.raises(NoticeSourceError, match="refused"):
        spot.poll()
    assert time.monotonic() - started < 2


def test_close_then_poll_reconnects(emu, sources):
    sources[SPOT].poll()
    for source in sources.values():
        source.close()
    emu.raise_notice()
    assert sources[SPOT].poll().action == "terminate"


# ---- the control endpoint ------------------------------------------------------------------------


def test_control_endpoint_raises_a_notice_later(emu, sources):
    resp = requests.post(emu.url + "/_spotguard/notice", json={"after_s": 0.5}, timeout=5)
    assert resp.status_code == 200
    started = time.monotonic()
    assert sources[SPOT].poll() is None
    notice = None
    while notice is None and time.monotonic() - started < 5:
        time.sleep(0.05)
        notice = sources[SPOT].poll()
    assert notice is not None and notice.action == "terminate"
    assert time.monotonic() - started >= 0.4


def test_control_endpoint_other_kinds_and_bad_parameters(emu, sources):
    assert requests.post(emu.url + "/_spotguard/notice", json={"kind": "rebalance"}, timeout=5).status_code == 200
    assert sources[REBALANCE].poll() is not None
    bad = requests.post(emu.url + "/_spotguard/notice", json={"kind": "meteor"}, timeout=5)
    assert bad.status_code == 400 and "meteor" in bad.json()["error"]
    with pytest.raises(ValueError, match="spot action"):
        emu.raise_notice(action="explode")


@pytest.mark.parametrize("path", ["notice", "fault"])
@pytest.mark.parametrize("body", ["{not json", "[1, 2]", '{"count": "many", "mode": "slow"}'])
def test_control_endpoints_answer_400_to_bad_bodies(emu, sources, path, body):
    resp = requests.post(
        f"{emu.url}/_spotguard/{path}", data=body, headers={"Content-Type": "application/json"}, timeout=5
    )
    assert resp.status_code == 400 and resp.json()["ok"] is False and resp.json()["error"]
    assert sources[SPOT].poll() is None  # neither a notice nor a fault got through


# ---- endpoints and probe ----------------------------------------------------------------------


def test_endpoint_precedence(monkeypatch):
    with AWSMetadataEmulator() as explicit, AWSMetadataEmulator() as ours, AWSMetadataEmulator() as aws:
        monkeypatch.setenv(metadata.ENDPOINT_ENV, aws.url)
        notice_sources()[0].poll()
        assert aws.tokens_issued == 1
        monkeypatch.setenv("SPOTGUARD_METADATA_URL", ours.url)
        notice_sources()[0].poll()
        assert (ours.tokens_issued, aws.tokens_issued) == (1, 1)
        notice_sources(explicit.url)[0].poll()
        assert (explicit.tokens_issued, ours.tokens_issued, aws.tokens_issued) == (1, 1, 1)


def test_default_endpoint_is_the_link_local_address():
    assert notice_sources()[0].client.base_url == "http://169.254.169.254"  # resolved only, never contacted


@pytest.mark.parametrize("url", ["ftp://127.0.0.1", "http://127.0.0.1:99999", "http://"])
def test_bad_url_is_a_clear_value_error(monkeypatch, url):
    with pytest.raises(ValueError, match="metadata URL"):
        notice_sources(url)
    monkeypatch.setenv(metadata.ENDPOINT_ENV, url)
    with pytest.raises(ValueError, match="metadata URL"):
        probe()


def test_probe(emu):
    assert probe(emu.url) is True
    started = time.monotonic()
    assert probe(f"http://127.0.0.1:{closed_port()}") is False
    emu.set_fault("slow", delay_s=2)
    assert probe(emu.url, timeout_s=0.2) is False  # listening but not answering in time
    emu.set_fault("error", status=403)
    assert probe(emu.url) is False
    assert time.monotonic() - started < 1.5
