"""Real HTTP servers on 127.0.0.1 standing in for reward services: they answer what a test tells them,
optionally late or not at all, and count calls and the peak number of requests in flight."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeService:
    """`respond(body, n) -> (status, payload)` answers the n-th call (1-based); `hold` (an Event) keeps every
    request open until it is set; `delay_s` holds each one that long (a slow server)."""

    def __init__(self, respond, delay_s: float = 0.0):
        self.respond, self.delay_s = respond, delay_s
        self.calls, self.bodies, self.headers = 0, [], []
        self.in_flight = self.peak = 0
        self.hold: threading.Event | None = None
        self._lock = threading.Lock()
        self._released = threading.Event()
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service._lock:
                    service.calls += 1
                    n = service.calls
                    service.bodies.append(body)
                    service.headers.append(dict(self.headers))
                    service.in_flight += 1
                    service.peak = max(service.peak, service.in_flight)
                try:
                    if service.hold is not None:
                        service.hold.wait(30)
                    if service.delay_s:
                        service._released.wait(service.delay_s)  # a slow answer, cut short when the test ends
                    status, payload = service.respond(body, n)
                finally:
                    with service._lock:
                        service.in_flight -= 1
                data = json.dumps(payload).encode() if not isinstance(payload, bytes) else payload
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._released.set()
        if self.hold is not None:
            self.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def scores_by_length(body, n):
    """A scorer: each completion's score is its length."""
    return 200, {"scores": [len(item["completion"]) for item in body["items"]]}


def judge_saying(text):
    """A judge whose every answer is `text`."""
    return lambda body, n: (200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})
