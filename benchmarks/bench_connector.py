"""Disaggregated TTFT, split (issue #5): a producer engine prefills a prompt and saves its KV
to a `pdserve kvstore` process; a consumer engine loads it and computes the first decode step.
Per prompt length (256, 1,024, 2,048 tokens) and per transfer mode, in one run:
- prefill compute: the producer's time to its first token minus its waits for saves;
- save tail: what the producer waited for saves after the forward (per-layer streaming sends
  each layer while the next ones compute; whole-request sends everything after the last layer);
- load: the consumer's load of every layer;
- first decode step: the consumer's time to its first token minus the load (with layer-wise
  loads, which overlap that step, its whole time to first token).
Target: (save tail + load) <= 10% of prefill compute at 1,024 tokens and above (streaming).
Default model, float32, 2 threads; medians of the repeats, fresh prompts each time.

Each measure is taken in two configurations, in the same run (issue #19):
- open: a `pdserve kvstore` without tokens, engines without checksums (integrity_checks off);
- secured: a second store started with `--auth-file`, the engines' store clients presenting a
  producer,consumer token (PDSERVE_KV_TOKEN, set while they are built) and keyed BLAKE3
  checksums on (PDSERVE_KV_INTEGRITY_KEY): put by the producer, verified by the consumer.
Each repeat runs one prompt through both pairs of engines, open and secured alternating which
goes first, so noise from elsewhere hits both. The secured / open ratios of (save tail + load)
and of TTFT show the cost of security; target for TTFT <= 1.05 (a cost under 5%).

    python benchmarks/bench_connector.py [--repeats 3] [--lengths 256,1024,2048]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    markdown_table,
    median,
    random_token_ids,
    resolve_model_folder,
    set_threads,
    vocab_size,
)
from benchmarks.kvstore_process import StoreProcess
from engine.config import DEFAULT_MODEL

TOKEN_ENV, INTEGRITY_ENV = "PDSERVE_KV_TOKEN", "PDSERVE_KV_INTEGRITY_KEY"  # kvstore/connect.py, integrity.py
CLIENT_ENV = (TOKEN_ENV, f"{TOKEN_ENV}_FILE", INTEGRITY_ENV, f"{INTEGRITY_ENV}_FILE")
COST_TARGET = 1.05  # secured / open TTFT: a cost under 5%


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--lengths", default="256,1024,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


@contextlib.contextmanager
def client_env(values: dict[str, str]) -> Iterator[None]:
    """The store clients' credential variables set to `values` (the others unset) while
    engines are built (their clients read them then), restored afterwards."""
    saved = {k: os.environ.pop(k, None) for k in CLIENT_ENV}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def engine(folder: Path, url: str, role: str, stream: bool, threads: int,
           load_mode: str = "async", secured: bool = False) -> Any:
    from engine.llm import LLM

    llm = LLM(model=str(folder), num_threads=threads, kv_cache_gib=0.5, max_num_batched_tokens=2048,
              kv_connector="kvstore", kv_role=role, kv_store_url=url, kv_stream_layers=stream,
              kv_load_mode=load_mode, enable_prefix_caching=False)
    worker: Any = llm.engine_core.runner.connector
    worker.integrity_checks = secured
    if secured and worker.integrity_key is None:
        raise RuntimeError(f"the secured engine has no integrity key (${INTEGRITY_ENV} unread)")
    return llm


def engine_pair(folder: Path, store: StoreProcess, stream: bool, load_mode: str,
                threads: int) -> tuple[Any, Any]:
    """A producer and a consumer of `store`; for a secured store with its token and a keyed
    checksum secret, passed the way a deployment does: through the environment."""
    values = {TOKEN_ENV: store.token, INTEGRITY_ENV: secrets.token_hex(16)} if store.token else {}
    with client_env(values):
        return (engine(folder, store.url, "kv_producer", stream, threads, secured=store.secured),
                engine(folder, store.url, "kv_consumer", stream, threads, load_mode, store.secured))


def one(producer: Any, consumer: Any, prompt: list[int]) -> dict[str, float]:
    from engine.sampling_params import SamplingParams

    pw = producer.engine_core.runner.connector
    cw = consumer.engine_core.runner.connector
    waits_before = len(pw.timings.save_waits)
    pre = producer.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                     kv_transfer_params={"do_remote_decode": True}),
                            use_tqdm=False)[0]
    ttft_p = pre.metrics.first_token_time - pre.metrics.arrival_time
    tail = sum(pw.timings.save_waits[waits_before:])
    first = pre.outputs[0].token_ids[0]
    dec = consumer.generate([[*prompt, first]], SamplingParams(
        temperature=0, max_tokens=1, ignore_eos=True, kv_transfer_params=pre.kv_transfer_params),
        use_tqdm=False)[0]
    assert dec.num_cached_tokens == len(prompt), "the consumer did not load the prompt"
    ttft_c = dec.metrics.first_token_time - dec.metrics.arrival_time
    load = list(cw.timings.loads.values())[-1]  # this request's (one load at a time here)
    layerwise = consumer.engine_core.config.kv_load_mode == "layerwise"
    # Layer-wise loads overlap the first step: its time is the consumer's whole TTFT.
    first_step = ttft_c if layerwise else ttft_c - load
    return {"compute": ttft_p - tail, "tail": tail, "load": load, "first": first_step,
            "ttft": ttft_p + ttft_c}


CONFIGS = ("open", "secured")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    folder = resolve_model_folder(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    vocab = vocab_size(folder)
    rows = []
    with StoreProcess() as open_store, StoreProcess(secured=True) as secured_store:
        stores = {"open": open_store, "secured": secured_store}
        modes = [(True, "async", "per-layer streaming"), (False, "async", "whole request"),
                 (True, "layerwise", "streaming + layer-wise load")]
        for stream, load_mode, label in modes:
            pairs = {c: engine_pair(folder, stores[c], stream, load_mode, args.threads) for c in CONFIGS}
            for c in CONFIGS:  # warm-up at the longest length: no timed run is a first at its shape
                one(*pairs[c], random_token_ids_seeded(max(lengths), 999, vocab))
            for n in lengths:
                runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
                for r in range(args.repeats):
                    prompt = random_token_ids_seeded(n, 1000 * r + n + stream, vocab)
                    for c in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:  # alternate who goes first
                        runs[c].append(one(*pairs[c], prompt))  # same prompt: separate stores
                m = {c: {k: median([x[k] for x in runs[c]]) for k in runs[c][0]} for c in CONFIGS}
                o, s = m["open"], m["secured"]
                share = (o["tail"] + o["load"]) / o["compute"]
                xfer_cost = (s["tail"] + s["load"]) / (o["tail"] + o["load"])
                ttft_cost = s["ttft"] / o["ttft"]
                rows.append([label, n,
                             f"{o['compute'] * 1e3:.0f}", f"{o['tail'] * 1e3:.1f}",
                             f"{o['load'] * 1e3:.1f}", f"{o['first'] * 1e3:.1f}",
                             f"{o['ttft'] * 1e3:.0f}", f"{share:.3f}",
                             ("ok" if share <= 0.10 else "MISS")
                             if label == "per-layer streaming" and n >= 1024 else "-",
                             f"{s['tail'] * 1e3:.1f}", f"{s['load'] * 1e3:.1f}",
                             f"{s['ttft'] * 1e3:.0f}", f"{xfer_cost:.2f}", f"{ttft_cost:.3f}",
                             "ok" if ttft_cost <= COST_TARGET else "MISS"])
            for pair in pairs.values():
                for llm in pair:
                    llm.engine_core.shutdown()
    print(f"disaggregated TTFT split: model {folder.name}, fp32, {args.threads} threads, two kvstore "
          f"processes on loopback (open; secured = bearer token + keyed BLAKE3 checksums put and "
          f"verified), same prompts, runs alternating; median of {args.repeats}; open's split, then "
          f"secured's; target (tail + load) / compute <= 0.10 (open, streaming, >= 1,024 tokens), "
          f"secured / open TTFT <= {COST_TARGET}")
    print(markdown_table(["transfer", "prompt tokens", "prefill compute ms", "save tail ms",
                          "load ms", "first decode step ms", "TTFT ms", "(tail+load)/compute",
                          "target", "secured tail ms", "secured load ms", "secured TTFT ms",
                          "secured/open tail+load", "secured/open TTFT",
                          f"target <= {COST_TARGET}x"], rows))
    return 0


def random_token_ids_seeded(n: int, seed: int, vocab: int = 49152) -> list[int]:
    import numpy as np

    return random_token_ids(np.random.default_rng(seed), n, vocab)


if __name__ == "__main__":
    raise SystemExit(main())
