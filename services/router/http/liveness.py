"""The router's liveness, answered off the event loop: whatever a request does to the loop, the
liveness probe is answered at once and says how long ago the loop last ran.

    watch = LoopWatch()                      # in the loop: asyncio.create_task(watch.run())
    server = LivenessServer(watch, host, port, stall_s=30)   # a thread with its own socket
    server.start(); ...; server.stop()

`GET /livez` on that port: 200 `{"status": "alive", "loop_lag_s": ...}` while the loop ran within
`stall_s`; 503 once it has not for that long (hung: a restart helps). A loop busy for a moment
(a large request being parsed) is still alive. `/livez` on the API port is kept for probes that
use it (answered by the loop, so a busy loop delays it).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopWatch:
    """A task of the event loop stamps the time every `every_s`; any thread reads the lag."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.stamp = time.monotonic()

    async def run(self) -> None:
        while True:
            self.stamp = time.monotonic()
            await asyncio.sleep(self.every_s)

    @property
    def lag_s(self) -> float:
        """Seconds since the loop last ran (its own sleep included)."""
        return max(0.0, time.monotonic() - self.stamp)


class LivenessServer:
    """GET /livez (any other path: 404) in a thread, on `host:port` (port 0: any free one)."""

    def __init__(self, watch: LoopWatch, host: str, port: int, stall_s: float, instance_id: str = "") -> None:
        if stall_s <= 0:
            raise ValueError(f"liveness stall_s: must be positive, got {stall_s}")
        self.watch, self.stall_s, self.instance_id = watch, stall_s, instance_id
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="liveness", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/livez":
                    self._answer(404, {"error": "not found: this port answers GET /livez only"})
                    return
                lag = server.watch.lag_s
                alive = lag <= server.stall_s
                self._answer(200 if alive else 503, {"status": "alive" if alive else "stalled",
                                                     "loop_lag_s": round(lag, 3),
                                                     "instance_id": server.instance_id})

            def _answer(self, status: int, body: dict[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                return  # probes every few seconds: no access log

        return Handler
