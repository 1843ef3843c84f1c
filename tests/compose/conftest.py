"""The compose tests run the real `docker compose` stack (compose.yaml) and need a Docker engine,
the compose v2 plugin and the images from docker/build_images.sh (`make test-compose` does all
three). They are skipped unless PDSERVE_RUN_COMPOSE=1; once asked for, a missing engine, plugin
or image fails them instead of skipping.

The `compose_stack` fixture brings a project with a unique name up (`up --wait`), publishes the
router on a free 127.0.0.1 port and always takes the project down again (`down -v`: its
containers, network and model volume only)."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator

import pytest

from services.procs import free_port
from tests.compose.stack import IMAGES, ComposeStack, compose

UP_TIMEOUT_S = 600
DOWN_TIMEOUT_S = 120


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PDSERVE_RUN_COMPOSE") == "1":
        return
    skip = pytest.mark.skip(reason="compose: needs Docker; run with PDSERVE_RUN_COMPOSE=1 "
                                   "(make test-compose)")
    for item in items:
        if "compose" in item.keywords:
            item.add_marker(skip)


def _require_docker() -> None:
    for argv, what in ((["docker", "info"], "a running Docker engine"),
                       (["docker", "compose", "version"], "the docker compose v2 plugin")):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.fail(f"compose tests need {what}: {exc} (run docker/install_docker.sh)")
        if done.returncode != 0:
            pytest.fail(f"compose tests need {what}: {done.stderr.strip()} (run docker/install_docker.sh)")
    for image in IMAGES:
        found = subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60)
        if found.returncode != 0:
            pytest.fail(f"image {image} missing: run docker/build_images.sh")


@pytest.fixture(scope="module")
def compose_stack() -> Iterator[ComposeStack]:
    _require_docker()
    project = f"pdserve-test-{os.getpid()}-{secrets.token_hex(3)}"
    env = {**os.environ,
           "PDSERVE_PORT": str(free_port()),
           "PDSERVE_API_KEY": secrets.token_hex(8),
           "PDSERVE_KV_CACHE_GIB": "0.25",
           "PDSERVE_NUM_THREADS": "1",
           "PDSERVE_MAX_MODEL_LEN": "2048",
           "PDSERVE_PREFILL_REPLICAS": "1",
           "PDSERVE_DECODE_REPLICAS": "1",
           "PDSERVE_LOCAL_PREFILL_TOKENS": "0",
           "PDSERVE_PREFILL_TIMEOUT_S": "60"}
    env.pop("PDSERVE_IMAGE", None)
    env.pop("PDSERVE_REDIS_IMAGE", None)
    try:
        t0 = time.monotonic()
        try:
            compose(project, env, ["up", "--wait", "--no-build", "--pull", "never"], UP_TIMEOUT_S, True)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            logs = compose(project, env, ["logs", "--no-color", "--tail", "80"], 60, False)
            pytest.fail(f"docker compose up --wait failed: {exc}\n--- logs ---\n{logs.stdout}{logs.stderr}")
        yield ComposeStack(project, int(env["PDSERVE_PORT"]), env["PDSERVE_API_KEY"], env,
                           time.monotonic() - t0)
    finally:
        compose(project, env, ["down", "-v", "--remove-orphans", "-t", "10"], DOWN_TIMEOUT_S, False)
