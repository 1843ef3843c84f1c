"""The load-test workloads: seeded sequences of requests (token-id prompts, output lengths).

- `random`: workload A (docs/architecture.md, "Benchmark workloads"): prompts of 64..512
  random token ids, 128 output tokens.
- `long-prompt`: about 10:1 input to output: mostly 256..768-token prompts with 2,048-token
  prompts among them (one in five), each answered with a tenth of its length (25..204 tokens).
- `shared-prefix`: a few long system prompts (4 of 1,024 tokens) shared by many short questions
  (32..96 tokens), 64 output tokens: what prefix caching and prefix-aware routing are for.
- `prompt-heavy`: 1,024..2,048-token prompts, 8 output tokens: almost all work is prefill (a
  burst of long prompts: what grows the prefill pool and leaves the decode pool alone).
- `smoke`: 16..64-token prompts, 8 output tokens: for tests on tiny models with short contexts.

Prompts are token ids (sent as `"prompt": [ids]` to /v1/completions) so their lengths are exact;
outputs use `ignore_eos` so every request generates exactly its `max_tokens`. For /v1/chat the
ids are decoded to text by the caller (lengths then approximate).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("random", "long-prompt", "shared-prefix", "prompt-heavy", "smoke")
SPECIAL_MARGIN = 100  # ids kept clear of the special tokens at both ends of the vocabulary


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_ids: list[int]
    max_tokens: int


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(x) for x in rng.integers(SPECIAL_MARGIN, vocab - SPECIAL_MARGIN, size=n)]


def requests(workload: str, vocab_size: int, seed: int = 0) -> Iterator[RequestSpec]:
    """An endless, seeded sequence of requests of `workload`."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    rng = np.random.default_rng(seed)
    prefixes = [_ids(rng, 1024, vocab_size) for _ in range(4)]
    i = 0
    while True:
        if workload == "random":
            spec = RequestSpec(i, _ids(rng, int(rng.integers(64, 513)), vocab_size), 128)
        elif workload == "smoke":
            spec = RequestSpec(i, _ids(rng, int(rng.integers(16, 65)), vocab_size), 8)
        elif workload == "prompt-heavy":
            spec = RequestSpec(i, _ids(rng, int(rng.integers(1024, 2049)), vocab_size), 8)
        elif workload == "long-prompt":
            n = 2048 if rng.random() < 0.2 else int(rng.integers(256, 769))
            spec = RequestSpec(i, _ids(rng, n, vocab_size), max(16, min(256, n // 10)))
        else:
            prefix = prefixes[int(rng.integers(0, len(prefixes)))]
            spec = RequestSpec(i, prefix + _ids(rng, int(rng.integers(32, 97)), vocab_size), 64)
        yield spec
        i += 1
