"""Helpers shared by the benchmark scripts: workloads, model FLOP counts, GEMM speed, tables.

Pure helpers; nothing here starts an engine. Every benchmark compares numbers taken inside one
run (absolute times vary between runs and machines).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
SPECIAL_ID_MARGIN = 100  # keep clear of the special tokens at both ends of the vocabulary


def add_repo_root_to_path() -> None:
    """Let `python benchmarks/<name>.py` import `engine` and `benchmarks` from the repo root."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def set_threads(num_threads: int) -> None:
    """Pin torch (and OpenMP in children) to `num_threads` intra-op threads."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)


def random_token_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    """`length` ids drawn uniformly from [margin, vocab - margin) so no special token appears."""
    low = min(SPECIAL_ID_MARGIN, vocab_size // 4)
    high = max(vocab_size - SPECIAL_ID_MARGIN, low + 1)
    return rng.integers(low, high, size=length).tolist()


def random_prompts(
    num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """`num_prompts` prompts of random ids, lengths uniform in [min_len, max_len] (seeded)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num_prompts)
    return [random_token_ids(rng, int(n), vocab_size) for n in lengths]


def resolve_model_folder(model: str) -> Path:
    """A Hugging Face folder for `model`: an existing local folder, else the engine's resolver."""
    path = Path(model)
    if path.is_dir():
        return path
    from engine.model.loader import resolve_model_path

    return Path(resolve_model_path(model))


def vocab_size(folder: Path) -> int:
    """The vocabulary size in a Hugging Face folder's config.json."""
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-family model that its FLOP count depends on."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_folder(cls, folder: Path) -> ModelShape:
        cfg = json.loads((folder / "config.json").read_text())
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
        )

    @property
    def non_embedding_params(self) -> int:
        """Weights every token multiplies through (attention, MLP, norms); no embedding/lm_head."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        return self.num_layers * per_layer + h

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size


def workload_flops(
    shape: ModelShape, prompt_lens: Sequence[int], output_len: int
) -> float:
    """Ideal FLOPs of running every prompt and generating `output_len` tokens for each.

    Dense: 2 * non-embedding params per token (prompt + output). lm_head: 2 * its params per
    sampled position (`output_len` per prompt). Attention: 4 * layers * (heads * head_dim) *
    context per token (QK^T and PV), with context = the token's 1-based position.
    """
    tokens = sum(prompt_lens) + len(prompt_lens) * output_len
    dense = 2.0 * shape.non_embedding_params * tokens
    lm_head = 2.0 * shape.lm_head_params * len(prompt_lens) * output_len
    attn_width = shape.num_layers * shape.num_heads * shape.head_dim
    context_sum = sum(_triangle(p + output_len) for p in prompt_lens)
    return dense + lm_head + 4.0 * attn_width * context_sum


def _triangle(n: int) -> int:
    return n * (n + 1) // 2


def measure_gemm_flops(size: int = 2048, repeats: int = 5) -> float:
    """Median fp32 FLOP/s of `size`^3 torch.mm calls on the current torch thread count."""
    import torch

    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    torch.mm(a, b)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        rates.append(2.0 * size**3 / (time.perf_counter() - start))
    return statistics.median(rates)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; floats printed with 2 decimals (3 significant digits below 1)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row in cells:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def machine_line(num_threads: int, gemm_flops: float | None) -> str:
    """One line naming the machine: cores, torch threads, measured GEMM speed."""
    import torch

    gemm = "-" if gemm_flops is None else f"{gemm_flops / 1e9:.1f}"
    return (
        f"machine: {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{num_threads} threads, fp32 GEMM {gemm} GFLOP/s"
    )
