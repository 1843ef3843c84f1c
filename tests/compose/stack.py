"""Helpers of the compose tests: a `docker compose` project of compose.yaml, driven by the CLI."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
IMAGES = ("pdserve/pdserve:latest", "pdserve/redis:latest")


@dataclass(frozen=True)
class ComposeStack:
    project: str
    port: int
    api_key: str
    env: dict[str, str]
    up_seconds: float

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout_s: float = 120,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        return compose(self.project, self.env, list(args), timeout_s, check)

    def logs(self, tail: int = 60) -> str:
        done = self.compose("logs", "--no-color", "--tail", str(tail), check=False)
        return done.stdout + done.stderr


def compose(project: str, env: dict[str, str], args: list[str], timeout_s: float,
            check: bool) -> subprocess.CompletedProcess[str]:
    argv = ["docker", "compose", "-f", str(COMPOSE_FILE), "-p", project, *args]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done



