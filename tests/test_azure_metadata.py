"""Azure Scheduled Events client against the Azure IMDS emulator, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import requests

from cloud_adapters.azure import metadata
from cloud_adapters.azure.emulator import AzureMetadataEmulator
from cloud_adapters.azure.metadata import ScheduledEventsSource, notice_sources, probe
from cloud_adapters.notice import Notice, NoticeSource, NoticeSourceError, parse_rfc1123, utc_now
from tests.servers import Fault, FaultProxy

pytestmark = pytest.mark.timeout(30)

HEADERS = {"Metadata": "true"}
EVENTS = "/metadata/scheduledevents"
EVENTS_QUERY = "?api-version=2020-07-01"


@pytest.fixture(autouse=True)
def _no_env_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTGUARD_METADATA_URL", raising=False)


@pytest.fixture
def emulator():
    with AzureMetadataEmulator(started_remove_after_s=0.3) as emu:
        yield emu


@pytest.fixture
def source(emulator: AzureMetadataEmulator):
    src = ScheduledEventsSource(emulator.url, timeout_s=1.0)
    yield src
    src.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.05)


# ---- notices ---------------------------------------------------------------------------
def test_no_events_means_no_notice(source: ScheduledEventsSource) -> None:
    assert source.poll() is None
    assert source.vm_name == "spotguard-vm-0"


def test_preempt_for_this_vm_is_an_interruption_due_at_not_before(emulator, source) -> None:
    event_id = emulator.raise_notice()
    notice = source.poll()
    assert isinstance(notice, Notice) and notice.is_interruption
    assert (notice.cloud, notice.action, notice.key) == ("azure", "preempt", f"azure:{event_id}")
    [event] = emulator.events()
    assert notice.deadline == parse_rfc1123(event["NotBefore"])
    assert 25 < notice.seconds_left() <= 31
    assert notice.detail["document_incarnation"] == emulator.incarnation
    assert notice.detail["event"]["EventId"] == event_id
    assert notice.detail["event"]["EventStatus"] == "Scheduled"


def test_event_for_another_vm_is_ignored(emulator, source) -> None:
    emulator.raise_notice(resources=["someone-else"])
    assert source.poll() is None
    # A source told its name explicitly never asks IMDS for it, and sees that VM's event.
    before = emulator.requests_seen
    named = ScheduledEventsSource(emulator.url, vm_name="SOMEONE-ELSE")
    try:
        assert named.poll().action == "preempt"
        assert emulator.requests_seen == before + 1
    finally:
        named.close()


def test_freeze_is_maintenance(emulator, source) -> None:
    emulator.raise_notice(event_type="Freeze", not_before_in_s=10)
    notice = source.poll()
    assert (notice.kind, notice.action) == ("maintenance", "freeze")
    assert not notice.is_interruption


def test_the_most_severe_event_is_reported(emulator, source) -> None:
    emulator.raise_notice(event_type="Freeze", not_before_in_s=5)
    emulator.raise_notice(event_type="Preempt", not_before_in_s=90)
    soonest = emulator.raise_notice(event_type="Terminate", not_before_in_s=60)
    notice = source.poll()
    assert (notice.kind, notice.key) == ("interruption", f"azure:{soonest}")


def test_same_event_gives_the_same_notice_on_every_poll(emulator, source) -> None:
    emulator.raise_notice(not_before_in_s=None)  # no NotBefore: detection + 30 s
    first = source.poll()
    time.sleep(0.3)
    second = source.poll()
    assert first.key == second.key
    assert first.deadline == second.deadline == first.detected_at + timedelta(seconds=30)
    assert abs((first.detected_at - utc_now()).total_seconds()) < 5


def test_event_life_cycle_without_ack(emulator, source) -> None:
    emulator.raise_notice(not_before_in_s=0.5)
    scheduled = source.poll()
    incarnation = emulator.incarnation
    wait_until(lambda: emulator.events()[0]["EventStatus"] == "Started")
    assert emulator.incarnation == incarnation + 1
    started = source.poll()
    # NotBefore is blanked once started; the notice keeps the deadline it had.
    assert started.detail["event"]["NotBefore"] == ""
    assert (started.key, started.deadline) == (scheduled.key, scheduled.deadline)
    wait_until(lambda: not emulator.events())
    assert source.poll() is None


def test_notice_raised_through_the_control_endpoint(emulator, source) -> None:
    body = {"event_type": "Terminate", "not_before_in_s": 40, "event_id": "E-1"}
    assert requests.post(f"{emulator.url}/_spotguard/notice", json=body, timeout=5).status_code == 200
    notice = source.poll()
    assert (notice.action, notice.key) == ("terminate", "azure:E-1")


def test_unparseable_not_before_is_an_error(emulator, source) -> None:
    emulator.raise_notice(not_before="soon-ish")
    with pytest.raises(NoticeSourceError, match="unparseable RFC 1123 time 'soon-ish'"):
        source.poll()


# ---- an unusable VM name never blinds the source --------------------------------------
NAME_PATH = "/metadata/instance/compute/name"


@pytest.fixture
def proxy(emulator):
    fronted = FaultProxy(emulator.url)
    yield fronted
    fronted.close()


def name_fetches(proxy: FaultProxy) -> int:
    return sum(path.startswith(NAME_PATH) for _, path, _ in proxy.seen)


BAD_NAME = Fault(200, b"<html>\n<body>Service Unavailable</body>\n</html>\n")


@pytest.mark.parametrize("fault", [BAD_NAME, Fault(200, b"a" * 65), Fault(200, b""), Fault(500, b"oops")])
def test_one_bad_vm_name_answer_never_hides_our_preempt(emulator, proxy, fault) -> None:
    proxy.arm(fault)  # the first request, for the VM name, gets this answer
    source = ScheduledEventsSource(proxy.url, timeout_s=1.0)
    try:
        preempt = emulator.raise_notice()
        notice = source.poll()
        assert notice.is_interruption and notice.key == f"azure:{preempt}" and notice.detail["vm_name"] is None
        assert source.poll().key == notice.key  # the name was read again
        assert source.vm_name == "spotguard-vm-0"
    finally:
        source.close()


def test_while_the_vm_name_is_unknown_any_vms_preempt_counts(emulator, proxy) -> None:
    source = ScheduledEventsSource(proxy.url, timeout_s=1.0)
    try:
        emulator.raise_notice(event_type="Terminate", resources=["someone-else"])
        proxy.arm(BAD_NAME)
        assert source.poll() is None and source.vm_name is None  # only a Preempt counts without the name
        preempt = emulator.raise_notice(resources=["vmss_3"])
        proxy.arm(BAD_NAME)
        assert source.poll().key == f"azure:{preempt}"
        assert source.poll() is None and source.vm_name == "spotguard-vm-0"  # known again: not ours
    finally:
        source.close()


def test_the_vm_name_is_read_again_periodically(emulator, proxy, monkeypatch) -> None:
    monkeypatch.setattr(metadata, "VM_NAME_REFRESH_S", 0.5)
    source = ScheduledEventsSource(proxy.url, timeout_s=1.0)
    try:
        assert source.poll() is None and name_fetches(proxy) == 1
        assert source.poll() is None and name_fetches(proxy) == 1
        time.sleep(0.6)
        assert source.poll() is None and name_fetches(proxy) == 2
    finally:
        source.close()


# ---- acknowledging ----------------------------------------------------------------------
def test_ack_posts_a_start_request(emulator, source) -> None:
    event_id = emulator.raise_notice(not_before_in_s=60)
    notice = source.poll()
    source.ack(notice)
    assert emulator.acknowledged == [event_id]
    after_ack = source.poll()
    assert after_ack.detail["event"]["EventStatus"] == "Started"
    assert after_ack.deadline == notice.deadline
    wait_until(lambda: not emulator.events())
    assert source.poll() is None
    # The event is gone: acknowledging it again is refused, with the reason.
    with pytest.raises(NoticeSourceError, match="HTTP 400 .*Unknown EventId"):
        source.ack(notice)


def test_ack_failures_raise_notice_source_errors(emulator, source) -> None:
    emulator.raise_notice()
    notice = source.poll()
    emulator.stop()
    with pytest.raises(NoticeSourceError, match="could not acknowledge"):
        source.ack(notice)
    foreign = Notice("aws", "interruption", "terminate", None, utc_now(), "aws:spot", "aws:x")
    with pytest.raises(ValueError, match="not an Azure scheduled event"):
        source.ack(foreign)


# ---- the emulator is as strict as IMDS ----------------------------------------------
def test_requests_need_the_metadata_header_and_an_api_version() -> None:
    with AzureMetadataEmulator(rate_limit=False) as emu:
        url = emu.url + EVENTS

        def get(suffix: str, **headers: str) -> requests.Response:
            return requests.get(url + suffix, headers=headers, timeout=5)

        for response in (get(EVENTS_QUERY), get(EVENTS_QUERY, Metadata="false")):
            assert response.status_code == 400
            assert response.json()["error"] == "Bad request. Required metadata header not specified"
        missing = get("", **HEADERS)
        assert missing.status_code == 400 and "api-version" in missing.json()["error"]
        assert "2020-07-01" in missing.json()["newest-versions"]
        assert get("?api-version=2099-01-01", **HEADERS).status_code == 400
        assert get(EVENTS_QUERY, **HEADERS, **{"X-Forwarded-For": "10.0.0.1"}).status_code == 400
        ok = get(EVENTS_QUERY, **HEADERS)
        assert ok.status_code == 200 and ok.json() == {"DocumentIncarnation": 0, "Events": []}

        name = requests.get(
            emu.url + "/metadata/instance/compute/name?api-version=2021-02-01&format=text", headers=HEADERS, timeout=5
        )
        assert name.text == "spotguard-vm-0"
        instance = requests.get(emu.url + "/metadata/instance?api-version=2021-02-01", headers=HEADERS, timeout=5)
        assert instance.json()["compute"]["name"] == "spotguard-vm-0"
        bad_post = requests.post(url + EVENTS_QUERY, headers=HEADERS, json={"Start": []}, timeout=5)
        assert bad_post.status_code == 400


def test_more_than_five_requests_a_second_are_rate_limited(emulator) -> None:
    statuses = [requests.get(emulator.url + EVENTS + EVENTS_QUERY, headers=HEADERS, timeout=5) for _ in range(8)]
    assert [r.status_code for r in statuses[:5]] == [200] * 5
    assert {r.status_code for r in statuses[5:]} == {429}
    assert statuses[-1].headers["Retry-After"] == "1"
    src = ScheduledEventsSource(emulator.url, vm_name="spotguard-vm-0")
    try:
        with pytest.raises(NoticeSourceError, match=r"rate limited .*HTTP 429.*Retry-After 1 s"):
            src.poll()
        time.sleep(1.1)
        # Our own polls are spaced under the limit: back to back, they never trip it.
        assert [src.poll() for _ in range(8)] == [None] * 8
    finally:
        src.close()


def test_prime_waits_for_the_slow_first_call() -> None:
    with AzureMetadataEmulator(first_call_delay_s=1.0) as emu:
        src = ScheduledEventsSource(emu.url, vm_name="spotguard-vm-0", timeout_s=0.3)
        try:
            started = time.monotonic()
            with pytest.raises(NoticeSourceError, match="no answer within 0.3 s"):
                src.poll()  # a normal poll gives up quickly
            emu.raise_notice()
            notice = src.prime(timeout_s=10)
            assert time.monotonic() - started >= 0.9
            assert notice is not None and notice.action == "preempt"
            quick = time.monotonic()
            assert src.poll().key == notice.key
            assert time.monotonic() - quick < 0.9
        finally:
            src.close()


# ---- faults end in exceptions, never hangs -------------------------------------------
@pytest.mark.parametrize(
    ("mode", "error", "message"),
    [
        ("error", NoticeSourceError, "HTTP 500"),
        ("malformed", NoticeSourceError, "not JSON"),
        ("slow", NoticeSourceError, r"^GET .*scheduledevents.* failed: no answer within 0.5 s$"),
        ("reset", NoticeSourceError, r"^GET .*scheduledevents.* failed: (Remote end closed|Connection reset)"),
    ],
)
def test_faults_raise_and_the_next_poll_recovers(emulator, mode, error, message) -> None:
    src = ScheduledEventsSource(emulator.url, vm_name="spotguard-vm-0", timeout_s=0.5)
    try:
        emulator.set_fault(mode, count=1, delay_s=3)
        started = time.monotonic()
        with pytest.raises(error, match=message):
            src.poll()
        assert time.monotonic() - started < 2.5
        emulator.raise_notice()
        assert src.poll().is_interruption
    finally:
        src.close()


# ---- endpoints and probing -----------------------------------------------------------
def test_endpoint_precedence(emulator, monkeypatch) -> None:
    [default] = notice_sources()
    assert isinstance(default, NoticeSource)
    assert default.base_url == "http://169.254.169.254" and default.blocking is False
    monkeypatch.setenv("SPOTGUARD_METADATA_URL", emulator.url + "/")
    [from_env] = notice_sources()
    assert from_env.base_url == emulator.url
    emulator.raise_notice()
    assert from_env.poll().cloud == "azure"
    [explicit] = notice_sources("127.0.0.1:1")
    assert explicit.base_url == "http://127.0.0.1:1"
    for source in (default, from_env, explicit):
        source.close()


@pytest.mark.parametrize("url", ["ftp://host", "http://host:port", "http://"])
def test_bad_metadata_url_is_a_value_error(url: str, monkeypatch) -> None:
    with pytest.raises(ValueError, match="metadata URL"):
        notice_sources(url)
    monkeypatch.setenv("SPOTGUARD_METADATA_URL", url)
    with pytest.raises(ValueError, match="metadata URL"):
        notice_sources()


def test_probe(emulator, monkeypatch) -> None:
    assert probe(emulator.url) is True
    assert probe(f"http://127.0.0.1:{free_port()}") is False
    emulator.set_fault("malformed", count=1)
    assert probe(emulator.url) is False
    emulator.set_fault("error", count=1)
    assert probe(emulator.url) is False
    monkeypatch.setenv("SPOTGUARD_METADATA_URL", emulator.url)
    assert probe() is True
