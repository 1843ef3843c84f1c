"""Locust users that stream OpenAI completions and report TTFT, every inter-token gap (ITL), TPOT
and E2E as locust request events (request_type TTFT / ITL / TPOT / E2E, name = the workload).

Two ways to load the server:
- `StreamingUser` (closed loop): each locust user sends its next request as soon as the last one
  ended; load = the user count (`-u`).
- `PoissonUser` (open loop): one user issues requests at Poisson arrival times of rate
  `PDSERVE_LT_RATE` per second, each in its own greenlet, whether or not earlier ones finished
  (bounded by `PDSERVE_LT_MAX_INFLIGHT`); run it with `-u 1`.

Configuration by environment (the runner, loadtest/run.py, sets it): PDSERVE_LT_WORKLOAD
(random | long-prompt | shared-prefix | prompt-heavy | smoke), PDSERVE_LT_MODEL (served model
name), PDSERVE_LT_VOCAB,
PDSERVE_LT_SEED, PDSERVE_LT_API (completions | chat), PDSERVE_LT_MAX_REQUESTS (the run stops after
that many requests ended), PDSERVE_LT_TIMEOUT_S (per request), PDSERVE_LT_LOG (a JSON-lines file
with one record per request, for the report), PDSERVE_LT_API_KEY. Every run is bounded: locust's
`--run-time` and the request count; traffic goes only to `--host` (loopback in our runs).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from typing import Any

import gevent
import gevent.pool
import locust.stats
from locust import HttpUser, constant, events, task
from locust.env import Environment

from loadtest.workloads import RequestSpec, requests

locust.stats.CSV_STATS_INTERVAL_SEC = 0.5  # type: ignore[assignment]  # int-typed, float-safe (gevent.sleep)

WORKLOAD = os.environ.get("PDSERVE_LT_WORKLOAD", "random")
MODEL = os.environ.get("PDSERVE_LT_MODEL", "smollm2-135m-instruct")
API = os.environ.get("PDSERVE_LT_API", "completions")
RATE = float(os.environ.get("PDSERVE_LT_RATE", "1"))
MAX_REQUESTS = int(os.environ.get("PDSERVE_LT_MAX_REQUESTS", "100"))
MAX_INFLIGHT = int(os.environ.get("PDSERVE_LT_MAX_INFLIGHT", "256"))
TIMEOUT_S = float(os.environ.get("PDSERVE_LT_TIMEOUT_S", "300"))
LOG_PATH = os.environ.get("PDSERVE_LT_LOG", "")
API_KEY = os.environ.get("PDSERVE_LT_API_KEY", "")


class _Shared:
    """The request sequence and counters shared by every user of this locust process."""

    def __init__(self) -> None:
        self.specs = requests(WORKLOAD, int(os.environ.get("PDSERVE_LT_VOCAB", "49152")),
                              int(os.environ.get("PDSERVE_LT_SEED", "0")))
        self.lock = threading.Lock()
        self.issued = 0
        self.ended = 0
        self.inflight = 0
        self.log = open(LOG_PATH, "a", buffering=1) if LOG_PATH else None  # noqa: SIM115
        self.tokenizer: Any = None

    def next_spec(self) -> RequestSpec | None:
        with self.lock:
            if self.issued >= MAX_REQUESTS:
                return None
            self.issued += 1
            return next(self.specs)

    def record(self, env: Environment, row: dict[str, Any]) -> None:
        with self.lock:
            self.ended += 1
            if self.log is not None:
                self.log.write(json.dumps(row) + "\n")
            done = self.ended >= MAX_REQUESTS
        if done and env.runner is not None:
            # every request ended: stop the run once locust's CSV writer (every 0.5 s) has the
            # final figures (it writes nothing more on quit)
            gevent.spawn_later(1.5, env.runner.quit)


SHARED = _Shared()


def _body(spec: RequestSpec) -> tuple[str, dict[str, Any]]:
    common = {"model": MODEL, "max_tokens": spec.max_tokens, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}
    if API == "chat":
        if SHARED.tokenizer is None:
            from transformers import AutoTokenizer

            SHARED.tokenizer = AutoTokenizer.from_pretrained(os.environ["PDSERVE_LT_TOKENIZER"])
        text = SHARED.tokenizer.decode(spec.prompt_ids)
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**common, "prompt": spec.prompt_ids}


def _fire(env: Environment, kind: str, seconds: float, length: int = 0, error: Exception | None = None
          ) -> None:
    env.events.request.fire(request_type=kind, name=WORKLOAD, response_time=seconds * 1000,
                            response_length=length, exception=error, context={})


def run_one(user: HttpUser, spec: RequestSpec) -> None:
    """Sends one streamed request; fires TTFT, ITL (each gap), TPOT and E2E events; logs it."""
    env = user.environment
    path, body = _body(spec)
    headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
    start = time.perf_counter()
    wall = time.time()
    first: float | None = None
    last = start
    itls: list[float] = []
    tokens = 0
    error = ""
    try:
        client = user.client
        with client.post(path, json=body, headers=headers, stream=True, timeout=TIMEOUT_S,
                         name=f"{WORKLOAD} {path}", catch_response=True) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                resp.failure(error)
            else:
                for line in resp.iter_lines():
                    if not line or not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = f"stream error: {chunk['error'].get('message', '')[:200]}"
                        break
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
                    choices = chunk.get("choices") or []
                    has_text = any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices)
                    if not has_text:
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itls.append(now - last)
                    last = now
                if error:
                    resp.failure(error)
                else:
                    resp.success()
    except Exception as e:  # connection refused, timeout, malformed stream
        error = f"{type(e).__name__}: {e}"[:300]
    end = time.perf_counter()
    if not error and first is None:
        error = "no token received"
    if error:
        _fire(env, "E2E", end - start, error=RuntimeError(error))
    else:
        assert first is not None
        _fire(env, "TTFT", first - start)
        for gap in itls:
            _fire(env, "ITL", gap)
        if tokens > 1:
            _fire(env, "TPOT", (end - first) / (tokens - 1))
        _fire(env, "E2E", end - start, length=tokens)
    SHARED.record(env, {"index": spec.index, "start": wall, "prompt_tokens": len(spec.prompt_ids),
                        "max_tokens": spec.max_tokens, "output_tokens": tokens,
                        "ttft": None if first is None else first - start, "itls": itls,
                        "e2e": end - start, "ok": not error, "error": error})


class StreamingUser(HttpUser):
    """Closed loop: the next request as soon as the previous one ended."""

    wait_time = constant(0)

    @task
    def generate(self) -> None:
        spec = SHARED.next_spec()
        if spec is None:
            gevent.sleep(0.5)  # this user is done; the run stops when every request ended
            return
        run_one(self, spec)


class PoissonUser(HttpUser):
    """Open loop: requests start at Poisson arrival times (PDSERVE_LT_RATE per second)."""

    fixed_count = 1
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = random.Random(int(os.environ.get("PDSERVE_LT_SEED", "0")))
        self.pool = gevent.pool.Pool(MAX_INFLIGHT)

    @task
    def arrive(self) -> None:
        gevent.sleep(self.rng.expovariate(RATE))
        spec = SHARED.next_spec()
        if spec is None:
            self.pool.join(timeout=TIMEOUT_S)
            gevent.sleep(0.5)
            return
        self.pool.spawn(run_one, self, spec)


@events.quitting.add_listener
def _close_log(environment: Environment, **_: Any) -> None:
    if SHARED.log is not None:
        SHARED.log.flush()

