"""The router app under uvicorn in a background thread, for service tests, and a /metrics reader."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from services.procs import free_port
from services.router.app import RouterConfig, create_app
from services.router.http.edge import uvicorn_config

# Workers started by a test module (conftest.py's `workers`) answer on the module's event loop,
# which the test's own client code holds now and then: an SDK imported on first use, the openai
# client building its response models on a first call (measured: up to 5 s on a loaded 2-core
# machine). Five late load reports in a row mark a worker unhealthy (a 503 for the next request),
# so routers over such workers give a report 3 s, not 1 s. Frozen-worker tests keep the default.
IN_LOOP_LOAD_TIMEOUT_S = 3.0


class ServedRouter:
    """The router app (or any ASGI app) under uvicorn in a background thread (its own event loop).
    A port taken between `free_port` and the bind (another test process under `make test`'s
    two) is retried on a new port."""

    BIND_TRIES = 5

    def __init__(self, config: RouterConfig | Any) -> None:
        self.config = config
        self.router = config if isinstance(config, RouterConfig) else RouterConfig(model="m", tokenizer="m")
        self._make()

    def _make(self) -> None:
        """A new port and server; a new router app too (a failed start ran its lifespan)."""
        self.port = free_port()
        app = create_app(self.config) if isinstance(self.config, RouterConfig) else self.config
        self.server = uvicorn.Server(uvicorn_config(app, self.router, host="127.0.0.1",
                                                    port=self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServedRouter:
        for attempt in range(self.BIND_TRIES):
            self.thread.start()
            deadline = time.monotonic() + 30
            while not self.server.started and self.thread.is_alive():
                assert time.monotonic() < deadline, "router did not start"
                time.sleep(0.02)
            if self.server.started:
                return self
            if attempt + 1 < self.BIND_TRIES:  # died before serving: most likely the bind
                self._make()
        raise AssertionError(f"router thread died {self.BIND_TRIES} times (last port {self.port})")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics by (name, sorted labels)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels`."""
        return sum(v for (n, ls), v in self.metrics().items()
                   if n == name and all((k, val) in ls for k, val in labels.items()))


@contextlib.contextmanager
def serving(configs: Mapping[str, RouterConfig | Any]) -> Iterator[dict[str, ServedRouter]]:
    """A ServedRouter per config, by name, all started; all stopped at the end."""
    served = {name: ServedRouter(c) for name, c in configs.items()}
    started: list[ServedRouter] = []
    try:
        for r in served.values():
            started.append(r.__enter__())
        yield served
    finally:
        for r in started:
            r.__exit__(None, None, None)
