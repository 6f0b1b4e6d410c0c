"""A loopback HTTP server speaking the chat-completions protocol, on threads beside the caller's engine loop.

    server = ChatServer(answer, model="smollm2")     # 127.0.0.1, a free port
    server.start(); server.url                       # http://127.0.0.1:PORT/v1
    ...
    server.close()

`answer(route, request)` is called on the server's request thread and blocks until the engine loop
has the replies, one per choice (a completions request is a ChatRequest with its `prompt` set)
(rollout/chat.py hands it over); it raises BadRequest (400), NotFound (404) or Unavailable (503) to
refuse. `route` is the first path segment before `/v1` (`/ep-7/v1/chat/completions` -> "ep-7"), None
for `/v1/...`: a rollout worker gives each episode its own base URL that way; a server made with
`routes=False` (`a3po serve`) has only `/v1/...`. The server binds 127.0.0.1 unless told otherwise
and, whatever it binds, answers only peers on a loopback address (403 for the others). Every answer
is JSON, errors included: a method other than GET and POST is a 405, a bad request line or header a
400. A request with `stream: true` is answered as server-sent events (`data: {chunk}` lines, then
`data: [DONE]`) on a connection closed after them; its errors before the reply are JSON, as above.
"""

from __future__ import annotations

import ipaddress
import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from a3po.serving.protocol import (
    MAX_BODY_BYTES,
    BadRequest,
    ChatReply,
    ChatRequest,
    chat_completion,
    error,
    model_list,
    parse_chat_request,
    parse_completion_request,
    stream_chunks,
    text_completion,
)

LOOPBACK = "127.0.0.1"
_PATH = re.compile(r"^(?:/(?P<route>[A-Za-z0-9_.-]+))?/v1/(?P<what>chat/completions|completions|models)/?$")
REQUEST_READ_S = 30.0  # a client that sends its request slower than this is dropped


class NotFound(LookupError):
    """No such route (an episode that ended, a path the server does not have)."""


class Unavailable(RuntimeError):
    """The server cannot answer now (stopping, or the reply did not come within its deadline)."""


Answer = Callable[["str | None", ChatRequest], "list[ChatReply]"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: every episode of a batch connects at once (the default is 5)


class ChatServer:
    def __init__(self, answer: Answer, model: str, host: str = LOOPBACK, port: int = 0, routes: bool = True):
        self.answer, self.model, self.routes = answer, model, routes
        handler = type("Handler", (_Handler,), {"server_ref": self})
        self._httpd = _Server((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        return f"http://{'127.0.0.1' if host in ('', '0.0.0.0') else host}:{self.port}/v1"

    def route_url(self, route: str) -> str:
        return self.url[:-len("/v1")] + f"/{route}/v1"

    def start(self) -> ChatServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="a3po-chat-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5.0)
            self._thread = None
        self._httpd.server_close()


def _byte_count(header: str) -> int | None:
    """A Content-Length's value, or None if it is not one (a sign, letters, other scripts' digits)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*", header)
    if m is None:
        return None
    digits = m[1].lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else 10 ** 18  # over any limit; int() refuses past 4300 digits


class _Handler(BaseHTTPRequestHandler):
    server_ref: ChatServer
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_READ_S

    def log_message(self, format, *args):  # noqa: A002 - the base class's name; requests are not logged
        pass

    def _refuse_remote(self) -> bool:
        try:
            loopback = ipaddress.ip_address(self.client_address[0]).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            self._send(403, error("this server answers loopback clients only", "permission_error"))
        return not loopback

    def _match(self) -> re.Match | None:
        m = _PATH.match(self.path.split("?")[0])
        return None if m is None or (m["route"] is not None and not self.server_ref.routes) else m

    def do_GET(self):  # noqa: N802 - http.server's name
        if self._refuse_remote():
            return
        m = self._match()
        if m is None or m["what"] != "models":
            self._send(404, error(f"no GET {self.path}; this server has GET /v1/models", "not_found_error"))
            return
        self._send(200, model_list(self.server_ref.model))

    def do_POST(self):  # noqa: N802
        if self._refuse_remote():
            return
        server = self.server_ref
        m = self._match()
        if m is None or m["what"] == "models":
            self._drain()
            self._send(404, error(f"no POST {self.path}; this server has POST /v1/chat/completions and "
                                  "/v1/completions", "not_found_error"))
            return
        given = self.headers.get("Content-Length")
        if given is None:
            self._send(411, error("send a Content-Length header with the JSON body"), close=True)
            return
        length = _byte_count(given)
        if length is None:
            self._send(400, error(f"Content-Length: {given.strip()[:40]} is not a byte count; send the body's "
                                  "length in bytes"), close=True)
            return
        if length > MAX_BODY_BYTES:
            self._send(413, error(f"the body is {length} bytes, more than {MAX_BODY_BYTES}"), close=True)
            return
        body = self.rfile.read(length)
        text = m["what"] == "completions"
        try:
            request = (parse_completion_request if text else parse_chat_request)(body)
            replies = server.answer(m["route"], request)
        except BadRequest as e:
            self._send(400, error(str(e)))
        except NotFound as e:
            self._send(404, error(str(e), "not_found_error"))
        except Unavailable as e:
            self._send(503, error(str(e), "server_error"))
        else:
            if request.stream:
                self._stream(stream_chunks(replies, server.model, text, request.include_usage))
            else:
                self._send(200, (text_completion if text else chat_completion)(replies, server.model))

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (an unknown method, a malformed request line or header) as JSON errors."""
        if code == 501 and self.command:  # http.server's answer to a method it has no do_ method for
            self._send(405, error(f"{self.command} is not served; this server answers GET /v1/models and POST "
                                  "/v1/chat/completions and /v1/completions", "method_not_allowed"), close=True,
                       headers={"Allow": "GET, POST"})
            return
        self._send(code, error(message or explain or f"HTTP {code}"), close=True)

    def _drain(self) -> None:
        given = self.headers.get("Content-Length", "0")
        length = _byte_count(given) or 0
        if 0 < length <= MAX_BODY_BYTES:
            self.rfile.read(length)

    def _stream(self, chunks: list[dict]) -> None:
        """The reply as server-sent events; the connection closes after `[DONE]`, which ends the body."""
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left; nothing to answer

    def _send(self, status: int, payload: dict, close: bool = False, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left; nothing to answer


__all__ = ["LOOPBACK", "ChatServer", "NotFound", "Unavailable", "BadRequest"]
