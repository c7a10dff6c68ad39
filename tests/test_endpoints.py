"""The metadata HTTP session against a real server on 127.0.0.1: query strings, headers,
JSON bodies, one-line errors."""

import http.server
import json
import threading
import time

import pytest

from cloud_adapters.endpoints import MetadataSession, MetadataTimeout
from cloud_adapters.notice import NoticeSourceError
from tests.servers import free_port


class _Echo(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.dumps(
            {"method": self.command, "path": self.path, "flavor": self.headers.get("Metadata-Flavor"),
             "extra": self.headers.get("X-Extra"), "body": self.rfile.read(length).decode()}
        ).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def echo_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_query_headers_and_json_body_reach_the_server(echo_url):
    with MetadataSession({"Metadata-Flavor": "Google"}) as session:
        got = session.get(echo_url + "/a", params={"x": "1 2", "skip": None, "many": ["p", "q"]}, timeout=5).json()
        assert got["path"] == "/a?x=1+2&many=p&many=q" and got["flavor"] == "Google"
        got = session.get(echo_url + "/b?api-version=1", params={"format": "text"}, timeout=(1, 5)).json()
        assert got["path"] == "/b?api-version=1&format=text"
        answer = session.request("POST", echo_url + "/c", timeout=5, headers={"X-Extra": "y"}, json_body={"k": [1]})
        assert answer.ok and answer.headers["content-type"] == "application/json"
        assert answer.json()["extra"] == "y" and json.loads(answer.json()["body"]) == {"k": [1]}


def test_no_answer_is_one_line_and_says_why():
    with MetadataSession() as session:
        with pytest.raises(
            NoticeSourceError, match=r"^GET http://127.0.0.1:\d+/x failed: \[Errno 111\] Connection refused$"
        ):
            session.get(f"http://127.0.0.1:{free_port()}/x", timeout=2)


def test_a_server_that_accepts_but_never_answers_is_a_read_timeout():
    import socket

    with socket.socket() as listener, MetadataSession() as session:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with pytest.raises(MetadataTimeout, match=r"failed: no answer within 0.3 s$") as caught:
            session.put(f"http://127.0.0.1:{listener.getsockname()[1]}/t", timeout=0.3)
        assert caught.value.connected


class _Drip(http.server.BaseHTTPRequestHandler):
    """Headers at once, then the body one byte every 0.1 s: every read is quick, the whole is not."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        chunked = self.path == "/chunked"
        self.send_response(200)
        self.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", "40")))
        self.end_headers()
        try:
            for _ in range(40):
                self.wfile.write(b"1\r\nx\r\n" if chunked else b"x")
                time.sleep(0.1)
            self.wfile.write(b"0\r\n\r\n" if chunked else b"")
        except OSError:
            pass  # the client gave up

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("path", ["/sized", "/chunked"])
def test_a_slow_drip_answer_ends_at_the_whole_response_deadline(path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with MetadataSession() as session:
            started = time.monotonic()
            with pytest.raises(MetadataTimeout, match=r"failed: answer incomplete after \d+\.\d s$"):
                session.get(f"http://127.0.0.1:{server.server_address[1]}{path}", timeout=0.5)
            assert time.monotonic() - started < 2.0  # connect + read timeouts in all, not 40 quick reads
    finally:
        server.shutdown()
