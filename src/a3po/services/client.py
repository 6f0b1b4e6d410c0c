"""The client side every reward service shares: a concurrency cap, deadlines, retries, micro-batches.

    client = ServiceClient(score_batch, max_concurrency=4, batch_size=8, timeout_s=30, retries=3, backoff_s=0.5)
    client.submit(key, items)        # returns at once; the requests run on the client's threads
    for got in client.poll(): ...    # Scored: a group's results once every batch answered

`score_batch(items, timeout_s) -> list[float]` is one request (judge.py, scorer.py): it raises
`Retry` for what may pass on a new attempt (no connection, a timeout, 429, 5xx) and `Refused`
for what will not (another 4xx, an answer that cannot be read). A key's items go in
ceil(n / batch_size) requests; at most `max_concurrency` are in flight, the others queue. A
request that keeps failing is retried `retries` times, waiting backoff_s x 2^k x a random
0.5..1.5 before attempt k + 1 (jitter, so workers that failed together do not retry together).
Every failure ends as an answer, never an exception: a score of None with the reason.
"""

from __future__ import annotations

import json
import queue
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

RETRY_STATUS = (408, 429, 500, 502, 503, 504)


class Retry(Exception):
    """A failure a later attempt may not have."""


class Refused(Exception):
    """A failure every attempt would have."""


@dataclass(frozen=True)
class Scored:
    key: Hashable
    scores: list[float | None]  # None where the service failed ...
    failures: list[str | None]  # ... and why
    seconds: float  # from submit to the last answer


@dataclass
class _Group:
    scores: list[float | None]
    failures: list[str | None]
    batches_left: int
    started: float = field(default_factory=time.perf_counter)


class ServiceClient:
    def __init__(self, score_batch: Callable[[list[Any], float], list[float]], *, max_concurrency: int,
                 batch_size: int, timeout_s: float, retries: int, backoff_s: float, name: str = "reward service"):
        self.score_batch, self.batch_size = score_batch, batch_size
        self.timeout_s, self.retries, self.backoff_s, self.name = timeout_s, retries, backoff_s, name
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="a3po-reward-service")
        self._groups: dict[Hashable, _Group] = {}
        self._done: queue.Queue = queue.Queue()
        self._lock = threading.Lock()

    def submit(self, key: Hashable, items: list[Any]) -> None:
        batches = [list(range(i, min(i + self.batch_size, len(items)))) for i in range(0, len(items), self.batch_size)]
        self._groups[key] = _Group([None] * len(items), [None] * len(items), len(batches))
        for idx in batches:
            self._pool.submit(self._run, key, idx, [items[i] for i in idx])

    def poll(self, block_s: float = 0.0) -> list[Scored]:
        """Every key whose batches have all answered."""
        out = []
        try:
            out.append(self._done.get(timeout=block_s) if block_s > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, key: Hashable, idx: list[int], items: list[Any]) -> None:
        scores, failure = self._attempts(items)
        with self._lock:
            g = self._groups[key]
            for j, i in enumerate(idx):
                g.scores[i] = None if scores is None else scores[j]
                g.failures[i] = failure
            g.batches_left -= 1
            if g.batches_left:
                return
            del self._groups[key]
        self._done.put(Scored(key, g.scores, g.failures, time.perf_counter() - g.started))

    def _attempts(self, items: list[Any]) -> tuple[list[float] | None, str | None]:
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
            try:
                scores = self.score_batch(items, self.timeout_s)
            except Retry as e:
                why = str(e)
                continue
            except Refused as e:
                return None, f"{self.name}: {e}"
            except Exception as e:  # a bug in reading the answer must not kill the worker's thread silently
                return None, f"{self.name}: {type(e).__name__}: {e}"
            if len(scores) != len(items):
                return None, f"{self.name}: {len(scores)} scores for {len(items)} completions"
            return scores, None
        tries = self.retries + 1
        return None, f"{self.name}: {why} ({tries} attempt{'s' if tries > 1 else ''})"


def post_json(url: str, payload: dict, timeout_s: float, api_key: str | None = None) -> Any:
    """POST `payload` as JSON and read the JSON answer; Retry or Refused on failure, saying why."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:200].decode(errors="replace")
        err = Retry if e.code in RETRY_STATUS else Refused
        raise err(f"HTTP {e.code} from {url}: {detail}") from None
    except TimeoutError:
        raise Retry(f"no answer from {url} within {timeout_s:g}s") from None
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise Retry(f"no answer from {url} within {timeout_s:g}s") from None
        raise Retry(f"cannot reach {url}: {reason}") from None
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise Refused(f"the answer from {url} is not JSON: {body[:80]!r}") from None
