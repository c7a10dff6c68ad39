"""GCP notices against the GCE metadata emulator over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import requests

from cloud_adapters.gcp.emulator import GCPMetadataEmulator
from cloud_adapters.gcp.metadata import (
    MaintenanceSource,
    PreemptionSource,
    notice_sources,
    probe,
)
from cloud_adapters.notice import INTERRUPTION, MAINTENANCE, NoticeSource, NoticeSourceError, parse_iso8601
from tests.servers import FaultProxy

HANG_S = 1  # timeout_sec of the hanging GETs in these tests


@pytest.fixture
def emulator() -> Iterator[GCPMetadataEmulator]:
    with GCPMetadataEmulator() as emu:
        yield emu


@pytest.fixture
def preempted(emulator: GCPMetadataEmulator) -> Iterator[PreemptionSource]:
    source = PreemptionSource(emulator.url, hang_timeout_s=HANG_S, request_timeout_s=2.0)
    yield source
    source.close()


@pytest.fixture
def maintenance(emulator: GCPMetadataEmulator) -> Iterator[MaintenanceSource]:
    source = MaintenanceSource(emulator.url, hang_timeout_s=HANG_S, request_timeout_s=2.0)
    yield source
    source.close()


@pytest.fixture
def raw() -> Iterator[requests.Session]:
    session = requests.Session()
    session.trust_env = False  # straight to 127.0.0.1, never through a proxy
    yield session
    session.close()


def refused_url() -> str:
    """A localhost URL on which nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def poll_in_thread(source: NoticeSource) -> tuple[threading.Thread, dict]:
    """Start `source.poll()` on a thread; the dict gets `notice` or `error`, and `returned_at`."""
    result: dict = {}

    def run() -> None:
        try:
            result["notice"] = source.poll()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc
        result["returned_at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_for_requests(emulator: GCPMetadataEmulator, count: int) -> None:
    deadline = time.monotonic() + 5
    while emulator.requests_seen < count:
        assert time.monotonic() < deadline, "the poll never reached the emulator"
        time.sleep(0.005)
    time.sleep(0.05)  # let the handler start waiting


# ---- preemption ---------------------------------------------------------------------


def test_no_notice_is_none(preempted: PreemptionSource, maintenance: MaintenanceSource) -> None:
    assert preempted.blocking and maintenance.blocking
    assert preempted.poll() is None
    assert maintenance.poll() is None


def test_preemption_wakes_a_hanging_poll_at_once(emulator: GCPMetadataEmulator) -> None:
    source = PreemptionSource(emulator.url, hang_timeout_s=20)
    try:
        assert source.poll() is None  # reads the value and its ETag without waiting
        thread, result = poll_in_thread(source)
        wait_for_requests(emulator, 2)
        assert thread.is_alive(), "the second poll should hang on the server"
        raised_at = time.monotonic()
        emulator.raise_notice()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the preemption did not end the hanging GET"
        latency = result["returned_at"] - raised_at
        print(f"hanging GET returned {latency * 1000:.1f} ms after the preemption")
        assert latency < 1.0
        notice = result["notice"]
        assert notice.cloud == "gcp" and notice.kind == INTERRUPTION and notice.action == "preempt"
        assert notice.source == "gcp:instance/preempted"
        assert notice.deadline - notice.detected_at == timedelta(seconds=30)
        assert notice.detail["value"] == "TRUE"
        # Same event on the next poll (the hang times out with the value unchanged): same key, same deadline.
        source.hang_timeout_s = 1
        again = source.poll()
        assert again.key == notice.key and again.deadline == notice.deadline
    finally:
        source.close()


def test_hanging_poll_returns_none_after_timeout(emulator: GCPMetadataEmulator, preempted: PreemptionSource) -> None:
    assert preempted.poll() is None
    started = time.monotonic()
    thread, result = poll_in_thread(preempted)
    wait_for_requests(emulator, 2)
    # A change elsewhere wakes the server's waiters but must not end a hang on an unchanged key.
    emulator.raise_notice(kind="maintenance", event="MIGRATE_ON_HOST_MAINTENANCE")
    thread.join(timeout=HANG_S + 5)
    assert "error" not in result and result["notice"] is None
    assert HANG_S - 0.1 < result["returned_at"] - started < HANG_S + 2


def test_without_an_etag_a_change_between_polls_is_seen_within_the_interval(emulator: GCPMetadataEmulator) -> None:
    proxy = FaultProxy(emulator.url)
    proxy.drop_headers = {"etag"}  # something between us and the server strips it
    source = PreemptionSource(proxy.url, hang_timeout_s=15)
    try:
        assert source.poll() is None
        emulator.raise_notice()  # between two polls: a hang "for a change from now" would miss it
        started = time.monotonic()
        assert source.poll().is_interruption
        assert time.monotonic() - started < 3
    finally:
        source.close()
        proxy.close()


def test_stopping_the_emulator_ends_a_hanging_poll(emulator: GCPMetadataEmulator) -> None:
    source = PreemptionSource(emulator.url, hang_timeout_s=30)
    try:
        source.poll()
        thread, result = poll_in_thread(source)
        wait_for_requests(emulator, 2)
        started = time.monotonic()
        emulator.stop()
        thread.join(timeout=10)
        assert time.monotonic() - started < 3
        assert isinstance(result["error"], NoticeSourceError) and "\n" not in str(result["error"])
    finally:
        source.close()


def test_stopping_the_emulator_does_not_wait_for_a_hanging_poll_whose_client_left(
    emulator: GCPMetadataEmulator,
) -> None:
    """aiohttp lets a handler run on after its client closed the connection: stop() cancels it rather than
    waiting out its 60 s (it waited 10 s, then left the loop's thread behind)."""
    client = socket.create_connection(("127.0.0.1", emulator.port))
    client.sendall(
        b"GET /computeMetadata/v1/instance/preempted?wait_for_change=true&timeout_sec=60 HTTP/1.1\r\n"
        b"Host: metadata\r\nMetadata-Flavor: Google\r\n\r\n"
    )
    wait_for_requests(emulator, 1)
    client.close()
    started = time.monotonic()
    emulator.stop()
    assert time.monotonic() - started < 3


def test_hanging_polls_cancelled_as_their_wait_times_out_leave_the_next_one_woken_by_a_change(
    emulator: GCPMetadataEmulator,
) -> None:
    """Handlers cancelled at the moment their wait for a change times out (aiohttp cancels the handler of
    a client that left) leave nothing behind. Waiting on a Condition under asyncio.wait_for, on Python
    3.11 they left its lock taken: no change woke a hanging GET again, each answered only at its timeout."""

    async def cancelled_as_they_time_out(delay_s: float) -> None:
        version = emulator.version
        waiters = [asyncio.ensure_future(emulator.wait_for_change(version, 0.05)) for _ in range(20)]
        await asyncio.sleep(0.05 + delay_s)
        for waiter in waiters:
            waiter.cancel()
        await asyncio.wait(waiters)

    for delay_s in (0.0, 0.0002, 0.0005, 0.001, 0.002):
        asyncio.run_coroutine_threadsafe(cancelled_as_they_time_out(delay_s), emulator._loop).result(timeout=5)
    source = PreemptionSource(emulator.url, hang_timeout_s=20)
    try:
        assert source.poll() is None
        thread, result = poll_in_thread(source)
        wait_for_requests(emulator, 2)
        raised_at = time.monotonic()
        emulator.raise_notice()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the change did not wake the hanging GET"
        assert result["notice"].is_interruption and result["returned_at"] - raised_at < 1.0
    finally:
        source.close()


def test_preemption_seen_on_first_poll(emulator: GCPMetadataEmulator, preempted: PreemptionSource) -> None:
    emulator.raise_notice(kind="preempt")
    notice = preempted.poll()
    assert notice is not None and notice.is_interruption
    emulator.clear()
    assert preempted.poll() is None  # the hang returns at once: the value changed since the last ETag


# ---- host maintenance -----------------------------------------------------------------


def test_terminate_maintenance_without_window(emulator: GCPMetadataEmulator, maintenance: MaintenanceSource) -> None:
    emulator.raise_notice(kind="maintenance", event="TERMINATE_ON_HOST_MAINTENANCE")
    notice = maintenance.poll()
    assert notice.kind == INTERRUPTION and notice.action == "terminate-on-host-maintenance"
    assert notice.source == "gcp:instance/maintenance-event"
    assert notice.deadline - notice.detected_at == timedelta(seconds=3600)
    assert notice.detail["upcoming_maintenance"] is None


def test_terminate_maintenance_with_window(emulator: GCPMetadataEmulator, maintenance: MaintenanceSource) -> None:
    emulator.raise_notice(kind="maintenance", event="TERMINATE_ON_HOST_MAINTENANCE", window_start_in_s=300)
    notice = maintenance.poll()
    assert notice.kind == INTERRUPTION
    window = notice.detail["upcoming_maintenance"]
    assert window["maintenance_status"] == "PENDING"
    assert notice.deadline == parse_iso8601(window["window_start_time"])
    assert 290 < notice.seconds_left() <= 300


def test_migrate_maintenance_is_an_advisory(emulator: GCPMetadataEmulator, maintenance: MaintenanceSource) -> None:
    assert maintenance.poll() is None
    thread, result = poll_in_thread(maintenance)
    wait_for_requests(emulator, 2)
    emulator.raise_notice(kind="maintenance", event="MIGRATE_ON_HOST_MAINTENANCE")
    thread.join(timeout=5)
    notice = result["notice"]
    assert notice.kind == MAINTENANCE and notice.action == "migrate-on-host-maintenance"
    assert notice.deadline is None and not notice.is_interruption


# ---- the emulator is as strict as the real server --------------------------------------


def test_metadata_flavor_header_required(emulator: GCPMetadataEmulator, raw: requests.Session) -> None:
    url = emulator.url + "/computeMetadata/v1/instance/preempted"
    assert raw.get(url).status_code == 403
    assert raw.get(url, headers={"Metadata-Flavor": "Google", "X-Forwarded-For": "10.0.0.1"}).status_code == 403
    answer = raw.get(url, headers={"Metadata-Flavor": "Google"})
    assert answer.status_code == 200 and answer.text == "FALSE"
    assert answer.headers["Metadata-Flavor"] == "Google" and answer.headers["ETag"]
    assert answer.headers["Content-Type"].startswith("application/text")
    upcoming = raw.get(
        emulator.url + "/computeMetadata/v1/instance/upcoming-maintenance", headers={"Metadata-Flavor": "Google"}
    )
    assert upcoming.status_code == 404


def test_stale_etag_answers_at_once(emulator: GCPMetadataEmulator, raw: requests.Session) -> None:
    url = emulator.url + "/computeMetadata/v1/instance/preempted"
    started = time.monotonic()
    answer = raw.get(
        url,
        params={"wait_for_change": "true", "last_etag": "0000", "timeout_sec": 30},
        headers={"Metadata-Flavor": "Google"},
        timeout=5,
    )
    assert answer.text == "FALSE" and time.monotonic() - started < 1


# ---- failures --------------------------------------------------------------------------


def test_brief_503s_are_retried(emulator: GCPMetadataEmulator, preempted: PreemptionSource) -> None:
    emulator.raise_notice()
    emulator.set_fault("error", count=2, status=503)
    assert preempted.poll().is_interruption
    assert emulator.requests_seen == 3


def test_persistent_500_raises(emulator: GCPMetadataEmulator, preempted: PreemptionSource) -> None:
    emulator.set_fault("error", status=500)
    with pytest.raises(NoticeSourceError, match="HTTP 500"):
        preempted.poll()
    assert emulator.requests_seen == 1  # only 503 is retried


def test_malformed_answer_raises(
    emulator: GCPMetadataEmulator, preempted: PreemptionSource, maintenance: MaintenanceSource
) -> None:
    emulator.set_fault("malformed")
    with pytest.raises(NoticeSourceError, match="expected TRUE or FALSE"):
        preempted.poll()
    with pytest.raises(NoticeSourceError, match="expected NONE"):
        maintenance.poll()


def test_malformed_window_keeps_the_notice(emulator: GCPMetadataEmulator, maintenance: MaintenanceSource) -> None:
    emulator.raise_notice(kind="maintenance", event="TERMINATE_ON_HOST_MAINTENANCE", window_start_in_s=60)
    emulator.upcoming_maintenance = {"window_start_time": "next tuesday"}
    notice = maintenance.poll()
    assert notice.is_interruption and notice.deadline - notice.detected_at == timedelta(seconds=3600)


def test_slow_answer_times_out(emulator: GCPMetadataEmulator) -> None:
    source = PreemptionSource(emulator.url, hang_timeout_s=HANG_S, request_timeout_s=0.3)
    emulator.set_fault("slow", count=1, delay_s=1.5)
    started = time.monotonic()
    with pytest.raises(NoticeSourceError, match=r"^GET .*instance/preempted failed: no answer within 0.3 s$"):
        source.poll()
    assert time.monotonic() - started < 1.0
    source.close()


def test_refused_port_raises() -> None:
    source = PreemptionSource(refused_url(), hang_timeout_s=HANG_S, request_timeout_s=1.0)
    with pytest.raises(NoticeSourceError, match=r"failed: \[Errno 111\] Connection refused$"):
        source.poll()
    source.close()


# ---- control endpoint, endpoint resolution, probe ----------------------------------------


def test_control_endpoint_with_delay(
    emulator: GCPMetadataEmulator, preempted: PreemptionSource, raw: requests.Session
) -> None:
    assert preempted.poll() is None
    answer = raw.post(emulator.url + "/_spotguard/notice", json={"kind": "preempt", "after_s": 0.3}, timeout=5)
    assert answer.json() == {"ok": True, "after_s": 0.3}
    posted_at = time.monotonic()
    notice = preempted.poll()  # hangs until the delayed notice lands
    assert notice is not None and notice.is_interruption
    assert 0.25 < time.monotonic() - posted_at < HANG_S
    bad = raw.post(emulator.url + "/_spotguard/notice", json={"kind": "maintenance", "event": "REBOOT"}, timeout=5)
    assert bad.status_code == 400 and "REBOOT" in bad.json()["error"]


def test_endpoint_precedence(emulator: GCPMetadataEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTGUARD_METADATA_URL", raising=False)
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    assert {s.base_url for s in notice_sources()} == {"http://metadata.google.internal"}  # not contacted

    host = f"127.0.0.1:{emulator.port}"  # GCE_METADATA_HOST is host[:port], no scheme
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    sources = notice_sources()
    assert [s.name for s in sources] == ["gcp:instance/preempted", "gcp:instance/maintenance-event"]
    assert all(isinstance(s, NoticeSource) for s in sources)
    emulator.raise_notice()
    assert sources[0].poll().is_interruption
    for source in sources:
        source.close()

    monkeypatch.setenv("SPOTGUARD_METADATA_URL", "http://127.0.0.1:1")
    assert notice_sources()[0].base_url == "http://127.0.0.1:1"
    assert notice_sources(emulator.url)[0].base_url == emulator.url

    with pytest.raises(ValueError, match="metadata URL"):
        notice_sources("ftp://127.0.0.1")
    with pytest.raises(ValueError, match="invalid port"):
        notice_sources("127.0.0.1:port")


class _NotGoogle(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"12345")

    def log_message(self, *args: object) -> None:
        pass


def test_probe(emulator: GCPMetadataEmulator) -> None:
    assert probe(emulator.url) is True
    assert probe(refused_url()) is False
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotGoogle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert probe(f"http://127.0.0.1:{server.server_port}", timeout_s=2) is False  # 200, but not GCE
    finally:
        server.shutdown()
        server.server_close()
    emulator.set_fault("error", status=500)
    assert probe(emulator.url) is False
