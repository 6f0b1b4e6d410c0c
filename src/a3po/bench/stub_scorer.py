"""A reward service standing in for a slow reward model in `a3po bench e2e`'s `service` arm.

It answers the scorer protocol (services/scorer.py) on 127.0.0.1 with the built-in `exact`
reward of each completion, after `delay_s`: the run trains on the same reward as a rule-reward
run, so the two differ only in where the reward is computed and how long it takes.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from a3po.data import Example
from a3po.data.rewards import ExactReward


class StubScorer:
    def __init__(self, delay_s: float):
        reward, stop = ExactReward(), threading.Event()
        self._stop = stop

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
                stop.wait(delay_s)  # the reward model's latency (cut short when the benchmark ends)
                scores = [reward(i["completion"], Example(i["prompt"], i["answer"], 0)) for i in items]
                data = json.dumps({"scores": scores}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="a3po-stub-scorer", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/score"

    def __enter__(self) -> StubScorer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
