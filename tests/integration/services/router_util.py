"""The router app under uvicorn in a background thread, for service tests, and a /metrics reader."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from services.procs import free_port
from services.router.app import RouterConfig, create_app
from services.router.edge import uvicorn_config


class ServedRouter:
    """The router app (or any ASGI app) under uvicorn in a background thread (its own event loop)."""

    def __init__(self, config: RouterConfig | Any) -> None:
        self.port = free_port()
        router = config if isinstance(config, RouterConfig) else RouterConfig(model="m", tokenizer="m")
        app = create_app(config) if isinstance(config, RouterConfig) else config
        self.server = uvicorn.Server(uvicorn_config(app, router, host="127.0.0.1", port=self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServedRouter:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "router did not start"
            assert self.thread.is_alive(), "router thread died"
            time.sleep(0.02)
        return self

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
